"""Which code path each kind of attention call takes: the rule, written in one place.

Backends (``attention(backend=...)``, "auto" by default):

  =========================  =====================================================================
  call                       backend
  =========================  =====================================================================
  float64 inputs             "reference" (plain torch, the test oracle)
  CUDA tensors               "triton": the forward below; backward (``triton.bwd``, from the
                             forward's log-sum-exp)
  CPU tensors                "cpu": the forward path below; the backward path below
  =========================  =====================================================================

Triton forward (``triton_forward_kernel``): calls with at most ``SPLIT_KEY_ROWS`` query rows take the
split-key kernel (``triton.decode``: the keys split across programs, one program holding the query rows
of all heads that share a KV head), longer ones the prefill kernel (``triton.fwd``: one program per block
of a head's query rows). ``SPLIT_KEY_ROWS`` is 1 (decode) until a GPU has timed the split-key kernel on
calls of 2-64 rows, such as detection's verification passes (``bench/bench_triton.py``, verify phase):
there the prefill grid is one row block per head, mostly padding rows, each program walking every key
alone, and the split-key kernel is expected to be several times faster at long context.

Triton launch (``cached_triton_launch``): with ``CACHED_TRITON_LAUNCH`` a compiled kernel's launch skips
Triton's JIT entry (binding, specialisation, a string key per call) and goes straight to the kernel
compiled for the call's specialisation (``triton.launch``); without it, and always in the interpreter,
``kernel[grid](...)``. Off until a GPU has timed it (``bench/bench_triton_decode.py``: host time per call
with and without) and its tests have run there (``CHECK_LAUNCHES`` compares every cached launch with the
kernel Triton itself picks).

CPU forward (``cpu_forward_path``), in this order:

  1. ``$RETMASK_CPU_PATH`` set: that path ("cpp", "bf16dot" or "blocked"; "bf16dot" changes only
     bfloat16 calls with an even head dim, others run as "cpp").
  2. The extension ``retmask._C`` is not built: "blocked" (torch SDPA for the output plus a key-blocked
     argmax scan).
  3. bfloat16, even head dim, more than one query row, and the kernel build that runs bf16 dot products
     natively (``avx512bf16``, a CPU with AVX512-BF16): "bf16dot", the fused kernel with both block
     products as bf16 dot products (0.55-0.66x the time of "cpp" on prefill, chunks and verification
     where it was measured; decode stays on "cpp": it pads one row to a vector).
  4. Else "cpp": the fused C++ kernel with its fp32 FMA micro-kernels, in the widest build this CPU runs
     (``$RETMASK_CPU_ISA`` picks another).

CPU backward (``cpu_backward_path``): the CPU kernel keeps no log-sum-exp, so its gradients are
computed after the fact by one of

  "kernel"     the C++ backward (fp32 throughout, no [M, N] tensor): eager calls without soft-capping
               or sinks (0.15-0.94x the time of SDPA's backward wherever it was measured), a sliding
               window with or without sink tokens included;
  "chunked"    a recompute over query-row chunks against the keys they see (``chunked.py``), for
               soft-capping and sinks, which neither the C++ backward nor SDPA express, and for a window
               (with or without sink tokens) in traced graphs;
  "sdpa_fp32"  PyTorch SDPA's backward on fp32 copies, for bf16 / fp16 calls traced by
               ``torch.compile`` / AOTAutograd (which cannot run the C++ kernel on fake tensors): the
               C++ backward's numerics, so compiled and eager gradients agree to rounding;
  "sdpa"       PyTorch SDPA's backward in the inputs' dtype: other traced calls, and CPU builds without
               the extension.

The measurements behind the fixed choices are on the pages of ``bench/RESULTS.md``; ``retmask env``
prints, for this machine, the path of every kind of call the project makes (``describe``).
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from retmask.errors import UsageError
from retmask.requirements import installed_version

CPU_PATH_ENV = "RETMASK_CPU_PATH"
CPU_PATHS = ("cpp", "bf16dot", "blocked")


def check_settings() -> None:
    """Validate the environment settings of the kernels and the CPU speed-ups (``$RETMASK_CPU_PATH``,
    ``$RETMASK_CPU_ISA``, ``$RETMASK_CPU_SPEEDUPS``): UsageError (a ValueError) naming the variable, so that
    a command fails before it loads anything (``load_model`` calls it first)."""
    from retmask import cpu_speedups

    from .cpu import backend as cpu

    forced_cpu_path()
    if cpu.cpp_available():
        cpu.selected_isa()
    cpu_speedups.enabled()


def forced_cpu_path() -> str:
    """``$RETMASK_CPU_PATH``, or "" when unset; UsageError naming the variable for another value."""
    value = os.environ.get(CPU_PATH_ENV, "").strip()
    if value and value not in CPU_PATHS:
        raise UsageError(
            f"${CPU_PATH_ENV} must be one of {list(CPU_PATHS)}, got {value!r}; unset it for the default"
        )
    return value


SPLIT_KEY_ROWS = 1  # query rows up to which a Triton forward takes the split-key kernel


def triton_forward_kernel(rows: int) -> str:
    """The Triton forward kernel ("split_keys" or "prefill") of a call with ``rows`` query rows, by the
    rule of the module docstring."""
    return "split_keys" if rows <= SPLIT_KEY_ROWS else "prefill"


CACHED_TRITON_LAUNCH = False  # launch compiled Triton kernels through retmask's launcher cache


def cached_triton_launch(kernel: object) -> bool:
    """Whether a launch of ``kernel`` goes through ``triton.launch``'s cache of compiled kernels (True)
    or Triton's JIT entry ``kernel[grid]`` (False), by the rule of the module docstring."""
    if not CACHED_TRITON_LAUNCH:
        return False
    from triton.runtime.jit import JITFunction

    return isinstance(kernel, JITFunction)


BF16_DOT_BUILD = "avx512bf16"  # the kernel build that runs bf16 dot products natively


def bf16_dot_fits(dtype: torch.dtype, head_dim: int) -> bool:
    """bfloat16 with an even head dim: what the bf16 dot products take (pairs of dims)."""
    return dtype == torch.bfloat16 and head_dim % 2 == 0


def cpu_forward_path(dtype: torch.dtype, head_dim: int, rows: int, *, build: str) -> str:
    """The CPU forward path ("cpp", "bf16dot" or "blocked") of a call of ``dtype`` with ``rows`` query
    rows of ``head_dim`` dims, where ``build`` is the kernel build that runs ("" when ``retmask._C`` is
    not built), by the rule of the module docstring."""
    forced = forced_cpu_path()
    if forced:
        return "cpp" if forced == "bf16dot" and not bf16_dot_fits(dtype, head_dim) else forced
    if not build:
        return "blocked"
    if rows > 1 and build == BF16_DOT_BUILD and bf16_dot_fits(dtype, head_dim):
        return "bf16dot"
    return "cpp"


def cpu_backward_path(dtype: torch.dtype, *, built: bool, traced: bool, window: int | None,
                      softcap: float | None, sinks: torch.Tensor | None) -> str:  # fmt: skip
    """The CPU backward path ("kernel", "chunked", "sdpa_fp32" or "sdpa") of a call of ``dtype``, by the
    rule of the module docstring. ``built``: ``retmask._C`` is built; ``traced``: the call is seen by a
    tracer or transform (fake tensors, ``torch.compile``, ``torch.func``), where the C++ kernel cannot
    read the data.
    Sink tokens need no argument of their own: they come with a window, which takes the window's path
    ("kernel" eager, "chunked" traced); both compute them."""
    if softcap is not None or sinks is not None:
        return "chunked"
    if built and not traced:
        return "kernel"
    if window is not None:
        return "chunked"
    return "sdpa_fp32" if traced and dtype in (torch.bfloat16, torch.float16) else "sdpa"


# ---- the description of this machine -----------------------------------------------------------------

KINDS = {  # the kinds of call the project makes, by their query rows (head dim 64 in the description)
    "prefill / chunk (M > 1)": 256,
    "verification (a few rows, argmax)": 8,
    "decode (M = 1)": 1,
}
WHY_CPU = {
    "cpp": "the fused C++ kernel",
    "bf16dot": "the fused C++ kernel on native bf16 dot products",
    "blocked": "SDPA + a blocked argmax scan",
}


def _gpu() -> str:
    if not torch.cuda.is_available():
        return "none"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"


def _cpu_reason(path: str, forced: str) -> str:
    from .cpu import backend as cpu

    if forced:
        return f"${CPU_PATH_ENV}={forced}"
    if path == "blocked":
        return "retmask._C is not built"
    build = cpu.selected_isa()
    if path == "bf16dot":
        return f"bf16 with an even head dim on the {build} build (native bf16 dot products)"
    return f"{build} build" + (f" (${cpu.ISA_ENV})" if os.environ.get(cpu.ISA_ENV) else "")


def describe() -> dict[str, Any]:
    """The machine and, for each kind of call the project makes, the path it takes here and why: what
    ``retmask env`` prints and what run records embed."""
    from retmask import cpu_speedups
    from retmask.cpuinfo import cpu_family, cpu_flags, cpu_model

    from .cpu import backend as cpu

    simd = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma")))
    machine = {
        "cpu": cpu_model(),
        "cpu_family": cpu_family(),
        "simd_flags": simd,
        "kernel_builds": [name for name, _ in cpu.builds()] or ["not built"],
        "kernel_build_used": cpu.selected_isa() or "not built",
        "threads": torch.get_num_threads(),
        "gpu": _gpu(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": installed_version("transformers") or "not installed",
        "trl": installed_version("trl") or "not installed",
        "triton": installed_version("triton") or "not installed",
    }
    forced = forced_cpu_path()
    build = cpu.selected_isa()
    calls: dict[str, dict[str, str]] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        for kind, rows in KINDS.items():
            path = cpu_forward_path(dtype, 64, rows, build=build)
            calls[f"cpu {name} {kind}"] = {
                "path": path,
                "why": f"{WHY_CPU[path]}: {_cpu_reason(path, forced)}",
            }
        built = bool(build)
        eager = cpu_backward_path(dtype, built=built, traced=False, window=None, softcap=None, sinks=None)
        traced = cpu_backward_path(dtype, built=built, traced=True, window=None, softcap=None, sinks=None)
        capped = cpu_backward_path(dtype, built=built, traced=False, window=None, softcap=30.0, sinks=None)
        calls[f"cpu {name} backward"] = {
            "path": eager,
            "why": f"eager: {eager}; traced (torch.compile): {traced}; soft-capping or sinks: {capped}",
        }
    no_gpu = "" if torch.cuda.is_available() else " (no GPU here)"
    for kind, rows in KINDS.items():
        why = f"M = {rows} query rows; the split-key kernel takes M <= {SPLIT_KEY_ROWS}"
        calls[f"cuda {kind}"] = {"path": f"triton {triton_forward_kernel(rows)}{no_gpu}", "why": why}
    calls["cuda backward"] = {"path": f"triton{no_gpu}", "why": "the Triton backward for CUDA tensors"}
    launch_why = (
        "compiled kernels launched from retmask's cache, one per specialisation (CACHED_TRITON_LAUNCH)"
        if CACHED_TRITON_LAUNCH
        else "CACHED_TRITON_LAUNCH is off until a GPU has timed retmask's launcher cache"
    )
    calls["cuda kernel launch"] = {
        "path": ("retmask launcher cache" if CACHED_TRITON_LAUNCH else "Triton JIT entry") + no_gpu,
        "why": launch_why,
    }
    calls["float64"] = {"path": "reference", "why": "only the plain-torch oracle computes in float64"}
    settings = {
        name: os.environ.get(name, "") for name in (CPU_PATH_ENV, cpu.ISA_ENV, cpu_speedups.SWITCH_ENV)
    }
    return {
        "machine": machine,
        "settings": settings,
        "attention": calls,
        "cpu_speedups": cpu_speedups.describe(),
    }
