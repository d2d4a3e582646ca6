"""Shared test utilities for kernel tests: random inputs, poisoning, argmax comparison."""

from __future__ import annotations

import torch

from retmask.kernels.reference import reference_logits

POISON_FLOAT = float("nan")
POISON_INDEX = -12345


def make_qkv(
    B: int,
    Hq: int,
    Hkv: int,
    M: int,
    N: int,
    D: int,
    *,
    dtype=torch.float32,
    seed: int = 0,
    noncontiguous_q: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random q: [B, Hq, M, D], k, v: [B, Hkv, N, D] (never zeros). With ``noncontiguous_q`` q is
    a transposed view of a [B, M, Hq, D] buffer, as transformers passes it."""
    gen = torch.Generator().manual_seed(seed)
    if noncontiguous_q:
        q = torch.randn(B, M, Hq, D, generator=gen).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(B, Hq, M, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, N, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, N, D, generator=gen).to(dtype)
    return q, k, v


def left_padding_mask(B: int, N: int, pads: list[int]) -> torch.Tensor:
    """bool [B, N] with ``pads[b]`` invalid keys at the start of row b."""
    mask = torch.ones(B, N, dtype=torch.bool)
    for b, p in enumerate(pads):
        mask[b, :p] = False
    return mask


def assert_argmax_matches(
    argmax: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float | None,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    atol: float,
    window: int | None = None,
    softcap: float | None = None,
    sink_tokens: int | None = None,
) -> None:
    """Check a kernel's argmax [B, Hq, T] against float64 logits of the last T rows.

    Rows whose top-2 logit gap exceeds ``atol`` must match exactly; closer rows (accumulation-order
    near-ties) must point at a key whose logit is within ``atol`` of the maximum. Invalid rows and
    skipped heads must be -1.
    """
    T = argmax.shape[-1]
    logits = reference_logits(
        q.double(), k.double(), causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
        window=window, softcap=softcap, sink_tokens=sink_tokens,
    )[:, :, -T:]  # fmt: skip
    has_key = torch.isfinite(logits).any(-1)
    expected_invalid = ~has_key
    if skip_heads is not None:
        skip = skip_heads if skip_heads.dim() == 2 else skip_heads.expand(argmax.shape[0], -1)
        expected_invalid = expected_invalid | skip[:, :, None]
    assert torch.equal(argmax == -1, expected_invalid), "argmax is -1 exactly where rows are invalid/skipped"
    valid = ~expected_invalid
    assert bool((argmax[valid] >= 0).all()) and bool((argmax[valid] < k.shape[2]).all())
    top2 = logits.topk(min(2, logits.shape[-1]), dim=-1).values
    ref_idx = logits.argmax(-1)
    picked = logits.gather(-1, argmax.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    assert bool((picked[valid] >= top2[..., 0][valid] - atol).all()), "argmax points at a non-maximal key"
    if top2.shape[-1] > 1:
        clear = valid & ((top2[..., 0] - top2[..., 1]) > atol)
        assert torch.equal(argmax[clear], ref_idx[clear]), "argmax differs on rows with a clear maximum"
