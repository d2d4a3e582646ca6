"""The device the device-aware tests run on: the CPU, unless ``RETMASK_TEST_DEVICE`` names another.

``RETMASK_TEST_DEVICE=cuda`` (on a machine with a GPU) runs the Triton kernel tests on compiled kernels
instead of the interpreter, and puts the tiny models of the Hugging Face and detection tests
(``tests/hf/conftest.py``, ``tests/tiny.py``) on the GPU; ``bench/gpu_check.sh`` lists the files that run so.
Inputs are still drawn on the CPU, so both runs check the same numbers. CI has no GPU and runs the CPU.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

TEST_DEVICE = torch.device(os.environ.get("RETMASK_TEST_DEVICE", "cpu"))


def _moved(x: Any, device: torch.device | str) -> Any:
    """``x`` with every tensor in it (also inside tuples / lists / named tuples) moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_moved(y, device) for y in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_moved(y, device) for y in x)
    return x


def on_test_device(fn: Callable) -> Callable:
    """``fn`` run on TEST_DEVICE: its tensor arguments are moved there and its tensor results back to
    the CPU. Both moves are differentiable, so gradients reach the CPU leaves. ``fn`` itself on the CPU."""
    if TEST_DEVICE.type == "cpu":
        return fn

    @functools.wraps(fn)
    def run_on_device(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _moved(args, TEST_DEVICE), {k: _moved(v, TEST_DEVICE) for k, v in kwargs.items()}
        return _moved(fn(*args, **kwargs), "cpu")

    return run_on_device
