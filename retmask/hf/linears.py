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
the classes back. ``load_model`` patches every model it loads for the CPU unless the CPU speed-ups are
off (``RETMASK_CPU_SPEEDUPS=0``, see ``retmask.cpu_speedups``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from retmask.cpu_speedups.half_matmul import emulated_linear, emulated_linear_dtype
from retmask.cpu_speedups.linear import linear


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
