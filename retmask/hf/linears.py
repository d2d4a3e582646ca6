"""``patch_linears(model)``: the model's CPU linears on the backend this machine runs fastest.

Each plain ``torch.nn.Linear`` of the model becomes a :class:`CPULinear` (its class is swapped in place:
same parameters, hooks, state dict and ``isinstance``), whose forward is
``retmask.cpu_speedups.linear.linear``: torch's BLAS, oneDNN or, for one to a few input rows (a decode
step), retmask's few-row kernel, measured once per layer shape on this machine (see that module). A bf16 /
fp16 call (bf16 weights, or CPU autocast) on a CPU without native half-precision GEMMs, where torch would
emulate them at up to 100x the fp32 time, runs as fp32 products of the rounded operands, rounded after
(``retmask.cpu_speedups.half_matmul.emulated_linear``: the same numbers). Native bf16 calls of more rows,
CUDA and ``torch.compile`` run ``F.linear`` as before.
Subclasses of ``nn.Linear`` (LoRA layers, quantised linears) are left alone. ``unpatch_linears`` swaps
the classes back; ``decide_linears`` has every case of a model decided at once (timed runs call it
first). ``load_model`` patches every model it loads for the CPU unless the CPU speed-ups are off
(``RETMASK_CPU_SPEEDUPS=0``, see ``retmask.cpu_speedups``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from retmask.cpu_speedups.half_matmul import (
    HALF_DTYPES,
    emulated_linear,
    emulated_linear_dtype,
    native_half_matmul,
)
from retmask.cpu_speedups.linear import backend_for, forward_cases, linear


class CPULinear(torch.nn.Linear):
    """``nn.Linear`` whose float32 (and few-row bfloat16) CPU forward runs on the backend measured fastest on
    this machine."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's argument name)
        half = emulated_linear_dtype(input, self.weight, self.bias)
        if half is not None:
            return emulated_linear(input, self.weight, self.bias, half)
        return linear(input, self.weight, self.bias)


def _swap(model: torch.nn.Module, old: type, new: type) -> list[torch.nn.Module]:
    """Give every module of ``model`` whose class is exactly ``old`` the class ``new``; returns them."""
    swapped = [m for m in model.modules() if type(m) is old]
    for module in swapped:
        module.__class__ = new
    return swapped


def patch_linears(model: torch.nn.Module) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` to :class:`CPULinear` in place; returns how many."""
    return len(_swap(model, torch.nn.Linear, CPULinear))


def unpatch_linears(model: torch.nn.Module) -> int:
    """Swap every :class:`CPULinear` of ``model`` back to ``nn.Linear``; returns how many."""
    return len(_swap(model, CPULinear, torch.nn.Linear))


def decide_linears(model: torch.nn.Module) -> dict[str, str]:
    """Decide now the backend of every forward case the CPU :class:`CPULinear` layers of ``model`` can
    run (each layer shape with one, a few and many input rows, at the current thread count): read from
    the decision cache, or measured and stored where this machine has not measured the case yet.
    Otherwise the first call of a new case measures it, a few seconds for a large LM head, in the middle
    of whatever runs; a timed run (a benchmark's warm-up) calls this first. Returns {case name: backend}."""
    decided: dict[str, str] = {}
    for module in model.modules():
        if type(module) is not CPULinear or module.weight.device.type != "cpu":
            continue
        shape = (module.out_features, module.in_features, module.bias is not None)
        dtype = module.weight.dtype
        cases = forward_cases(*shape, dtype)
        if dtype in HALF_DTYPES and not native_half_matmul(dtype):
            # calls of EMULATE_MIN_ROWS rows or more run as float32 products (emulated_linear)
            cases += [case for case in forward_cases(*shape, torch.float32) if case.kind == "gemm"]
        for case in cases:
            decided[case.name()] = backend_for(case)
    return decided


@contextlib.contextmanager
def torch_linears(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` with torch's own ``nn.Linear`` inside the block (e.g. to time what a user without
    retmask gets); the same layers are patched again on exit, exceptions included."""
    swapped = _swap(model, CPULinear, torch.nn.Linear)
    try:
        yield
    finally:
        for module in swapped:
            module.__class__ = CPULinear
