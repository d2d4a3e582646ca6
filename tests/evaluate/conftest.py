"""Fixtures for the evaluation tests: the embedded tokenizer, a tiny random Llama over its vocabulary, and
a plain step-by-step greedy decoder (the reference the fast NIAH evaluation must equal)."""

from __future__ import annotations

import pytest
import torch
import transformers

import retmask
from tests.tiny import tiny_llama_for


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer (chat template, newline tokens, EOS) without loading the model."""
    return transformers.AutoTokenizer.from_pretrained(retmask.default_model_path())


@pytest.fixture(scope="session")
def tiny(tokenizer):
    return tiny_llama_for(tokenizer)


@torch.no_grad()
def greedy_reference(model, prompt_ids, stop_ids, max_new_tokens: int) -> list[int]:
    """Plain greedy decoding: one full forward over the prompt, then one token per call; stops after a
    stop token (included) or ``max_new_tokens``. Any runtime head mask of ``model`` applies."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)[None]
    cache = transformers.DynamicCache(config=model.config)
    out = model(input_ids=ids, cache=cache, use_cache=True)
    tokens: list[int] = []
    while True:
        y = int(out.logits[0, -1].argmax())
        tokens.append(y)
        if y in stop_ids or len(tokens) >= max_new_tokens:
            return tokens
        out = model(input_ids=torch.tensor([[y]]), cache=cache, use_cache=True)
