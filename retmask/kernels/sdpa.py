"""Differentiable attention through PyTorch SDPA with the kernel contract's exact semantics.

Used (1) as the backward of backends without a hand-written one (recompute, then autograd through
SDPA's memory-efficient kernels) and (2) as the speed floor in benchmarks. Handles what plain SDPA does
not: causal alignment with a KV cache (row i at position N - M + i; SDPA's ``is_causal`` aligns
top-left), rows with no valid key (0, not NaN) and skipped heads (exact 0, no gradient). A sliding window
and sink tokens go in as a boolean [M, N] mask (``reference.allowed_keys``): O(M * N) memory, which the
kernels avoid; this path is for comparisons and small calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import allowed_keys


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    key_padding_mask: torch.Tensor | None = None,
    skip_heads: torch.Tensor | None = None,
    window: int | None = None,
    sink_tokens: int | None = None,
) -> torch.Tensor:
    """q: [B, Hq, M, D]; k, v: [B, Hkv, N, D]; key_padding_mask: bool [B, N]; skip_heads: bool [B, Hq];
    window: sliding window (causal) or None; sink_tokens: with a window, the first keys every row also
    sees, or None (``reference.py``'s contract).

    Returns out: [B, Hq, M, D] in q's dtype (differentiable w.r.t. q, k, v).
    """
    M, N = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if key_padding_mask is None and window is None and (not causal or M == N):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale, enable_gqa=gqa)
        has_key = None
    else:
        # [B|1, 1, M, N]
        allowed = allowed_keys(M, N, causal, key_padding_mask, q.device, window, sink_tokens)
        has_key = allowed.any(dim=-1, keepdim=True)
        # A row with no valid key would be NaN in SDPA; let it attend everywhere, then zero it below.
        allowed = allowed | ~has_key
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=sm_scale, enable_gqa=gqa)
    if has_key is not None and not bool(has_key.all()):
        out = out * has_key.to(out.dtype)
    if skip_heads is not None:
        out = out * (~skip_heads)[:, :, None, None].to(out.dtype)
    return out
