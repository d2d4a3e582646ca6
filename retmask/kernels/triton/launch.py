"""Launch a Triton kernel: through Triton's JIT entry, or through a launcher kept per specialisation.

``kernel[grid](*args, **constexprs)`` goes through ``JITFunction.run`` on every call: it binds every
argument, works out each one's specialisation, formats the whole specialisation as a string to look up the
compiled kernel, reads Triton's settings, and only then calls the compiled launcher. With the 30-50
arguments of our kernels that host work is several times the GPU time of a decode call.

The cached launch (``paths.cached_triton_launch`` says when) does that work once per *specialisation*:
the first call with a new one compiles (or fetches) the kernel through Triton's own public entry,
``kernel.warmup``, and keeps the ``CompiledKernel``; later calls with the same specialisation launch it
directly (``compiled[grid](*all_args)``). The specialisation key holds everything Triton specialises a
kernel on, and more (``specialisation``): each tensor's dtype and whether its address is 16-byte aligned;
each integer's width class, whether it is 1 and whether it divides by 16; the type of every other
argument; the constexpr values, ``num_warps`` and ``num_stages``; the current device. A key with more facts
than Triton uses only makes more entries, each compiled by Triton's own rules, never a wrong kernel.
``CHECK_LAUNCHES`` (tests) has every cached launch also ask ``kernel.warmup`` for the kernel Triton would
pick and fail unless it is the same object.

Other kernel objects (the interpreter's, the stand-ins of ``triton.aot`` and of the host-overhead
benchmark) always take ``kernel[grid]``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..paths import cached_triton_launch

CHECK_LAUNCHES = False  # test aid: every cached launch is checked against Triton's own choice

_INT32 = 2**31
_INT64 = 2**63

# (kernel, specialisation) -> (compiled kernel, the constexpr arguments in the kernel's parameter order)
_LAUNCHERS: dict[tuple, tuple[Any, tuple]] = {}


def specialisation(args: tuple) -> tuple:
    """The facts of the positional (non-constexpr) ``args`` that a compiled Triton kernel depends on.

    An int (not a bool): (equal to 1, divisible by 16, in int32's range, below 2**63: else uint64). A
    tensor: (dtype, 16-byte aligned address). Anything else (bool, float, None): its type, which alone
    decides how Triton passes it. One comprehension, as it runs on every launch (its cost:
    docs/kernel_optimisation.md)."""
    return tuple(
        [
            (arg == 1, arg & 15 == 0, -_INT32 <= arg < _INT32, arg < _INT64)
            if type(arg) is int
            else (arg.dtype, arg.data_ptr() & 15 == 0)
            if isinstance(arg, torch.Tensor)
            else type(arg)
            for arg in args
        ]
    )


def _compile(kernel: Any, grid: tuple, args: tuple, constexprs: dict[str, Any], options: dict[str, int]):
    """Triton's compiled kernel for this call (compiled now, or from Triton's caches) and the values of
    the parameters after the positional ones, in the kernel's parameter order (defaults filled in)."""
    if any(param.is_constexpr for param in kernel.params[: len(args)]):
        raise TypeError(f"{kernel.fn.__name__}: constexpr parameters must be passed by name")
    compiled = kernel.warmup(*args, grid=grid, **constexprs, **options)
    tail = []
    for param in kernel.params[len(args) :]:
        if param.name in constexprs:
            tail.append(constexprs[param.name])
        elif param.has_default:
            tail.append(param.default)
        else:
            raise TypeError(f"{kernel.fn.__name__}: no value for parameter {param.name!r}")
    return compiled, tuple(tail)


def launch_kernel(
    kernel: Any,
    grid: tuple,
    *args: Any,
    num_warps: int,
    num_stages: int | None = None,
    **constexprs: Any,
) -> None:
    """Launch ``kernel`` on ``grid``, as ``kernel[grid](*args, **constexprs, num_warps=...,
    num_stages=...)`` would.

    args: the kernel's parameters before its constexprs (tensors, integers, floats), positionally;
    constexprs: the rest, by name. ``num_stages`` None leaves Triton's default."""
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if not cached_triton_launch(kernel):
        kernel[grid](*args, **constexprs, **options)
        return
    # id(kernel): our kernels are module globals, alive as long as the process; a JITFunction's own hash
    # takes a lock on every call.
    key = (
        id(kernel),
        torch.cuda.current_device(),
        num_warps,
        num_stages,
        tuple(constexprs.items()),
        specialisation(args),
    )
    entry = _LAUNCHERS.get(key)
    if entry is None:
        entry = _compile(kernel, grid, args, constexprs, options)
    compiled, tail = entry
    if CHECK_LAUNCHES:
        chosen = kernel.warmup(*args, grid=grid, **constexprs, **options)
        if chosen is not compiled:
            raise AssertionError(f"{kernel.fn.__name__}: the cached launcher is not the kernel Triton picks")
    # A compiled kernel's launcher reads three grid dimensions (the JIT entry fills in the missing ones).
    compiled[(*grid, 1, 1)[:3]](*args, *tail)
    # Kept only once it ran: a kernel the GPU refused (OutOfResources, retried with a smaller tile by
    # ``launch_fitting``) is not kept.
    _LAUNCHERS[key] = entry


__all__ = ["CHECK_LAUNCHES", "launch_kernel", "specialisation"]
