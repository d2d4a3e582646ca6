"""Live retrieval telemetry: probes logged in the trainer's log_history, equal to a direct detection."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import retmask
from retmask.cli import main as cli
from retmask.detect import FastDetector, head_scores, stop_token_ids
from retmask.detect.answers import prefix_order
from retmask.detect.run import run_tests
from retmask.detect.scores import mean_matrix
from retmask.heads import model_shape
from retmask.methods.retmask.telemetry import KEYS, RetrievalTelemetry, heads_for_pairs, unwrap
from retmask.niah import build_tests, load_haystack, load_needles

from .conftest import HEADS


def direct_means(model, tok, lengths, depths, num_needles, heads, max_new_tokens):
    """What `retmask detect` computes on the same tests, then the masked / other split, by hand."""
    needles = load_needles()[:num_needles]
    tests = [t for t in build_tests(tok, needles, load_haystack(None), lengths, depths) if not t.skip_reason]
    det = FastDetector(model, stop_token_ids(tok, model), max_new_tokens)
    done = run_tests(det, tok, prefix_order(tests), needles, {}, progress_bar=False)
    counted = [done[i] for i in sorted(done) if done[i]["counted"]]
    shape = model_shape(model)
    mean = mean_matrix(head_scores([np.asarray(e["copies"]) for e in counted],
                                   [e["answer_tokens"] for e in counted], shape), shape)  # fmt: skip
    mask = np.zeros(shape, bool)
    for a, b in heads:
        mask[a, b] = True
    recall = float(np.mean([e["rouge1_recall"] for e in done.values()]))
    return float(mean[mask].mean()), float(mean[~mask].mean()), recall, len(counted)


def test_cli_telemetry_logs_probes_equal_to_direct_detection(tiny_dir, pairs_with_heads, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["train", "--pairs", str(pairs_with_heads), "--model", str(tiny_dir), "--out", str(out),
            "--max-steps", "3", "--batch-size", "2", "--grad-accum", "1", "--lr", "1e-2", "--max-length", "128",
            "--telemetry-every", "2"]  # fmt: skip
    assert cli(argv) == 0
    assert "retrieval telemetry ->" in capsys.readouterr().out
    summary = json.loads((out / "retmask_train.json").read_text())
    probes = [h for h in summary["log_history"] if KEYS[0] in h]
    # step 0, every 2 steps, and the end (step 3)
    assert [p["step"] for p in probes] == [0, 2, 3]
    assert all(k in p for p in probes for k in KEYS)
    # TRL's own metrics stay in the loss entries (our entries do not flush them)
    losses = [h for h in summary["log_history"] if "loss" in h]
    assert len(losses) == 3 and all("rewards/chosen" in h and KEYS[0] not in h for h in losses)
    tele = json.loads((out / "telemetry.json").read_text())
    assert tele["heads"] == HEADS and [h["step"] for h in tele["history"]] == [0, 2, 3]
    assert (out / "telemetry.png").stat().st_size > 1000

    # the last probe ran on the final weights: equal to a direct detection of the saved model
    model, tok = retmask.load_model(str(out))
    masked, other, recall, counted = direct_means(model, tok, [1000], [25, 75], 2, HEADS, 32)
    last = probes[-1]
    assert last[KEYS[0]] == pytest.approx(masked, abs=1e-12)
    assert last[KEYS[1]] == pytest.approx(other, abs=1e-12)
    assert last[KEYS[2]] == pytest.approx(recall, abs=1e-12) and last[KEYS[3]] == counted


def test_probe_restores_train_mode_and_matches_direct(tiny, monkeypatch):
    """With every test counted (filter lowered), the split equals the hand computation; mode restored."""
    import retmask.detect.run as run_mod

    monkeypatch.setattr(run_mod, "RECALL_THRESHOLD", -1.0)  # count every test, whatever the tiny model says
    model, tok = tiny
    cb = RetrievalTelemetry(HEADS, 1, tokenizer=tok, lengths=[400], depths=[0, 100], num_needles=3,
                            max_new_tokens=12)  # fmt: skip
    model.train()
    values = cb.measure(model)
    assert model.training
    model.eval()
    masked, other, recall, counted = direct_means(model, tok, [400], [0, 100], 3, HEADS, 12)
    assert counted == 6 and values[KEYS[3]] == 6
    assert (values[KEYS[0]], values[KEYS[1]], values[KEYS[2]]) == pytest.approx((masked, other, recall))


def test_unwrap_and_errors(tiny, pairs_with_heads, tmp_path):
    model, _ = tiny

    assert unwrap(torch.compile(torch.nn.DataParallel(model))) is model
    assert unwrap(model) is model
    with pytest.raises(ValueError, match="positive"):
        RetrievalTelemetry(HEADS, 0)
    with pytest.raises(ValueError, match="masked heads"):
        RetrievalTelemetry([], 5)
    cb = RetrievalTelemetry([[7, 0]], 1, tokenizer=tiny[1])
    with pytest.raises(ValueError, match=r"does not exist in a model with \[L, Hq\] = \[2, 4\]"):
        cb.measure(model)
    assert heads_for_pairs(pairs_with_heads) == [tuple(h) for h in HEADS]
    bare = tmp_path / "other.jsonl"
    bare.write_text(pairs_with_heads.read_text())
    with pytest.raises(ValueError, match="--telemetry-heads"):
        heads_for_pairs(bare)
