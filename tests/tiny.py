"""The one tiny random model of the test suite.

Tiny Llama = hidden 64, 2 layers, 4 query heads over 2 KV heads (GQA), head dim 16. A large init range
(0.2) makes attention peaked, so argmaxes are well separated from the runner-up and float rounding decides
nothing; a small vocabulary makes copies frequent. ``tiny_llama_for(tokenizer)`` takes the tokenizer's
vocabulary and special tokens (so a real chat template and EOS apply).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

import retmask  # noqa: F401  (registers attn_implementation="retmask")

from .device import TEST_DEVICE


def tiny_llama(
    vocab: int = 16,
    *,
    seed: int = 0,
    init: float = 0.2,
    layers: int = 2,
    attn: str = "retmask",
    dtype: torch.dtype = torch.float32,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
) -> transformers.PreTrainedModel:
    """A random tiny causal Llama in eval mode, seeded, on TEST_DEVICE (the CPU unless
    ``RETMASK_TEST_DEVICE`` names another)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=init,
        pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    return model.to(TEST_DEVICE).eval()


def tiny_llama_for(tokenizer: Any, **kw: Any) -> transformers.PreTrainedModel:
    """:func:`tiny_llama` over ``tokenizer``'s vocabulary; pad = the tokenizer's pad (else EOS), bos likewise."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    return tiny_llama(len(tokenizer), pad_token_id=pad, bos_token_id=bos, eos_token_id=eos, **kw)
