"""Fixtures for the command-line tests: a tiny random Llama saved with the embedded model's tokenizer.

Tiny = hidden 64, 2 layers, 4 query heads over 2 KV heads (GQA), head dim 16, SmolLM2's vocabulary (its
chat template and EOS apply). A random model retrieves no needle, which is what the "nothing counted"
tests need; commands load it by path like any user model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

import retmask
from tests.tiny import tiny_llama_for


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    tok = transformers.AutoTokenizer.from_pretrained(retmask.default_model_path())
    path = tmp_path_factory.mktemp("tiny-cli")
    tiny_llama_for(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def one_needle(tmp_path) -> Path:
    """A needles file with the first shipped needle only."""
    from retmask.niah import DEFAULT_NEEDLES_PATH

    path = tmp_path / "needles.jsonl"
    path.write_text(DEFAULT_NEEDLES_PATH.read_text().splitlines()[0] + "\n")
    return path
