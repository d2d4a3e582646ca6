"""Public entry point of the kernels: ``retmask.kernels.attention``.

One call computes softmax attention *and*, optionally, for every (batch, head, query row) the index of
the key with the largest attention logit, without materialising the attention matrix; heads marked in
``skip_heads`` are not computed at all (output exactly 0, argmax -1).

Backends (``backend=``):
  "triton"    fused Triton forward (online softmax carrying the running max logit and its index) with a
              split-key decode variant for M == 1 and a Triton backward; CUDA tensors.
  "cpu"       fused CPU kernel (C++/OpenMP from csrc/, or the blocked-torch path where faster).
  "reference" plain torch, materialised, float64-capable: the test oracle.
  "auto"      triton for CUDA tensors, cpu otherwise (reference for float64 inputs).

``attention`` validates and normalises its arguments here (plain Python: under ``torch.compile`` it runs
at trace time), then calls the ``torch.ops.retmask.attention_fwd`` operator (``ops.py``), whose
registered autograd formula supplies the backward. The reference backend runs plain torch ops; a plain
eager call that records no autograd graph runs the operator's body directly (``ops.eager_direct``); a
call under a ``torch.func`` transform (vmap, grad, jvp...) or with a forward-mode tangent runs the
reference, whose plain torch ops have the batching and forward-mode rules the operator lacks
(``eager_state.transformed``).
"""

from __future__ import annotations

import os
from typing import Literal

import torch

from retmask.eager_state import transformed

from .ops import LSE_BACKENDS, attention_fwd, backend_module, eager_direct, forward_impl
from .reference import reference_attention
from .validation import (
    check_argmax_rows,
    check_key_padding_mask,
    check_out_layout,
    check_qkv,
    check_sink_tokens,
    check_sinks,
    check_skip_heads,
    check_sm_scale,
    check_softcap,
    check_window,
)

Backend = Literal["auto", "triton", "cpu", "reference"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "cpu", "reference")
OutLayout = Literal["bhmd", "bmhd"]


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """Map ``"auto"`` to a concrete backend for ``q``'s device and dtype; validate explicit choices."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if q.dtype == torch.float64:
            return "reference"
        return "triton" if q.is_cuda else "cpu"
    if backend == "triton" and not q.is_cuda:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend='triton' needs CUDA tensors, got q on {q.device}; use backend='cpu' (or set "
                "TRITON_INTERPRET=1 to run the Triton kernels in the interpreter, for tests)"
            )
    if backend == "cpu" and q.is_cuda:
        raise ValueError(
            "backend='cpu' needs CPU tensors, got q on a CUDA device; use backend='triton' or 'auto'"
        )
    if q.dtype == torch.float64 and backend != "reference":
        raise ValueError(f"float64 inputs are only supported by backend='reference', got backend={backend!r}")
    return backend


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    skip_heads: torch.Tensor | None = None,
    return_argmax: bool = False,
    argmax_rows: int | None = None,
    window: int | None = None,
    sink_tokens: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: Backend = "auto",
    out_layout: OutLayout = "bhmd",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with optional per-row argmax of the logits and head skipping.

    Args:
        q: [B, Hq, M, D] queries (may be a non-contiguous view). Row i sits at position N - M + i.
        k, v: [B, Hkv, N, D] keys/values, Hq % Hkv == 0 (not repeated for GQA/MQA).
        causal: row i attends to keys j <= N - M + i.
        sm_scale: logit scale in [1e-6, 1e4] (``validation.SM_SCALE_RANGE``), default D ** -0.5.
        key_padding_mask: bool [B, N], True = valid key (left or right padding).
        skip_heads: bool [Hq] or [B, Hq], True = head disabled: output exactly 0, argmax -1, no work.
        return_argmax: also return the argmax of the logits per row.
        argmax_rows: only the last ``argmax_rows`` query rows get an argmax (default: all M rows); an
            int in [1, M] (a bool is refused).
        window: sliding window (needs ``causal``): the row at position p sees keys p - window < j <= p,
            as transformers' ``sliding_window``; only key blocks inside the window are visited.
        sink_tokens: with ``window``, S >= 1 keys at the start that every row keeps seeing (StreamingLLM's
            attention-sink tokens): the row at position p sees keys j <= p with p - window < j or j < S,
            "first S + last window" keys; the key blocks holding them are visited besides the window's, so
            the work stays O(M * (window + S)). Refused without a window; S + window >= N is plain causal
            attention. These are kept *keys* (their values count, and one can be the argmax), unlike
            ``sinks``.
        softcap: logits <- softcap * tanh(logits / softcap) before the softmax (and the argmax); in
            [1e-6, 1e10] (``validation.SOFTCAP_RANGE``: a larger cap changes no float32 logit).
        sinks: float [Hq], one learned logit per query head added to the softmax denominator only (it has
            no value and is never an argmax; gpt-oss's ``s_aux``); differentiable. Not ``sink_tokens``.
        backend: "auto" | "triton" | "cpu" | "reference".
        out_layout: the memory layout of ``out`` (its shape is [B, Hq, M, D] either way): "bhmd", contiguous;
            or "bmhd", a view of a contiguous [B, M, Hq, D] tensor (``out.transpose(1, 2)`` is contiguous),
            the layout transformers' attention functions return. It saves the caller's transpose copy:
            the fused CPU kernel writes that layout directly; the other paths copy once (differentiably).

    Returns:
        out: [B, Hq, M, D] in q's dtype (fp32 accumulation), or ``(out, argmax)`` with
        argmax: int64 [B, Hq, T] (T = argmax_rows or M), the smallest index among tied maxima, -1 for a
        row without any valid key or a skipped head.

    Non-finite inputs: a row with a NaN or +inf logit among the keys it sees (NaN / inf in its query or
    in one of those keys) gives output NaN and argmax -1, in every backend; NaN / inf in ``v`` make the
    output of the rows that see them NaN (others may follow: 0 * NaN is NaN, as in eager attention) and
    leave the argmax alone. Skipped heads stay exactly 0 / -1. Gradients: a NaN output row has a NaN
    dq row and NaN dk (and, for a non-finite query or key, dv) for every key it sees; other (batch, KV
    head) groups are unaffected; skipped heads get dq = 0; the rest of an affected group is
    backend-dependent (the full contract: ``reference.py``).
    """
    shape = check_qkv(q, k, v)
    if not isinstance(causal, bool) or not isinstance(return_argmax, bool):  # "false" would be truthy
        raise ValueError(f"causal and return_argmax must be bools, got {causal!r} and {return_argmax!r}")
    # Each optional argument is checked only when given: in a decode step this runs once per layer with
    # cold caches, where every function a call enters costs microseconds.
    if key_padding_mask is not None:
        key_padding_mask = check_key_padding_mask(key_padding_mask, shape, q.device)
    if skip_heads is not None:
        skip_heads = check_skip_heads(skip_heads, shape, q.device)
    rows = 0
    if return_argmax or argmax_rows is not None:
        rows = check_argmax_rows(argmax_rows, return_argmax, shape)
    scale = check_sm_scale(sm_scale, shape.head_dim)
    if window is not None:
        window = check_window(window, causal)
    if sink_tokens is not None:
        sink_tokens = check_sink_tokens(sink_tokens, window)
    if softcap is not None:
        softcap = check_softcap(softcap)
    if sinks is not None:
        sinks = check_sinks(sinks, shape, q.device)
    name = resolve_backend(backend, q)
    heads_last = out_layout != "bhmd" and check_out_layout(out_layout)

    if shape.batch == 0 or shape.q_heads == 0 or shape.q_len == 0:
        # Nothing to compute: every backend would only be handed empty buffers.
        out = torch.zeros_like(q, memory_format=torch.contiguous_format)
        argmax = torch.empty((shape.batch, shape.q_heads, 0), dtype=torch.int64, device=q.device)
        grads = [t for t in (q, k, v, sinks) if t is not None and t.requires_grad]
        if grads and torch.is_grad_enabled():  # still in the graph: zero gradients for every input, as SDPA
            out = out + sum(t.sum() for t in grads) * 0
    elif name == "reference":
        out, argmax = reference_attention(
            q, k, v, causal=causal, sm_scale=scale, key_padding_mask=key_padding_mask,
            skip_heads=skip_heads, argmax_rows=rows, window=window, softcap=softcap, sinks=sinks,
            sink_tokens=sink_tokens,
        )  # fmt: skip
    elif eager_direct(q, k, v, key_padding_mask, skip_heads, sinks):
        out, argmax, _ = forward_impl(
            q, k, v, key_padding_mask, skip_heads, sinks, causal, scale, rows, window, softcap, name, False,
            sink_tokens, heads_last=heads_last,
        )  # fmt: skip
    elif not torch.compiler.is_compiling() and transformed(q, k, v, sinks):
        # torch.func transforms and forward-mode AD: the operator has neither batching nor forward-mode
        # rules (a jvp through it would come out zero), the plain-torch reference has all of them.
        out, argmax = reference_attention(
            q, k, v, causal=causal, sm_scale=scale, key_padding_mask=key_padding_mask,
            skip_heads=skip_heads, argmax_rows=rows, window=window, softcap=softcap, sinks=sinks,
            sink_tokens=sink_tokens,
        )  # fmt: skip
    else:
        # The log-sum-exp is only kept for a backend's own backward, and only when a gradient is wanted.
        wants_grad = any(t is not None and t.requires_grad for t in (q, k, v, sinks))
        need_lse = name in LSE_BACKENDS and torch.is_grad_enabled() and wants_grad
        out, argmax, _ = attention_fwd(
            q, k, v, key_padding_mask, skip_heads, sinks, causal, scale, rows, window, softcap, name, need_lse,
            sink_tokens,
        )  # fmt: skip
    if heads_last and not out.transpose(1, 2).is_contiguous():  # a path that wrote [B, Hq, M, D]
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
    return (out, argmax) if return_argmax else out


def available_backends() -> list[str]:
    """Concrete backends importable in this environment (CUDA availability not checked)."""
    names = ["reference"]
    for name in ("cpu", "triton"):
        try:
            backend_module(name)
            names.append(name)
        except RuntimeError:
            pass
    return names
