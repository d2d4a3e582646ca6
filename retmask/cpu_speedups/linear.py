"""CPU linear layers on the backend this machine runs fastest: torch's, oneDNN's or retmask's few-row kernel.

Why. torch's CPU ``F.linear`` in float32 calls the BLAS torch was built with (MKL in the x86 wheels),
while bf16 and fp16 linears already go to oneDNN. MKL's sgemm runs AVX2 code on AMD CPUs, half the FMA
rate of a core with full-width AVX-512, while oneDNN JIT-compiles its fp32 inner product for the
instruction set the CPU reports. With one or a few input rows (a decode step, a verification pass) a
linear is bound by reading its weight, and both reach well under the memory bandwidth there; retmask's
C++ kernel (``rows_kernel``: the weight streamed once, in place) is a third candidate for those calls,
float32 and bfloat16. Which backend is faster is a property of the machine and of the layer's shape,
measured there once per case and cached (the measurements: bench/RESULTS.md, "fp32 linears"):

* A :class:`LinearCase` is (out features, in features, bias, kind, threads, dtype) with kind "gemv"
  (one input row), "few" (2 to ``FEW_ROWS`` rows), "gemm" (more rows), "backward" (the two products of
  the gradient, fewer than ``LONG_BACKWARD_ROWS`` rows) or "backward-long" (more rows: the weight
  gradient reduces over the rows, and which backend wins that product changes with their number).
* Its candidates (:func:`candidates`): torch's linear; oneDNN's inner product for float32; retmask's
  kernel for "gemv" and "few". bfloat16 calls of more rows are torch's (its oneDNN) without a decision.
* Its proxy: seeded random inputs, the case's weight shape and ``PROXY_ROWS[kind]`` rows; the candidates
  interleaved, median of at least 3 calls each. For "gemv" and "few" each call sweeps copies of the
  weight (``STREAM_BYTES`` in all), so that it is read from memory as in a decode step: a weight that
  stays in cache across calls favours other code than one streamed once per token.
* Another backend replaces torch's linear only at <= ``MAX_RATIO`` of its time (the fastest such one):
  on a near tie torch's stays.
* Each candidate must first agree with torch's linear on the proxy (max |difference| within
  ``AGREE_TOL[dtype]`` of the output's scale, as two summation orders do) or it is rejected on that
  machine, with a warning.
* The decisions are kept in ``<cache>/cpu_linears.json`` (``decisions.py``) under a key of the CPU
  (model, family, flags), torch and oneDNN versions: another machine or torch measures again; deleting
  the file is safe. Where no other backend is available, or the speed-ups are off, torch's linear runs.

Only plain float32 / bfloat16 CPU calls are concerned: another dtype or device, an input or weight that
is not a plain tensor, CPU autocast (which must see ``F.linear`` to cast it), ``torch.compile`` tracing, a
function mode, a functorch transform or forward-mode AD all go to ``F.linear`` unchanged
(``eager_state.plain_eager``). A dispatch mode, which torch offers no public query for, sees
``aten::mkldnn_linear`` or ``retmask::linear_rows``; torch's FLOP counter counts both through formulas
registered for them. The gradient is exact either way (the same products, another summation order; the
backward runs torch's or oneDNN's products, decided for the "backward" kinds in float32); there is no
double backward through oneDNN or retmask's kernel. :func:`decisions` lists what this process used, for
run records and pages.
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

from . import enabled, rows_kernel
from .decisions import DecisionCache, DecisionStore, interleaved_medians

BACKENDS = ("torch", "onednn", "retmask")
MAX_RATIO = 0.9
FEW_ROWS = 8
PROXY_ROWS = {"gemv": 1, "few": 4, "gemm": 128, "backward": 256, "backward-long": 1024}
ROWS_KERNEL_KINDS = ("gemv", "few")
# The proxies of these kinds read their weight from memory, as a decode step does (a model's weights are
# far larger than the last-level cache, so each layer's are evicted before the next token): each call
# runs on the next of several copies of the weight, STREAM_BYTES in all (3x this project's 32 MB L3s),
# at most STREAM_COPIES of them.
STREAM_KINDS = ("gemv", "few")
STREAM_BYTES = 96 * 2**20
STREAM_COPIES = 256
LONG_BACKWARD_ROWS = 1024
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# |candidate - torch| / max |torch| on a proxy call: fp32 rounding of K <= ~16K terms; bf16 outputs rounded
# once from two fp32 sums of another order may differ by one bf16 step (2^-8 of the value) and a little.
AGREE_TOL = {"float32": 1e-5, "bfloat16": 1e-2}
CACHE_FILE = "cpu_linears.json"
_FORMAT = (
    3  # 3: retmask's few-row kernel, the "few" kind and bfloat16 cases; 2: oneDNN through aten::mkldnn_linear
)

log = logging.getLogger("retmask.kernels")


class LinearCase(NamedTuple):
    """What decides which backend runs a CPU linear (see the module docstring)."""

    out_features: int
    in_features: int
    bias: bool
    kind: str  # "gemv" | "few" | "gemm" | "backward" | "backward-long" (see the module docstring)
    threads: int
    dtype: str = "float32"  # "float32" | "bfloat16"

    def name(self) -> str:
        """A stable, readable key: ``576x1536 bias=0 gemm float32 threads=2`` (out x in)."""
        return (
            f"{self.out_features}x{self.in_features} bias={int(self.bias)} {self.kind} {self.dtype} "
            f"threads={self.threads}"
        )


def row_kind(rows: int) -> str:
    """The forward kind of a call with ``rows`` input rows: "gemv", "few" or "gemm"."""
    return "gemv" if rows == 1 else "few" if rows <= FEW_ROWS else "gemm"


def candidates(case: LinearCase) -> tuple[str, ...]:
    """The backends timed for ``case``, torch's first: oneDNN's for float32 (where this torch runs it),
    retmask's kernel for the "gemv" and "few" kinds (where ``retmask._C`` has it)."""
    names = ["torch"]
    if case.dtype == "float32" and onednn_available():
        names.append("onednn")
    if case.kind in ROWS_KERNEL_KINDS and rows_kernel.available():
        names.append("retmask")
    return tuple(names)


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


def _rows_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias through retmask's few-row kernel (``rows_kernel``). x: [..., in] float32 or
    bfloat16; weight: [out, in]; bias: [out] or None, all of x's dtype -> [..., out] (contiguous)."""
    y = rows_kernel.linear_rows(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _forward(backend: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The forward of ``backend``, "onednn" or "retmask" (torch's is ``F.linear``)."""
    return _onednn_forward(x, weight, bias) if backend == "onednn" else _rows_forward(x, weight, bias)


class _MeasuredLinear(torch.autograd.Function):
    """y = x @ weight^T + bias with the forward on ``backend`` ("onednn" or "retmask"); the backward's
    products on torch's linear algebra or oneDNN, as decided for the case's "backward" kind (float32), or
    torch's (bfloat16)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: str
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _forward(backend, x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        if need_x or need_w:
            onednn = False
            if x.dtype == torch.float32:
                rows = grad.numel() // grad.shape[-1]
                kind = "backward-long" if rows >= LONG_BACKWARD_ROWS else "backward"
                case = LinearCase(
                    weight.shape[0], weight.shape[1], ctx.has_bias, kind, torch.get_num_threads()
                )
                onednn = backend_for(case) == "onednn"
            grad_x, grad_w = _backward_products(grad, x, weight, onednn, need_x, need_w)
        if need_b and ctx.has_bias:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b, None


# ---- the entry point ---------------------------------------------------------------------------------


def _decided_dtype(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """The dtype name of a call this module decides (see the module docstring), or None for F.linear's."""
    if type(x) is not torch.Tensor or type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return None
    dtype = DTYPES.get(x.dtype)
    if dtype is None or weight.dtype != x.dtype or x.device.type != "cpu":
        return None
    if weight.device.type != "cpu" or weight.dim() != 2 or x.dim() < 2 or x.numel() == 0:
        return None
    if dtype == "bfloat16" and x.numel() > FEW_ROWS * x.shape[-1]:
        return None  # torch's own oneDNN: no other candidate to measure
    if bias is not None and (bias.dtype != x.dtype or bias.device.type != "cpu"):
        return None
    if torch.is_autocast_enabled("cpu") or not plain_eager(x, weight, bias):
        return None
    return dtype


def forward_cases(out_features: int, in_features: int, bias: bool, dtype: torch.dtype) -> list[LinearCase]:
    """Every forward case under which ``linear`` can decide a CPU call of a layer [out, in] in ``dtype``
    at the current thread count: float32 one row, a few and more rows; bfloat16 one row and a few (more
    rows are torch's without a decision, ``_decided_dtype``); none for other dtypes."""
    name = DTYPES.get(dtype)
    if name is None:
        return []
    kinds = ("gemv", "few", "gemm") if name == "float32" else ("gemv", "few")
    threads = torch.get_num_threads()
    return [LinearCase(out_features, in_features, bias, kind, threads, name) for kind in kinds]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on float32 / bfloat16 CPU calls through the backend this machine
    runs fastest for the case.

    x: [..., in] (at least 2-D); weight: [out, in]; bias: [out] or None -> [..., out], differentiable.
    """
    dtype = _decided_dtype(x, weight, bias)
    if dtype is None:
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    case = LinearCase(weight.shape[0], weight.shape[1], bias is not None, row_kind(rows), torch.get_num_threads(),
                      dtype)  # fmt: skip
    backend = backend_for(case)
    if backend == "torch":
        return F.linear(x, weight, bias)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if needs_grad:
        return _MeasuredLinear.apply(x, weight, bias, backend)
    return _forward(backend, x, weight, bias)


# ---- measuring and caching ---------------------------------------------------------------------------


def _describe_machine() -> dict[str, str]:
    """What the decisions are valid for: CPU model, family and feature flags, torch and oneDNN versions."""
    return {
        **cpu_identity(),
        "torch": torch.__version__,
        "onednn": str(getattr(torch.backends.mkldnn, "version", lambda: "?")()),
    }


def _usable(decision: dict) -> bool:
    """Whether a stored decision names a backend this process can run (an older build of retmask._C may
    lack the few-row kernel)."""
    backend = decision.get("backend")
    if backend == "onednn":
        return onednn_available()
    if backend == "retmask":
        return rows_kernel.available()
    return backend == "torch"


_store = DecisionStore(
    DecisionCache(CACHE_FILE, _FORMAT, valid=_usable, what="the linear backend cache"),
    _describe_machine,
)
_backends: dict[LinearCase, str] = {}  # case -> backend: a decided call costs a dict lookup
machine = _store.machine
machine_key = _store.machine_key


def decisions() -> dict[str, dict[str, Any]]:
    """The decisions this process used, by case name: ``{"backend", "times_s", "ratios", "rejected",
    "calls", "proxy"}`` (ratios: each other candidate's median time over torch's; rejected: the
    candidates that disagreed with torch, and why)."""
    return _store.decisions()


def clear_memory() -> None:
    """Forget the decisions held in memory (the disk cache stays); for tests and benchmarks."""
    _store.clear_memory()
    _backends.clear()


Runner = Callable[[str, dict[str, Any]], Any]  # (backend, proxy call) -> result


def proxy_call(case: LinearCase) -> dict[str, Any]:
    """Seeded random x [rows, in], weight [out, in], bias [out] or None (in the case's dtype) and, for
    "backward", the output gradient [rows, out] of the small call that stands for ``case``; for the
    ``STREAM_KINDS``, "weights": the weight and copies of it, swept by each call (see the constants)."""
    rows = PROXY_ROWS[case.kind]
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(0)
    call = {
        "x": torch.randn(rows, case.in_features, generator=gen).to(dtype),
        "weight": (
            torch.randn(case.out_features, case.in_features, generator=gen) * case.in_features**-0.5
        ).to(dtype),
        "bias": torch.randn(case.out_features, generator=gen).to(dtype) if case.bias else None,
    }
    if case.kind.startswith("backward"):
        call["grad"] = torch.randn(rows, case.out_features, generator=gen).to(dtype)
    if case.kind in STREAM_KINDS:
        nbytes = max(1, call["weight"].numel() * call["weight"].element_size())
        copies = min(STREAM_COPIES, -(-STREAM_BYTES // nbytes))
        call["weights"] = [call["weight"]] + [call["weight"].clone() for _ in range(copies - 1)]
    return call


def run_backend(backend: str, call: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """The proxy's products on ``backend``: (y,) forward (one y per weight of a sweep), (grad_x, grad_w) for a
    backward proxy."""
    if "grad" in call:
        return _backward_products(call["grad"], call["x"], call["weight"], backend == "onednn", True, True)
    x, bias = call["x"], call["bias"]
    weights = call.get("weights", [call["weight"]])
    if backend == "torch":
        return tuple(F.linear(x, w, bias) for w in weights)
    return tuple(_forward(backend, x, w, bias) for w in weights)


def disagreement(torch_result: tuple, other_result: tuple, tol: float = AGREE_TOL["float32"]) -> str | None:
    """Why another backend's results are not torch's (shape, or a difference beyond ``tol`` of the
    scale), or None."""
    for a, b in zip(torch_result, other_result, strict=True):
        if a.shape != b.shape:
            return f"shape {list(b.shape)}, expected {list(a.shape)}"
        scale = max(a.abs().max().item(), 1e-30)
        diff = (a.float() - b.float()).abs().max().item()
        if not diff <= tol * scale:  # also catches NaN
            return f"differs by {diff:.3g} at a scale of {scale:.3g} (tolerance {tol:g} of the scale)"
    return None


def measure(case: LinearCase, run: Runner = run_backend, *, min_calls: int = 3, max_calls: int = 15,
            budget_s: float = 0.2) -> dict[str, Any]:  # fmt: skip
    """Check each candidate of ``case`` against torch on its proxy (one call each), then time the ones that
    agree, interleaved: at least ``min_calls`` each, more (up to ``max_calls``) while under ``budget_s``."""
    call = proxy_call(case)
    expected = run("torch", call)
    rejected = {}
    for name in candidates(case)[1:]:
        why = disagreement(expected, run(name, call), AGREE_TOL[case.dtype])
        if why is not None:
            log.warning("the %s linear disagrees with torch's on [%s]: %s; not used", name, case.name(), why)
            rejected[name] = why
    timed = [name for name in candidates(case) if name not in rejected]
    median, n = interleaved_medians(
        lambda backend: run(backend, call), timed, min_calls=min_calls, max_calls=max_calls, budget_s=budget_s
    )  # fmt: skip
    ratios = {
        name: round(t / median["torch"], 4) if median["torch"] > 0 else float("inf")
        for name, t in median.items()
        if name != "torch"
    }
    winners = [name for name, ratio in ratios.items() if ratio <= MAX_RATIO]
    return {
        "backend": min(winners, key=ratios.__getitem__) if winners else "torch",
        "times_s": median,
        "ratios": ratios,
        "rejected": rejected,
        "calls": n,
        "proxy": f"{PROXY_ROWS[case.kind]} rows, {case.kind}"
        + (f", {len(call['weights'])} copies of the weight" if "weights" in call else ""),
    }


def choose(case: LinearCase, run: Runner = run_backend) -> dict[str, Any]:
    """The decision for ``case``: from memory, from the disk cache, or measured now (and stored)."""
    name = case.name()

    def measure_now() -> dict[str, Any]:
        with torch.no_grad():
            decision = measure(case, run)
        log.info("CPU linear [%s]: %s (time over torch's on a proxy call: %s)",
                 name, decision["backend"], decision.get("ratios"))  # fmt: skip
        return decision

    return _store.get(name, measure_now)


def backend_for(case: LinearCase) -> str:
    """The backend, "torch", "onednn" or "retmask", for a call of ``case``: "torch" when the CPU
    speed-ups are off (``$RETMASK_CPU_SPEEDUPS=0``) or torch's is the only candidate, else the (memoised)
    decision."""
    if not enabled():
        return "torch"
    backend = _backends.get(case)
    if backend is None:
        backend = _backends[case] = choose(case)["backend"] if len(candidates(case)) > 1 else "torch"
    return backend
