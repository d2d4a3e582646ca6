"""Per-call cost of the C++ kernel's Python binding at decode sizes: ctypes (before) against pybind11 (now).

Until the pybind11 binding, ``retmask._C`` exposed a plain C ABI that ``retmask/kernels/cpu.py`` called
through ctypes (24 arguments, strides as ctypes arrays, an integer return code). A build of that version
is needed for the "before" side, e.g. from the last commit that had it:

    mkdir -p /tmp/retmask_ctypes && git archive <commit> setup.py csrc pyproject.toml README.md \\
        | tar -x -C /tmp/retmask_ctypes
    (cd /tmp/retmask_ctypes && mkdir -p retmask && python setup.py build_ext --inplace)
    flock /tmp/retmask-heavy.lock python bench/bench_binding_overhead.py \\
        --ctypes-build /tmp/retmask_ctypes/retmask/_C*.so

As committed, that kernel can segfault on decode calls whose last key block is partial (N = 16 here):
its key-bias row is a std::vector (16-byte aligned) read with aligned 32-byte loads. The page's "before"
build has that one buffer 64-byte aligned (nothing else changed); say so with --baseline-note.

The "before" side calls that build exactly as that commit's ``cpp_forward`` did (copied below as
``ctypes_forward``); the "after" side is today's ``retmask.kernels.cpu.backend.cpp_forward`` on the installed
build. Cases, SmolLM2-135M heads (Hq = 9, Hkv = 3, D = 64), fp32, B = 1, one query row:

  call only        the bare foreign call with its arguments built in advance and B = 0 (the kernel
                   returns at once): what ctypes / pybind11 cost per call, argument conversion included
  wrapper, B = 0   cpp_forward on an empty batch (no argmax): wrapper + binding + checks, no kernel work
  decode N = ...   cpp_forward of a decode step (M = 1, argmax of the row) against N keys, the output
                   and argmax allocated by the wrapper as in generation; N = 16, 512, 4096

Both sides run interleaved (A B B A ..., so drift of a shared machine hits both); a sample is the mean
of a batch of calls (~20 ms), the table shows the median of the samples, both of the calling thread's CPU
time (robust on a busy machine) and of the elapsed time. Each case runs with every torch
thread count of --threads (default 1 and 2; the kernel runs N <= 512 on one thread either way, below its
parallel-work threshold; N = 4096 splits over 2 threads, where a busy machine's scheduler shows).
Writes bench/results/binding_overhead.{md,json}.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_flags, cpu_model, machine_description, markdown_table  # noqa: E402

from retmask.kernels.cpu import backend as cpu  # noqa: E402
from retmask.runfiles import atomic_write_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HQ, HKV, D = 9, 3, 64
DECODE_N = (16, 512, 4096)

# ---- the ctypes binding as it was (retmask/kernels/cpu.py before pybind11) -------------------------

_I64x4 = ctypes.c_int64 * 4
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def bind_ctypes(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    fn = lib.retmask_attention_fwd_cpu
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, p, p, p, p, p, p, p, p, p, p, p]
    fn.argtypes += [i64] * 6 + [ctypes.c_int, ctypes.c_float, i64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


def ctypes_forward(
    lib, q, k, v, *, causal, sm_scale, key_padding_mask, skip_heads, argmax_rows, out=None, argmax=None,
    block_m=None, block_n=cpu.BLOCK_N,
):  # fmt: skip
    """The ctypes-era ``cpp_forward``, line for line."""
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    if out is None:
        out = torch.empty(B, Hq, M, D, dtype=q.dtype)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {list(q.shape)} {q.dtype}, got {list(out.shape)} {out.dtype}")
    if argmax_rows and argmax is None:
        argmax = torch.empty(B, Hq, argmax_rows, dtype=torch.int64)
    if argmax_rows and (argmax.shape != (B, Hq, argmax_rows) or not argmax.is_contiguous()):
        raise ValueError(f"argmax must be a contiguous int64 [{B}, {Hq}, {argmax_rows}] tensor")
    kpm = key_padding_mask.contiguous() if key_padding_mask is not None else None
    skip = skip_heads.contiguous() if skip_heads is not None else None
    rc = lib.retmask_attention_fwd_cpu(
        _DTYPE_CODES[q.dtype],
        q.data_ptr(), _I64x4(*q.stride()), k.data_ptr(), _I64x4(*k.stride()),
        v.data_ptr(), _I64x4(*v.stride()), out.data_ptr(), _I64x4(*out.stride()),
        argmax.data_ptr() if argmax_rows else None,
        kpm.data_ptr() if kpm is not None else None,
        skip.data_ptr() if skip is not None else None,
        B, Hq, Hkv, M, N, D, int(causal), float(sm_scale), argmax_rows,
        block_m or cpu.default_block_m(N), block_n, torch.get_num_threads(),
    )  # fmt: skip
    if rc == 2:
        raise MemoryError("retmask CPU attention kernel could not allocate its scratch buffers")
    if rc != 0:
        raise RuntimeError(f"retmask CPU attention kernel rejected its arguments (code {rc})")
    return out, (argmax if argmax_rows else None)


# ---- cases -----------------------------------------------------------------------------------------


def inputs(B: int, N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(N)
    return (
        torch.randn(B, HQ, 1, D, generator=gen),
        torch.randn(B, HKV, N, D, generator=gen),
        torch.randn(B, HKV, N, D, generator=gen),
    )


def call_only(lib_ctypes: ctypes.CDLL, lib_new: cpu.KernelLibrary):
    """Bare foreign calls on an empty batch, arguments built once (the kernel returns at once)."""
    q, k, v = inputs(0, 16)
    out = torch.empty_like(q)
    fn = lib_ctypes.retmask_attention_fwd_cpu
    strides = [_I64x4(*t.stride()) for t in (q, k, v, out)]
    ptrs = [t.data_ptr() for t in (q, k, v, out)]
    c_args = (0, ptrs[0], strides[0], ptrs[1], strides[1], ptrs[2], strides[2], ptrs[3], strides[3], None,
              None, None, 0, HQ, HKV, 1, 16, D, 1, 0.125, 0, 128, 64, 2)  # fmt: skip
    codes = lib_new.codes
    t_args = [(t.data_ptr(), codes[t.dtype], t.shape, t.stride()) for t in (q, k, v, out)]
    p_args = (*t_args, None, None, None, True, 0.125, 128, 64, 2)
    attention_fwd = lib_new.module.attention_fwd

    def before():
        if fn(*c_args) != 0:
            raise RuntimeError("ctypes call failed")

    def after():
        attention_fwd(*p_args)

    return before, after


def wrapper_calls(lib_ctypes: ctypes.CDLL, B: int, N: int, argmax_rows: int = 1):
    """cpp_forward (now) and ctypes_forward (before) on the same inputs."""
    q, k, v = inputs(B, N)
    kw = dict(causal=True, sm_scale=D**-0.5, key_padding_mask=None, skip_heads=None, argmax_rows=argmax_rows)

    def before():
        return ctypes_forward(lib_ctypes, q, k, v, **kw)

    def after():
        return cpu.cpp_forward(q, k, v, **kw)

    return before, after


def batch_size(fn, target_s: float) -> int:
    fn()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < target_s / 4:
        fn()
        n += 1
    return max(1, int(n * 4))


def sample(fn, n: int) -> tuple[float, float]:
    """Mean wall time and mean CPU time of the calling thread per call, over n calls."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n, (time.thread_time() - c0) / n


def measure(before, after, samples: int, target_s: float) -> dict:
    n = min(batch_size(before, target_s), batch_size(after, target_s))
    wall: dict[str, list[float]] = {"before": [], "after": []}
    cpu_time: dict[str, list[float]] = {"before": [], "after": []}
    for i in range(samples):
        order = (
            (("before", before), ("after", after)) if i % 2 == 0 else (("after", after), ("before", before))
        )
        for side, fn in order:
            w, c = sample(fn, n)
            wall[side].append(w)
            cpu_time[side].append(c)
    med = {f"{side}_{kind}_us": statistics.median(d[side]) * 1e6 for side in wall for kind, d in
           (("wall", wall), ("cpu", cpu_time))}  # fmt: skip
    return {
        "calls_per_sample": n,
        "samples": samples,
        **med,
        "wall_ratio": med["after_wall_us"] / med["before_wall_us"],
        "cpu_ratio": med["after_cpu_us"] / med["before_cpu_us"],
    }


def lscpu() -> tuple[str, list[str]]:
    """CPU model name (lscpu, else /proc/cpuinfo) and the SIMD flags that matter to the kernel."""
    model = ""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in text.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    flags = sorted(f for f in cpu_flags() if f in ("avx2", "fma") or f.startswith(("avx512", "amx")))
    return model or cpu_model(), flags


def openmp_runtime(lib_new: cpu.KernelLibrary) -> dict:
    """Which OpenMP runtime(s) this process runs, after torch and the kernel have both run in parallel."""
    torch.set_num_threads(2)
    x = torch.randn(2048, 2048)
    torch.softmax(x, dim=1)  # a parallel torch op
    q, k, v = inputs(1, 4096)
    cpu.cpp_forward(
        q, k, v, causal=True, sm_scale=0.125, key_padding_mask=None, skip_heads=None, argmax_rows=1
    )
    maps = sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                   if "libgomp" in line or "libiomp" in line or "libomp" in line})  # fmt: skip
    libtorch = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    ext = ctypes.CDLL(lib_new.module.__file__)

    def addr(lib: ctypes.CDLL) -> int | None:
        try:
            return ctypes.cast(lib.omp_get_max_threads, ctypes.c_void_p).value
        except AttributeError:
            return None

    same = libtorch.exists() and addr(ext) is not None and addr(ext) == addr(ctypes.CDLL(str(libtorch)))
    return {
        "mapped_openmp_libraries": maps,
        "kernel_and_torch_share_omp_get_max_threads": bool(same),
        "threads_in_process": len(list(Path("/proc/self/task").iterdir())),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctypes-build", required=True, help="retmask/_C*.so of the ctypes (C ABI) version")
    ap.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    ap.add_argument("--samples", type=int, default=15, help="timed batches per side and case")
    ap.add_argument("--sample-seconds", type=float, default=0.02, help="target length of one batch")
    ap.add_argument("--baseline-note", default="", help="what the --ctypes-build is (goes on the page)")
    args = ap.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]
    lib_new = cpu._library()
    if lib_new is None:
        raise SystemExit("retmask._C is not built; run `python setup.py build_ext --inplace` first")
    lib_ctypes = bind_ctypes(args.ctypes_build)

    # Same results from both sides before anything is timed.
    for n in DECODE_N:
        before, after = wrapper_calls(lib_ctypes, 1, n)
        (o1, a1), (o2, a2) = before(), after()
        if not (torch.equal(o1, o2) and torch.equal(a1, a2)):
            raise SystemExit(f"the two builds disagree at N = {n}")

    cases = [("call only (B = 0, arguments prebuilt)", 0, call_only(lib_ctypes, lib_new))]
    cases.append(("cpp_forward, B = 0 (no kernel work)", 0, wrapper_calls(lib_ctypes, 0, 16, argmax_rows=0)))
    cases += [(f"decode step, N = {n}", n, wrapper_calls(lib_ctypes, 1, n)) for n in DECODE_N]

    records, rows = [], []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for name, n, (before, after) in cases:
            r = measure(before, after, args.samples, args.sample_seconds)
            records.append({"case": name, "N": n, "threads": threads, **r})
            rows.append([name, str(threads), f"{r['before_cpu_us']:.2f}", f"{r['after_cpu_us']:.2f}",
                         f"{r['after_cpu_us'] - r['before_cpu_us']:+.2f}", f"{r['cpu_ratio']:.3f}",
                         f"{r['before_wall_us']:.2f} / {r['after_wall_us']:.2f}", f"{r['wall_ratio']:.3f}"])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)

    model, flags = lscpu()
    machine = machine_description()
    omp = openmp_runtime(lib_new)
    RESULTS.mkdir(parents=True, exist_ok=True)
    headers = [
        "case",
        "threads",
        "ctypes CPU us/call",
        "pybind11 CPU us/call",
        "difference us",
        "pybind11 / ctypes (CPU)",
        "wall us/call ctypes / pybind11",
        "pybind11 / ctypes (wall)",
    ]
    md = [
        "# Binding overhead of the C++ CPU kernel: ctypes (before) vs pybind11 (now)",
        "",
        f"CPU: {model} ({machine.get('cores', '?')} cores; flags: {', '.join(flags) or 'none of avx2/avx512/amx'}), "
        f"torch threads {args.threads}, torch {machine.get('torch', '')}, Python {machine.get('python', '')}. "
        f"SmolLM2-135M heads (Hq = {HQ}, Hkv = {HKV}, D = {D}), fp32, one query row with its argmax. Median over "
        f"{args.samples} interleaved batches per side (each the mean of a batch of calls, "
        f"~{args.sample_seconds * 1e3:.0f} ms); outputs and argmax checked bit-identical first. Made by "
        "`bench/bench_binding_overhead.py`. CPU = CPU time of the calling thread (what a shared machine's "
        "other processes do not inflate; on 2 threads it leaves out the worker's share of N = 4096), "
        "wall = elapsed time.",
        "",
        f"Before: {args.baseline_note or args.ctypes_build}. After: the installed `retmask._C`.",
        "",
        markdown_table(headers, rows),
        "",
        "OpenMP in this process after a parallel torch op and a parallel kernel call: mapped runtime(s) "
        + ", ".join(f"`{m}`" for m in omp["mapped_openmp_libraries"])
        + f"; kernel and libtorch_cpu resolve `omp_get_max_threads` to the same function: "
        f"{omp['kernel_and_torch_share_omp_get_max_threads']}; threads in the process: {omp['threads_in_process']}.",
    ]
    atomic_write_text(RESULTS / "binding_overhead.md", "\n".join(md) + "\n")
    record = {"machine": {**machine, "lscpu_model": model, "flags": flags}, "threads": thread_counts,
              "baseline": args.baseline_note or args.ctypes_build, "openmp": omp, "cases": records}  # fmt: skip
    atomic_write_text(RESULTS / "binding_overhead.json", json.dumps(record, indent=1))
    print("\n".join(md))


if __name__ == "__main__":
    main()
