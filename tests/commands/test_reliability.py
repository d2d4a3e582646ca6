"""The command line never gives silent wrong results or loses work, and its errors name the problem and
the fix (issue 15). Everything goes through the real entry point ``retmask.cli.main``; models are the
tiny random Llama of ``conftest.tiny_dir`` (it retrieves no needle)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from retmask.cli import main
from retmask.errors import UsageError
from retmask.runfiles import RunLock, lock_path
from tests.test_runfiles import unwritable_dir

GRID = ["--min-len", "300", "--max-len", "300", "--num-lengths", "1", "--num-depths", "1"]
PIPELINE_GRID = [
    "--detect-min-len",
    "300",
    "--detect-max-len",
    "300",
    "--detect-lengths",
    "1",
    "--detect-depths",
    "1",
]


def detect_argv(tiny_dir, needles, out, *extra):
    return ["detect", "--model", str(tiny_dir), "--needles", str(needles), *GRID, "--max-new-tokens", "4",
            "--out", str(out), "--no-progress", *extra]  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Silent wrong results -> clear errors
# --------------------------------------------------------------------------------------------------


def test_detect_with_nothing_counted_fails_and_reruns_need_resume_or_overwrite(
    tiny_dir, one_needle, tmp_path, capsys
):
    out = tmp_path / "d" / "s.json"
    assert main(detect_argv(tiny_dir, one_needle, out)) == 2
    err = capsys.readouterr().err
    assert "no test counted: none of the 1 answers passed the ROUGE-1 filter" in err and "best recall" in err
    assert not out.exists()  # no scores file with empty lists
    record = json.loads(out.with_name("s.run.json").read_text())  # the answers, to see why
    assert record["tests_run"] == 1 and record["tests_counted"] == 0
    progress = out.with_name("s.json.progress.json")
    before = progress.read_bytes()

    # a rerun without --resume does not silently replace the earlier run's files
    assert main(detect_argv(tiny_dir, one_needle, out)) == 2
    err = capsys.readouterr().err
    assert "already exist" in err and "pass --resume to continue or --overwrite to start over" in err
    assert progress.read_bytes() == before
    assert main(detect_argv(tiny_dir, one_needle, out, "--resume", "--overwrite")) == 2
    assert "exclude each other" in capsys.readouterr().err
    # --overwrite starts over (and fails again for the same reason); --resume reuses the finished test
    assert main(detect_argv(tiny_dir, one_needle, out, "--overwrite")) == 2
    assert "no test counted" in capsys.readouterr().err
    assert main(detect_argv(tiny_dir, one_needle, out, "--resume")) == 2
    err = capsys.readouterr().err
    assert "resuming: 1 of 1 tests already done" in err and "no test counted" in err
    assert not lock_path(out).exists()


def test_detect_static_passes_flag_gives_the_same_answers(tiny_dir, one_needle, tmp_path, capsys):
    """``--static-passes`` reaches the run (its record says so) and changes no answer (the tiny model
    retrieves nothing, so both runs end in "no test counted" after writing their records)."""
    answers = {}
    for flag in ((), ("--static-passes",)):
        out = tmp_path / ("static" if flag else "default") / "s.json"
        assert main(detect_argv(tiny_dir, one_needle, out, *flag)) == 2
        record = json.loads(out.with_name("s.run.json").read_text())
        assert record["config"]["static_passes"] is bool(flag)
        answers[flag] = [t["tokens"] for t in record["tests"]]
    assert answers[()] == answers[("--static-passes",)] and answers[()][0]
    capsys.readouterr()


def test_detect_with_every_test_skipped_fails(tiny_dir, one_needle, tmp_path, capsys):
    argv = detect_argv(tiny_dir, one_needle, tmp_path / "s.json")
    argv[argv.index("--min-len") + 1] = argv[argv.index("--max-len") + 1] = "60"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no test could run: all 1 tests were skipped: 1 with a context too short for the needle" in err
    assert "raise --min-len/--max-len" in err


def test_mask_refuses_a_scores_file_without_counted_tests(tmp_path, capsys):
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({f"{a}-{b}": [] for a in range(2) for b in range(4)}))
    assert main(["mask", "--scores", str(scores), "--top-k", "2", "--out", str(tmp_path / "h.json")]) == 2
    assert "counted no test" in capsys.readouterr().err
    assert not (tmp_path / "h.json").exists()


# --------------------------------------------------------------------------------------------------
# Outputs checked before any work
# --------------------------------------------------------------------------------------------------

MISSING_MODEL = "/nonexistent/retmask-model"  # loading it would fail: these errors come first


def test_output_paths_are_checked_before_any_work(tmp_path, capsys):
    ro = unwritable_dir(tmp_path)
    folder = tmp_path / "folder"
    folder.mkdir()
    cases = [
        (["detect", "--model", MISSING_MODEL, "--out", str(folder)], "scores file", "is a folder"),
        (["detect", "--model", MISSING_MODEL, "--out", str(ro / "s.json")], "scores file", "is not writable"),
        (["niah", "--model", MISSING_MODEL, "--out", str(ro / "n.json")], "--out", "is not writable"),
        (["niah", "--model", MISSING_MODEL, "--plot", str(ro / "n.png")], "--plot", "is not writable"),
        (["ablate", "--model", MISSING_MODEL, "--out-dir", str(ro / "a")], "--out-dir", "is not writable"),
        (
            ["generate", "--heads", "h.json", "--model", MISSING_MODEL, "--out", str(folder)],
            "--out",
            "is a folder",
        ),
        (["eval", "--model", MISSING_MODEL, "--out-dir", str(ro / "e")], "--out-dir", "is not writable"),
        (["mudaf-train", "--data", "x.jsonl", "--out", str(ro / "m")], "--out", "is not writable"),
        (["mdqa-score", "--data", "x.jsonl", "--out", str(ro / "m.json")], "--out", "is not writable"),
        (["pipeline", "--model", MISSING_MODEL, "--run-dir", str(ro / "p")], "run dir", "is not writable"),
    ]
    for argv, what, problem in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"retmask {argv[0]}: error: " in err and what in err and problem in err, (argv, err)
        assert "does not exist" not in err  # the model was never looked at
    assert {p.name for p in tmp_path.iterdir()} <= {"folder", "ro"}  # nothing created


def test_mask_export_target_checked_before_loading(tmp_path, capsys):
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({f"{a}-{b}": [0.1 * b] for a in range(2) for b in range(4)}))
    heads = tmp_path / "h.json"
    existing = tmp_path / "ckpt"
    existing.write_text("not a folder")
    base = ["mask", "--scores", str(scores), "--top-k", "2", "--out", str(heads), "--model", MISSING_MODEL]
    assert main([*base, "--export", str(existing)]) == 2
    assert "--export" in (err := capsys.readouterr().err) and "is an existing file, not a folder" in err
    assert main([*base, "--export", str(unwritable_dir(tmp_path) / "ckpt")]) == 2
    assert "is not writable" in capsys.readouterr().err
    assert not heads.exists() and existing.read_text() == "not a folder"


def test_model_errors_name_the_path_and_the_fix(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"heads": [[0, 1]]}))
    cases = [
        (["detect", "--model", MISSING_MODEL, "--out", str(tmp_path / "s.json")], f"model path {MISSING_MODEL} does not exist"),
        (["generate", "--model", str(empty), "--heads", str(heads), "--out", str(tmp_path / "p.jsonl")],
         f"model folder {empty} is empty: it is not a Hugging Face model folder"),
        (["niah", "--model", MISSING_MODEL, "--device", "cuda:0"], "CUDA is not available"),
    ]  # fmt: skip
    if __import__("torch").cuda.is_available():
        cases.pop()
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"retmask {argv[0]}: error: " in err and message in err and "Traceback" not in err, err
    assert {p.name for p in tmp_path.iterdir()} == {"empty", "heads.json"}  # no outputs, locks or folders


# --------------------------------------------------------------------------------------------------
# One run per output
# --------------------------------------------------------------------------------------------------


def test_second_run_on_the_same_output_is_refused(tiny_dir, one_needle, tmp_path, capsys):
    out = tmp_path / "s.json"
    with RunLock(out):  # stands for a running `retmask detect --out s.json`
        assert main(detect_argv(tiny_dir, one_needle, out)) == 2
        err = capsys.readouterr().err
        assert (
            f"another retmask run is writing {out} (pid {os.getpid()}); wait for it or choose another --out"
            in err
        )
        with RunLock(tmp_path / "p" / "pipeline.json"):
            assert main(["pipeline", "--model", str(tiny_dir), "--run-dir", str(tmp_path / "p")]) == 2
            assert "another retmask run is writing" in capsys.readouterr().err
    assert not out.with_name("s.json.progress.json").exists()


# --------------------------------------------------------------------------------------------------
# Ctrl-C
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def ctrl_c_on_load(monkeypatch):
    """Every model loader raises KeyboardInterrupt, as if Ctrl-C came during the work."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    _replace_loaders(monkeypatch, interrupted)


def _replace_loaders(monkeypatch, loader) -> None:
    """Every name a command loads its model through -> ``loader``. ``retmask.load_model`` first: it is
    resolved lazily from ``retmask.hf.loading``, so patched after it, monkeypatch would record the stand-in
    as the value to restore, and later tests would load through it."""
    for target in ("retmask.load_model", "retmask.hf.loading.load_model", "retmask.detect.run.load_model",
                   "retmask.evaluate.suite.load_model", "retmask.methods.retmask.pipeline.load_model"):  # fmt: skip
        module, name = target.rsplit(".", 1)
        monkeypatch.setattr(sys.modules[module] if module in sys.modules else __import__(module), name,
                            loader, raising=False)  # fmt: skip


def _inputs(tmp_path: Path) -> dict[str, Path]:
    from retmask.methods.mudaf.mdqa import generate_mdqa, write_mdqa

    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({f"{a}-{b}": [0.1 * b] for a in range(2) for b in range(4)}))
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"heads": [[0, 1]]}))
    return {
        "scores": scores,
        "heads": heads,
        "data": write_mdqa(generate_mdqa(2, seed=0), tmp_path / "d.jsonl"),
    }


def _command_argv(command: str, model_args: list[str], tmp_path: Path) -> list[str]:
    """A minimal valid command line of ``command`` that gets as far as loading its model."""
    f = _inputs(tmp_path)
    m = model_args
    return {
        "detect": ["detect", *m, "--out", str(tmp_path / "s.json"), "--no-progress", *GRID],
        "generate": ["generate", *m, "--heads", str(f["heads"]), "--out", str(tmp_path / "p.jsonl")],
        "ablate": ["ablate", *m, "--scores", str(f["scores"]), "--out-dir", str(tmp_path / "a")],
        "mudaf-train": [
            "mudaf-train",
            *m,
            "--data",
            str(f["data"]),
            "--heads",
            str(f["heads"]),
            "--out",
            str(tmp_path / "m"),
        ],  # fmt: skip
        "pipeline": ["pipeline", *m, "--run-dir", str(tmp_path / "p"), "--no-progress", *PIPELINE_GRID],
        "eval": ["eval", *m, "--out-dir", str(tmp_path / "e"), "--no-progress"],
        "niah": ["niah", *m],
        "mdqa-score": ["mdqa-score", *m, "--data", str(f["data"]), "--out", str(tmp_path / "s.json")],
    }[command]


INTERRUPTED = [
    ("detect", "continue with the same command plus --resume"),
    ("generate", "continue with the same command plus --resume"),
    ("ablate", "continue with the same command plus --resume"),
    ("mudaf-train", "continue with the same command plus --resume"),
    ("pipeline", "run the same command again to resume"),
    ("eval", "run the same command again: the models and tasks already evaluated are cached"),
    ("niah", "nothing was written"),
    ("mdqa-score", "nothing was written"),  # before its first scored example
]


@pytest.mark.parametrize("command,hint", INTERRUPTED, ids=[c for c, _ in INTERRUPTED])
def test_ctrl_c_prints_how_to_continue(command, hint, tiny_dir, tmp_path, ctrl_c_on_load, capsys):
    argv = _command_argv(command, ["--model", str(tiny_dir)], tmp_path)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert f"retmask {command}: interrupted; {hint}" in err
    assert [p.name for p in tmp_path.rglob("*.lock")] == []  # the lock is released


def test_real_sigint_during_detect(tiny_dir, tmp_path):
    from retmask.niah import DEFAULT_NEEDLES_PATH

    out = tmp_path / "s.json"
    progress = out.with_name("s.json.progress.json")
    cmd = [sys.executable, "-m", "retmask", "detect", "--model", str(tiny_dir), "--needles",
           str(DEFAULT_NEEDLES_PATH), "--min-len", "300", "--max-len", "500", "--num-lengths", "3", "--num-depths",
           "5", "--out", str(out), "--no-progress"]  # fmt: skip
    # A shell without job control starts background commands with SIGINT ignored, and the child inherits
    # that (Python then installs no KeyboardInterrupt handler): restore the default, as in a terminal.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.time() + 120
    while not progress.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "retmask detect: interrupted; continue with the same command plus --resume" in err
    assert "Traceback" not in err
    assert json.loads(progress.read_text())["results"]  # the finished tests are kept
    assert not lock_path(out).exists()


# --------------------------------------------------------------------------------------------------
# Resume readers name the file
# --------------------------------------------------------------------------------------------------


def test_truncated_progress_files_are_named(tiny_dir, one_needle, tmp_path, capsys):
    out = tmp_path / "s.json"
    progress = out.with_name("s.json.progress.json")
    progress.write_text('{"version": 1, "fingerprint": {"model": ')
    assert main(detect_argv(tiny_dir, one_needle, out, "--resume")) == 2
    err = capsys.readouterr().err
    assert f"detect progress file {progress} is not valid JSON" in err and "delete it to start over" in err

    state = tmp_path / "p" / "pipeline.json"
    state.parent.mkdir()
    state.write_text('{"stages": {"detect": ')
    assert main(["pipeline", "--model", str(tiny_dir), "--run-dir", str(state.parent)]) == 2
    err = capsys.readouterr().err
    assert f"pipeline state {state} is not valid JSON" in err and "--overwrite" in err


# --------------------------------------------------------------------------------------------------
# RetMask pairs: --overwrite, and train refuses the pairs of an unfinished run
# --------------------------------------------------------------------------------------------------


def test_generate_overwrite_and_train_refuses_unfinished_pairs(tiny_dir, tmp_path, capsys, monkeypatch):
    from retmask.methods.retmask import dpo

    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"heads": [[0, 1]]}))
    out = tmp_path / "pairs.jsonl"
    gen = ["generate", "--model", str(tiny_dir), "--heads", str(heads), "--out", str(out), "--limit", "2",
           "--max-new-tokens", "3", "--temperature", "1.0", "--no-progress"]  # fmt: skip
    assert main(gen) == 0
    progress = out.with_name("pairs.jsonl.progress.json")
    assert json.loads(progress.read_text())["complete"] is True
    capsys.readouterr()
    assert main(gen) == 2 and "--overwrite" in capsys.readouterr().err
    assert main([*gen, "--overwrite", "--seed", "3"]) == 0
    assert json.loads(progress.read_text())["fingerprint"]["seed"] == 3  # a new run, not a resumed one

    calls = []

    def fake_train(pairs, out_dir, model, cfg, callbacks=None, resume=False):
        calls.append(pairs)
        return SimpleNamespace(lengths=SimpleNamespace(summary=lambda: ""), steps=0, seconds=0.0,
                               seconds_per_step=0.0, losses=[], resumed_from_step=0)  # fmt: skip

    monkeypatch.setattr(dpo, "train_dpo", fake_train)
    train = ["train", "--pairs", str(out), "--model", str(tiny_dir), "--out", str(tmp_path / "model")]
    assert main(train) == 0 and calls == [out]
    # what an interrupted generate leaves: a valid but partial pairs file, no end recorded, no statistics
    state = json.loads(progress.read_text())
    progress.write_text(json.dumps(state | {"complete": False}))
    out.with_name("pairs.stats.json").unlink()
    capsys.readouterr()
    assert main(train) == 2
    err = capsys.readouterr().err
    assert "from an unfinished `retmask generate` run (2 instructions handled" in err
    assert "same generate command plus --resume" in err and "--allow-incomplete" in err
    assert main([*train, "--allow-incomplete"]) == 0 and len(calls) == 2
    assert "warning" in capsys.readouterr().err


@pytest.mark.parametrize("native", [False, True])
def test_detect_records_the_dtype_auto_resolved_to(
    native, tiny_dir, one_needle, tmp_path, monkeypatch, capsys
):
    """--dtype auto is written into the run record as the dtype it ran in (bf16 only with native bf16)."""

    from retmask.cpu_speedups import half_matmul

    monkeypatch.setattr(
        half_matmul, "_cpu_flags", lambda: frozenset({"avx2", "amx_tile", "amx_bf16"} if native else {"avx2"})
    )
    out = tmp_path / "s.json"
    main(detect_argv(tiny_dir, one_needle, out, "--dtype", "auto"))  # the tiny model counts no test: rc 2
    record = json.loads(out.with_name("s.run.json").read_text())
    assert record["config"]["dtype"] == ("bfloat16" if native else "float32")
    # the prompt style is recorded the same way: as requested in config, resolved at the top level
    from transformers import AutoTokenizer

    from retmask.niah import resolve_prompt_style

    assert record["config"]["prompt_style"] == "auto"
    assert record["prompt_style"] == resolve_prompt_style(AutoTokenizer.from_pretrained(tiny_dir), "auto")


class _Loaded(UsageError):
    """Raised by the stand-in loader: the command got as far as loading its model."""


DEVICE_COMMANDS = ["detect", "niah", "ablate", "generate", "eval", "mdqa-score", "mudaf-train", "pipeline"]


@pytest.mark.parametrize("command", DEVICE_COMMANDS)
def test_every_command_loads_its_model_on_the_device_asked_for(
    command, tiny_dir, tmp_path, monkeypatch, capsys
):
    """--device reaches the model loader of every command that loads a model (a command that ignored it
    would silently run on the CPU). The loader is a stand-in that records the device and stops."""
    import torch

    seen = []

    def loader(spec=None, **kw):
        seen.append(str(kw.get("device", "cpu")))
        raise _Loaded("loaded")

    _replace_loaders(monkeypatch, loader)
    # this machine may have no GPU: the device check passes "cuda" through
    monkeypatch.setattr("retmask.hf.loading.check_device", lambda device: torch.device(device))
    argv = _command_argv(command, ["--model", str(tiny_dir), "--device", "cuda"], tmp_path)
    assert main(argv) == 2
    assert "loaded" in capsys.readouterr().err
    assert seen == ["cuda"]


@pytest.mark.parametrize("command", DEVICE_COMMANDS)
def test_a_bad_environment_setting_fails_before_the_model_loads(
    command, tiny_dir, tmp_path, monkeypatch, capsys
):
    """A bad ``$RETMASK_*`` setting is one line naming the variable and its values, before any weights are
    read: the loader checks the settings first (it used to fail at the first attention call, with a
    traceback from some commands and a half-written pairs file from ``generate``)."""
    monkeypatch.setenv("RETMASK_CPU_PATH", "bogus")
    loaded = []
    real = __import__("transformers").AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        "transformers.AutoTokenizer.from_pretrained", lambda *a, **k: loaded.append(a) or real(*a, **k)
    )
    before = {p.name for p in tmp_path.iterdir()}
    argv = _command_argv(command, ["--model", str(tiny_dir)], tmp_path)
    inputs = {p.name for p in tmp_path.iterdir()} - before
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"retmask {command}: error: $RETMASK_CPU_PATH must be one of" in err and "Traceback" not in err, (
        err
    )
    assert loaded == []
    assert {p.name for p in tmp_path.iterdir()} - before == inputs  # no outputs, progress or lock files


def _refusals(tmp_path: Path) -> list[tuple[list[str], str]]:
    """Command lines a user gets wrong, each with the words its error must contain. Every one is refused
    before a model loads (the audit found each of them failing only after the load, or not at all)."""
    f = _inputs(tmp_path)
    scores, heads, missing = str(f["scores"]), str(f["heads"]), str(tmp_path / "nope.json")
    same = str(tmp_path / "same.png")
    model = ["--model", str(tmp_path)]  # never loaded
    return [
        # two outputs on one file: the later write would replace the earlier (the scores by the heatmap)
        (["detect", *model, *GRID, "--out", same, "--plot", same], "the scores file and the plot name the same file"),
        (["compare", scores, scores, "--json", same, "--plot", same], "--json and --plot name the same file"),
        (["niah", *model, "--out", same, "--plot", same], "--out and --plot name the same file"),
        (["mdqa-score", *model, "--data", str(f["data"]), "--out", same, "--plot", same],
         "--out and --plot name the same file"),
        (["compare", scores, scores, "--json", scores], f"--json {scores} is also an input (compared file 1)"),
        # an output that replaces its own input
        (["mask", "--scores", scores, "--top-k", "1", "--out", scores, "--overwrite"], "is also an input (--scores)"),
        # the heads file would be written into the folder the export must create
        (["mask", "--scores", scores, "--top-k", "1", "--out", str(tmp_path / "x" / "h.json"), "--export",
          str(tmp_path / "x"), *model], "lies inside the --export folder"),
        # input files read before the model loads
        (["niah", *model, "--mask-file", missing], f"heads file {missing}"),
        (["generate", *model, "--heads", missing, "--out", str(tmp_path / "p.jsonl")], f"heads file {missing}"),
        (["generate", *model, "--heads", heads, "--instructions", str(tmp_path / "nope.jsonl"), "--out",
          str(tmp_path / "p.jsonl")], "does not exist; give an existing .json/.jsonl/.parquet file"),
        (["mudaf-train", *model, "--data", str(f["data"]), "--heads", missing, "--out", str(tmp_path / "m")],
         f"heads file {missing}"),
        (["mudaf-train", *model, "--data", str(f["data"]), "--vanilla-sft", "--alpha", "0.3", "--out",
          str(tmp_path / "m")], "--vanilla-sft trains on the CLM loss only; drop --alpha"),
        # flags the run would ignore
        (["ablate", *model, "--each", "0-1", "--seed", "7", "--out-dir", str(tmp_path / "a")],
         "--seed set the K curve, which --each replaces"),
        (["kv", *model, "--policies", "full", "--budgets", "0.5", "--out-dir", str(tmp_path / "k")],
         "--budgets applies to the retrieval, random, non-retrieval policies"),
        (["kv", *model, "--policies", "full,streaming", "--seeds", "4", "--out-dir", str(tmp_path / "k")],
         "--seeds only set the random policy's draws"),
        (["niah", *model, "--seed", "3"], "--seed only applies with --mask-random K"),
        (["niah", *model, "--title", "mine"], "--title is the heatmap's title; add --plot"),
        (["mask", "--scores", scores, "--top-k", "1", "--seed", "3", "--out", str(tmp_path / "h2.json")],
         "--seed draws a baseline's random heads; add --baseline"),
    ]  # fmt: skip


def test_mistakes_are_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    def loader(*args, **kwargs):
        raise AssertionError("the model was loaded")

    _replace_loaders(monkeypatch, loader)
    for argv, message in _refusals(tmp_path):
        before = sorted(p.name for p in tmp_path.rglob("*"))
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"retmask {argv[0]}: error: " in err and message in err and "Traceback" not in err, (argv, err)
        assert sorted(p.name for p in tmp_path.rglob("*")) == before, argv  # nothing written


def test_training_device():
    """DPO / SFT: the Trainer places the model; cpu, or the first visible GPU (another index says how)."""
    import torch

    from retmask.hf.loading import ModelLoadError
    from retmask.methods.retmask import dpo

    assert dpo._use_cpu("cpu") is True
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="--device cuda: CUDA is not available"):
            dpo._use_cpu("cuda")
    with pytest.raises(ModelLoadError, match="not a device name"):
        dpo._use_cpu("gpu")


@pytest.mark.parametrize("command", ["eval", "pipeline", "generate"])
def test_a_missing_second_model_fails_before_the_first_is_loaded(
    command, tiny_dir, tmp_path, monkeypatch, capsys
):
    """eval's later --model, pipeline's and generate's --rejected-model: checked before any loading."""
    import retmask.hf.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded a model first"))
    monkeypatch.setattr("retmask.load_model", loading.load_model, raising=False)
    monkeypatch.setattr("retmask.evaluate.suite.load_model", loading.load_model)
    missing = str(tmp_path / "typo")
    argv = {
        "eval": ["eval", "--model", str(tiny_dir), "--model", missing, "--out-dir", str(tmp_path / "e")],
        "pipeline": [
            "pipeline",
            "--model",
            str(tiny_dir),
            "--baseline",
            "smaller-model",
            "--rejected-model",
            missing,
            "--run-dir",
            str(tmp_path / "p"),
        ],  # fmt: skip
        "generate": [
            "generate",
            "--model",
            str(tiny_dir),
            "--rejected-model",
            missing,
            "--out",
            str(tmp_path / "p.jsonl"),
        ],  # fmt: skip
    }[command]
    assert main(argv) == 2
    assert f"model path {missing} does not exist" in capsys.readouterr().err


def test_detect_checks_the_context_before_loading_the_weights(tiny_dir, tmp_path, monkeypatch, capsys):
    """A local model's config is read first: a grid longer than its context fails before a large model loads."""
    import retmask.detect.run as detect_run

    monkeypatch.setattr(detect_run, "load_model", lambda *a, **k: pytest.fail("loaded the weights first"))
    argv = [
        "detect",
        "--model",
        str(tiny_dir),
        "--min-len",
        "2000",
        "--max-len",
        "2000",
        "--out",
        str(tmp_path / "s.json"),
    ]
    assert main(argv) == 2
    assert "exceeds the model's maximum of 1024 tokens" in capsys.readouterr().err
