"""Host (Python) time of one Triton-backend attention call, with the kernel launches stubbed out.

Usage:  python bench/bench_triton_host_overhead.py [--calls 1000] [--tag NAME]

On a GPU a decode call (M = 1) is host-bound: its kernels take microseconds, the call about 0.1 ms. This
measures, on any machine, the part of that host time that is ours: validation, dispatch, allocations,
grid sizing and argument building, everything except the Triton launches themselves, which are replaced
by no-ops (the kernels run nowhere; inputs are small CPU tensors in interpreter mode). Cases: decode and
a 256-row prefill at SmolLM2's shape (Hq 9, Hkv 3, D 64, 4,096 keys), with and without argmax, and with
half the heads skipped (the default grid mode, whose pair list is built on the host, and the sync-free
mode that CUDA-graph capture uses), and a verification pass of 9 rows with the argmax in the kernel the
rule gives it and in the split-key kernel (two launches instead of one); decode and prefill also
through retmask's launcher cache ("cached launch", ``triton.launch``), whose key is then the only launch
work left that runs here. Prints a table
and writes bench/results/triton_host_overhead_<cpu kind>[_<tag>].{md,json}; times are the fastest of 9
rounds of ``--calls`` calls, in microseconds per call, and the Python and C function calls one call
makes (a count, robust where a shared machine makes the times noisy).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors reach the Triton launchers; the launches are stubbed

import torch  # noqa: E402

from retmask.commands.argtypes import positive_int  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_triton import sync_free_grid  # noqa: E402
from common import (  # noqa: E402
    cpu_kind,
    cpu_label,
    machine_description,
    markdown_table,
    python_calls,
    split_key_rows,
    time_calls,
    write_page,
)

RESULTS = Path(__file__).resolve().parent / "results"
STUBBED = {"triton.fwd": ["_fwd_kernel"], "triton.decode": ["_decode_partial_kernel", "_decode_merge_kernel"]}


@dataclass(frozen=True)
class _Param:
    """What the launcher cache reads of a kernel parameter (as ``triton.runtime.jit.KernelParam``)."""

    name: str
    is_constexpr: bool
    has_default: bool = False
    default: object = None


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` (the JIT entry) does nothing, and so does the
    compiled kernel ``kernel.warmup(...)`` hands to the launcher cache."""

    def __init__(self, kernel) -> None:
        self.fn = kernel.fn
        self.params = [
            _Param(p.name, "constexpr" in str(p.annotation))
            for p in inspect.signature(kernel.fn).parameters.values()
        ]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None

    def warmup(self, *args, grid, **kwargs):
        return self


def _stub_launches() -> None:
    for module, kernels in STUBBED.items():
        mod = importlib.import_module(f"retmask.kernels.{module}")
        for name in kernels:
            setattr(mod, name, _NoLaunch(getattr(mod, name)))


@contextlib.contextmanager
def _cached_launch():
    """Launches through retmask's launcher cache (``triton.launch``) instead of the JIT entry, on a
    pretend current CUDA device 0; the stubs' compiled kernels do nothing either."""
    from retmask.kernels.triton import launch

    saved = launch.cached_triton_launch, torch.cuda.current_device
    launch.cached_triton_launch, torch.cuda.current_device = (lambda kernel: True), (lambda: 0)
    try:
        yield
    finally:
        launch.cached_triton_launch, torch.cuda.current_device = saved


def _per_call_us(fn, calls: int) -> float:
    """Microseconds per call: the fastest of 9 rounds of ``calls`` calls, after one untimed round (the
    least disturbed round: on a shared 2-core VM the median of 5 moved by 2x between runs)."""
    rounds = time_calls(lambda: [fn() for _ in range(calls)], repeats=9, warmup=1)
    return min(rounds) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=positive_int, default=1000)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    _stub_launches()
    from retmask.kernels import attention
    from retmask.kernels.paths import triton_forward_kernel

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, 4096, 64, generator=gen)
    v = torch.randn(1, 3, 4096, 64, generator=gen)
    q1 = torch.randn(1, 9, 1, 64, generator=gen)
    qp = torch.randn(1, 9, 256, 64, generator=gen)
    skip = torch.arange(9) % 2 == 1
    q9 = torch.randn(1, 9, 9, 64, generator=gen)
    verify = lambda: attention(q9, k, v, backend="triton", return_argmax=True)  # noqa: E731
    cases = {
        "decode": lambda: attention(q1, k, v, backend="triton"),
        "decode + argmax": lambda: attention(q1, k, v, backend="triton", return_argmax=True),
        "decode, half the heads skipped": lambda: attention(q1, k, v, backend="triton", skip_heads=skip),
        "decode, half the heads skipped, sync-free grid": sync_free_grid(
            lambda: attention(q1, k, v, backend="triton", skip_heads=skip)
        ),
        "prefill (256 rows)": lambda: attention(qp, k, v, backend="triton"),
        "prefill + argmax of the last 50": lambda: attention(
            qp, k, v, backend="triton", return_argmax=True, argmax_rows=50
        ),
        f"verification (9 rows) + argmax, {triton_forward_kernel(9)} kernel": verify,
    }
    # the same call with the rule moved (split_key_rows) for its whole measurement, unless the rule
    # already gives it the split-key kernel
    split_case = "verification (9 rows) + argmax, split_keys kernel"
    extra = [] if split_case in cases else [(split_case, verify)]
    # the calls whose launch cost matters most, through the launcher cache: the cost it adds here is what
    # it pays for skipping Triton's JIT entry on a GPU (stubbed here: no cost)
    cached = {
        f"{name}, cached launch": cases[name] for name in ("decode", "decode + argmax", "prefill (256 rows)")
    }
    rows, counts = {}, {}
    for name, fn in [*cases.items(), *extra, *cached.items()]:
        with (
            split_key_rows(64 if name == split_case else None),
            _cached_launch() if name in cached else contextlib.nullcontext(),
        ):
            rows[name] = _per_call_us(fn, args.calls)
            counts[name] = python_calls(fn)
    machine = machine_description()
    stem = RESULTS / ("triton_host_overhead_" + cpu_kind(machine) + (f"_{args.tag}" if args.tag else ""))
    lines = [
        f"# Host time of a Triton-backend call, launches stubbed ({cpu_label(machine)})",
        "",
        f"Machine: {machine['cpu']}, {machine['simd']}; torch {machine['torch']}; one thread. Fastest of 9 rounds "
        f"of {args.calls} calls; SmolLM2 shape (Hq 9, Hkv 3, D 64), 4,096 keys. On a GPU add the Triton "
        "launches (two for the split-key kernel, one for the prefill kernel) and the device time. "
        "'cached launch': through retmask's launcher cache instead of Triton's JIT entry (both stubbed here), "
        "so the difference to the row without is what the cache's key costs; on a GPU it saves the JIT "
        "entry's work (bench_triton_decode.py measures both there). "
        "'Python calls' and 'C calls' count the function calls of one call (sys.setprofile): the same on a "
        "busy machine as on a quiet one.",
        "",
        markdown_table(
            ["call", "host us / call", "Python calls", "C calls"],
            [[name, f"{us:.1f}", str(counts[name][0]), str(counts[name][1])] for name, us in rows.items()],
        ),
        "",
    ]
    write_page(stem, lines, dict(machine=machine, calls=args.calls, us_per_call=rows, calls_per_call=counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
