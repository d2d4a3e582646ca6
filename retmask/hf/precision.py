"""Training precision: float32, or bf16 autocast over float32 master weights.

``bfloat16`` training keeps the parameters, their gradients and the optimizer state in float32 and runs
the forward (and so the backward) of matmul-like ops in bf16 under ``torch.autocast``; losses, softmax
and norms stay in float32 (autocast's own op lists). This is what transformers' Trainer does with
``bf16=True`` and what the published RetMask and MuDAF runs train with on GPUs.
"""

from __future__ import annotations

import contextlib

import torch

from retmask.hf.loading import resolve_dtype_name

TRAINING_DTYPES = ("float32", "bfloat16")


def resolve_training_dtype(name: str, device: str | torch.device = "cpu") -> str:
    """``--dtype`` of a training command → ``"float32"`` or ``"bfloat16"`` (``auto``: bf16 where the device
    computes it natively, see ``retmask.hf.loading.native_bf16``)."""
    resolved = resolve_dtype_name(name, device)
    if resolved not in TRAINING_DTYPES:
        raise ValueError(
            f"training runs in float32 or bfloat16 (bf16 autocast, float32 master weights), not {name!r}; "
            "pass --dtype float32, bfloat16 or auto"
        )
    return resolved


def training_autocast(dtype: str, device_type: str) -> contextlib.AbstractContextManager:
    """The context a training forward runs in: nothing for float32, bf16 autocast for bfloat16.
    ``device_type``: ``"cpu"`` or ``"cuda"`` (``model.device.type``)."""
    if dtype not in TRAINING_DTYPES:
        raise ValueError(f"training dtype must be one of {TRAINING_DTYPES}, got {dtype!r}")
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
