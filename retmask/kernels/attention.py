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
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Literal

import torch

from .reference import reference_attention
from .sdpa import sdpa_attention
from .validation import check_argmax_rows, check_key_padding_mask, check_qkv, check_skip_heads

Backend = Literal["auto", "triton", "cpu", "reference"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "cpu", "reference")

# Backend modules are imported lazily: triton is optional and slow to import.
_BACKEND_MODULES = {"triton": "retmask.kernels.triton_backend", "cpu": "retmask.kernels.cpu"}


def _backend_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(_BACKEND_MODULES[name])
    except ImportError as err:  # e.g. triton not installed
        raise RuntimeError(
            f"attention backend {name!r} is not available: {err}. Install the optional dependency "
            f"(pip install 'retmask[triton]') or pass backend='cpu' / 'reference'"
        ) from err


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """Map ``"auto"`` to a concrete backend for ``q``'s device and dtype; validate explicit choices."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if q.dtype == torch.float64:
            return "reference"
        return "triton" if q.is_cuda else "cpu"
    if backend == "triton" and not q.is_cuda:
        import os

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


class _FusedAttention(torch.autograd.Function):
    """Autograd wrapper around a fused backend forward.

    Backward: the backend's own ``backward`` if it has one (Triton), otherwise recompute through SDPA
    (memory-efficient) and differentiate that. Skipped heads get zero gradient either way.
    """

    @staticmethod
    def forward(ctx, q, k, v, backend_name, causal, sm_scale, key_padding_mask, skip_heads, argmax_rows):
        module = _backend_module(backend_name)
        # The log-sum-exp is only kept for a hand-written backward, and only when a gradient is wanted.
        need_lse = hasattr(module, "backward") and any(ctx.needs_input_grad[:3])
        out, argmax, lse = module.forward(
            q, k, v, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
            skip_heads=skip_heads, argmax_rows=argmax_rows, return_lse=need_lse,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, skip_heads)
        ctx.backend_name, ctx.causal, ctx.sm_scale = backend_name, causal, sm_scale
        if argmax is None:
            return out, None
        ctx.mark_non_differentiable(argmax)
        return out, argmax

    @staticmethod
    def backward(ctx, grad_out, _grad_argmax):
        q, k, v, out, lse, key_padding_mask, skip_heads = ctx.saved_tensors
        module = _backend_module(ctx.backend_name)
        if hasattr(module, "backward"):
            dq, dk, dv = module.backward(
                grad_out, q, k, v, out, lse, causal=ctx.causal, sm_scale=ctx.sm_scale,
                key_padding_mask=key_padding_mask, skip_heads=skip_heads,
            )  # fmt: skip
        else:
            with torch.enable_grad():
                qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
                recomputed = sdpa_attention(
                    qr, kr, vr, causal=ctx.causal, sm_scale=ctx.sm_scale,
                    key_padding_mask=key_padding_mask, skip_heads=skip_heads,
                )  # fmt: skip
                dq, dk, dv = torch.autograd.grad(recomputed, (qr, kr, vr), grad_out)
        return dq, dk, dv, None, None, None, None, None, None


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
    backend: Backend = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with optional per-row argmax of the logits and head skipping.

    Args:
        q: [B, Hq, M, D] queries (may be a non-contiguous view). Row i sits at position N - M + i.
        k, v: [B, Hkv, N, D] keys/values, Hq % Hkv == 0 (not repeated for GQA/MQA).
        causal: row i attends to keys j <= N - M + i.
        sm_scale: logit scale, default D ** -0.5.
        key_padding_mask: bool [B, N], True = valid key (left or right padding).
        skip_heads: bool [Hq] or [B, Hq], True = head disabled: output exactly 0, argmax -1, no work.
        return_argmax: also return the argmax of the logits per row.
        argmax_rows: only the last ``argmax_rows`` query rows get an argmax (default: all M rows).
        backend: "auto" | "triton" | "cpu" | "reference".

    Returns:
        out: [B, Hq, M, D] in q's dtype (fp32 accumulation), or ``(out, argmax)`` with
        argmax: int64 [B, Hq, T] (T = argmax_rows or M), the smallest index among tied maxima, -1 for a
        row without any valid key or a skipped head.
    """
    shape = check_qkv(q, k, v)
    key_padding_mask = check_key_padding_mask(key_padding_mask, shape, q.device)
    skip_heads = check_skip_heads(skip_heads, shape, q.device)
    rows = check_argmax_rows(argmax_rows, return_argmax, shape)
    scale = float(shape.head_dim**-0.5 if sm_scale is None else sm_scale)
    name = resolve_backend(backend, q)

    if name == "reference":
        out, argmax = reference_attention(
            q, k, v, causal=causal, sm_scale=scale, key_padding_mask=key_padding_mask,
            skip_heads=skip_heads, argmax_rows=rows,
        )  # fmt: skip
    else:
        out, argmax = _FusedAttention.apply(q, k, v, name, causal, scale, key_padding_mask, skip_heads, rows)
    return (out, argmax) if return_argmax else out


def available_backends() -> list[str]:
    """Concrete backends importable in this environment (CUDA availability not checked)."""
    names = ["reference"]
    for name in ("cpu", "triton"):
        try:
            _backend_module(name)
            names.append(name)
        except RuntimeError:
            pass
    return names
