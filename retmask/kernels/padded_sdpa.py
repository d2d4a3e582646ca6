"""PyTorch SDPA over left- or right-padded keys without an [M, N] mask: one call per key run.

A padded batch usually gives every batch row its valid keys as one contiguous run ``[s, e)``: right
padding (training batches, ``s = 0``) or left padding (generation batches, ``e = N``). SDPA takes such a
mask only as a dense ``[B, 1, M, N]`` tensor, which it also converts to an additive float mask: at 16K
keys and batch 2 that is 0.5 GB of bools and 2 GB of floats per call, and its flash kernels cannot skip
the blocks above the diagonal. Per batch row the same attention is instead:

  causal, M == N (row i sits at position i):
    rows [0, s)  see no valid key               -> 0 (the contract of a row without keys)
    rows [s, e)  see keys [s, i]                -> causal SDPA on the slice q[s:e], k[s:e], v[s:e]
    rows [e, N)  see every valid key [s, e)     -> SDPA of q[e:] against k[s:e], v[s:e], no mask
  not causal (any M): every row sees [s, e)     -> SDPA of q against k[s:e], v[s:e], no mask

Same softmax over the same keys, so the outputs and gradients agree with the masked call up to the
summation order inside SDPA. :func:`key_runs` tells whether a mask has this form, reading the mask on the
host: callers use it in eager mode only, never while a graph is traced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def key_runs(key_padding_mask: torch.Tensor) -> list[tuple[int, int]] | None:
    """key_padding_mask: bool [B, N] (True = valid key). Per batch row ``(s, e)`` with the valid keys
    exactly ``[s, e)`` (``s == e`` when it has none), or None if some row's valid keys are not one run."""
    mask = key_padding_mask
    count = mask.sum(dim=1)
    first = mask.to(torch.uint8).argmax(dim=1)  # first valid key (0 for a row without any)
    # One run iff the row has no False -> True step after its first valid key: count the rising edges.
    rises = (mask[:, 1:] & ~mask[:, :-1]).sum(dim=1) + mask[:, 0].to(count.dtype)
    rows = torch.stack([first, count, rises], dim=1).tolist()  # one host read for the whole batch
    if any(r > 1 for _, _, r in rows):
        return None
    return [(s, s + c) for s, c, _ in rows]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=sm_scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def sdpa_over_key_runs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    runs: list[tuple[int, int]],
    *,
    causal: bool,
    sm_scale: float,
) -> torch.Tensor:
    """q: [B, Hq, M, D]; k, v: [B, Hkv, N, D]; runs: per batch row the valid keys ``[s, e)`` (from
    :func:`key_runs`); causal requires M == N. Returns out: [B, Hq, M, D] in q's dtype, differentiable
    w.r.t. q, k, v; rows without a valid key are 0."""
    B, Hq, M, D = q.shape
    if causal and M != k.shape[2]:
        raise ValueError(f"causal key runs need as many query rows as keys, got M={M}, N={k.shape[2]}")
    rows = []
    for b, (s, e) in enumerate(runs):
        qb, kb, vb = q[b : b + 1], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e]
        if e == s:  # no valid key: the whole row block is 0
            rows.append(q.new_zeros((1, Hq, M, D)))
            continue
        if not causal:
            rows.append(_sdpa(qb, kb, vb, False, sm_scale))
            continue
        parts = [q.new_zeros((1, Hq, s, D))] if s > 0 else []
        parts.append(_sdpa(qb[:, :, s:e], kb, vb, True, sm_scale))
        if e < M:
            parts.append(_sdpa(qb[:, :, e:], kb, vb, False, sm_scale))
        rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(rows, dim=0) if B > 1 else rows[0]
