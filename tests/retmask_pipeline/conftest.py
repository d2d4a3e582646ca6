"""Fixtures for the RetMask pipeline tests: a tiny random Llama saved with the embedded model's tokenizer.

Tiny = hidden 64, 2 layers, 4 query heads over 2 KV heads (GQA), head dim 16, SmolLM2's 49152-token
vocabulary (so the real chat template and EOS apply). Saved once per session to a temporary folder, so
commands can load it by path like any user model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import retmask


@pytest.fixture(scope="session")
def tokenizer():
    tok = transformers.AutoTokenizer.from_pretrained(retmask.default_model_path())
    tok.pad_token = tok.pad_token or tok.eos_token
    return tok


def tiny_llama(tokenizer, seed: int = 0, init: float = 0.2) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        initializer_range=init, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="retmask").eval()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer) -> Path:
    """A saved tiny random Llama + tokenizer (a plain HF folder)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(tokenizer, init=0.02).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(model, tokenizer) loaded through retmask.load_model (retmask attention, eval mode)."""
    return retmask.load_model(str(tiny_dir))
