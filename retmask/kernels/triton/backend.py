"""Triton backend of ``retmask.kernels.attention`` (imported lazily as backend "triton").

Dispatch only: ``triton.fwd`` (prefill forward with argmax and head skipping), ``triton.decode`` (calls
with few query rows, split over keys; the rule is ``paths.triton_forward_kernel``) and ``triton.bwd``
(FA2-style backward), all three with sliding window (and sink tokens), logit soft-capping and attention
sinks (``reference.py`` defines them). Inputs arrive validated and normalised by ``attention()`` (see
``validation.py``): masks are contiguous bool, skip_heads is [B, Hq] or None, argmax_rows is in [0, M].

Head skipping has two grid modes (``triton.common.sync_free``): by default the prefill and backward
grids hold only the enabled heads, which costs one device->host sync per call to size them; while a CUDA
graph is being captured, or everywhere with ``triton.common.FORCE_SYNC_FREE`` (tests), there is
no host sync and programs for disabled heads only write their fixed outputs. Decode calls always take the
sync-free grid (their few programs cost less than the sync). So every call, with or without skipped
heads, can be captured in a CUDA graph (``torch.cuda.graph``) and replayed; at batch 1 a decode call's
eager time is almost all host time (Python and two Triton launches), which a graph removes. Debugging:
``triton.common.POISON_OUTPUTS = True`` (tests) fills every output buffer with NaN / -12345 before the kernels run, so an
unwritten element cannot pass unnoticed.
"""

from __future__ import annotations

import torch

from ..paths import triton_forward_kernel
from .bwd import attention_backward
from .common import fp32_sinks
from .decode import decode_forward
from .fwd import attention_forward


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
    return_lse: bool,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    heads_last: bool = False,
    sink_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """q: [B, Hq, M, D]; k, v: [B, Hkv, N, D] -> (out [B, Hq, M, D] q.dtype,
    argmax int64 [B, Hq, argmax_rows] | None, lse fp32 [B, Hq, M] | None).

    ``heads_last`` (the backend interface's request for a [B, M, Hq, D] output) is not taken up here:
    these kernels write a contiguous [B, Hq, M, D] out and ``attention`` copies it (on a GPU the copy
    is small next to the attention).

    window (causal only), sink_tokens (with a window), softcap and sinks ([Hq], any float dtype) follow
    ``reference.py``; the lse
    includes the sink (``log(sum_j e^{s_j} + e^{sink})``), as the backward expects. A call with few
    query rows (decode) takes the split-key kernel, longer ones the prefill kernel
    (``paths.triton_forward_kernel``).
    """
    feats = dict(window=window, softcap=softcap, sinks=fp32_sinks(sinks), sink_tokens=sink_tokens)
    if triton_forward_kernel(q.shape[2]) == "split_keys":
        return decode_forward(
            q, k, v, causal=causal, key_padding_mask=key_padding_mask, skip_heads=skip_heads,
            sm_scale=sm_scale, argmax_rows=argmax_rows, return_lse=return_lse, **feats,
        )  # fmt: skip
    return attention_forward(
        q, k, v, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
        skip_heads=skip_heads, argmax_rows=argmax_rows, return_lse=return_lse, **feats,
    )  # fmt: skip


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    sink_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """grad_out, q, out: [B, Hq, M, D]; k, v: [B, Hkv, N, D]; lse: fp32 [B, Hq, M] from ``forward``
    (with the same window / sink_tokens / softcap / sinks) -> (dq [B, Hq, M, D], dk [B, Hkv, N, D], dv [B, Hkv, N, D])
    in the inputs' dtypes, and dsinks [Hq] in sinks' dtype (None without sinks)."""
    dq, dk, dv, dsinks = attention_backward(
        grad_out, q, k, v, out, lse, causal=causal, sm_scale=sm_scale,
        key_padding_mask=key_padding_mask, skip_heads=skip_heads, window=window, softcap=softcap,
        sinks=fp32_sinks(sinks), sink_tokens=sink_tokens,
    )  # fmt: skip
    if dsinks is not None:
        dsinks = dsinks.to(sinks.dtype)
    return dq, dk, dv, dsinks
