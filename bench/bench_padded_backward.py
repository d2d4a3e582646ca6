"""Training attention on the CPU with a padded batch: forward + backward time and peak memory.

A training batch is right-padded: every batch row's valid keys are one run ``[0, len)``. The CPU
backend's backward recomputes the attention through PyTorch SDPA; SDPA takes padding only as a dense
``[B, 1, M, N]`` boolean mask, which it also turns into a float bias. From ``KEY_RUNS_MIN_KEYS`` keys on,
the backward instead calls SDPA once per key run (``retmask/kernels/padded_sdpa.py``): no O(M x N) mask,
and causal calls that skip the blocks above the diagonal.

Methods (each cell in a fresh subprocess: peak RSS above the inputs, median wall time of fwd + bwd):
  ours_runs    retmask.kernels.attention(backend="cpu", key_padding_mask=...): the fused forward, the
               per-run backward (retmask's default from KEY_RUNS_MIN_KEYS keys).
  ours_dense   the same with the per-run path off: the dense-mask backward (retmask before this change).
  sdpa_mask    F.scaled_dot_product_attention with the [B, 1, N, N] causal & padding mask (what
               attn_implementation="sdpa" does with a padded batch), forward + backward.

Shape: SmolLM2-135M (9 query / 3 KV heads, D 64), B = 2, causal M = N, the second row right-padded to
3/4 of N; fp32 and bf16; N in {1024, 2048, 4096, 8192, 16384}.

    flock /tmp/retmask-heavy.lock python bench/bench_padded_backward.py     # ~6 min on 2 cores
    python bench/bench_padded_backward.py --ns 1024 --repeats 1 --out /tmp/pb  # smoke test

Writes bench/results/padded_backward_<cpu kind>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HQ, HKV, D, B = 9, 3, 64, 2
METHODS = ("ours_runs", "ours_dense", "sdpa_mask")
DTYPES = ("float32", "bfloat16")
NS = (1024, 2048, 4096, 8192, 16384)


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from retmask.kernels import attention, ops
    from retmask.kernels.reference import allowed_keys

    torch.manual_seed(0)
    N, method, dtype = cfg["n"], cfg["method"], getattr(torch, cfg["dtype"])
    q = torch.randn(B, HQ, N, D, dtype=dtype).requires_grad_(True)
    k = torch.randn(B, HKV, N, D, dtype=dtype).requires_grad_(True)
    v = torch.randn(B, HKV, N, D, dtype=dtype).requires_grad_(True)
    grad = torch.randn(B, HQ, N, D, dtype=dtype)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 3 * N // 4 :] = False
    if method == "ours_dense":
        ops.KEY_RUNS_MIN_KEYS = 1 << 62

    def step() -> None:
        if method == "sdpa_mask":
            allowed = allowed_keys(N, N, True, mask, q.device)  # [B, 1, N, N], built per call as HF does
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
        else:
            out = attention(q, k, v, causal=True, key_padding_mask=mask, backend="cpu")
        torch.autograd.grad(out, (q, k, v), grad)

    peak = common.PeakMemory()
    peak.start()
    step()  # warm-up and the memory peak of one call
    peak_bytes = peak.stop()
    times = common.time_calls(step, cfg["repeats"], 0)
    return {"seconds": common.median(times), "all_seconds": times, "peak_bytes": peak_bytes}


def plot(path: Path, cells: dict[str, dict], ns: list[int], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for dtype, style in zip(DTYPES, ("-", "--"), strict=True):
        for method, color in zip(METHODS, ("tab:green", "tab:orange", "tab:gray"), strict=True):
            xs = [n for n in ns if "seconds" in cells.get(f"{dtype} {method} {n}", {})]
            if not xs:
                continue
            label = f"{method} {dtype}"
            axes[0].plot(xs, [cells[f"{dtype} {method} {n}"]["seconds"] for n in xs], style, color=color,
                         marker="o", label=label)  # fmt: skip
            axes[1].plot(xs, [cells[f"{dtype} {method} {n}"]["peak_bytes"] / 2**30 for n in xs], style,
                         color=color, marker="o", label=label)  # fmt: skip
    for ax, ylabel in zip(
        axes, ("seconds per fwd + bwd (median)", "peak memory above inputs (GiB)"), strict=True
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens N (batch 2, second row padded to 3N/4)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    common.save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default=",".join(map(str, NS)), help="comma-separated token counts")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls per cell after the warm-up call")
    ap.add_argument(
        "--out", type=Path, default=None, help="page stem (default results/padded_backward_<cpu>)"
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    ns = [int(x) for x in args.ns.split(",")]
    if args.repeats < 1 or any(n < 2 for n in ns):
        ap.error("--repeats must be >= 1 and every N >= 2")
    machine = common.machine_description()
    stem = args.out or RESULTS / f"padded_backward_{common.cpu_kind(machine)}"
    configs = {
        f"{dtype} {method} {n}": {"n": n, "method": method, "dtype": dtype, "repeats": args.repeats}
        for n in ns
        for dtype in DTYPES
        for method in METHODS
    }
    cells = common.run_cells(__file__, configs, timeout=1800)

    rows = []
    for dtype in DTYPES:
        for n in ns:
            c = {m: cells[f"{dtype} {m} {n}"] for m in METHODS}
            rows.append([dtype, str(n), *(common.time_and_peak(x) for x in c.values()),
                         common.cell_ratio(c["ours_runs"], c["ours_dense"], "seconds"),
                         common.cell_ratio(c["ours_runs"], c["sdpa_mask"], "seconds"),
                         common.cell_ratio(c["ours_runs"], c["ours_dense"], "peak_bytes")])  # fmt: skip
    headers = ["dtype", "N", *(f"{m} (time / peak)" for m in METHODS), "runs / dense time", "runs / sdpa_mask time",
               "runs / dense memory"]  # fmt: skip
    title = f"Padded-batch attention, forward + backward on the CPU ({common.cpu_label(machine)})"
    lines = [
        f"# {title}",
        "",
        f"SmolLM2-135M shape ({HQ} query / {HKV} KV heads, D {D}), batch {B}, causal M = N, the second row "
        "right-padded to 3/4 of N. Each cell in a fresh process: median of the timed calls after one warm-up "
        f"call ({args.repeats} timed), peak RSS above the inputs during the warm-up call. `ours_runs`: "
        '`retmask.kernels.attention(backend="cpu")`, the backward per key run (default); `ours_dense`: the '
        "same with the dense-mask backward; `sdpa_mask`: PyTorch SDPA with the [B, 1, N, N] mask "
        '(`attn_implementation="sdpa"` on a padded batch).',
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + ".",
        "",
        common.markdown_table(headers, rows),
        "",
        f"![time and memory]({stem.name}.png)",
        "",
    ]
    plot(stem.with_suffix(".png"), cells, ns, title)
    common.write_page(stem, lines, {"machine": machine, "cells": cells, "ns": ns})


if __name__ == "__main__":
    main()
