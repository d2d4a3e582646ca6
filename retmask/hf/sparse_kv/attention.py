"""Attention of a head-sparse layer: full KV heads and windowed KV heads in separate calls.

The full KV heads' query heads attend over every key (one kernel call, causal, the layer's padding mask);
the windowed KV heads' query heads attend over their compact sink + window keys (``SparseKV.mode``):

* "visible" (a decode step): one kernel call, not causal, over the buffer, whose non-empty slots are
  exactly the keys the query sees; the padding mask's columns are picked by slot position;
* "ordered" (no key evicted yet): one causal kernel call, as for a full head;
* "pattern" (a prefill past S + W tokens): over keys in position order from 0 (a first prefill) the
  kernel's window (with its ``sink_tokens`` argument for S > 0, where the kernel has it); else
  ``sink_window.sink_window_attention`` (row blocks against the keys each block sees).

Each part writes its query heads' columns of one ``[B, M, Hq, D]`` output (the layout transformers takes),
so no [N, N] mask and no gathered copy of the cache is ever made. Argmax capture and head masks work: each
part's argmax is mapped to absolute positions and scattered into ``[B, Hq, T]``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from retmask.hf.sparse_kv.layer import SparseKV
from retmask.hf.sparse_kv.sink_window import sink_window_attention
from retmask.kernels import attention as kernel_attention

# The fused kernel computes "first S + last W" itself once it has a ``sink_tokens`` argument (row p sees
# j <= p with p - W < j or j < S); until then the windowed prefill takes the exact blocked path.
KERNEL_SINK_TOKENS = "sink_tokens" in inspect.signature(kernel_attention).parameters


def _pick(t: torch.Tensor | None, heads: torch.Tensor, dim: int) -> torch.Tensor | None:
    return None if t is None else t.index_select(dim, heads)


def _window_part(
    q: torch.Tensor,
    sparse: SparseKV,
    kpm: torch.Tensor | None,
    common: dict[str, Any],
    argmax_rows: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q: [B, Hq_w, M, D] -> out [B, Hq_w, M, D], argmax int64 [B, Hq_w, T] (absolute positions) or None."""
    k, v, pos = sparse.keys_win, sparse.values_win, sparse.positions_win
    argmax_kw = {"return_argmax": True, "argmax_rows": argmax_rows} if argmax_rows else {}
    S = sparse.sink_tokens
    # keys 0 .. N-1 in order (a first prefill): the kernel's band does it, given sink_tokens when S > 0
    in_order = sparse.start == 0 and pos.numel() == sparse.length
    if sparse.mode == "pattern" and not (in_order and (S == 0 or KERNEL_SINK_TOKENS)):
        return sink_window_attention(
            q, k, v, pos, start=sparse.start, sink_tokens=S, window=sparse.window,
            key_padding_mask=None if kpm is None else kpm[:, pos.clamp_min(0)], argmax_rows=argmax_rows,
            **common,
        )  # fmt: skip
    if sparse.mode == "visible":
        # slot order: the padding mask picked by position, empty slots (-1) invalid; once S + W positions
        # were written every slot holds one, so without padding no mask at all (a decode step's usual case)
        if kpm is None and sparse.length >= S + sparse.window:
            mask = None
        else:
            mask = pos >= 0
            mask = mask[None].expand(q.shape[0], -1) if kpm is None else kpm[:, pos.clamp_min(0)] & mask
        result = kernel_attention(q, k, v, causal=False, key_padding_mask=mask, **common, **argmax_kw)
    else:  # "ordered" (plain causal), or "pattern" over keys 0 .. N-1 in order
        extra: dict[str, Any] = {}
        if sparse.mode == "pattern":
            extra = {"window": sparse.window, **({"sink_tokens": S} if S else {})}
        result = kernel_attention(q, k, v, causal=True, key_padding_mask=kpm, **common, **argmax_kw, **extra)
    if not argmax_rows:
        return result, None
    out, argmax = result
    if sparse.mode == "visible":  # slot -> position
        argmax = torch.where(argmax >= 0, pos[argmax.clamp_min(0)], argmax)
    return out, argmax


def sparse_attention(
    query: torch.Tensor,
    sparse: SparseKV,
    *,
    key_padding_mask: torch.Tensor | None,
    sm_scale: float | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    skip_heads: torch.Tensor | None = None,
    argmax_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """query: [B, Hq, M, D] (rows at positions ``sparse.start`` ..); key_padding_mask: bool [B, N] over
    every position (N = ``sparse.length``) or None; sinks: [Hq]; skip_heads: bool [Hq] or [B, Hq].
    Returns out [B, M, Hq, D] contiguous and, when ``argmax_rows`` T > 0, argmax int64 [B, Hq, T] (absolute
    positions of the last T rows)."""
    B, Hq, M, D = query.shape
    if sm_scale is None:
        sm_scale = D**-0.5
    out = query.new_empty(B, M, Hq, D)
    argmax = (
        torch.full((B, Hq, argmax_rows), -1, dtype=torch.int64, device=query.device) if argmax_rows else None
    )
    parts = ((sparse.q_full, "full"), (sparse.q_win, "window"))
    for heads, part in parts:
        if heads.numel() == 0:
            continue
        q = query.index_select(1, heads)
        common = {
            "sm_scale": sm_scale, "softcap": softcap, "sinks": _pick(sinks, heads, 0),
            "skip_heads": _pick(skip_heads, heads, skip_heads.dim() - 1) if skip_heads is not None else None,
        }  # fmt: skip
        if part == "full":
            argmax_kw = {"return_argmax": True, "argmax_rows": argmax_rows} if argmax_rows else {}
            result = kernel_attention(
                q, sparse.keys_full, sparse.values_full, causal=True, key_padding_mask=key_padding_mask,
                **common, **argmax_kw,
            )  # fmt: skip
            o, a = result if argmax_rows else (result, None)
        else:
            o, a = _window_part(q, sparse, key_padding_mask, common, argmax_rows)
        out.index_copy_(2, heads, o.transpose(1, 2))
        if argmax is not None:
            argmax.index_copy_(1, heads, a)
    return out, argmax
