"""retmask eval on tiny models: structure, caching, NIAH answers equal evaluate_niah, shift, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

import retmask
from retmask.cli import main as cli
from retmask.evaluate.niah import evaluate_niah
from retmask.evaluate.suite import EvalConfig, run_suite, shift_rows
from tests.tiny import tiny_llama_for

CFG = dict(min_len=300, max_len=500, num_lengths=2, num_depths=2, niah_needles=2, mn_needles=2, kv_depths=[10, 90],
           max_new_tokens=8)  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    """Two tiny models saved as HF folders (different weights), plus a copy of the first."""
    root = tmp_path_factory.mktemp("eval-models")
    out = []
    for name, seed in (("a", 0), ("b", 1), ("a-copy", 0)):
        tiny_llama_for(tokenizer, seed=seed).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        out.append(str(root / name))
    return out


def test_suite_structure_cache_and_niah_equals_evaluate_niah(folders, tmp_path):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"heads": [[0, 1], [1, 2]]}))
    logs = []
    data = run_suite(folders, tmp_path / "out", EvalConfig(**CFG), heads_files=[heads], progress=False,
                     log=logs.append)  # fmt: skip
    out = tmp_path / "out"
    for f in ("eval.json", "report.md", "niah.png", "tasks.png", "shift.png"):
        assert (out / f).stat().st_size > 100, f
    assert [m["label"] for m in data["models"]] == ["a", "b", "a-copy"]
    a, b, a2 = data["models"]
    assert a["lengths"] == [300, 500] and set(a["tasks"]) == {"niah", "multi_needle", "kv"}
    assert (
        len(a["niah"]["entries"]) == 2 * 2 * 2
        and len(a["kv"]["entries"]) == 4
        and len(a["multi_needle"]["entries"]) == 4
    )
    assert np.asarray(a["scores"]["mean"]).shape == (2, 4)
    # the same weights in another folder: the cached result is reused, identical numbers
    assert a2["fingerprint"] == a["fingerprint"] and any("a-copy: cached" in s for s in logs)
    assert a2["tasks"] == a["tasks"]
    shift = data["heads"][0]["shift"]
    assert shift[0]["masked_change"] == 0 and shift[2]["masked_change"] == 0 and shift[2]["other_change"] == 0
    assert b["fingerprint"] != a["fingerprint"]
    report = (out / "report.md").read_text()
    assert "## Task scores" in report and "## Retrieval-score shift" in report and "| a-copy |" in report

    # the NIAH answers are evaluate_niah's
    model, tok = retmask.load_model(folders[1])
    ref = evaluate_niah(
        model, tok, lengths=[300, 500], depths=[0, 100], needles=None, max_new_tokens=8, progress=False
    )
    # evaluate_niah with all shipped needles: compare the tests of the first two needles
    ref_entries = {e["key"]: e for e in ref.entries if e["needle_index"] < 2}
    assert {e["key"]: (e["response"], e["rouge1_recall"]) for e in b["niah"]["entries"]} == {
        k: (e["response"], e["rouge1_recall"]) for k, e in ref_entries.items()
    }

    # second run: everything cached (nothing evaluated), same report
    logs.clear()
    again = run_suite(folders[:2], tmp_path / "out", EvalConfig(**CFG), progress=False, log=logs.append)
    assert sum("cached" in s for s in logs) == 2 and again["models"][1]["tasks"] == b["tasks"]


def test_shift_rows():
    mean = np.zeros((2, 3))
    mean[0, 1] = 0.6
    after = mean.copy()
    after[0, 1] = 0.9
    after[1, 2] = 0.5
    rows = shift_rows([{"label": "x", "scores": {"mean": mean.tolist(), "counted": 1, "tests": 2}},
                       {"label": "y", "scores": {"mean": after.tolist(), "counted": 2, "tests": 2}}], [[0, 1]])  # fmt: skip
    assert rows[0]["masked_mean"] == pytest.approx(0.6) and rows[1]["masked_change"] == pytest.approx(0.3)
    assert rows[1]["other_change"] == pytest.approx(0.1) and rows[0]["other_mean"] == 0


def test_cli_errors(folders, tmp_path, capsys):
    bad = tmp_path / "heads.json"
    bad.write_text(json.dumps({"heads": [[5, 0]], "model_shape": [2, 4]}))
    assert cli(["eval", "--model", folders[0], "--heads", str(bad), "--out-dir", str(tmp_path / "o")]) == 2
    assert "does not exist in a model" in capsys.readouterr().err
    argv = [
        "eval",
        "--model",
        folders[0],
        "--max-len",
        "1020",
        "--out-dir",
        str(tmp_path / "o"),
        "--no-progress",
    ]
    assert cli(argv) == 2
    assert "exceeds the model's maximum of 1024" in capsys.readouterr().err
    assert (
        cli(["eval", "--model", folders[0], "--label", "x", "--label", "y", "--out-dir", str(tmp_path / "o")])
        == 2
    )
    assert "2 labels for 1 models" in capsys.readouterr().err


def test_an_interrupted_model_resumes_with_its_next_task(folders, tmp_path, monkeypatch):
    """Ctrl-C in the key-value task: NIAH and multi-needle are kept in <fingerprint>.partial.json, the rerun
    evaluates only the key-value task and writes what an uninterrupted run writes."""
    from retmask.evaluate import suite

    cfg = EvalConfig(**CFG)
    want = run_suite(folders[1:2], tmp_path / "whole", cfg, progress=False, log=lambda s: None)["models"][0]
    ran, run_task, interrupts = [], suite.run_task, [KeyboardInterrupt]

    def interrupt_kv(model, tokenizer, task, *args, **kwargs):
        ran.append(task)
        if task == "kv" and interrupts:
            raise interrupts.pop()
        return run_task(model, tokenizer, task, *args, **kwargs)

    monkeypatch.setattr(suite, "run_task", interrupt_kv)
    with pytest.raises(KeyboardInterrupt):
        run_suite(folders[1:2], tmp_path / "out", cfg, progress=False, log=lambda s: None)
    (partial,) = (tmp_path / "out" / "models").glob("*.partial.json")
    assert set(json.loads(partial.read_text())["tasks"]) == {"niah", "multi_needle"}
    ran.clear()
    logs = []
    got = run_suite(folders[1:2], tmp_path / "out", cfg, progress=False, log=logs.append)["models"][0]
    assert ran == ["kv"] and any("niah, multi_needle cached" in s for s in logs)
    assert not partial.exists()
    untimed = lambda r: {k: v for k, v in r.items() if k != "seconds"} if isinstance(r, dict) else r  # noqa: E731
    for key in ("tasks", "niah", "scores", "multi_needle", "kv", "lengths", "shape", "fingerprint"):
        assert untimed(got[key]) == untimed(want[key]), key


@pytest.mark.parametrize("models", [1, 2])
def test_shift_plot_of_one_or_more_models(models, tmp_path):
    """One evaluated model has no change to plot: the panel says so, with no empty-legend warning."""
    import warnings

    from retmask.evaluate.report import plot_shift

    rng = np.random.default_rng(0)
    results = [{"label": f"m{i}", "scores": {"mean": rng.random((2, 3)).tolist()}} for i in range(models)]
    shift = [{"masked_mean": 0.5, "other_mean": 0.1} for _ in range(models)]
    heads_sets = [{"name": "retrieval", "heads": [[0, 1]], "shift": shift}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = plot_shift(results, heads_sets, tmp_path / "shift.png")
    assert path.stat().st_size > 1000
