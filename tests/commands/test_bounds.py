"""Hostile sizes and outputs (issue 47): every size-like flag has a ceiling checked before any work, a grid
never holds more points than it can (distinct lengths in [min, max], depths 0..100), plot paths and
export targets are checked before the model loads, and an output that cannot be written after the work
is one line (exit 2) with the results already on stdout. Models are the tiny random Llama of
``conftest.tiny_dir``; most checks fail before any model is looked at (``MISSING_MODEL``)."""

from __future__ import annotations

import argparse
import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

import retmask.runfiles
from retmask.cli import build_parser, main
from retmask.commands.argtypes import MAX_DEPTHS, MAX_TOKENS, png_path, seed_int
from retmask.niah import grid
from retmask.niah.grid import MAX_GRID_TOKENS, GridError, check_grid_tests, resolve_grid
from retmask.runfiles import RunFileError, check_writable

MISSING_MODEL = "/nonexistent/retmask-model"  # loading it would fail: the errors below come first
HUGE = "1000000000"


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse refuses a value at parse time
        return e.code


# --------------------------------------------------------------------------------------------------
# Size-like flags: ceilings at parse time
# --------------------------------------------------------------------------------------------------

CAPPED = [
    ("detect", "--num-lengths", HUGE, f"<= {MAX_TOKENS}"),
    ("detect", "--num-depths", "1000", f"must be >= 1 and <= {MAX_DEPTHS} (depths are whole percentages"),
    ("detect", "--max-len", "99999999999", "more tokens than any model's context"),
    ("detect", "--max-new-tokens", HUGE, f"<= {MAX_TOKENS}"),
    ("detect", "--chunk", HUGE, f"<= {MAX_TOKENS}"),
    ("detect", "--seed", str(2**64), "seeds are 32-bit"),
    ("niah", "--num-depths", "102", f"<= {MAX_DEPTHS}"),
    ("niah", "--mask-random", HUGE, "no model has that many"),
    ("ablate", "--seeds", HUGE, "each draw is a whole NIAH grid"),
    ("eval", "--mn-needles", HUGE, "each needle is a sentence"),
    ("eval", "--num-depths", "500", f"<= {MAX_DEPTHS}"),
    ("generate", "--max-new-tokens", HUGE, f"<= {MAX_TOKENS}"),
    ("mask", "--top-k", HUGE, "no model has that many"),
    ("mudaf-train", "--max-length", HUGE, f"<= {MAX_TOKENS}"),
    ("mdqa-score", "--max-length", HUGE, f"<= {MAX_TOKENS}"),
    ("train", "--max-length", HUGE, f"<= {MAX_TOKENS}"),
    ("pipeline", "--detect-depths", "1000", f"<= {MAX_DEPTHS}"),
    ("pipeline", "--eval-lengths", HUGE, f"<= {MAX_TOKENS}"),
    ("pipeline", "--gen-max-new-tokens", HUGE, f"<= {MAX_TOKENS}"),
]


@pytest.mark.parametrize(("command", "flag", "value", "why"), CAPPED)
def test_absurd_sizes_are_refused_at_parse_time(command, flag, value, why, capsys):
    assert _exit_code([command, flag, value]) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {value} is out of range: must be >= " in err and why in err, err


def test_the_lower_bound_message_is_unchanged_with_a_ceiling(capsys):
    assert _exit_code(["detect", "--chunk", "0"]) == 2
    assert "0 is out of range: must be >= 1 and <= " in capsys.readouterr().err


def test_every_seed_and_plot_flag_uses_the_bounded_types():
    seeds, plots = [], []
    for name, p in _subparsers().items():
        for action in p._actions:
            if action.dest.endswith("seed"):
                seeds.append((name, action.dest, action.type))
            if "--plot" in action.option_strings:
                plots.append((name, action.type))
    assert seeds and all(t is seed_int for _, _, t in seeds), seeds
    assert {n for n, _ in plots} >= {"niah", "detect", "compare", "mdqa-score"}
    assert all(t is png_path for _, t in plots), plots


@pytest.mark.parametrize("command", ["niah", "detect", "compare", "mdqa-score"])
def test_a_plot_that_is_not_png_is_refused_at_parse_time(command, capsys):
    assert _exit_code([command, "--plot", "heatmap.pdf"]) == 2
    err = capsys.readouterr().err
    assert "argument --plot: 'heatmap.pdf' does not end in .png" in err and "e.g. heatmap.png" in err
    assert png_path("out/heat.PNG") == Path("out/heat.PNG")


# --------------------------------------------------------------------------------------------------
# Grid bounds: what the grid can hold
# --------------------------------------------------------------------------------------------------


def test_grid_holds_at_most_the_distinct_lengths_and_depths():
    assert MAX_DEPTHS == grid.MAX_DEPTHS  # the flag's ceiling is the grid's
    lengths, depths = resolve_grid(min_len=100, max_len=600, num_lengths=501, num_depths=MAX_DEPTHS)
    assert len(set(lengths)) == 501 and len(set(depths)) == MAX_DEPTHS  # the bounds are exact
    with pytest.raises(GridError, match=r"--num-lengths 3502 is out of range: \[500, 4000\] holds only 3501"):
        resolve_grid(min_len=500, max_len=4000, num_lengths=3502)
    with pytest.raises(GridError, match=r"--num-depths 102 is out of range: .* must be >= 1 and <= 101"):
        resolve_grid(num_depths=102)
    with pytest.raises(GridError, match=r"holds only 1 distinct whole-token length;"):
        resolve_grid(min_len=300, max_len=300, num_lengths=2)  # used to run 300 twice
    # the protocol's 4 lengths shrink to what a range given on the command line holds; no duplicates
    assert resolve_grid(min_len=300, max_len=300) == ([300], [0, 33, 67, 100])
    assert resolve_grid(min_len=300, max_len=302)[0] == [300, 301, 302]
    with pytest.raises(GridError, match=r"prompt tokens, more than the"):
        resolve_grid("wu2024", num_lengths=20000, num_depths=50)
    with pytest.raises(GridError, match=r"3 needles x 20 lengths x 10 depths\) holds about"):
        check_grid_tests(3, [MAX_GRID_TOKENS // 100] * 20, list(range(10)))


def test_grid_errors_come_before_the_model_loads(tmp_path, capsys):
    cases = [
        (["niah", "--num-lengths", "5000"], "--num-lengths 5000 is out of range: [500, 4000] holds only 3501"),
        (["detect", "--min-len", "100", "--max-len", "120", "--num-lengths", "30",
          "--out", str(tmp_path / "d" / "s.json")], "--num-lengths 30 is out of range: [100, 120] holds only 21"),
        (["ablate", "--scores", str(tmp_path / "s.json"), "--min-len", "700", "--max-len", "700",
          "--out-dir", str(tmp_path / "a")], "--num-lengths 3 is out of range: [700, 700]"),
        (["eval", "--num-lengths", "4000", "--out-dir", str(tmp_path / "e")],
         "--num-lengths 4000 is out of range: [1000, 4000] holds only 3001"),
        (["pipeline", "--detect-lengths", "5000", "--run-dir", str(tmp_path / "p")],
         "--detect-lengths 5000 is out of range"),
        (["pipeline", "--eval-min-len", "5000", "--run-dir", str(tmp_path / "p")],
         "empty grid: --eval-max-len 4000 (the default cap) is below --eval-min-len 5000"),
    ]  # fmt: skip
    (tmp_path / "s.json").write_text(json.dumps({"0-0": [0.5]}))
    for argv, message in cases:
        argv = [argv[0], "--model", MISSING_MODEL, *argv[1:]]
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "does not exist" not in err, (argv, err)  # the model was never looked at
    assert not (tmp_path / "d").exists() and not (tmp_path / "p").exists()


# --------------------------------------------------------------------------------------------------
# retmask niah: no silent empty result; the results survive an output that cannot be written
# --------------------------------------------------------------------------------------------------


def _niah_argv(tiny_dir, needles, *extra) -> list[str]:
    return ["niah", "--model", str(tiny_dir), "--needles", str(needles), "--min-len", "300", "--max-len",
            "300", "--num-lengths", "1", "--num-depths", "1", "--max-new-tokens", "4", "--no-progress",
            *extra]  # fmt: skip


def test_niah_with_every_test_skipped_fails_and_writes_nothing(tiny_dir, one_needle, tmp_path, capsys):
    out = tmp_path / "n.json"
    argv = _niah_argv(tiny_dir, one_needle, "--out", str(out))
    argv[argv.index("--min-len") + 1] = argv[argv.index("--max-len") + 1] = "60"
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "retmask niah: error: no test could run: all 1 tests were skipped" in captured.err
    assert "raise --min-len/--max-len" in captured.err
    assert "mean" not in captured.out and not out.exists()  # no "mean": null result


def _failing_replace(target: Path, monkeypatch) -> None:
    """``os.replace`` onto ``target`` fails as on a full disk (the atomic writers' last step)."""
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(dst) == target:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(retmask.runfiles.os, "replace", replace)


def test_niah_prints_its_results_before_an_output_fails(tiny_dir, one_needle, tmp_path, capsys, monkeypatch):
    out = tmp_path / "n.json"
    with monkeypatch.context() as m:
        _failing_replace(out, m)
        assert main(_niah_argv(tiny_dir, one_needle, "--out", str(out))) == 2
    captured = capsys.readouterr()
    assert "mean ROUGE-1 recall" in captured.out and "1 tests in" in captured.out  # the work is not lost
    errors = [line for line in captured.err.splitlines() if "error" in line.lower()]
    assert errors == [
        f"retmask niah: error: cannot write {out}: No space left on device (the grid and mean are printed "
        "above; the answers are kept: the same command plus --resume writes the result without running the "
        "tests again)"
    ]
    assert "Traceback" not in captured.err
    # no result, no temporary, no lock: only the answers, which --resume turns into the result
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([one_needle.name, "n.json.progress.json"])
    assert main(_niah_argv(tiny_dir, one_needle, "--out", str(out), "--resume")) == 0
    assert "(1 of them answered by the interrupted run)" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["n.json", one_needle.name])


# --------------------------------------------------------------------------------------------------
# retmask mask: atomic --out, export target checked first
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def scores_file(tmp_path) -> Path:
    path = tmp_path / "scores.json"
    path.write_text(json.dumps({f"{a}-{b}": [0.1 * b] for a in range(2) for b in range(4)}))
    return path


def test_mask_out_that_cannot_be_written_leaves_no_empty_file(scores_file, tmp_path, capsys, monkeypatch):
    heads = tmp_path / "h.json"
    _failing_replace(heads, monkeypatch)
    assert main(["mask", "--scores", str(scores_file), "--top-k", "2", "--out", str(heads)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"retmask mask: error: cannot write {heads}: No space left on device"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores.json"]  # not a 0-byte h.json

    monkeypatch.undo()
    heads.write_text("old")
    assert (
        main(["mask", "--scores", str(scores_file), "--top-k", "2", "--out", str(heads), "--overwrite"]) == 0
    )
    assert json.loads(heads.read_text())["heads"] == [[0, 3], [1, 3]]


def test_mask_export_symlink_or_non_empty_folder_refused_before_loading(scores_file, tmp_path, capsys):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    base = ["mask", "--scores", str(scores_file), "--top-k", "2", "--out", str(tmp_path / "h.json"),
            "--model", MISSING_MODEL]  # fmt: skip
    assert main([*base, "--export", str(link)]) == 2
    err = capsys.readouterr().err
    assert f"--export {link} is a symbolic link" in err and "does not exist" not in err
    assert main([*base, "--export", str(full)]) == 2
    err = capsys.readouterr().err
    assert f"--export {full} is a folder that is not empty" in err and "does not exist" not in err
    assert (full / "keep.txt").read_text() == "mine" and not (tmp_path / "h.json").exists()
    assert main([*base, "--export", str(real), "--model-shape", "60000", "60000"]) == 2
    assert "L x HQ must be <= 65536" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# Output paths: devices and over-long names refused up front
# --------------------------------------------------------------------------------------------------


def test_check_writable_refuses_devices_and_names_too_long(tmp_path):
    with pytest.raises(RunFileError, match=r"--out /dev/null is not a regular file"):
        check_writable("/dev/null", what="--out")
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    long_file = tmp_path / ("x" * (limit - 10) + ".json")  # fits alone, not with its ".NAME.tmpPID"
    with pytest.raises(RunFileError, match=rf"cannot write --out: the name x+\.\.\. is {limit - 5} bytes"):
        check_writable(long_file, what="--out")
    long_dir = tmp_path / ("d" * (limit + 1)) / "s.json"  # a missing parent: exists() itself would fail
    with pytest.raises(RunFileError, match=rf"is {limit + 1} bytes, longer than the {limit} bytes allowed"):
        check_writable(long_dir, what="scores file")
    assert check_writable(tmp_path / ("y" * 200 + ".json")).name.startswith("yyy")
    assert check_writable(tmp_path / ("z" * limit), directory=True).name.startswith("zzz")


def test_over_long_out_name_is_refused_before_the_model_loads(tmp_path, capsys):
    out = tmp_path / ("n" * 300 + ".json")
    assert main(["niah", "--model", MISSING_MODEL, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "retmask niah: error: cannot write --out: the name nnn" in err and "choose a shorter name" in err


def test_generation_budget_is_checked_against_the_context():
    from retmask.commands.generate import check_generation_budget
    from retmask.methods.retmask.generate import GenerateError

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1024))
    check_generation_budget(SimpleNamespace(max_prompt_tokens=512, max_new_tokens=512), model)
    with pytest.raises(GenerateError, match=r"--max-new-tokens 100000 = 100512 tokens exceed the context"):
        check_generation_budget(SimpleNamespace(max_prompt_tokens=512, max_new_tokens=100000), model)
