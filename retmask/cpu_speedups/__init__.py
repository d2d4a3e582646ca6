"""CPU training and inference speed-ups that are not attention, behind one switch.

What they are (each is exact: the same numbers as the code it replaces, up to summation order):

* ``linear``: float32 linear layers on torch's BLAS, oneDNN or retmask's few-row kernel (``rows_kernel``:
  one to a few input rows, as in a decode step; float32 and bfloat16), whichever this machine runs
  fastest for the layer's shape; the one measured choice of the project (measured once per case on a
  small proxy call, cached in ``<cache>/cpu_linears.json`` under a key of the CPU, torch and oneDNN
  versions).
* ``half_matmul``: bf16 / fp16 linears on a CPU without native half-precision GEMMs (where torch emulates
  them slowly) as fp32 products of the rounded operands, rounded once.

``hf.loading.load_model`` patches a CPU model's linears (``hf.linears.patch_linears``) when these are on.
``RETMASK_CPU_SPEEDUPS=0`` turns all of them off: torch's linears, exactly what a user without retmask
runs. ``retmask env`` says which are on.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from retmask.errors import UsageError

SWITCH_ENV = "RETMASK_CPU_SPEEDUPS"
_ON = ("", "1", "on", "true", "yes")
_OFF = ("0", "off", "false", "no")


def enabled() -> bool:
    """Whether the CPU speed-ups are on: ``$RETMASK_CPU_SPEEDUPS`` unset or 1 (default), off for 0.
    Raises UsageError (a ValueError) naming the variable for any other value."""
    value = os.environ.get(SWITCH_ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise UsageError(f"${SWITCH_ENV}={value!r}: set it to 1 (on, the default) or 0 (off), or unset it")


def describe() -> dict[str, Any]:
    """Which CPU speed-ups are on and why, for ``retmask env`` and run records."""
    on = enabled()
    if not on:
        why = f"${SWITCH_ENV}=0"
        return {"enabled": False, "linears": f"torch's ({why})", "half_precision_linears": f"torch's ({why})"}
    from . import rows_kernel
    from .half_matmul import native_half_matmul
    from .linear import FEW_ROWS, decisions, onednn_available

    decided = {name: d["backend"] for name, d in decisions().items()}
    linears = "float32: torch's BLAS or oneDNN" if onednn_available() else "float32: torch's BLAS"
    if rows_kernel.available():
        linears += f"; 1-{FEW_ROWS} rows (float32, bfloat16) also retmask's few-row kernel"
    linears += ", measured per layer shape on this machine"
    half = (
        "native (torch's own)"
        if native_half_matmul(torch.bfloat16)
        else "fp32 products of the rounded operands"
    )
    return {
        "enabled": True,
        "linears": linears,
        "linear_decisions": decided,
        "half_precision_linears": f"bf16: {half}",
    }
