"""retmask's C++ linear kernel for few input rows as the operator ``torch.ops.retmask.linear_rows``.

``linear_rows(x, weight, bias) -> y``: x [rows, K], weight [N, K], bias [N] or None -> y [rows, N], one
dtype (float32 or bfloat16), CPU tensors. With one input row (a decode step) a linear is bound by reading
its weight; the kernel (csrc/linear_cpu_kernel.h) streams the weight once, in place, as dot products along
its rows (fp32 sums; bf16 on AVX512-BF16 dot products where the CPU has them, rounded once), threads
splitting the output features. It runs the widest build of ``retmask._C`` this CPU has.

Registered with ``torch.library`` (a CPU kernel, a fake kernel and a FLOP formula), so that a dispatch
mode (torch's FLOP counter, a profiler) sees one operator where the call used to be ``aten::linear``. It
has no autograd formula: ``linear.py`` calls it inside its autograd Function, whose backward runs torch's
or oneDNN's products. Which calls take it is decided in ``linear.py`` (measured per layer shape).
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import register_flop_formula

from retmask.kernels.cpu import backend as cpu_backend


def available() -> bool:
    """Whether ``retmask._C`` is built and has the linear kernel (an older build may lack it)."""
    lib = cpu_backend._library()
    return lib is not None and hasattr(lib.module, "linear_rows")


def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, isa: str = "",
        threads: int | None = None) -> torch.Tensor:  # fmt: skip
    """y = x @ weight^T + bias through the pybind11 binding, on the build ``isa`` ("" = the widest).

    x: [rows, K], weight: [N, K] (unit stride along K: other layouts are copied), bias: [N] or None, all
    of one dtype, float32 or bfloat16 -> y: [rows, N] contiguous. ``threads``: OpenMP threads (default torch's
    ``get_num_threads()``). Raises ValueError naming a bad argument."""
    lib = cpu_backend._library()
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    if weight.shape[-1] > 1 and weight.stride(-1) != 1:
        weight = weight.contiguous()
    if bias is not None:  # a local: a copy made in the call below would be freed before the kernel reads it
        bias = bias.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)  # int sizes: half the cost of a tuple
    codes = lib.codes
    arg = cpu_backend.tensor_arg
    lib.module.linear_rows(
        arg("x", x, codes), arg("weight", weight, codes),
        None if bias is None else arg("bias", bias, codes), arg("y", y, codes),
        torch.get_num_threads() if threads is None else threads, isa,
    )  # fmt: skip
    return y


def _fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _flops(x_shape, weight_shape, *_args, out_shape=None, **_kwargs) -> int:
    """FLOPs for torch's FLOP counter: x [rows, K] @ weight [N, K]^T."""
    return 2 * math.prod(x_shape[:-1]) * weight_shape[0] * weight_shape[1]


# FRAGMENT: the namespace also holds the attention operators (retmask.kernels.ops).
_lib = torch.library.Library("retmask", "FRAGMENT")
_lib.define("linear_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_lib.impl("linear_rows", lambda x, weight, bias: run(x, weight, bias), "CPU")
torch.library.register_fake("retmask::linear_rows", _fake, lib=_lib)
register_flop_formula(torch.ops.retmask.linear_rows)(_flops)

linear_rows = torch.ops.retmask.linear_rows.default
