"""Exact attention of windowed KV heads over a "first S + last W" key set given by positions.

Query row i sits at position ``start + i``; key slot k holds position ``positions[k]`` (any order, -1 =
empty). Row p sees key j iff ``0 <= j <= p`` and (``j < S`` or ``p - W < j``), the key is valid in the
padding mask, as the kernel's contract otherwise (``retmask/kernels/reference.py``): scale, soft-capping,
sinks in the denominator, argmax = the smallest position among tied maximal logits, 0 / -1 for a row
without a visible key or a skipped head.

The fused kernel cannot express this pattern over unordered keys (its window is a band over key indices),
so the rows run in blocks, each against only the keys some row of the block can see (S sinks + W + block
rows at most): memory O(block x (S + W + block)), never [M, N]. Used for the windowed heads' prefill; a
decode step (every kept key visible) goes to the kernel.
"""

from __future__ import annotations

import torch

# Logit elements per block (fp32): 2^22 = 16 MiB, plus the same again for the probabilities.
BLOCK_ELEMENTS = 1 << 22


def sink_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    *,
    start: int,
    sink_tokens: int,
    window: int,
    sm_scale: float,
    key_padding_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    skip_heads: torch.Tensor | None = None,
    argmax_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q: [B, Hq, M, D] (query heads KV-major: head h reads KV head h // g); k, v: [B, Hkv, K, D];
    positions: int64 [K]; key_padding_mask: bool [B, K] (True = valid) or None; sinks: float [Hq];
    skip_heads: bool [Hq] or [B, Hq]. Returns out [B, Hq, M, D] in q's dtype (fp32 arithmetic) and, when
    ``argmax_rows`` T > 0, argmax int64 [B, Hq, T] of the last T rows as absolute positions."""
    B, Hq, M, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    S, W = sink_tokens, window
    dev = q.device
    qf = q.float().reshape(B, Hkv, g, M, D)
    kf, vf = k.float(), v.float()
    valid = positions >= 0  # [K]
    valid = valid[None] if key_padding_mask is None else valid[None] & key_padding_mask  # [B, K]
    out = torch.zeros(B, Hkv, g, M, D, dtype=torch.float32, device=dev)
    first_argmax = M - argmax_rows
    argmax = torch.full((B, Hkv, g, argmax_rows), -1, dtype=torch.int64, device=dev) if argmax_rows else None
    sink_logit = None if sinks is None else sinks.float().reshape(1, Hkv, g, 1)
    rows = max(1, BLOCK_ELEMENTS // max(1, B * Hq * min(positions.numel(), S + W + M)))
    for i0 in range(0, M, rows):
        i1 = min(M, i0 + rows)
        q_pos = torch.arange(start + i0, start + i1, device=dev)  # [R]
        # the keys any row of the block sees: one host read per block (prefill only)
        near = (positions >= 0) & (positions < start + i1) & ((positions < S) | (positions > start + i0 - W))
        index = near.nonzero().flatten()
        if index.numel() == 0:
            continue  # no row sees a key: output 0, argmax -1
        pos = positions[index]  # [K']
        allowed = (pos[None] <= q_pos[:, None]) & ((pos[None] < S) | (pos[None] > q_pos[:, None] - W))
        allowed = allowed[None] & valid[:, index][:, None, :]  # [B, R, K']
        logits = torch.einsum("bhgmd,bhkd->bhgmk", qf[:, :, :, i0:i1], kf.index_select(2, index)) * sm_scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits.masked_fill(~allowed[:, None, None], float("-inf"))  # [B, Hkv, g, R, K']
        top = logits.amax(-1, keepdim=True)
        if sink_logit is not None:
            top = torch.maximum(top, sink_logit[..., None])
        top = torch.where(torch.isinf(top) & (top < 0), 0.0, top)  # a row with no key: exp(-inf) = 0 below
        weights = torch.exp(logits - top)
        denom = weights.sum(-1, keepdim=True)
        if sink_logit is not None:
            denom = denom + torch.exp(sink_logit[..., None] - top)
        block = weights @ vf.index_select(2, index)[:, :, None]  # [B, Hkv, g, R, D]
        seen = allowed.any(-1)[:, None, None, :, None]  # [B, 1, 1, R, 1]
        out[:, :, :, i0:i1] = torch.where(seen, block / denom.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        if argmax is not None and i1 > first_argmax:
            r0 = max(i0, first_argmax)
            cap = logits[:, :, :, r0 - i0 :]
            best = cap.amax(-1, keepdim=True)
            # smallest position among the tied maxima; none when the row sees no key or a logit is NaN
            tied = (cap == best) & torch.isfinite(best) & ~torch.isnan(cap).any(-1, keepdim=True)
            first = torch.where(tied, pos, torch.iinfo(torch.int64).max).amin(-1)
            argmax[:, :, :, r0 - first_argmax : i1 - first_argmax] = torch.where(tied.any(-1), first, -1)
    out = out.reshape(B, Hq, M, D)
    if argmax is not None:
        argmax = argmax.reshape(B, Hq, argmax_rows)
    if skip_heads is not None:
        skipped = skip_heads.reshape(-1, Hq)[:, :, None]  # [1 or B, Hq, 1]
        out = out.masked_fill(skipped[..., None], 0.0)
        if argmax is not None:
            argmax = argmax.masked_fill(skipped, -1)
    return out.to(q.dtype), argmax
