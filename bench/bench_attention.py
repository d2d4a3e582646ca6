"""CPU attention benchmark: eager softmax(QK^T)V + argmax vs PyTorch SDPA vs retmask's fused kernel.

Every (method, shape) runs in a fresh subprocess (bench/common.py: peak RSS above the inputs, median
wall time), so memory numbers do not leak between configs. B = 1, causal prefill (M = N), in one dtype
per run (``--dtype``, default float32; every ratio compares two methods in that dtype).

Methods:
  eager        what ``output_attentions=True`` forces: repeat KV for GQA, materialise the [Hq, N, N]
               logits and probabilities, softmax(QK^T)V, argmax of every row.
  sdpa         torch.nn.functional.scaled_dot_product_attention (is_causal, enable_gqa): the floor,
               no argmax.
  ours_all     retmask.kernels.attention(backend="cpu", return_argmax=True): argmax of every row.
  ours_last64  the same with argmax_rows=64 (teacher-forced retrieval scoring needs only the last rows).
  cpp_* / dot_* / blocked_*   the CPU paths called directly (evidence for the rule of
               kernels/paths.py): the fused kernel ("cpp"), (bf16 runs on a build with AVX512-BF16) the
               fused kernel on bf16 dot products ("bf16dot"), SDPA + a blocked argmax ("blocked").

The page also lists the path the rule (``retmask.kernels.paths.cpu_forward_path``) gives the calls of this
benchmark and of detection (prefill, prefill chunks, decode, verification) at both shapes on this machine.

Usage:
  flock /tmp/retmask-heavy.lock python bench/bench_attention.py            # full run (~15 min, 2 cores)
                                            # -> bench/results/attention_cpu_<cpu kind>.{md,json,png}
  python bench/bench_attention.py --quick                                  # 1K-2K, a smoke test
  python bench/bench_attention.py --max-n 8192 --out /tmp/attn             # cap N, other output prefix
  python bench/bench_attention.py --min-n 32768 --no-paths --out bench/results/attention_cpu_<kind>_32k
  python bench/bench_attention.py --dtype bfloat16 --max-n 8192 --no-paths
                                            # -> bench/results/attention_cpu_<cpu kind>_bf16.{md,json,png}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from retmask.plotting import save_figure as save_png  # noqa: E402
from retmask.runfiles import atomic_write_text  # noqa: E402

MODELS: dict[str, tuple[int, int, int]] = {  # name: (Hq, Hkv, D)
    "SmolLM2": (9, 3, 64),
    "Llama-3.1-8B": (32, 8, 128),
}
FULL_NS = [1024, 2048, 4096, 8192, 16384, 32768]
QUICK_NS = [1024, 2048]
MAIN_METHODS = ["eager", "sdpa", "ours_all", "ours_last64"]
SKIP_FRACTIONS = [0.0, 0.25, 0.5, 0.9]
EAGER_MEMORY_FRACTION = 0.4  # run eager only if its estimated bytes fit in this share of MemAvailable
LAST_ROWS = 64


# ---- worker (runs in the subprocess) ---------------------------------------------------------------


def _make_inputs(cfg: dict[str, Any]):
    """Random q [1, Hq, M, D], k, v [1, Hkv, N, D] in the config's dtype (seeded)."""
    import torch

    Hq, Hkv, D, N, M = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["N"], cfg.get("M", cfg["N"])
    dtype = getattr(torch, cfg.get("dtype", "float32"))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, Hq, M, D, generator=gen).to(dtype)
    k = torch.randn(1, Hkv, N, D, generator=gen).to(dtype)
    v = torch.randn(1, Hkv, N, D, generator=gen).to(dtype)
    return q, k, v


def _make_fn(method: str, skip_frac: float, q, k, v):
    """A zero-argument callable running ``method`` on the given inputs (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    from retmask.kernels import attention
    from retmask.kernels.cpu import backend as cpu_backend
    from retmask.kernels.cpu import blocked as cpu_blocked

    Hq, M, D = q.shape[1], q.shape[2], q.shape[3]
    N = k.shape[2]
    scale = D**-0.5
    g = Hq // k.shape[1]
    skip = None
    if skip_frac:
        # A fixed random set of heads, spread over the KV groups like real retrieval-head masks.
        n_skip = round(skip_frac * Hq)
        perm = torch.randperm(Hq, generator=torch.Generator().manual_seed(1))
        skip = torch.zeros(Hq, dtype=torch.bool)
        skip[perm[:n_skip]] = True
    rows = {"all": M, "last64": min(LAST_ROWS, M)}

    if method == "eager":

        def fn():
            kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # transformers' repeat_kv
            s = torch.matmul(q, kr.transpose(-1, -2)) * scale
            future = torch.ones(M, N, dtype=torch.bool).triu_(N - M + 1)
            s.masked_fill_(future, float("-inf"))
            p = torch.softmax(s, dim=-1)
            out = torch.matmul(p, vr)
            return out, p.argmax(-1)

    elif method == "sdpa":

        def fn():
            return F.scaled_dot_product_attention(q, k, v, is_causal=M == N, scale=scale, enable_gqa=g > 1)

    elif method.startswith("ours_"):
        T = rows[method.split("_", 1)[1]]

        def fn():
            return attention(q, k, v, skip_heads=skip, return_argmax=True, argmax_rows=T, backend="cpu")

    elif method.startswith(("cpp_", "dot_", "blocked_")):
        path, which = method.split("_", 1)
        T = rows[which]
        skip_b = skip.expand(1, Hq).contiguous() if skip is not None else None
        if path in ("cpp", "dot"):

            def fn():
                return cpu_backend.cpp_forward(
                    q, k, v, causal=True, sm_scale=scale, key_padding_mask=None, skip_heads=skip_b,
                    argmax_rows=T, bf16_dot=path == "dot",
                )  # fmt: skip

        else:

            def fn():
                return cpu_blocked.forward(
                    q, k, v, causal=True, sm_scale=scale, key_padding_mask=None, skip_heads=skip_b,
                    argmax_rows=T,
                )  # fmt: skip

    else:
        raise ValueError(f"unknown method {method!r}")
    return fn


def _import_kernels_only() -> None:
    """Make ``import retmask.kernels`` skip ``retmask/__init__`` (which imports transformers, ~5 s):
    each config is a fresh process, and their start-up would otherwise dominate a full run."""
    import importlib.util
    import types

    if "retmask" in sys.modules:
        return
    spec = importlib.util.find_spec("retmask")
    pkg = types.ModuleType("retmask")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["retmask"] = pkg


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run the config's variants (list of {"method", "skip_frac"}) on one set of inputs.

    Memory: peak RSS above the inputs during the *first* call of the first variant (the process is
    fresh, so nothing is cached yet). Time: after warm-up, the variants' calls are interleaved
    (A B A B ...), so a ratio between variants of one config is robust to load changes on a shared
    machine. With warmup == 0 the memory-probe call doubles as the first timed call of variant 0.
    """
    _import_kernels_only()
    import torch

    torch.set_num_threads(cfg["threads"])
    with torch.inference_mode():
        q, k, v = _make_inputs(cfg)
        fns = [_make_fn(x["method"], x.get("skip_frac", 0.0), q, k, v) for x in cfg["variants"]]
        mem = common.PeakMemory()
        mem.start()
        t0 = time.perf_counter()
        fns[0]()
        probe = time.perf_counter() - t0
        peak = mem.stop()
        times: list[list[float]] = [[] for _ in fns]
        if cfg["warmup"] == 0:
            times[0].append(probe)
        else:
            for fn in fns[1:]:
                fn()
            for _ in range(cfg["warmup"] - 1):
                for fn in fns:
                    fn()
        # Cheap calls are timed in batches of `inner` so one sample spans >= ~0.2 s: the VM's scheduler
        # hands out CPU in ~4-8 ms slices, which otherwise quantises millisecond timings.
        inner = max(1, min(100, int(0.2 / max(probe, 1e-5)))) if cfg["warmup"] else 1
        for rep in range(cfg["repeats"]):
            for i, fn in enumerate(fns):
                if len(times[i]) > rep:
                    continue
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                times[i].append((time.perf_counter() - t0) / inner)
    return {
        "times": times,
        "medians": [common.median(t) for t in times],
        "peak": peak,
        "peak_exact": mem.exact,
        "calls_per_sample": inner,
    }


# ---- driver ----------------------------------------------------------------------------------------


def causal_flops(Hq: int, N: int, D: int, M: int | None = None) -> float:
    """FLOPs of causal attention (QK^T and PV over the lower triangle)."""
    M = N if M is None else M
    return 4.0 * Hq * D * M * (N - M / 2)


def repeats_for(flops: float, quick: bool) -> tuple[int, int]:
    """(repeats, warmup): fewer at large sizes so a full run stays near 15 minutes on 2 cores."""
    est = flops / 150e9  # seconds at roughly SDPA's rate here
    if quick:
        return 5, 1
    if est < 0.5:
        return 9, 1  # short calls are the most exposed to the shared VM's scheduling noise
    if est < 4:
        return 3, 1
    if est < 15:
        return 2, 0
    return 1, 0


def eager_bytes(Hq: int, Hkv: int, N: int, D: int) -> int:
    """Bytes the eager method materialises: fp32 logits and probabilities [Hq, N, N], the bool causal
    mask [N, N], the repeated K/V [Hq, N, D] and the output."""
    return 2 * Hq * N * N * 4 + N * N + 2 * Hq * N * D * 4 + Hq * N * D * 4


# (label, M, N, argmax rows) of the calls whose path is reported: this benchmark's and detection's.
DECISION_CALLS = [
    ("prefill, argmax of every row", 1024, 1024, 1024),
    ("prefill, argmax of the last 64 rows", 1024, 1024, 64),
    ("prefill, no argmax", 1024, 1024, 0),
    ("chunk of 256 against a cache, no argmax", 256, 2048, 0),
    ("verification of 5 tokens, argmax", 5, 2048, 5),
    ("decode, argmax", 1, 2048, 1),
]


def path_decisions(models: list[str], dtype: str) -> list[dict[str, Any]]:
    """The CPU forward path of each of ``DECISION_CALLS`` at each model's shape on this machine, by the rule
    of ``retmask.kernels.paths`` (``$RETMASK_CPU_PATH`` and ``$RETMASK_CPU_ISA`` included)."""
    import torch

    from retmask.kernels import paths
    from retmask.kernels.cpu import backend as cpu_backend

    build = cpu_backend.selected_isa()
    rows = []
    for model in models:
        _, _, D = MODELS[model]
        for label, M, _N, _argmax_rows in DECISION_CALLS:
            path = paths.cpu_forward_path(getattr(torch, dtype), D, M, build=build)
            rows.append({"model": model, "call": label, "path": path, "why": paths.WHY_CPU[path]})
    return rows


PAIR_LIMIT_S = 20.0  # pair a method with SDPA in its worker while one SDPA call is estimated below this


class Runner:
    """Runs configs in fresh subprocesses and logs one line each."""

    def __init__(self, threads: int, quick: bool, log, dtype: str = "float32") -> None:
        self.threads, self.quick, self.log, self.dtype = threads, quick, log, dtype
        self.results: list[dict[str, Any]] = []

    def run(self, model: str, N: int, method: str, M: int | None = None, skip_frac: float = 0.0,
            repeats: tuple[int, int] | None = None, sweep: list[float] | None = None,
            kind: str = "main", threads: int | None = None) -> dict[str, Any]:  # fmt: skip
        """One config. Non-SDPA methods are timed interleaved with SDPA (``sdpa_median``) when an SDPA
        call is cheap enough; ``sweep`` instead interleaves ``method`` at several skip fractions."""
        Hq, Hkv, D = MODELS[model]
        M = N if M is None else M
        flops = causal_flops(Hq, N, D, M)
        reps, warm = repeats or repeats_for(flops, self.quick)
        if method == "eager":
            reps, warm = min(reps, 2), 0  # eager is 5-10x slower; one or two calls suffice
        if sweep is not None:
            variants = [{"method": method, "skip_frac": f} for f in sweep]
        else:
            variants = [{"method": method, "skip_frac": skip_frac}]
            if method != "sdpa" and flops / 150e9 <= PAIR_LIMIT_S:
                variants.append({"method": "sdpa", "skip_frac": 0.0})
        cfg = dict(Hq=Hq, Hkv=Hkv, D=D, N=N, M=M, variants=variants, repeats=reps, warmup=warm,
                   threads=threads or self.threads, dtype=self.dtype)  # fmt: skip
        t0 = time.time()
        res = common.run_worker(__file__, cfg, timeout=900)
        res.update(model=model, N=N, M=M, method=method, skip_frac=skip_frac, kind=kind,
                   threads=cfg["threads"])  # fmt: skip
        if "error" not in res:
            res["median"] = res["medians"][0]
            if sweep is None and len(variants) == 2:
                res["sdpa_median"] = res["medians"][1]
        self.results.append(res)
        if "error" in res:
            status = res["error"]
        else:
            status = "  ".join(f"{v['method']}@{v['skip_frac']:.2f} {common.fmt_seconds(t)}"
                               for v, t in zip(variants, res["medians"], strict=True))  # fmt: skip
            status += f"  peak +{common.fmt_bytes(res['peak'])}  (n={reps})"
        self.log(f"  {model:13s} N={N:6d} M={M:6d} {status}  [{time.time() - t0:.0f} s wall]")
        return res


def time_ratio(r: dict, base: dict | None) -> tuple[float | None, bool]:
    """(time / SDPA time, paired?): the interleaved SDPA of the same worker when there is one."""
    if "error" in r:
        return None, False
    if "sdpa_median" in r:
        return r["median"] / r["sdpa_median"], True
    if base is None or "error" in base:
        return None, False
    return r["median"] / base["median"], False


def main_table(results: list[dict], models: list[str], ns: list[int]) -> tuple[list[str], list[list[str]]]:
    by = {(r["model"], r["N"], r["method"]): r for r in results if r["kind"] == "main"}
    headers = ["model", "N"]
    for m in MAIN_METHODS:
        headers += [f"{m} time", f"{m} peak"]
    headers += ["eager/sdpa time", "ours_all/sdpa time", "ours_last64/sdpa time", "ours_all/sdpa peak",
                "ours_last64/sdpa peak"]  # fmt: skip
    rows = []
    for model in models:
        Hq, Hkv, D = MODELS[model]
        for N in ns:
            base = by.get((model, N, "sdpa"))
            if base is None:
                continue
            row = [model, str(N)]
            ratios_t, ratios_m = {}, {}
            for m in MAIN_METHODS:
                r = by.get((model, N, m))
                if r is None or "error" in r:
                    if m == "eager":
                        why = r["error"] if r and "error" in r else "not run"
                        row += [f"skipped ({why})", f"needs ~{common.fmt_bytes(eager_bytes(Hq, Hkv, N, D))}"]
                    else:
                        row += ["error", "-"]
                    continue
                row += [common.fmt_seconds(r["median"]), common.fmt_bytes(r["peak"])]
                ratio, paired = time_ratio(r, base)
                if ratio is not None:
                    ratios_t[m] = common.fmt_ratio(ratio) + ("" if paired else " †")
                if "error" not in base:
                    ratios_m[m] = r["peak"] / max(base["peak"], 1)
            row += [ratios_t.get(m, "-") for m in ("eager", "ours_all", "ours_last64")]
            row += [common.fmt_ratio(ratios_m.get(m)) for m in ("ours_all", "ours_last64")]
            rows.append(row)
    return headers, rows


def plot(results: list[dict], models: list[str], ns: list[int], path: Path, dtype: str = "float32") -> None:
    """Rows: median time, time / SDPA (paired where available) with the targets, peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(models), figsize=(6 * len(models), 11), squeeze=False)
    labels = {"eager": "eager + argmax", "sdpa": "SDPA (no argmax)", "ours_all": "ours, argmax all rows",
              "ours_last64": "ours, argmax last 64 rows"}  # fmt: skip
    styles = {"eager": "o-", "sdpa": "s-", "ours_all": "^-", "ours_last64": "v--"}
    colors = {"eager": "tab:blue", "sdpa": "tab:orange", "ours_all": "tab:green", "ours_last64": "tab:red"}
    for col, model in enumerate(models):
        main = [r for r in results if r["model"] == model and r["kind"] == "main" and "error" not in r
                and r["N"] in ns]  # fmt: skip
        sdpa = {r["N"]: r for r in main if r["method"] == "sdpa"}
        for method in MAIN_METHODS:
            pts = sorted((r["N"], r["median"], r["peak"], time_ratio(r, sdpa.get(r["N"]))[0])
                         for r in main if r["method"] == method)  # fmt: skip
            if not pts:
                continue
            x, t, m, ratio = zip(*pts, strict=True)
            kw = dict(color=colors[method], label=labels[method])
            axes[0][col].plot(x, t, styles[method], **kw)
            if method != "sdpa":
                xr = [xi for xi, ri in zip(x, ratio, strict=True) if ri is not None]
                axes[1][col].plot(xr, [ri for ri in ratio if ri is not None], styles[method], **kw)
            axes[2][col].plot(x, [b / 1e6 for b in m], styles[method], **kw)
        axes[1][col].axhline(1.0, color="tab:orange", lw=1, label="SDPA")
        axes[1][col].axhline(1.3, color="gray", ls=":", lw=1, label="target, argmax all rows (1.3x)")
        axes[1][col].axhline(1.05, color="gray", ls="--", lw=1, label="target, last 64 rows (1.05x)")
        Hq, Hkv, D = MODELS[model]
        axes[0][col].set_title(f"{model} shape (Hq={Hq}, Hkv={Hkv}, D={D}), {dtype}, causal")
        axes[0][col].set_ylabel("median time (s)")
        axes[1][col].set_ylabel("time / SDPA time (paired)")
        axes[2][col].set_ylabel("peak RSS above inputs (MB)")
        for row in (0, 1, 2):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length N")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path, dpi=80)


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N in {1K, 2K}, fewer configs (smoke test)")
    ap.add_argument("--max-n", type=int, default=None, help="largest N to run")
    ap.add_argument("--min-n", type=int, default=None, help="smallest N to run (e.g. only the 32K cells)")
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: all cores)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--out", default=None, help="output prefix (default bench/results/attention_cpu_<cpu kind>, "
                    "e.g. attention_cpu_amd-epyc-avx2, or /tmp/attention_cpu_quick with --quick)")  # fmt: skip
    ap.add_argument("--no-paths", action="store_true", help="skip the comparison of the CPU paths")
    ap.add_argument("--paths-only", action="store_true", help="run only the comparison of the CPU paths")
    ap.add_argument("--dtype", default="float32", choices=list(common.DTYPE_SUFFIX),
                    help="dtype of q, k, v for every method (default float32)")  # fmt: skip
    args = ap.parse_args()

    import os

    threads = args.threads or os.cpu_count() or 1
    ns = QUICK_NS if args.quick else FULL_NS
    if args.max_n:
        ns = [n for n in ns if n <= args.max_n]
    if args.min_n:
        ns = [n for n in ns if n >= args.min_n]
    if not ns and not args.paths_only:
        ap.error(f"no N in {QUICK_NS if args.quick else FULL_NS} lies in [--min-n, --max-n] "
                 f"= [{args.min_n}, {args.max_n}]: nothing would be measured")  # fmt: skip
    machine = common.machine_description()
    machine_tag = common.cpu_kind(machine)
    name = f"attention_cpu_{machine_tag}{common.dtype_suffix(args.dtype)}"
    out_prefix = Path(args.out or ("/tmp/attention_cpu_quick" if args.quick else
                                   Path(__file__).parent / "results" / name))  # fmt: skip
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    machine["threads used"] = str(threads)
    log("machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
    runner = Runner(threads, args.quick, log, args.dtype)
    t_start = time.time()
    mem_avail = common.mem_available_bytes()

    log("== CPU forward path of each kind of call (the rule of retmask/kernels/paths.py) ==")
    decisions = path_decisions(args.models, args.dtype)
    for d in decisions:
        log(f"  {d['model']:13s} {d['call']:40s} {d['path']:8s} {d['why']}")

    log(f"== main: eager vs SDPA vs ours (causal prefill, B=1, {args.dtype}) ==")
    eager_skipped = []
    for model in [] if args.paths_only else args.models:
        Hq, Hkv, D = MODELS[model]
        for N in ns:
            for method in MAIN_METHODS:
                if method == "eager":
                    need = eager_bytes(Hq, Hkv, N, D)
                    if need > EAGER_MEMORY_FRACTION * mem_avail:
                        eager_skipped.append((model, N, need))
                        log(f"  {model:13s} N={N:6d} eager skipped: needs ~{common.fmt_bytes(need)}, "
                            f"{common.fmt_bytes(mem_avail)} available")  # fmt: skip
                        continue
                runner.run(model, N, method)

    log("== head-skip sweep: ours, argmax on all rows ==")
    sweep = []
    sweep_cfgs = [("SmolLM2", 8192), ("Llama-3.1-8B", 4096)] if not args.quick else [("SmolLM2", 2048)]
    for model, N in [] if args.paths_only else sweep_cfgs:
        if model not in args.models or (args.max_n and N > args.max_n) or (args.min_n and N < args.min_n):
            continue
        sweep.append(runner.run(model, N, "ours_all", sweep=SKIP_FRACTIONS, kind="sweep"))

    paths = []
    if not args.no_paths:
        log(
            "== CPU path comparison (evidence for the rule): fused C++ vs bf16 dot products vs blocked torch =="
        )
        prefill_ns = [2048, 4096] if not args.quick else [1024]
        from retmask.kernels.cpu import backend as cpu_backend

        kernel_kinds: tuple[str, ...] = ("cpp",)
        if args.dtype == "bfloat16" and cpu_backend.bf16_dot_native():
            kernel_kinds += ("dot",)  # bf16 dot products: prefill only (decode stays on cpp)
        for model in args.models:
            for N in prefill_ns:
                if args.max_n and N > args.max_n:
                    continue
                for which in ("all", "last64"):
                    for method in [f"{p}_{which}" for p in (*kernel_kinds, "blocked")]:
                        paths.append(runner.run(model, N, method, kind="path"))
            for N in [n for n in (2048, 8192, 32768) if not args.max_n or n <= args.max_n]:
                if args.quick and N > 2048:
                    continue
                # Decode: M = 1, argmax of the one row. Up to 8K one call takes well under a millisecond, and
                # with 2 threads on the shared VM it measures the scheduler's wake-up of the second thread
                # (4-16 ms when the other core is busy), not the kernel: those run single-threaded.
                for method in ("cpp_all", "blocked_all"):
                    th = 1 if N <= 8192 else None
                    paths.append(runner.run(model, N, method, M=1, repeats=(15, 2), kind="path", threads=th))

    elapsed = time.time() - t_start
    log(f"total benchmark wall time: {elapsed / 60:.1f} min")

    # ---- report ----------------------------------------------------------------------------------
    mode = "quick" if args.quick else ("paths-only" if args.paths_only else "full")
    md = [f"# CPU attention benchmark ({mode} run)", ""]
    md += [f"Generated by `bench/bench_attention.py{' --quick' if args.quick else ''}` on "
           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {elapsed / 60:.1f} min.", ""]  # fmt: skip
    md += [common.markdown_table(["", ""], [[k, v] for k, v in machine.items()]), ""]
    md += ["Method: every cell is a fresh subprocess; time = median wall time of the repeats (fewer at large "
           "N); peak = peak RSS above the inputs (VmHWM after resetting it via /proc/self/clear_refs, minus "
           "RSS once the inputs exist; outputs included). The machine is shared: other light processes may "
           "have been running; heavy jobs were serialised with a lock. Compare ratios within this run. "
           f"Time ratios vs SDPA are *paired*: the method and SDPA run interleaved in one worker (A B A B), "
           f"except where one SDPA call exceeds ~{PAIR_LIMIT_S:.0f} s (marked †: ratio to the separate SDPA "
           "cell).", ""]  # fmt: skip
    headers, rows = main_table(runner.results, args.models, ns)
    md += [
        f"## Eager vs SDPA vs ours (causal prefill M = N, B = 1, {args.dtype})",
        "",
        common.markdown_table(headers, rows),
        "",
    ]
    md += ["## Which CPU path each kind of call takes here", "",
           "`retmask.kernels.attention(backend=\"cpu\")` takes the path the rule of `retmask/kernels/paths.py` "
           "names: `$RETMASK_CPU_PATH` if set, else `blocked` (SDPA + a blocked argmax scan) without the built "
           "extension, else `bf16dot` (the fused kernel on native bf16 dot products) for bf16 calls of more than "
           "one query row with an even head dim on the `avx512bf16` build, else `cpp` (the fused kernel).", "",
           common.markdown_table(["model", "call", "path", "what"],
                                 [[d["model"], d["call"], d["path"], d["why"]] for d in decisions]),
           ""]  # fmt: skip
    if eager_skipped:
        md += ["Eager runs skipped because their materialised logits/probabilities would not fit "
               f"(> {EAGER_MEMORY_FRACTION:.0%} of {common.fmt_bytes(mem_avail)} available):", ""]  # fmt: skip
        md += [f"- {m}, N={n}: eager needs ~{common.fmt_bytes(b)}" for m, n, b in eager_skipped] + [""]
    if sweep:
        srows = []
        for r in sweep:
            if "error" in r:
                continue
            Hq = MODELS[r["model"]][0]
            for f, t in zip(SKIP_FRACTIONS, r["medians"], strict=True):
                srows.append([r["model"], str(r["N"]), f"{f:.0%} ({round(f * Hq)}/{Hq})", common.fmt_seconds(t),
                              common.fmt_ratio(t / r["medians"][0])])  # fmt: skip
        md += ["## Head-skip sweep (ours, argmax on all rows)", "",
               "The four fractions run interleaved in one worker; skipped heads are a fixed random set.", "",
               common.markdown_table(["model", "N", "heads skipped", "time", "vs none"], srows), ""]  # fmt: skip
    if paths:
        prow = []
        for r in paths:
            if "error" in r:
                continue
            ratio, _ = time_ratio(r, None)
            prow.append([r["model"], str(r["N"]), str(r["M"]), str(r["threads"]), r["method"],
                         common.fmt_seconds(r["median"]),
                         common.fmt_ratio(ratio), common.fmt_bytes(r["peak"])])  # fmt: skip
        md += ["## CPU path comparison (evidence for the rule)", "",
               "`cpp_*` = fused C++ kernel, `dot_*` = the fused kernel on bf16 dot products (bf16, AVX512-BF16), "
               "`blocked_*` = SDPA output + key-blocked torch argmax scan; "
               "`_all` = argmax of every row, `_last64` = of the last 64 rows; M = 1 rows are decode steps. "
               "Each path is timed interleaved with SDPA in its own worker.",
               "", common.markdown_table(["model", "N", "M", "threads", "path", "time", "vs SDPA (paired)", "peak"], prow),
               ""]  # fmt: skip
    md_path = out_prefix.with_suffix(".md")
    atomic_write_text(md_path, "\n".join(md))
    atomic_write_text(
        out_prefix.parent / (out_prefix.name + ".json"),
        json.dumps(
            {"machine": machine, "dtype": args.dtype, "cpu_paths": decisions, "results": runner.results},
            indent=1,
        ),
    )
    if any(r["kind"] == "main" for r in runner.results):
        plot(runner.results, args.models, ns, out_prefix.with_suffix(".png"), args.dtype)
    print()
    print(common.text_table(headers, rows))
    print(f"\nwrote {md_path}, {out_prefix.with_suffix('.png')}, {out_prefix.name}.json")


if __name__ == "__main__":
    main()
