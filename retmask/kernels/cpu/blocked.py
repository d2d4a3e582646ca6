"""Blocked-torch CPU path: output through SDPA's flash kernel, argmax by a key-blocked logit scan.

Memory stays linear in N: the argmax scan holds one ``[B, Hkv, g*T, block]`` logit block at a time.
Skipped heads are gathered out before any work is done.
"""

from __future__ import annotations

import torch

from ..chunked import chunked_attention
from ..sdpa import sdpa_attention

ARGMAX_KEY_BLOCK = 2048


def blocked_argmax(
    q_tail: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    key_padding_mask: torch.Tensor | None,
    block: int = ARGMAX_KEY_BLOCK,
) -> torch.Tensor:
    """Argmax of the logits of the last T query rows, scanning keys in blocks.

    q_tail: [B, Hq, T, D] (the last T rows of q); k: [B, Hkv, N, D]. Row t sits at position N - T + t.
    Returns int64 [B, Hq, T]; -1 for rows without a valid key and for rows with a NaN or +inf logit
    (the non-finite contract). Ties -> smallest index: a later block replaces the running best only if
    strictly greater.
    """
    B, Hq, T, D = q_tail.shape
    Hkv, N = k.shape[1], k.shape[2]
    g = Hq // Hkv
    compute = torch.float32
    # Group query heads by their KV head: [B, Hkv, g*T, D] so one matmul serves the whole group.
    qg = q_tail.to(compute).reshape(B, Hkv, g * T, D) * sm_scale
    best_val = torch.full((B, Hkv, g * T), float("-inf"), dtype=compute)
    best_idx = torch.full((B, Hkv, g * T), -1, dtype=torch.int64)
    poisoned = torch.zeros((B, Hkv, g * T), dtype=torch.bool)
    row_pos = (torch.arange(T) + (N - T)).repeat(g)  # absolute position of each grouped row
    for start in range(0, N, block):
        stop = min(start + block, N)
        if causal and start > N - 1:
            break
        logits = torch.matmul(qg, k[:, :, start:stop].to(compute).transpose(-1, -2))  # [B, Hkv, gT, blk]
        cols = torch.arange(start, stop)
        if causal:
            logits = logits.masked_fill(cols[None, :] > row_pos[:, None], float("-inf"))
        if key_padding_mask is not None:
            logits = logits.masked_fill(~key_padding_mask[:, None, None, start:stop], float("-inf"))
        poisoned |= (torch.isnan(logits) | (logits == float("inf"))).any(dim=-1)
        val, idx = logits.max(dim=-1)  # torch.max returns the first maximal index
        better = val > best_val
        best_val = torch.where(better, val, best_val)
        best_idx = torch.where(better, idx + start, best_idx)
    return best_idx.masked_fill(poisoned, -1).reshape(B, Hq, T)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    argmax_rows: int,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    sink_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """q: [B, Hq, M, D]; k, v: [B, Hkv, N, D] -> (out [B, Hq, M, D], argmax [B, Hq, T] | None, None).

    A sliding window (with or without sink tokens, which need one), soft-capping or sinks (which SDPA
    cannot express without an [M, N] mask) go to ``chunked.chunked_attention``: query-row chunks against
    the keys they see.
    """
    if window is not None or softcap is not None or sinks is not None:
        out, argmax = chunked_attention(
            q, k, v, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
            skip_heads=skip_heads, argmax_rows=argmax_rows, window=window, softcap=softcap, sinks=sinks,
            sink_tokens=sink_tokens,
        )  # fmt: skip
        return out, argmax, None
    B, Hq, M, D = q.shape
    g = Hq // k.shape[1]
    with torch.no_grad():
        if skip_heads is None or not bool(skip_heads.any()):
            out = sdpa_attention(q, k, v, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask)
            argmax = None
            if argmax_rows:
                argmax = blocked_argmax(
                    q[:, :, M - argmax_rows :], k, causal=causal, sm_scale=sm_scale,
                    key_padding_mask=key_padding_mask,
                )  # fmt: skip
            return out, argmax, None
        out = q.new_zeros(B, Hq, M, D)
        argmax = torch.full((B, Hq, argmax_rows), -1, dtype=torch.int64) if argmax_rows else None
        for b in range(B):
            heads = (~skip_heads[b]).nonzero().flatten()
            if heads.numel() == 0:
                continue
            # Active heads become separate KV groups of size 1: only their work is done.
            qb = q[b : b + 1, heads]
            kb = k[b : b + 1, heads // g]
            vb = v[b : b + 1, heads // g]
            mb = key_padding_mask[b : b + 1] if key_padding_mask is not None else None
            out[b, heads] = sdpa_attention(qb, kb, vb, causal=causal, sm_scale=sm_scale, key_padding_mask=mb)[
                0
            ]
            if argmax_rows:
                argmax[b, heads] = blocked_argmax(
                    qb[:, :, M - argmax_rows :], kb, causal=causal, sm_scale=sm_scale, key_padding_mask=mb
                )[0]
        return out, argmax, None
