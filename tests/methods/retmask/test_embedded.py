"""A short real run on the embedded SmolLM2-135M-Instruct: generate a handful of pairs, 2 DPO steps."""

from __future__ import annotations

import json

import pytest
import torch

import retmask
from retmask.cli import main as cli
from retmask.methods.retmask.generate import read_pairs, stats_path

# Heads of SmolLM2-135M ([30 layers, 9 query heads]); any set exercises the pipeline, a real run takes
# them from `retmask mask`.
HEADS = [[3, 3], [5, 1], [8, 8], [10, 3], [12, 4], [14, 6], [15, 0], [20, 2]]


@pytest.mark.embedded
def test_generate_then_dpo_on_embedded_model(tmp_path, capsys):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"heads": HEADS}))
    pairs = tmp_path / "pairs.jsonl"
    argv = ["generate", "--heads", str(heads), "--out", str(pairs), "--limit", "6", "--batch-size", "3",
            "--max-new-tokens", "12", "--no-progress"]  # fmt: skip
    assert cli(argv) == 0
    rows = read_pairs(pairs)
    stats = json.loads(stats_path(pairs).read_text())
    assert stats["instructions"] == 6 and stats["pairs"] == len(rows) >= 2
    assert stats["pairs"] + sum(stats["dropped"].values()) == 6
    for r in rows:
        assert r["chosen"][0]["content"] != r["rejected"][0]["content"]
        assert 0 < r["metadata"]["chosen_tokens"] <= 12 and r["metadata"]["prompt_tokens"] > 20
    assert "mean instruction tokens" in capsys.readouterr().out

    out = tmp_path / "dpo"
    argv = ["train", "--pairs", str(pairs), "--out", str(out), "--max-steps", "2", "--batch-size", "2",
            "--grad-accum", "1", "--max-length", "256"]  # fmt: skip
    assert cli(argv) == 0
    summary = json.loads((out / "retmask_train.json").read_text())
    assert summary["steps"] == 2 and all(torch.isfinite(torch.tensor(summary["losses"])))
    # the default peak lr 5e-7 is reached only after warm-up: the weights move, but very little
    before, _ = retmask.load_model()
    after, _ = retmask.load_model(str(out))
    diffs = [(a - b).abs().max().item() for a, b in zip(after.parameters(), before.parameters(), strict=True)]
    assert 0 < max(diffs) < 1e-3
