"""Sliding-window attention on the CPU: retmask's fused kernel against full causal and against PyTorch SDPA
with the boolean sliding-window mask transformers builds.

Every (model, N, method, window) cell runs in a fresh subprocess (bench/common.py: peak RSS above the
inputs, median wall time). fp32, B = 1, causal prefill (M = N), 2 threads.

Methods:
  ours_win_all     attention(window=w, return_argmax=True, backend="cpu"): argmax of every row.
  ours_win_last64  the same with argmax_rows=64.
  ours_full        attention(return_argmax=True, backend="cpu") without a window: full causal, argmax of
                   every row (the cost a local layer has without window support).
  sdpa_win_mask    F.scaled_dot_product_attention with the [N, N] boolean sliding-window causal mask
                   transformers builds (True = attend): needs N^2 bytes for the mask alone, and SDPA's CPU
                   kernel turns it into an N^2 float bias. Skipped (with the memory it would need) where
                   that exceeds MASK_MEMORY_LIMIT; no argmax.
  sdpa_causal      F.scaled_dot_product_attention(is_causal=True): full causal, no argmax.

Shapes: SmolLM2-135M (9 query / 3 KV heads, D 64) and Gemma-3-270M (4 / 1, D 256); N in {8192, 32768};
window in {512, 4096} (Gemma-3's local layers use 512).

Extrapolated cells (marked "≈"): a call of ours whose work (row x visited key x Hq x D, the kernel's own
cost model, ``kernel_work``) exceeds ``--direct-limit`` is not run whole: its last CHUNK_ROWS query rows
are (the same kernel call with M = CHUNK_ROWS against all N keys, so the same items, K/V streams and
masks), and the time is scaled by work(M = N) / work(chunk). The window cells of the target (window 512)
always run whole; the full-causal SmolLM2 call at 8K runs both ways, which checks the extrapolation.
Extrapolated cells have no peak memory. The full-causal cell of each (model, N) also times a window-512
call alternately with its own calls (``paired``): a ratio that the shared machine's load cannot skew.

Usage:
  flock /tmp/retmask-heavy.lock python bench/bench_window.py          # full run (~14 min, 2 AVX2 cores)
  python bench/bench_window.py --quick                                 # N = 2048 / 4096, a smoke test
Writes bench/results/window_<cpu-kind>.{md,png} (cpu-kind: CPU model and SIMD level, e.g.
``amd-epyc-avx2``).
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

RESULTS = Path(__file__).resolve().parent / "results"
MODELS: dict[str, tuple[int, int, int]] = {  # name: (Hq, Hkv, D)
    "SmolLM2": (9, 3, 64),
    "Gemma-3-270M": (4, 1, 256),
}
FULL_NS = [8192, 32768]
QUICK_NS = [2048, 4096]
WINDOWS = [512, 4096]
LAST_ROWS = 64
WINDOW_METHODS = ["ours_win_all", "ours_win_last64", "sdpa_win_mask"]
FULL_METHODS = ["ours_full", "sdpa_causal"]
MASK_MEMORY_LIMIT = 2 * 2**30  # bytes of mask + float bias SDPA may use before the cell is skipped
TARGET_WINDOW = 512  # the window whose cells always run whole, and are timed paired with full causal
CHUNK_ROWS = 512  # query rows an extrapolated cell runs (the last ones: the most keys)
DIRECT_LIMIT = 2e10  # kernel_work above which a cell of ours is extrapolated from a chunk
BLOCK_N = 64


# ---- worker (runs in the subprocess) ---------------------------------------------------------------


def _import_kernels_only() -> None:
    """Make ``import retmask.kernels`` skip ``retmask/__init__`` (which imports transformers, ~5 s)."""
    import importlib.util
    import types

    if "retmask" in sys.modules:
        return
    spec = importlib.util.find_spec("retmask")
    if spec is None:  # a source checkout run without installing: the repository root
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        spec = importlib.util.find_spec("retmask")
    pkg = types.ModuleType("retmask")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["retmask"] = pkg


def sliding_window_mask(N: int, window: int):
    """bool [1, 1, N, N], True = attend: causal and within ``window`` keys (transformers'
    ``sliding_window_causal`` mask for a prefill: key j visible from query i iff i - window < j <= i)."""
    import torch

    i = torch.arange(N)[:, None]
    j = torch.arange(N)[None, :]
    return ((j <= i) & (j > i - window))[None, None]


def mask_bytes(N: int) -> int:
    """The N x N bool mask plus the float bias SDPA's CPU path makes of it."""
    return N * N * (1 + 4)


def kernel_work(Hq: int, Hkv: int, M: int, N: int, D: int, window: int | None, block_m: int) -> int:
    """Work of a causal call of the C++ kernel as its planner counts it (make_plan in
    csrc/attention_cpu.cpp): per item, visited keys (from the block holding the first row's window
    start to one past the last row) x tile rows, summed, times D."""
    g = Hq // Hkv
    bm = max(1, block_m // g)
    w = window if window is not None and window < N else None
    total = 0
    for i0 in range(0, M, bm):
        i1 = min(M, i0 + bm)
        first = 0 if w is None else max(0, N - M + i0 - w + 1) // BLOCK_N * BLOCK_N
        total += (N - M + i1 - first) * g * (i1 - i0)
    return total * Hkv * D


def _make_fn(method: str, window: int | None, q, k, v):
    import torch.nn.functional as F

    from retmask.kernels import attention

    M, D, g = q.shape[2], q.shape[3], q.shape[1] // k.shape[1]
    scale = D**-0.5
    if method == "ours_win_all":
        return lambda: attention(q, k, v, window=window, return_argmax=True, backend="cpu")
    if method == "ours_win_last64":
        return lambda: attention(
            q, k, v, window=window, return_argmax=True, argmax_rows=LAST_ROWS, backend="cpu"
        )
    if method == "ours_full":
        return lambda: attention(q, k, v, return_argmax=True, backend="cpu")
    if method == "sdpa_causal":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=g > 1)
    if method == "sdpa_win_mask":

        def fn():
            mask = sliding_window_mask(M, window)  # built per call, as a model's forward does
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=g > 1)

        return fn
    raise ValueError(f"unknown method {method!r}")


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """One cell: peak RSS above the inputs during the first call, then median time of the repeats. With
    ``pair`` ({"method", "window"}: a whole call on the same inputs) the two alternate call by call, so
    the ratio of their medians does not depend on how busy the shared machine was at the time."""
    _import_kernels_only()
    import torch

    torch.set_num_threads(cfg["threads"])
    gen = torch.Generator().manual_seed(0)
    Hq, Hkv, D, N = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["N"]
    with torch.inference_mode():
        q = torch.randn(1, Hq, N, D, generator=gen)
        k = torch.randn(1, Hkv, N, D, generator=gen)
        v = torch.randn(1, Hkv, N, D, generator=gen)
        q_all = q
        if cfg.get("rows"):  # an extrapolated cell: the last `rows` query rows against all N keys
            q = q[:, :, N - cfg["rows"] :].contiguous()
        fn = _make_fn(cfg["method"], cfg["window"], q, k, v)
        pair = cfg.get("pair")
        pair_fn = _make_fn(pair["method"], pair["window"], q_all, k, v) if pair else None
        mem = common.PeakMemory()
        mem.start()
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
        peak = mem.stop()
        times = [first] if cfg["warmup"] == 0 else []
        pair_times: list[float] = []
        while len(times) < cfg["repeats"] or (pair_fn and len(pair_times) < len(times)):
            if pair_fn and len(pair_times) < len(times):
                t0 = time.perf_counter()
                pair_fn()
                pair_times.append(time.perf_counter() - t0)
                continue
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    res = {"times": times, "median": common.median(times), "peak": peak, "peak_exact": mem.exact}
    if pair_fn:
        res.update(pair_times=pair_times, pair_median=common.median(pair_times))
    return res


# ---- driver ----------------------------------------------------------------------------------------


def causal_flops(Hq: int, N: int, D: int, window: int | None = None) -> float:
    """FLOPs of QK^T and PV over the keys each row sees (prefill, M = N)."""
    keys = N * (N + 1) / 2 if window is None else sum(min(i + 1, window) for i in range(0, N, 64)) * 64
    return 4.0 * Hq * D * keys


def plan_repeats(
    method: str, Hq: int, N: int, D: int, window: int | None, work: int | None
) -> tuple[int, int]:
    """(repeats, warmup) from a rough estimate of the call's time: ours from its planned ``work`` (4 FLOPs
    per unit, ~3 GFLOP/s on the AVX2 machine of the committed results), SDPA from its FLOPs (~15 GFLOP/s;
    with a mask it computes every logit): one call above ~30 s, three below ~8 s (median of three, so
    one call slowed by other jobs on the shared machine does not set the cell)."""
    if work is not None:
        est = 4 * work / 3e9
    else:
        masked = method == "sdpa_win_mask"
        est = causal_flops(Hq, N, D) * (2 if masked else 1) / 15e9
    if est > 30:
        return 1, 0
    if est > 8:
        return 2, 0
    return (3, 0) if est > 1 else (3, 1)


def run_cell(
    model: str, N: int, method: str, window: int | None, threads: int, log, chunk: bool | None = None,
    direct_limit: float = DIRECT_LIMIT, pair: tuple[str, int | None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One cell in a fresh worker. ``chunk``: extrapolate from the last CHUNK_ROWS rows (None: when the
    call's work exceeds ``direct_limit``; only for our kernel, never for TARGET_WINDOW).
    ``pair``: (method, window) of a whole call timed alternately with this one (``pair_ratio``)."""
    from retmask.kernels.cpu.backend import default_block_m

    Hq, Hkv, D = MODELS[model]
    rec: dict[str, Any] = {"model": model, "N": N, "method": method, "window": window}
    if method == "sdpa_win_mask" and mask_bytes(N) > min(
        MASK_MEMORY_LIMIT, common.mem_available_bytes() // 3
    ):
        rec["skipped"] = f"needs >= {common.fmt_bytes(mask_bytes(N))} for the N x N mask"
        log(f"  {model:13s} N={N:6d} w={window!s:5s} {method:16s} skipped: {rec['skipped']}")
        return rec
    cfg = dict(Hq=Hq, Hkv=Hkv, D=D, N=N, method=method, window=window, threads=threads)
    work = None  # of the call as run (the chunk when extrapolating)
    if method.startswith("ours"):
        block_m = default_block_m(N, window)
        work = kernel_work(Hq, Hkv, N, N, D, window, block_m)
        if chunk is None:
            chunk = work > direct_limit and window != TARGET_WINDOW and N > CHUNK_ROWS
        if chunk:
            cfg["rows"] = CHUNK_ROWS
            rec["factor"] = work / kernel_work(Hq, Hkv, CHUNK_ROWS, N, D, window, block_m)
            work = kernel_work(Hq, Hkv, CHUNK_ROWS, N, D, window, block_m)
    reps, warm = plan_repeats(method, Hq, N, D, window, work)
    cfg.update(repeats=reps, warmup=warm)
    if pair is not None:
        cfg["pair"] = {"method": pair[0], "window": pair[1]}
    t0 = time.time()
    res = common.run_worker(__file__, cfg, timeout=900)
    rec.update(res)
    if "error" in res:
        status = res["error"]
    elif chunk:
        rec.update(estimated=True, chunk_time=res["median"], median=res["median"] * rec["factor"])
        rec.pop("peak", None)
        status = (
            f"~{common.fmt_seconds(rec['median'])} (last {CHUNK_ROWS} rows {common.fmt_seconds(res['median'])} "
            f"x {rec['factor']:.1f})  (n={reps})"
        )
    else:
        status = f"{common.fmt_seconds(res['median'])}  peak +{common.fmt_bytes(res['peak'])}  (n={reps})"
    if "pair_median" in rec:
        rec["pair"] = {"method": pair[0], "window": pair[1]}
        rec["pair_ratio"] = rec["pair_median"] / rec["median"]
        status += f"; paired {pair[0]} w={pair[1]}: {common.fmt_seconds(rec['pair_median'])}"
        status += f" = {rec['pair_ratio']:.3f}x"
    log(f"  {model:13s} N={N:6d} w={window!s:5s} {method:16s} {status}  [{time.time() - t0:.0f} s wall]")
    return rec


def _cell(r: dict | None) -> tuple[str, str]:
    if r is None:
        return "-", "-"
    if "skipped" in r:
        return "skipped", r["skipped"].replace("needs >= ", "needs ")
    if "error" in r:
        return "error", "-"
    if r.get("estimated"):
        return "≈ " + common.fmt_seconds(r["median"]), "n/a (extrapolated)"
    return common.fmt_seconds(r["median"]), common.fmt_bytes(r["peak"])


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or "median" not in a or "median" not in b:
        return None
    return a["median"] / b["median"]


def _fmt_ratio(a: dict | None, b: dict | None) -> str:
    x = _ratio(a, b)
    if x is None:
        return "skipped" if a is not None and "skipped" in a else "-"
    return ("≈ " if a.get("estimated") or b.get("estimated") else "") + common.fmt_ratio(x)


def tables(results: list[dict], models: list[str], ns: list[int]) -> tuple[str, str]:
    by = {(r["model"], r["N"], r["method"], r["window"]): r for r in results}
    time_rows, ratio_rows = [], []
    for model in models:
        for N in ns:
            full, sdpa = by.get((model, N, "ours_full", None)), by.get((model, N, "sdpa_causal", None))
            for w in WINDOWS:
                if w >= N:
                    continue
                cells = {m: by.get((model, N, m, w)) for m in WINDOW_METHODS}
                row = [model, str(N), str(w)]
                for m in WINDOW_METHODS:
                    row += list(_cell(cells[m]))
                row += list(_cell(full)) + list(_cell(sdpa))
                time_rows.append(row)
                ideal = (w * (w + 1) / 2 + (N - w) * w) / (N * (N + 1) / 2)
                paired = "-"
                if full is not None and "pair_ratio" in full and full["pair"]["window"] == w:
                    paired = ("≈ " if full.get("estimated") else "") + common.fmt_ratio(full["pair_ratio"])
                ratio_rows.append([
                    model, str(N), str(w),
                    paired,
                    _fmt_ratio(cells["ours_win_all"], full),
                    _fmt_ratio(cells["ours_win_last64"], full),
                    _fmt_ratio(cells["ours_win_all"], sdpa),
                    _fmt_ratio(cells["sdpa_win_mask"], sdpa),
                    _fmt_ratio(cells["ours_win_all"], cells["sdpa_win_mask"]),
                    f"{ideal:.3f}",
                ])  # fmt: skip
    headers = ["model", "N", "window"]
    for m in WINDOW_METHODS + FULL_METHODS:
        headers += [f"{m} time", f"{m} peak"]
    ratio_headers = [
        "model", "N", "window", "ours_win_all / ours_full (paired)", "ours_win_all / ours_full",
        "ours_win_last64 / ours_full",
        "ours_win_all / sdpa_causal", "sdpa_win_mask / sdpa_causal", "ours_win_all / sdpa_win_mask",
        "ideal (allowed keys / causal keys)",
    ]  # fmt: skip
    return common.markdown_table(headers, time_rows), common.markdown_table(ratio_headers, ratio_rows)


def plot(results: list[dict], models: list[str], ns: list[int], path: Path) -> None:
    """Time of each windowed method relative to our full-causal kernel, per (model, N, window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["model"], r["N"], r["method"], r["window"]): r for r in results}
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 3.6), squeeze=False)
    methods = ["ours_win_all", "ours_win_last64", "sdpa_win_mask", "sdpa_causal"]
    colors = {"ours_win_all": "tab:green", "ours_win_last64": "tab:red", "sdpa_win_mask": "tab:purple",
              "sdpa_causal": "tab:orange"}  # fmt: skip
    for col, model in enumerate(models):
        ax = axes[0, col]
        groups = [(N, w) for N in ns for w in WINDOWS if w < N]
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            vals = []
            for N, w in groups:
                full = by.get((model, N, "ours_full", None))
                r = by.get((model, N, m, None if m == "sdpa_causal" else w))
                vals.append(_ratio(r, full) or 0.0)
            xs = [g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))]
            bars = ax.bar(xs, vals, width, label=m, color=colors[m])
            for bar, (N, w) in zip(bars, groups, strict=True):
                r = by.get((model, N, m, None if m == "sdpa_causal" else w))
                if r is not None and r.get("estimated"):
                    bar.set_hatch("///")
                    bar.set_edgecolor("white")
            for x, val in zip(xs, vals, strict=True):
                if val == 0.0 and m == "sdpa_win_mask":
                    ax.text(x, 0.03, "skipped: N×N mask", rotation=90, fontsize=6, ha="center", va="bottom",
                            transform=ax.get_xaxis_transform())  # fmt: skip
        for g, (N, w) in enumerate(groups):  # the work a window-only kernel must do, relative to full causal
            ideal = (w * (w + 1) / 2 + (N - w) * w) / (N * (N + 1) / 2)
            ax.hlines(ideal, g - 0.45, g + 0.45, color="black", lw=1.2, label="ideal" if g == 0 else None)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(0.1, color="tab:green", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_xticks(range(len(groups)), [f"N={N // 1024}K\nw={w}" for N, w in groups], fontsize=8)
        ax.set_ylabel("time / ours full causal (hatched: extrapolated)", fontsize=8)
        Hq, Hkv, D = MODELS[model]
        ax.set_title(f"{model} (Hq {Hq}, Hkv {Hkv}, D {D})", fontsize=9)
        if col == 0:
            ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="N = 2K / 4K only (a smoke test)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS)
    )
    ap.add_argument("--out", default=None, help="output prefix (default bench/results/window_<cpu-kind>)")
    ap.add_argument(
        "--direct-limit", type=float, default=DIRECT_LIMIT,
        help="kernel work above which a cell of ours is extrapolated from its last rows (inf: never)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    _import_kernels_only()  # run_cell asks the backend for its tile rows
    models = [m for m in args.models.split(",") if m]
    ns = QUICK_NS if args.quick else FULL_NS
    machine = common.machine_description()
    machine["torch_threads"] = str(args.threads)
    out = Path(args.out) if args.out else RESULTS / f"window_{common.cpu_kind(machine)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    started = time.time()
    results = []
    checks = []  # (direct, extrapolated) pairs of one full-causal call: the extrapolation's error
    for model in models:
        for N in ns:
            for method in FULL_METHODS:
                pair = (
                    ("ours_win_all", TARGET_WINDOW) if method == "ours_full" and TARGET_WINDOW < N else None
                )
                results.append(
                    run_cell(
                        model, N, method, None, args.threads, log, direct_limit=args.direct_limit, pair=pair
                    )
                )
                if method == "ours_full" and "median" in results[-1] and not results[-1].get("estimated"):
                    check = run_cell(model, N, method, None, args.threads, log, chunk=True)
                    checks.append((results[-1], check))
            for w in WINDOWS:
                if w >= N:
                    continue
                for method in WINDOW_METHODS:
                    results.append(
                        run_cell(model, N, method, w, args.threads, log, direct_limit=args.direct_limit)
                    )
    minutes = (time.time() - started) / 60
    check_lines = [
        f"- {d['model']}, N = {d['N']}, full causal: measured {common.fmt_seconds(d['median'])}, extrapolated "
        f"from its last {CHUNK_ROWS} rows {common.fmt_seconds(c['median'])} ({c['median'] / d['median']:.2f}x)."
        for d, c in checks
        if "median" in c
    ]

    time_table, ratio_table = tables(results, models, ns)
    machine_rows = [[k, v] for k, v in machine.items()]
    md = [
        "# Sliding-window attention on the CPU" + (" (quick run)" if args.quick else ""),
        "",
        f"Generated by `bench/bench_window.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{minutes:.1f} min.",
        "",
        common.markdown_table(["", ""], machine_rows),
        "",
        "Method: causal prefill (M = N), B = 1, fp32, "
        f"{args.threads} threads. Every cell is a fresh subprocess; time = median wall time of its calls "
        "(three calls, two above ~8 s estimated, one above ~30 s); peak = peak RSS above the inputs during the first "
        "call (VmHWM reset via /proc/self/clear_refs; outputs included). The machine is shared with other "
        "jobs: compare ratios, not absolute times. `sdpa_win_mask` builds the [N, N] boolean sliding-window "
        "mask transformers would pass (inside the timed call) and is skipped where the mask and the float "
        f"bias SDPA makes of it (N² × 5 bytes) exceed {common.fmt_bytes(MASK_MEMORY_LIMIT)} or a third of "
        "the available memory.",
        "",
        f"Cells marked ≈ are extrapolated (work above {args.direct_limit:.3g} row·key·head·dim units): the "
        f"same call on the last {CHUNK_ROWS} query rows against all N keys, scaled by the ratio of the "
        "kernel's planned work (its cost model: visited keys × tile rows per work item). Check of the "
        "extrapolation on a call that also ran whole:",
        "",
        *(check_lines or ["- (none ran whole in this run)"]),
        "",
        "## Time ratios",
        "",
        ratio_table,
        "",
        "`paired`: the window-512 call timed alternately with the full-causal call (or its chunk) in one "
        "worker, which takes the shared machine's load out of the ratio; the other ratios divide medians "
        "of separate cells, run minutes apart. `ideal`: allowed (row, key) pairs with the window over those "
        "of full causal attention: the fraction of full-causal work a kernel that visits only the window's "
        "keys must do.",
        "",
        "## Times and peak memory",
        "",
        time_table,
        "",
    ]
    atomic_write_text(out.with_suffix(".md"), "\n".join(md) + "\n")
    plot(results, models, ns, out.with_suffix(".png"))
    print("\n".join(md))


if __name__ == "__main__":
    main()
