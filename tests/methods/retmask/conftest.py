"""Fixtures for the RetMask pipeline tests: a tiny random Llama saved with the embedded model's tokenizer.

Tiny = hidden 64, 2 layers, 4 query heads over 2 KV heads (GQA), head dim 16, SmolLM2's 49152-token
vocabulary (so the real chat template and EOS apply). Saved once per session to a temporary folder, so
commands can load it by path like any user model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import retmask
from tests.methods.retmask.test_train import ROWS, conv
from tests.tiny import tiny_llama_for

HEADS = [[0, 1], [1, 3]]  # the masked heads pairs_with_heads records


@pytest.fixture(scope="session")
def tokenizer():
    tok = transformers.AutoTokenizer.from_pretrained(retmask.default_model_path())
    tok.pad_token = tok.pad_token or tok.eos_token
    return tok


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer) -> Path:
    """A saved tiny random Llama + tokenizer (a plain HF folder)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama_for(tokenizer, init=0.02).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(model, tokenizer) loaded through retmask.load_model (retmask attention, eval mode)."""
    return retmask.load_model(str(tiny_dir))


@pytest.fixture(scope="session")
def peaked(tiny_dir):
    """``tiny`` with its logits scaled 10x (final norm weight): std ~1.6 instead of ~0.16.

    A random init=0.02 model's next-token distribution is almost uniform over 49,152 tokens, so top-p's
    sort order among ~42K near-equal probabilities is decided by float rounding, which differs between
    batch compositions (and between CPU kinds). A trained model's distribution is peaked like this one's;
    tests that compare sampled text across batchings use it.
    """
    model, tok = retmask.load_model(str(tiny_dir))
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    return model, tok


@pytest.fixture
def pairs_with_heads(tmp_path):
    """A pairs file plus the progress file a finished `retmask generate` leaves next to it (records the
    heads and that the run is complete)."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(conv(*r)) + "\n" for r in ROWS))
    progress = {"fingerprint": {"heads": HEADS}, "complete": True}
    (tmp_path / "pairs.jsonl.progress.json").write_text(json.dumps(progress))
    return path
