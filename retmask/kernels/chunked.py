"""Attention over chunks of query rows, each against only the keys it can see: memory O(rows x keys).

Every chunk runs the plain-torch oracle (``reference.py``) on a slice: query rows ``[i0, i1)`` against
keys ``[lo, hi)``, where ``hi`` is one past the last row's position (causal; else N) and ``lo`` the first
key inside the first row's sliding window (else 0). The slices keep their positions: the oracle places
row ``i`` at ``hi - lo - (i1 - i0) + (i - i0)`` in slice coordinates, which is ``N - M + i - lo`` for
causal chunks, and positions do not matter without causality. So every feature of the contract
(window, softcap, sinks, padding, skipped heads, non-finite inputs) is the oracle's, exactly.

Sink tokens S (with a window): a chunk whose window starts at ``lo > S`` also needs keys ``[0, S)``; its
slice is then their concatenation ``k[:S] ++ k[lo:hi]``. In slice coordinates the first S keys are still
the sink tokens (so the oracle gets ``sink_tokens=S`` unchanged), and every other key and every row moves
by the same ``S - lo``, which keeps the causal and window conditions. With ``lo <= S`` the slice is just
``[0, hi)``.

Two uses: the backward of the CPU backend for what PyTorch SDPA cannot express without an [M, N] mask
(sliding window with or without sink tokens, soft-capping, sinks), one ``autograd.grad`` per chunk; and the forward of the blocked
CPU fallback (no compiled kernel) for those features.
"""

from __future__ import annotations

import torch

from .reference import reference_attention

# Logit elements per chunk (fp32): 2^23 = 32 MiB, times the few copies autograd keeps.
CHUNK_ELEMENTS = 1 << 23


def _key_range(
    i0: int, i1: int, M: int, N: int, causal: bool, window: int | None, sink_tokens: int | None = None
) -> tuple[int, int, int]:
    """Keys rows [i0, i1) can see (row i sits at position N - M + i): (sink_end, lo, hi), the sink tokens
    [0, sink_end) below the window's keys [lo, hi) (sink_end = 0 when the slice [lo, hi) holds them)."""
    hi = N - M + i1 if causal else N
    lo = max(0, N - M + i0 - window + 1) if window is not None else 0
    if sink_tokens is None:
        return 0, lo, hi
    if sink_tokens >= lo:  # the sink tokens reach the window's keys: one slice from key 0
        return 0, 0, hi
    return sink_tokens, lo, hi


def _chunks(q: torch.Tensor, N: int, causal: bool, window: int | None, sink_tokens: int | None = None):
    """Yield (i0, i1, sink_end, lo, hi) covering the M query rows, about CHUNK_ELEMENTS logits each."""
    B, Hq, M, _ = q.shape
    span = min(N, window + (sink_tokens or 0)) if window is not None else N
    rows = max(1, CHUNK_ELEMENTS // max(1, B * Hq * span))
    for i0 in range(0, M, rows):
        i1 = min(M, i0 + rows)
        yield i0, i1, *_key_range(i0, i1, M, N, causal, window, sink_tokens)


def _keys(t: torch.Tensor, sink_end: int, lo: int, hi: int) -> torch.Tensor:
    """The chunk's keys along dim 2 (k, v [B, Hkv, N, D] or a mask [B, N] along dim 1 when 2-D):
    ``t[:sink_end] ++ t[lo:hi]``, or the plain slice without sink tokens below the window."""
    dim = 2 if t.dim() == 4 else 1
    part = t.narrow(dim, lo, hi - lo)
    return torch.cat([t.narrow(dim, 0, sink_end), part], dim) if sink_end else part


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    argmax_rows: int,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    sink_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward, no autograd. q: [B, Hq, M, D]; k, v: [B, Hkv, N, D] ->
    (out [B, Hq, M, D] q.dtype, argmax int64 [B, Hq, argmax_rows] | None)."""
    B, Hq, M, D = q.shape
    N = k.shape[2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    argmax = torch.empty(B, Hq, argmax_rows, dtype=torch.int64, device=q.device) if argmax_rows else None
    first_argmax_row = M - argmax_rows
    with torch.no_grad():
        for i0, i1, sink_end, lo, hi in _chunks(q, N, causal, window, sink_tokens):
            rows = max(0, i1 - max(i0, first_argmax_row)) if argmax_rows else 0
            out_c, am_c = reference_attention(
                q[:, :, i0:i1], _keys(k, sink_end, lo, hi), _keys(v, sink_end, lo, hi), causal=causal,
                sm_scale=sm_scale,
                key_padding_mask=None if key_padding_mask is None else _keys(key_padding_mask, sink_end, lo, hi),
                skip_heads=skip_heads, argmax_rows=rows, window=window, softcap=softcap, sinks=sinks,
                sink_tokens=sink_tokens,
            )  # fmt: skip
            out[:, :, i0:i1] = out_c
            if rows:
                # Slice key index -> absolute index (sink tokens keep theirs); -1 (no key / skipped /
                # poisoned) stays -1.
                am_c = torch.where(am_c >= sink_end, am_c - sink_end + lo, am_c)
                argmax[:, :, i1 - rows - first_argmax_row : i1 - first_argmax_row] = am_c
    return out, argmax


def chunked_grads(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    sink_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of ``sum(out * grad_out)``: (dq [B, Hq, M, D], dk, dv [B, Hkv, N, D], dsinks [Hq] | None),
    in the inputs' dtypes (accumulated in fp32), one autograd pass per chunk of query rows."""
    N = k.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    dsinks = torch.zeros(sinks.shape, dtype=acc, device=q.device) if sinks is not None else None
    for i0, i1, sink_end, lo, hi in _chunks(q, N, causal, window, sink_tokens):
        with torch.enable_grad():
            # k, v leaves: the chunk's window keys, then (sink tokens below them) the sink tokens' keys
            leaves = [q[:, :, i0:i1].detach(), k[:, :, lo:hi].detach(), v[:, :, lo:hi].detach()]
            if sinks is not None:
                leaves.append(sinks.detach())
            if sink_end:
                leaves += [k[:, :, :sink_end].detach(), v[:, :, :sink_end].detach()]
            for t in leaves:
                t.requires_grad_(True)
            k_c, v_c = leaves[1], leaves[2]
            if sink_end:
                k_c, v_c = torch.cat([leaves[-2], k_c], 2), torch.cat([leaves[-1], v_c], 2)
            out_c, _ = reference_attention(
                leaves[0], k_c, v_c, causal=causal, sm_scale=sm_scale,
                key_padding_mask=None if key_padding_mask is None else _keys(key_padding_mask, sink_end, lo, hi),
                skip_heads=skip_heads, window=window, softcap=softcap,
                sinks=leaves[3] if sinks is not None else None, sink_tokens=sink_tokens,
            )  # fmt: skip
            grads = torch.autograd.grad(out_c, leaves, grad_out[:, :, i0:i1], allow_unused=True)
        dq[:, :, i0:i1] += grads[0]
        dk[:, :, lo:hi] += grads[1]
        dv[:, :, lo:hi] += grads[2]
        if dsinks is not None and grads[3] is not None:
            dsinks += grads[3]
        if sink_end:
            dk[:, :, :sink_end] += grads[-2]
            dv[:, :, :sink_end] += grads[-1]
    return (
        dq.to(q.dtype),
        dk.to(k.dtype),
        dv.to(v.dtype),
        dsinks.to(sinks.dtype) if dsinks is not None else None,
    )
