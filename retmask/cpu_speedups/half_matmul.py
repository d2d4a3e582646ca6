"""Matrix products of bf16 / fp16 operands on CPUs with and without native half-precision GEMMs.

On a CPU with AMX or AVX512-BF16 (bf16), or AMX-FP16 / AVX512-FP16 (fp16), torch runs a half-precision
``mm`` / ``linear`` on oneDNN's native kernels, 2-4x faster than float32. Elsewhere (an AVX2-only CPU, say)
torch emulates them: on 2 such cores a [512 x 49,152] x [49,152 x 576] bf16 ``mm`` took 40 s against 0.23 s
in float32, and a bf16 ``linear`` 5x its float32 time.

:class:`HalfProducts` computes the same numbers either way. A product of bf16 values is exact in fp32 and
a half-precision GEMM accumulates in fp32, so upcasting the operands (values already rounded to the half
dtype), multiplying in fp32 and rounding the result to the half dtype once gives what the native kernel
gives, up to the order of the fp32 sums.

:func:`emulated_linear_dtype` / :func:`emulated_linear` do the same for a model's linear layers (used by
``retmask.hf.linears.CPULinear``): a bf16 autocast linear, or one with bf16 weights, on such a CPU runs
its forward and its backward's two products as fp32 products of rounded operands.
"""

from __future__ import annotations

from functools import cache

import torch

from retmask.cpuinfo import cpu_flags
from retmask.eager_state import plain_eager

from .linear import linear

HALF_DTYPES = (torch.bfloat16, torch.float16)
# Fewer input rows than this keep torch's own half-precision linear: its emulated matrix-vector products
# are fast (bf16 halves the bytes read), while converting the weight to fp32 per call is not. On 2 AVX2
# cores, SmolLM2's layer shapes: emulated / torch 0.17-0.6 at 32-512 rows (head 0.84 at 32), but 1.5-3x
# at 8 rows and 3-15x at one row.
EMULATE_MIN_ROWS = 32


# /proc/cpuinfo flags of the instructions that multiply each half dtype natively (AMX tiles or AVX-512).
NATIVE_FLAGS = {
    torch.bfloat16: frozenset({"amx_bf16", "avx512_bf16"}),
    torch.float16: frozenset({"amx_fp16", "avx512_fp16"}),
}


def native_half_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` matrices natively: bf16 with AMX-BF16 or AVX512-BF16, fp16
    with AMX-FP16 or AVX512-FP16, as /proc/cpuinfo lists them (``NATIVE_FLAGS``; none off Linux, where
    half-precision products are emulated). float32 is always native."""
    if dtype not in NATIVE_FLAGS:
        return True
    return bool(NATIVE_FLAGS[dtype] & _cpu_flags())


@cache
def _cpu_flags() -> frozenset[str]:
    """/proc/cpuinfo's flags, read once: the check runs on every linear call."""
    return frozenset(cpu_flags())


class HalfProducts:
    """Products whose operands and results are rounded to ``dtype`` (the compute dtype of a mixed-
    precision op), run natively where the CPU can (``native_half_matmul``) and in float32 elsewhere.

    ``operand(x)`` gives the form the products take (``x`` rounded to ``dtype``; in float32 when
    emulating), ``linear`` / ``mm`` take such operands and return results in ``dtype``. ``emulated``
    overrides the CPU's answer (None: ask ``native_half_matmul``)."""

    def __init__(self, dtype: torch.dtype, emulated: bool | None = None) -> None:
        self.dtype = dtype
        if emulated is None:
            emulated = dtype in HALF_DTYPES and not native_half_matmul(dtype)
        self.emulated = emulated

    def operand(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded to the compute dtype, as the products take it: [*] -> [*]."""
        rounded = x.to(self.dtype)
        return rounded.float() if self.emulated else rounded

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [n, k] @ weight [c, k]^T (+ bias [c]) -> [n, c] in the compute dtype; operands from
        ``operand``. float32 products take the backend ``linear`` measured faster on this machine."""
        if not self.emulated:
            return linear(x, weight, bias)
        with torch.autocast("cpu", enabled=False):  # autocast would cast the fp32 operands back to half
            return linear(x, weight, bias).to(self.dtype)

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a [n, k] @ b [k, c] -> [n, c] in the compute dtype; operands from ``operand``."""
        if not self.emulated:
            return torch.mm(a, b)
        with torch.autocast("cpu", enabled=False):
            return torch.mm(a, b).to(self.dtype)


def emulated_linear_dtype(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.dtype | None:
    """The half dtype in which ``F.linear(x, weight, bias)`` would compute on this CPU without native
    kernels for it, or None (a float32 call, a native one, another device, fewer than
    ``EMULATE_MIN_ROWS`` input rows, a call that must reach aten::linear itself). Under CPU autocast
    that is autocast's dtype for floating inputs; without, the inputs' common half dtype.

    Runs on every patched linear call, so the common float32 call is answered first and cheaply."""
    autocast = torch.is_autocast_enabled("cpu")
    dtype = torch.get_autocast_dtype("cpu") if autocast else x.dtype
    if dtype not in HALF_DTYPES:
        return None
    if type(x) is not torch.Tensor or type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if x.device.type != "cpu" or weight.device.type != "cpu" or weight.dim() != 2 or x.dim() < 2:
        return None
    if x.numel() < EMULATE_MIN_ROWS * x.shape[-1]:
        return None
    if autocast:
        if not (x.is_floating_point() and weight.is_floating_point()):
            return None
    elif weight.dtype != dtype or (bias is not None and bias.dtype != dtype):
        return None
    if native_half_matmul(dtype) or not plain_eager(x, weight, bias):
        return None
    return dtype


class _EmulatedLinear(torch.autograd.Function):
    """``F.linear`` as a half-precision GEMM computes it (operands rounded to ``dtype``, fp32 sums, the
    result rounded once), with fp32 products. Gradients likewise: each of the two products takes the
    output gradient rounded to ``dtype`` and is rounded to ``dtype`` once, then returned in its input's
    dtype, as autocast's casts give them back."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        products = HalfProducts(dtype, emulated=True)
        x_op = products.operand(x)  # [..., in]
        w_op = products.operand(weight)  # [out, in]
        b_op = products.operand(bias) if bias is not None else None
        out = products.linear(x_op, w_op, b_op)  # [..., out]
        need_x, need_w = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x_op if need_w else None, w_op if need_x else None)
        ctx.products = products
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x_op, w_op = ctx.saved_tensors
        products, (x_dtype, w_dtype, b_dtype) = ctx.products, ctx.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g = products.operand(grad_out)  # [..., out]
        g2 = g.reshape(-1, g.shape[-1])
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = products.mm(g2, w_op).to(x_dtype).reshape(*g.shape[:-1], w_op.shape[1])
        if need_w:
            grad_w = products.mm(g2.t(), x_op.reshape(-1, x_op.shape[-1])).to(w_dtype)
        if need_b:
            grad_b = g2.sum(0).to(products.dtype).to(b_dtype)
        return grad_x, grad_w, grad_b, None


def emulated_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in the half ``dtype`` (``emulated_linear_dtype``) with fp32 products.

    x: [..., in]; weight: [out, in]; bias: [out] or None -> [..., out] in ``dtype``, differentiable."""
    return _EmulatedLinear.apply(x, weight, bias, dtype)
