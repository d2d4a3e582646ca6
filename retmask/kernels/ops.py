"""The fused attention as PyTorch operators: ``torch.ops.retmask.attention_fwd`` / ``attention_bwd``.

Registered with ``torch.library`` (schema, a kernel for every device, a fake kernel and an autograd
kernel), so ``torch.compile(fullgraph=True)``, ``torch.export`` and AOTAutograd see each one as a single
opaque node with known output shapes instead of tracing into the backends (pybind11 calls into the C++
kernel, Triton launches with host-side grid sizing). ``retmask.kernels.attention`` validates its
arguments and calls ``attention_fwd``; only the reference backend (the plain-torch oracle) bypasses the
operators, and plain eager calls that record no autograd graph run the operator's body directly
(``eager_direct``).

``attention_fwd(q, k, v, key_padding_mask, skip_heads, sinks, causal, sm_scale, argmax_rows, window,
softcap, backend, need_lse, sink_tokens=None) -> (out, argmax, lse)``; inputs as normalised by
``validation.py`` (masks contiguous bool, skip_heads [B, Hq] or None, sinks float [Hq] or None, argmax_rows
in [0, M], window >= 1 or None, softcap > 0 or None, sink_tokens >= 1 (with a window) or None), backend
"cpu" or "triton". ``sink_tokens`` comes last, with a default, so that calls written before it keep their
positions. Operators cannot return None, so absent outputs are empty tensors:

  out:    [B, Hq, M, D] in q's dtype, contiguous.
  argmax: int64 [B, Hq, argmax_rows] ([B, Hq, 0] when no argmax is requested); not differentiable.
  lse:    fp32 [B, Hq, M] when ``need_lse`` and the backend has its own backward (``LSE_BACKENDS``),
          else fp32 [0]; saved for the backward only, not differentiable.

``attention_bwd(grad_out, q, k, v, out, lse, key_padding_mask, skip_heads, sinks, causal, sm_scale, window,
softcap, backend, sink_tokens=None) -> (dq, dk, dv, dsinks)``, contiguous, in the inputs' dtypes (dsinks: [Hq] in sinks'
dtype, or an empty tensor without sinks): the backend's own backward (Triton), given the forward's
``out`` and ``lse``. Backends without one (CPU) get their gradients in the autograd formula
(``_backward``, registered with ``torch.library.register_autograd``) rather than inside an operator, on
the path ``paths.cpu_backward_path`` names: the C++ CPU backward (``cpu/backward.py``) or a differentiated recompute (through PyTorch SDPA, or
``chunked.py``'s query-row chunks where SDPA cannot express the call without an [M, N] mask). The
recompute is done there because an operator body runs below the autograd dispatch key, and
``torch.func.vjp`` there breaks under any active TorchDispatchMode. Skipped heads get zero gradient
either way. There is no double backward.

The operators' names are taken in the ``retmask`` namespace (a FRAGMENT library, so a C++ extension may
register other operators there).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from retmask.eager_state import plain_eager

from . import paths
from .chunked import chunked_grads
from .cpu import backend as cpu
from .cpu import backward as cpu_backward
from .reference import allowed_keys

# Backend modules are imported lazily: triton is optional and slow to import.
BACKEND_MODULES = {"triton": "retmask.kernels.triton.backend", "cpu": "retmask.kernels.cpu.backend"}
# Backends with a hand-written backward that needs the forward's log-sum-exp. The fake (meta) forward
# must know the lse shape without importing the backend, hence a table; ``backend_module`` checks it.
LSE_BACKENDS = frozenset({"triton"})

_modules: dict[str, ModuleType] = {}


def backend_module(name: str) -> ModuleType:
    """The module implementing backend ``name`` ("cpu" / "triton"), imported on first use."""
    module = _modules.get(name)
    if module is not None:
        return module
    if name not in BACKEND_MODULES:
        raise ValueError(f"no fused attention backend {name!r}; expected one of {sorted(BACKEND_MODULES)}")
    try:
        module = importlib.import_module(BACKEND_MODULES[name])
    except ImportError as err:  # e.g. triton not installed
        raise RuntimeError(
            f"attention backend {name!r} is not available: {err}. Install the optional dependency "
            f"(pip install 'retmask[triton]') or pass backend='cpu' / 'reference'"
        ) from err
    if hasattr(module, "backward") != (name in LSE_BACKENDS):
        raise AssertionError(
            f"LSE_BACKENDS is out of date for backend {name!r} (has backward: {hasattr(module, 'backward')})"
        )
    _modules[name] = module
    return module


FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? skip_heads, Tensor? sinks, bool causal, "
    "float sm_scale, SymInt argmax_rows, SymInt? window, float? softcap, str backend, bool need_lse, "
    "SymInt? sink_tokens=None) -> (Tensor, Tensor, Tensor)"
)
BWD_SCHEMA = (
    "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? key_padding_mask, "
    "Tensor? skip_heads, Tensor? sinks, bool causal, float sm_scale, SymInt? window, float? softcap, "
    "str backend, SymInt? sink_tokens=None) -> (Tensor, Tensor, Tensor, Tensor)"
)


def forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    sinks: torch.Tensor | None,
    causal: bool,
    sm_scale: float,
    argmax_rows: int,
    window: int | None,
    softcap: float | None,
    backend: str,
    need_lse: bool,
    sink_tokens: int | None = None,
    heads_last: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The body of ``attention_fwd``: (out contiguous, argmax or None, lse or None). ``heads_last`` (from
    ``attention``'s direct eager call only, never the operator's, whose fake gives a contiguous out):
    the backend may write out as a view of a [B, M, Hq, D] tensor, which is then returned as is."""
    out, argmax, lse = backend_module(backend).forward(
        q, k, v, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
        skip_heads=skip_heads, argmax_rows=argmax_rows, window=window, softcap=softcap, sinks=sinks,
        return_lse=need_lse and backend in LSE_BACKENDS, heads_last=heads_last, sink_tokens=sink_tokens,
    )  # fmt: skip
    return (out if heads_last else out.contiguous()), argmax, lse


def _fwd_kernel(q, k, v, key_padding_mask, skip_heads, sinks, causal, sm_scale, argmax_rows, window, softcap,
                backend, need_lse, sink_tokens=None):  # fmt: skip
    """``attention_fwd`` on real tensors (every device: CompositeExplicitAutograd)."""
    out, argmax, lse = forward_impl(
        q, k, v, key_padding_mask, skip_heads, sinks, causal, sm_scale, argmax_rows, window, softcap, backend,
        need_lse, sink_tokens,
    )  # fmt: skip
    if argmax is None:
        argmax = torch.empty((q.shape[0], q.shape[1], 0), dtype=torch.int64, device=q.device)
    if lse is None:
        lse = torch.empty((0,), dtype=torch.float32, device=q.device)
    return out, argmax, lse


def _fwd_fake(q, k, v, key_padding_mask, skip_heads, sinks, causal, sm_scale, argmax_rows, window, softcap,
              backend, need_lse, sink_tokens=None):  # fmt: skip
    B, Hq, M, D = q.shape
    out = q.new_empty((B, Hq, M, D))
    argmax = q.new_empty((B, Hq, argmax_rows), dtype=torch.int64)
    lse_shape = (B, Hq, M) if need_lse and backend in LSE_BACKENDS else (0,)
    return out, argmax, q.new_empty(lse_shape, dtype=torch.float32)


def _empty_dsinks(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    return sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,), dtype=torch.float32)


def _bwd_kernel(grad_out, q, k, v, out, lse, key_padding_mask, skip_heads, sinks, causal, sm_scale, window,
                softcap, backend, sink_tokens=None):  # fmt: skip
    """``attention_bwd`` on real tensors: the backend's own backward."""
    if backend not in LSE_BACKENDS:
        raise ValueError(
            f"backend {backend!r} has no backward of its own; expected one of {sorted(LSE_BACKENDS)}"
        )
    dq, dk, dv, dsinks = backend_module(backend).backward(
        grad_out, q, k, v, out, lse, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
        skip_heads=skip_heads, window=window, softcap=softcap, sinks=sinks, sink_tokens=sink_tokens,
    )  # fmt: skip
    if dsinks is None:
        dsinks = _empty_dsinks(None, q)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsinks.contiguous()


def recompute_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    window: int | None = None,
    sink_tokens: int | None = None,
) -> torch.Tensor:
    """Differentiable attention through PyTorch SDPA for the backward of backends without their own:
    ``sdpa.sdpa_attention`` without its data-dependent shortcut (``if not has_key.all()``), which
    AOTAutograd cannot trace; rows without a valid key are zeroed by a masked_fill instead. A window (and
    sink tokens) become part of the boolean [M, N] mask; ``paths.cpu_backward_path`` sends windowed calls
    elsewhere (O(M * N) memory here), so only direct callers and tests pass one."""
    M, N = q.shape[2], k.shape[2]
    gqa = bool(q.shape[1] != k.shape[1])  # a SymBool under dynamic shapes
    # Queries whose output is fixed (skipped heads, rows without a valid key) are zeroed before SDPA
    # (masked_fill hands them an exact 0 gradient) and their outputs masked after it: a NaN in such a
    # query reaches no gradient, as reference.py's contract says (unzeroed, it made their recomputed
    # softmax NaN, and SDPA's backward multiplies that by the zero output gradient: NaN).
    if skip_heads is not None:
        skipped = skip_heads[:, :, None, None]
        q = q.masked_fill(skipped, 0)
    if key_padding_mask is None and window is None and (not causal or M == N):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale, enable_gqa=gqa)
    else:
        # [B|1, 1, M, N]
        allowed = allowed_keys(M, N, causal, key_padding_mask, q.device, window, sink_tokens)
        has_key = allowed.any(dim=-1, keepdim=True)
        # A row with no valid key would be NaN in SDPA; let it attend everywhere, then zero it.
        out = F.scaled_dot_product_attention(
            q.masked_fill(~has_key, 0), k, v, attn_mask=allowed | ~has_key, scale=sm_scale, enable_gqa=gqa
        )
        out = out.masked_fill(~has_key, 0)
    if skip_heads is not None:
        out = out.masked_fill(skipped, 0)
    return out


def recompute_grads(
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
    """(dq, dk, dv, dsinks or None) of a backend without a backward of its own (CPU), on the path
    ``paths.cpu_backward_path`` names: the C++ backward, a query-row-chunked recompute (``chunked.py``)
    or a recompute through SDPA (in the dtype, or on fp32 copies). Sink tokens come with a window, which
    the rule never sends to SDPA."""
    path = paths.cpu_backward_path(
        q.dtype, built=q.device.type == "cpu" and cpu.cpp_available(), traced=not _plain_eager(q, k),
        window=window, softcap=softcap, sinks=sinks,
    )  # fmt: skip
    kwargs = {
        "causal": causal,
        "sm_scale": sm_scale,
        "key_padding_mask": key_padding_mask,
        "skip_heads": skip_heads,
    }
    if path == "kernel":
        grads = cpu_backward.backward(grad_out, q, k, v, window=window, sink_tokens=sink_tokens, **kwargs)
        return (*grads, None)
    if path == "chunked":
        return chunked_grads(
            grad_out, q, k, v, window=window, softcap=softcap, sinks=sinks, sink_tokens=sink_tokens, **kwargs
        )
    return (*_sdpa_grads(grad_out, q, k, v, fp32=path == "sdpa_fp32", **kwargs), None)


def _sdpa_grads(grad_out, q, k, v, *, causal, sm_scale, key_padding_mask, skip_heads, fp32=False):
    """(dq, dk, dv) of ``recompute_attention`` at (q, k, v) for ``grad_out``, in their dtypes; with
    ``fp32`` computed on float32 copies and rounded back once."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    if fp32:
        grad_out, q, k, v = (t.float() for t in (grad_out, q, k, v))
    with torch.enable_grad():
        qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
        recomputed = recompute_attention(
            qr, kr, vr, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
            skip_heads=skip_heads,
        )  # fmt: skip
        grads = torch.autograd.grad(recomputed, (qr, kr, vr), grad_out)
    return tuple(g.to(dtype) for g, dtype in zip(grads, dtypes, strict=True))


def _plain_eager(*tensors: torch.Tensor) -> bool:
    """Plain tensors in plain eager execution (``eager_state.plain_eager``): what the C++ backward (which
    reads the data) needs. AOTAutograd traces the backward with fake tensors and without
    ``is_compiling()``, hence the type check."""
    return all(type(t) is torch.Tensor for t in tensors) and plain_eager(*tensors)


def _bwd_fake(grad_out, q, k, v, out, lse, key_padding_mask, skip_heads, sinks, causal, sm_scale, window,
              softcap, backend, sink_tokens=None):  # fmt: skip
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _empty_dsinks(sinks, q)


def _setup_context(ctx, inputs, output) -> None:
    """What the backward of ``attention_fwd`` keeps (``torch.library.register_autograd``): the inputs, and
    the forward's out and lse when the backend has its own backward."""
    q, k, v, key_padding_mask, skip_heads, sinks, causal, sm_scale, _rows, window, softcap, backend, need_lse, sink_tokens = inputs  # fmt: skip
    out, argmax, lse = output
    ctx.mark_non_differentiable(argmax, lse)
    ctx.use_lse = need_lse and backend in LSE_BACKENDS
    saved_out, saved_lse = (out, lse) if ctx.use_lse else (None, None)
    ctx.save_for_backward(q, k, v, saved_out, saved_lse, key_padding_mask, skip_heads, sinks)
    ctx.causal, ctx.sm_scale, ctx.backend = causal, sm_scale, backend
    ctx.window, ctx.softcap, ctx.sink_tokens = window, softcap, sink_tokens


@once_differentiable  # no double backward: differentiating these gradients raises
def _backward(ctx, grad_out, _grad_argmax, _grad_lse) -> tuple:
    """The autograd formula of ``attention_fwd``: the ``attention_bwd`` operator (the backend's own
    backward, one opaque node in a compiled graph) when the forward kept an lse, otherwise a recompute
    (``recompute_grads``) differentiated here, at the autograd level (AOTAutograd traces it into the
    compiled backward as plain torch ops)."""
    q, k, v, out, lse, key_padding_mask, skip_heads, sinks = ctx.saved_tensors
    if ctx.use_lse:
        dq, dk, dv, dsinks = attention_bwd(
            grad_out, q, k, v, out, lse, key_padding_mask, skip_heads, sinks, ctx.causal, ctx.sm_scale,
            ctx.window, ctx.softcap, ctx.backend, ctx.sink_tokens,
        )  # fmt: skip
    else:
        dq, dk, dv, dsinks = recompute_grads(
            grad_out, q, k, v, causal=ctx.causal, sm_scale=ctx.sm_scale, key_padding_mask=key_padding_mask,
            skip_heads=skip_heads, window=ctx.window, softcap=ctx.softcap, sinks=sinks,
            sink_tokens=ctx.sink_tokens,
        )  # fmt: skip
    if sinks is None or not ctx.needs_input_grad[5]:
        dsinks = None
    return dq, dk, dv, None, None, dsinks, None, None, None, None, None, None, None, None


def _no_double_backward(ctx, *grads) -> tuple:
    raise RuntimeError(
        "retmask attention has no double backward: retmask::attention_bwd is not differentiable "
        "(create_graph=True / higher-order gradients through retmask.kernels.attention are unsupported)"
    )


# FRAGMENT: the namespace may also hold operators defined elsewhere (e.g. a C++ extension's).
_lib = torch.library.Library("retmask", "FRAGMENT")
_lib.define("attention_fwd" + FWD_SCHEMA)
_lib.define("attention_bwd" + BWD_SCHEMA)
_lib.impl("attention_fwd", _fwd_kernel, "CompositeExplicitAutograd")
_lib.impl("attention_bwd", _bwd_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("retmask::attention_fwd", _fwd_fake, lib=_lib)
torch.library.register_fake("retmask::attention_bwd", _bwd_fake, lib=_lib)
torch.library.register_autograd("retmask::attention_fwd", _backward, setup_context=_setup_context, lib=_lib)
torch.library.register_autograd("retmask::attention_bwd", _no_double_backward, lib=_lib)

attention_fwd = torch.ops.retmask.attention_fwd.default
attention_bwd = torch.ops.retmask.attention_bwd.default


def eager_direct(*tensors: torch.Tensor | None) -> bool:
    """Whether ``attention`` may run ``forward_impl`` itself instead of dispatching ``attention_fwd``.

    Only where nothing could tell the difference: plain tensors with no autograd graph to record
    (no_grad, inference_mode, or no input requiring grad) in plain eager execution (no tracer, function
    mode, functorch transform or forward-mode tangent: ``eager_state.plain_eager``; a dispatch mode has
    no public query and sees the operators the body calls).
    The computation is the same function either way; this skips the dispatcher round trip (the Python
    Autograd kernel, redispatch, boxing ten arguments twice), about two thirds of a decode call's wrapper
    time.
    """
    grad_enabled = torch.is_grad_enabled()
    for t in tensors:  # a loop, not any() over a generator: this runs on every decode step of every layer
        if t is not None and (type(t) is not torch.Tensor or (grad_enabled and t.requires_grad)):
            return False
    return plain_eager(*tensors)
