"""Fixtures for detection tests: a tiny random Llama on retmask attention and the embedded model."""

from __future__ import annotations

import pytest
import torch
import transformers

import retmask


def tiny_llama(vocab: int = 16, seed: int = 0, dtype=torch.float32) -> transformers.PreTrainedModel:
    """2 layers, 4 query heads over 2 KV heads (GQA), head dim 16. A large init range makes attention
    peaked (argmaxes well separated from the runner-up, so float rounding decides nothing) and a small
    vocabulary makes copies frequent."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="retmask", dtype=dtype)
    return model.eval()


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct on retmask attention."""
    return retmask.load_model()
