"""Shared fixtures for the Hugging Face integration tests: tiny random models of each architecture.

Tiny = hidden 64, 2 layers, 4 query heads over 2 KV heads (GQA), head dim 16, vocab 128. Weights are
drawn with a large init range so attention logits are well separated: argmax comparisons against eager
attention are then not decided by float rounding.

With ``RETMASK_TEST_DEVICE=cuda`` the models and batches are made on the GPU (see tests/device.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import retmask
from retmask.hf.export import zero_heads_

from ..device import TEST_DEVICE

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "olmo2")
VOCAB = 128


def tiny_config(arch: str, **overrides) -> transformers.PretrainedConfig:
    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    if arch == "mistral":
        kw["sliding_window"] = None
    kw.update(overrides)
    return transformers.AutoConfig.for_model(arch, **kw)


def tiny_model(arch: str, attn: str = "retmask", seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random tiny causal LM in float32, eval mode, on TEST_DEVICE."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn, dtype=torch.float32
    )
    return model.to(TEST_DEVICE).eval()


def with_attn(model: transformers.PreTrainedModel, attn: str) -> transformers.PreTrainedModel:
    """A deep copy of ``model`` on another attention implementation (same weights)."""
    other = copy.deepcopy(model)
    other.set_attn_implementation(attn)
    for m in retmask.hf.head_layout(other).layers:
        m._retmask_skip = m._retmask_rows = m._retmask_capture = None
    return other


def zeroed_copy(
    model: transformers.PreTrainedModel, heads, attn: str = "sdpa"
) -> transformers.PreTrainedModel:
    """A copy with the o_proj columns of ``heads`` zeroed, on ``attn``."""
    other = with_attn(model, attn)
    return zero_heads_(other, heads)


def random_batch(batch: int, seq: int, left_pad: list[int] | None = None, seed: int = 0):
    """input_ids [B, S] (ids 3..VOCAB-1) and attention_mask [B, S] with ``left_pad[b]`` pad tokens on the
    left, on TEST_DEVICE."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for b, p in enumerate(left_pad or []):
        ids[b, :p] = 0
        mask[b, :p] = 0
    return ids.to(TEST_DEVICE), mask.to(TEST_DEVICE)


def assert_argmax_matches(kernel_idx: torch.Tensor, weights: torch.Tensor, atol: float = 1e-6) -> None:
    """kernel_idx: int64 [..., T]; weights: eager attention probabilities [..., T, N].

    Exact equality is expected; where a near-tie could flip under float rounding, the kernel's choice must
    carry the maximal weight within ``atol``.
    """
    assert kernel_idx.shape == weights.shape[:-1], (kernel_idx.shape, weights.shape)
    expected = weights.argmax(-1)
    differ = kernel_idx != expected
    if differ.any():
        picked = weights.gather(-1, kernel_idx.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        gap = (weights.amax(-1) - picked)[differ]
        assert (kernel_idx[differ] >= 0).all() and gap.max() <= atol, f"argmax differs, gap {gap.max()}"
    assert differ.float().mean() < 0.02


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param
