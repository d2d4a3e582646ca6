"""``retmask niah --out``: an interrupted run keeps its answered tests in ``<out>.progress.json`` and
``--resume`` finishes it with the result an uninterrupted run writes; other settings, a damaged progress
file or a misplaced flag are refused, naming the file and the fix. The model is the tiny random Llama of
``conftest.tiny_dir`` (its answers are noise, but greedy and deterministic)."""

from __future__ import annotations

import json

import pytest

import retmask.evaluate.niah as niah_eval
from retmask.cli import main
from retmask.evaluate.niah import evaluate_niah
from retmask.niah import DEFAULT_NEEDLES_PATH

TESTS = 8  # 2 needles x 2 lengths x 2 depths


@pytest.fixture
def two_needles(tmp_path):
    path = tmp_path / "needles.jsonl"
    path.write_text("\n".join(DEFAULT_NEEDLES_PATH.read_text().splitlines()[:2]) + "\n")
    return path


def _argv(tiny_dir, needles, out, *extra) -> list[str]:
    return ["niah", "--model", str(tiny_dir), "--needles", str(needles), "--min-len", "300", "--max-len",
            "420", "--num-lengths", "2", "--num-depths", "2", "--max-new-tokens", "4", "--no-progress",
            "--out", str(out), *extra]  # fmt: skip


def _interrupt_after(monkeypatch, answered: int) -> None:
    """Ctrl-C arrives while the test after the first ``answered`` ones is being scored."""
    real, calls = niah_eval.classify_answer, []

    def classify(*args, **kwargs):
        calls.append(1)
        if len(calls) > answered:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(niah_eval, "classify_answer", classify)


def _tests_run(monkeypatch) -> list:
    """Records the tests each later evaluation hands to the answer loop."""
    real, handed = niah_eval.answer_tests, []

    def answer_tests(detector, tokenizer, tests, *args, **kwargs):
        handed.append(len(tests))
        return real(detector, tokenizer, tests, *args, **kwargs)

    monkeypatch.setattr(niah_eval, "answer_tests", answer_tests)
    return handed


def test_an_interrupted_run_resumes_to_the_uninterrupted_result(tiny_dir, two_needles, tmp_path, capsys,
                                                                monkeypatch):  # fmt: skip
    ref = tmp_path / "ref.json"
    assert main(_argv(tiny_dir, two_needles, ref)) == 0
    assert not (tmp_path / "ref.json.progress.json").exists()  # a finished run leaves no progress
    capsys.readouterr()

    out = tmp_path / "n.json"
    progress = tmp_path / "n.json.progress.json"
    with monkeypatch.context() as m:
        _interrupt_after(m, 3)
        assert main(_argv(tiny_dir, two_needles, out)) == 130
    assert (
        "retmask niah: interrupted; continue with the same command plus --resume" in capsys.readouterr().err
    )
    assert not out.exists() and len(json.loads(progress.read_text())["entries"]) == 3

    # a new run on the same output must say what to do with the interrupted one
    assert main(_argv(tiny_dir, two_needles, out)) == 2
    err = capsys.readouterr().err
    assert f"{progress} already exists (an interrupted run's answers)" in err and "--resume" in err

    handed = _tests_run(monkeypatch)
    assert main(_argv(tiny_dir, two_needles, out, "--resume")) == 0
    assert handed == [TESTS - 3]  # only the tests the interrupted run had not answered
    assert f"{TESTS} tests in" in capsys.readouterr().out
    got, want = json.loads(out.read_text()), json.loads(ref.read_text())
    assert got["entries"] == want["entries"] and got["grid"] == want["grid"] and got["mean"] == want["mean"]
    assert got["meta"]["resumed_tests"] == 3 and "resumed_tests" not in want["meta"]
    assert not progress.exists()

    # finished: nothing left to resume
    assert main(_argv(tiny_dir, two_needles, out, "--resume")) == 2
    assert "there is no interrupted run" in capsys.readouterr().err


def test_resume_refuses_other_settings_and_damaged_progress(tiny_dir, two_needles, tmp_path, capsys,
                                                           monkeypatch):  # fmt: skip
    out = tmp_path / "n.json"
    progress = tmp_path / "n.json.progress.json"
    with monkeypatch.context() as m:
        _interrupt_after(m, 2)
        assert main(_argv(tiny_dir, two_needles, out)) == 130
    saved = progress.read_text()

    argv = _argv(tiny_dir, two_needles, out, "--resume")
    argv[argv.index("--max-new-tokens") + 1] = "5"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--resume: {progress} was written by a run with other settings (max_new_tokens: 4 -> 5)" in err
    assert main([*_argv(tiny_dir, two_needles, out, "--resume"), "--mask-random", "2"]) == 2
    assert "other settings (heads: [] -> [[" in capsys.readouterr().err
    assert progress.read_text() == saved  # refusals keep the answers

    damaged = json.loads(saved)
    damaged["entries"][1]["rouge1_recall"] = 2.5
    progress.write_text(json.dumps(damaged))
    assert main(_argv(tiny_dir, two_needles, out, "--resume")) == 2
    err = capsys.readouterr().err
    assert f"progress file {progress}: entries[1].rouge1_recall is 2.5; it must be >= 0 and <= 1" in err

    assert main(_argv(tiny_dir, two_needles, out, "--resume", "--overwrite")) == 2
    assert "--resume and --overwrite exclude each other" in capsys.readouterr().err
    assert main(_argv(tiny_dir, two_needles, out, "--overwrite")) == 0  # starts over
    assert not progress.exists() and "resumed_tests" not in json.loads(out.read_text())["meta"]

    argv = _argv(tiny_dir, two_needles, out, "--resume")
    del argv[argv.index("--out") : argv.index("--out") + 2]
    assert main(argv) == 2
    assert "--resume continues the run on --out" in capsys.readouterr().err


def test_earlier_entries_of_another_grid_are_refused(tiny_dir, two_needles):
    from retmask.hf.loading import load_model

    model, tok = load_model(str(tiny_dir))
    grid = dict(lengths=[300], depths=[0], needles=str(two_needles), max_new_tokens=2, progress=False)
    first = evaluate_niah(model, tok, **grid)
    entry = dict(first.entries[0])
    resumed = evaluate_niah(model, tok, **grid, done={entry["index"]: entry})
    assert resumed.entries == first.entries and resumed.meta["resumed_tests"] == 1
    entry["depth"] = 50
    with pytest.raises(ValueError, match=r"is not a runnable test of this grid"):
        evaluate_niah(model, tok, **grid, done={entry["index"]: entry})


def test_a_run_stopped_while_plotting_resumes_to_the_plot(
    tiny_dir, two_needles, tmp_path, capsys, monkeypatch
):
    """The progress file goes last: a run that fails writing its heatmap resumes without answering any test
    again (it used to delete the progress first, leaving --overwrite, a rerun of every test, as the way out)."""
    from retmask.runfiles import OutputWriteError

    out, plot = tmp_path / "n.json", tmp_path / "n.png"

    def full_disk(res, path, *args, **kwargs):
        raise OutputWriteError(f"cannot write {path}: No space left on device")

    with monkeypatch.context() as m:
        m.setattr(niah_eval, "plot_niah", full_disk)
        assert main(_argv(tiny_dir, two_needles, out, "--plot", str(plot))) == 2
    assert "cannot write" in capsys.readouterr().err
    assert out.exists() and not plot.exists() and (tmp_path / "n.json.progress.json").exists()
    handed = _tests_run(monkeypatch)
    assert main(_argv(tiny_dir, two_needles, out, "--plot", str(plot), "--resume")) == 0
    assert handed == [0] or handed == []  # every answer came from the progress file
    assert plot.exists() and not (tmp_path / "n.json.progress.json").exists()


def test_mask_random_is_drawn_with_seed_and_the_plot_takes_the_title(tiny_dir, two_needles, tmp_path):
    """--seed (with --mask-random) picks the draw: the same seed masks the same heads, another seed others;
    --title (with --plot) heads the heatmap."""
    heads = {}
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        out = tmp_path / f"{name}.json"
        extra = [
            "--mask-random",
            "3",
            "--seed",
            seed,
            "--plot",
            str(tmp_path / f"{name}.png"),
            "--title",
            "T",
        ]
        assert main(_argv(tiny_dir, two_needles, out, *extra)) == 0
        meta = json.loads(out.read_text())["meta"]
        heads[name] = meta["heads"]
        assert meta["mask"] == f"3 random heads (seed {seed}) masked"
        assert (tmp_path / f"{name}.png").stat().st_size > 0
    assert heads["a"] == heads["b"] != heads["c"] and len(heads["a"]) == 3
