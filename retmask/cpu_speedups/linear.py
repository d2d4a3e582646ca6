"""float32 linear layers on the CPU: torch's BLAS or oneDNN, whichever this machine runs faster.

Why. torch's CPU ``F.linear`` in float32 calls the BLAS torch was built with (MKL in the x86 wheels),
while bf16 and fp16 linears already go to oneDNN. MKL's sgemm runs AVX2 code on AMD CPUs, half the FMA
rate of a core with full-width AVX-512, while oneDNN JIT-compiles its fp32 inner product for the
instruction set the CPU reports; on other CPUs MKL is at home, and the winner also changes with the
layer's shape. So which backend is faster is a property of the machine, measured there once per case
and cached (the measurements: bench/RESULTS.md, "fp32 linears"):

* A :class:`LinearCase` is (out features, in features, bias, kind, threads) with kind "gemv" (one input
  row: a matrix-vector product, other kernels), "gemm" (more rows), "backward" (the two products of the
  gradient, fewer than ``LONG_BACKWARD_ROWS`` rows) or "backward-long" (more rows: the weight gradient
  reduces over the rows, and which backend wins that product changes with their number).
* Its proxy: seeded random inputs, the case's weight shape and ``PROXY_ROWS[kind]`` rows; both backends
  interleaved, median of at least 3 calls each.
* oneDNN replaces torch's linear only at <= ``ONEDNN_MAX_RATIO`` of its time: on a near tie torch's stays.
* oneDNN must first agree with torch's linear on the proxy (max |difference| within ``AGREE_TOL`` of
  the output's scale, as two fp32 summation orders do) or it is rejected on that machine, with a warning.
* The decisions are kept in ``<cache>/cpu_linears.json`` (``decisions.py``) under a key of the CPU
  (model, family, flags), torch and oneDNN versions: another machine or torch measures again; deleting
  the file is safe. Where oneDNN is unavailable, or the speed-ups are off, torch's linear runs.

Only plain float32 CPU calls are concerned: another dtype or device, an input or weight that is not a
plain tensor, CPU autocast (which must see ``F.linear`` to cast it), ``torch.compile`` tracing, a
function mode, a functorch transform or forward-mode AD all go to ``F.linear`` unchanged
(``eager_state.plain_eager``). A dispatch mode, which torch offers no public query for, sees
``aten::mkldnn_linear``; torch's FLOP counter counts it through a formula registered here. The gradient
is exact either way (the same products, another summation order); there is no double backward through
oneDNN. :func:`decisions` lists what this process used, for run records and pages.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import cache
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from retmask.cpuinfo import cpu_identity
from retmask.eager_state import plain_eager

from . import enabled
from .decisions import DecisionCache, DecisionStore, interleaved_medians

BACKENDS = ("torch", "onednn")
ONEDNN_MAX_RATIO = 0.9
PROXY_ROWS = {"gemv": 1, "gemm": 128, "backward": 256, "backward-long": 1024}
LONG_BACKWARD_ROWS = 1024
AGREE_TOL = 1e-5  # |onednn - torch| / max |torch| on a proxy call (fp32 rounding of K <= ~16K terms)
CACHE_FILE = "cpu_linears.json"
_FORMAT = 2  # 2: oneDNN through aten::mkldnn_linear, layout copies included in the times

log = logging.getLogger("retmask.kernels")


class LinearCase(NamedTuple):
    """What decides which backend runs a float32 CPU linear (see the module docstring)."""

    out_features: int
    in_features: int
    bias: bool
    kind: str  # "gemv" (one row) | "gemm" (more rows) | "backward" | "backward-long" (see the module doc)
    threads: int

    def name(self) -> str:
        """A stable, readable key: ``576x1536 bias=0 gemm threads=2`` (out x in)."""
        return (
            f"{self.out_features}x{self.in_features} bias={int(self.bias)} {self.kind} threads={self.threads}"
        )


@cache
def onednn_available() -> bool:
    """Whether this torch has oneDNN's fp32 linear (``aten::mkldnn_linear``) and it runs."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        works = bool(torch.equal(_onednn_forward(x, w, None), F.linear(x, w)))
    except (AttributeError, RuntimeError, NotImplementedError) as err:  # no such op in this build
        log.info(
            "oneDNN's fp32 linear is unavailable (%s: %s); float32 linears stay on torch's",
            type(err).__name__,
            err,
        )
        return False
    if not works:
        log.warning(
            "oneDNN's fp32 linear gives wrong results on a 2 x 3 check; float32 linears stay on torch's"
        )
    return works


def _mkldnn_linear_flops(x_shape, weight_shape, *_args, out_shape=None, **_kwargs) -> int:
    """FLOPs of ``aten::mkldnn_linear`` for torch's FLOP counter: x [rows, in] @ weight [out, in]^T."""
    return 2 * math.prod(x_shape[:-1]) * weight_shape[0] * weight_shape[1]


try:  # so that FlopCounterMode counts this module's linears as it counts aten's
    register_flop_formula(torch.ops.aten.mkldnn_linear)(_mkldnn_linear_flops)
except RuntimeError:  # "duplicate registrations": a torch release with a formula of its own
    pass


# ---- the two products through oneDNN ----------------------------------------------------------------


def _onednn_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias through oneDNN's inner product (``aten::mkldnn_linear``). x: [..., in]
    float32; weight: [out, in]; bias: [out] or None -> [..., out] (dense, contiguous).

    The operator takes its input in oneDNN's own layout and returns its output in it: both are copied
    (``Tensor.to_mkldnn`` / ``to_dense``), a cost the per-case measurement includes. The weight is read
    in place; oneDNN wants it with unit-stride rows."""
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.aten.mkldnn_linear(rows.to_mkldnn(), weight, bias).to_dense()
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _backward_products(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, onednn: bool, need_x: bool, need_w: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad_x [..., in], grad_w [out, in]) of y = x @ weight^T for grad: [..., out] (None where not
    needed). With ``onednn`` both are inner products of oneDNN: grad_x = grad @ weight is
    linear(grad, weight^T) and grad_w = grad^T @ x is linear(grad^T, x^T) over the rows."""
    g2 = grad.reshape(-1, grad.shape[-1])
    grad_x = grad_w = None
    if need_x:
        if onednn:
            grad_x = _onednn_forward(g2, weight.t().contiguous(), None)
        else:
            grad_x = g2 @ weight
        grad_x = grad_x.reshape(*grad.shape[:-1], weight.shape[1])
    if need_w:
        x2 = x.reshape(-1, x.shape[-1])
        grad_w = _onednn_forward(g2.t().contiguous(), x2.t().contiguous(), None) if onednn else g2.t() @ x2
    return grad_x, grad_w


class _OneDNNLinear(torch.autograd.Function):
    """y = x @ weight^T + bias with the forward through oneDNN; the backward's products through the
    backend decided for the case's "backward" kind."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_forward(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        if need_x or need_w:
            rows = grad.numel() // grad.shape[-1]
            kind = "backward-long" if rows >= LONG_BACKWARD_ROWS else "backward"
            case = LinearCase(weight.shape[0], weight.shape[1], ctx.has_bias, kind, torch.get_num_threads())
            onednn = backend_for(case) == "onednn"
            grad_x, grad_w = _backward_products(grad, x, weight, onednn, need_x, need_w)
        if need_b and ctx.has_bias:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b


# ---- the entry point ---------------------------------------------------------------------------------


def _plain_fp32_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a call is one this module decides (see the module docstring); anything else is F.linear's."""
    if type(x) is not torch.Tensor or type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        return False
    if weight.device.type != "cpu" or weight.dim() != 2 or x.dim() < 2 or x.numel() == 0:
        return False
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"):
        return False
    return not torch.is_autocast_enabled("cpu") and plain_eager(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on float32 CPU calls through the backend this machine runs faster.

    x: [..., in] (at least 2-D); weight: [out, in]; bias: [out] or None -> [..., out], differentiable.
    """
    if not _plain_fp32_cpu(x, weight, bias):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    case = LinearCase(weight.shape[0], weight.shape[1], bias is not None, "gemv" if rows == 1 else "gemm",
                      torch.get_num_threads())  # fmt: skip
    if backend_for(case) != "onednn":
        return F.linear(x, weight, bias)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if needs_grad:
        return _OneDNNLinear.apply(x, weight, bias)
    return _onednn_forward(x, weight, bias)


# ---- measuring and caching ---------------------------------------------------------------------------


def _describe_machine() -> dict[str, str]:
    """What the decisions are valid for: CPU model, family and feature flags, torch and oneDNN versions."""
    return {
        **cpu_identity(),
        "torch": torch.__version__,
        "onednn": str(getattr(torch.backends.mkldnn, "version", lambda: "?")()),
    }


_store = DecisionStore(
    DecisionCache(
        CACHE_FILE,
        _FORMAT,
        valid=lambda d: d.get("backend") in BACKENDS,
        what="the linear backend cache",
    ),
    _describe_machine,
)
_backends: dict[LinearCase, str] = {}  # case -> backend: a decided call costs a dict lookup
machine = _store.machine
machine_key = _store.machine_key


def decisions() -> dict[str, dict[str, Any]]:
    """The decisions this process used, by case name: ``{"backend", "times_s", "ratio", "rejected",
    "calls", "proxy"}`` (ratio: oneDNN's median time over torch's)."""
    return _store.decisions()


def clear_memory() -> None:
    """Forget the decisions held in memory (the disk cache stays); for tests and benchmarks."""
    _store.clear_memory()
    _backends.clear()


Runner = Callable[[str, dict[str, torch.Tensor]], Any]  # (backend, proxy tensors) -> result


def proxy_call(case: LinearCase) -> dict[str, torch.Tensor]:
    """Seeded random x [rows, in], weight [out, in], bias [out] or None and, for "backward", the output
    gradient [rows, out] of the small call that stands for ``case``."""
    rows = PROXY_ROWS[case.kind]
    gen = torch.Generator().manual_seed(0)
    call = {
        "x": torch.randn(rows, case.in_features, generator=gen),
        "weight": torch.randn(case.out_features, case.in_features, generator=gen) * case.in_features**-0.5,
        "bias": torch.randn(case.out_features, generator=gen) if case.bias else None,
    }
    if case.kind.startswith("backward"):
        call["grad"] = torch.randn(rows, case.out_features, generator=gen)
    return call


def run_backend(backend: str, call: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The proxy's products on ``backend``: (y,) forward, (grad_x, grad_w) for a backward proxy."""
    onednn = backend == "onednn"
    if "grad" in call:
        return _backward_products(call["grad"], call["x"], call["weight"], onednn, True, True)
    if onednn:
        return (_onednn_forward(call["x"], call["weight"], call["bias"]),)
    return (F.linear(call["x"], call["weight"], call["bias"]),)


def disagreement(torch_result: tuple, onednn_result: tuple) -> str | None:
    """Why oneDNN's results are not torch's (shape, or a difference beyond ``AGREE_TOL`` of the scale),
    or None."""
    for a, b in zip(torch_result, onednn_result, strict=True):
        if a.shape != b.shape:
            return f"shape {list(b.shape)}, expected {list(a.shape)}"
        scale = max(a.abs().max().item(), 1e-30)
        diff = (a - b).abs().max().item()
        if not diff <= AGREE_TOL * scale:  # also catches NaN
            return f"differs by {diff:.3g} at a scale of {scale:.3g} (tolerance {AGREE_TOL:g} of the scale)"
    return None


def measure(case: LinearCase, run: Runner = run_backend, *, min_calls: int = 3, max_calls: int = 15,
            budget_s: float = 0.2) -> dict[str, Any]:  # fmt: skip
    """Check oneDNN against torch on the proxy of ``case`` (one call each), then time both interleaved:
    at least ``min_calls`` each, more (up to ``max_calls``) while under ``budget_s``."""
    call = proxy_call(case)
    why = disagreement(run("torch", call), run("onednn", call))
    base = {"calls": 0, "proxy": f"{PROXY_ROWS[case.kind]} rows, {case.kind}"}
    if why is not None:
        log.warning("oneDNN's fp32 linear disagrees with torch's on [%s]: %s; not used", case.name(), why)
        return {"backend": "torch", "times_s": {}, "ratio": None, "rejected": why, **base}
    median, n = interleaved_medians(
        lambda backend: run(backend, call), ["torch", "onednn"], min_calls=min_calls, max_calls=max_calls,
        budget_s=budget_s,
    )  # fmt: skip
    ratio = median["onednn"] / median["torch"] if median["torch"] > 0 else float("inf")
    return {
        "backend": "onednn" if ratio <= ONEDNN_MAX_RATIO else "torch",
        "times_s": median,
        "ratio": round(ratio, 4),
        "rejected": None,
        **base,
        "calls": n,
    }


def choose(case: LinearCase, run: Runner = run_backend) -> dict[str, Any]:
    """The decision for ``case``: from memory, from the disk cache, or measured now (and stored)."""
    name = case.name()

    def measure_now() -> dict[str, Any]:
        with torch.no_grad():
            decision = measure(case, run)
        log.info("fp32 CPU linear [%s]: %s (oneDNN / torch on a proxy call: %s)",
                 name, decision["backend"], decision["ratio"])  # fmt: skip
        return decision

    return _store.get(name, measure_now)


def backend_for(case: LinearCase) -> str:
    """The backend, "torch" or "onednn", for a call of ``case``: "torch" when the CPU speed-ups are off
    (``$RETMASK_CPU_SPEEDUPS=0``) or oneDNN is unavailable, else the (memoised) decision."""
    if not enabled():
        return "torch"
    backend = _backends.get(case)
    if backend is None:
        backend = _backends[case] = choose(case)["backend"] if onednn_available() else "torch"
    return backend
