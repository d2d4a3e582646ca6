"""Telemetry on the embedded SmolLM2-135M-Instruct: 2 DPO steps, the retrieval heads score (non-zero)."""

from __future__ import annotations

import json

import pytest

import retmask
from retmask.methods.retmask.dpo import train_dpo
from retmask.methods.retmask.telemetry import KEYS, RetrievalTelemetry
from retmask.methods.retmask.train_config import TrainConfig

from .test_telemetry import direct_means
from .test_train import ROWS, conv

# top retrieval heads of SmolLM2-135M-Instruct (bench/results/smollm2_scores.json)
HEADS = [(18, 6), (20, 6), (17, 3), (23, 2)]


@pytest.mark.embedded
def test_telemetry_on_embedded_model(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(conv(*r)) + "\n" for r in ROWS[:2]))
    cb = RetrievalTelemetry(HEADS, 1, lengths=[600], depths=[50], num_needles=2, max_new_tokens=24)
    cfg = TrainConfig(max_steps=2, batch_size=1, grad_accum=1, max_length=128)
    res = train_dpo(pairs, tmp_path / "out", None, cfg, callbacks=[cb])
    assert res.steps == 2 and [h["step"] for h in cb.history] == [0, 1, 2]
    summary = json.loads((tmp_path / "out" / "retmask_train.json").read_text())
    logged = [h for h in summary["log_history"] if KEYS[0] in h]
    assert [h["step"] for h in logged] == [0, 1, 2]
    # SmolLM2 answers these needles: the retrieval heads score, far above the rest
    first = logged[0]
    assert first[KEYS[3]] >= 1 and first[KEYS[0]] > 0.2 > first[KEYS[1]]
    model, tok = retmask.load_model(str(tmp_path / "out"))
    masked, other, recall, counted = direct_means(model, tok, [600], [50], 2, HEADS, 24)
    assert logged[-1][KEYS[0]] == pytest.approx(masked, abs=1e-12) and logged[-1][KEYS[1]] == pytest.approx(
        other, abs=1e-12
    )
    assert logged[-1][KEYS[3]] == counted
