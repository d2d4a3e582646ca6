"""Benchmark: the bf16 attention backward on the CPU (the SDPA recompute that the CPU kernel's autograd
uses), in bf16 against in fp32 (q, k, v and the output gradient converted, the gradients converted back),
and what ``retmask.kernels.backward_precision`` decides for each shape on this machine.

SmolLM2's attention shape (9 query heads, 3 kv heads, head dim 64), causal, square (training), the last
batch row right-padded by a quarter; batch 1 and 4; 64-2,048 keys. Both precisions interleaved in one
process, median of ``--repeats`` calls; max |Δ| of the gradients between the two, relative to their
scale. The decision column is the autotuner's own measurement (on its proxy call of the same keys below
512, keys rounded up to a multiple of 64 from there), made in a fresh cache folder.

Writes bench/results/attention_backward_<cpu kind>.{md,json,png}.

    flock /tmp/retmask-heavy.lock python bench/bench_attention_backward.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    cpu_kind,
    cpu_label,
    interleaved,
    machine_description,
    markdown_table,
    save_figure,
    write_page,
)

from retmask.kernels import backward_precision, ops  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def cell(batch: int, keys: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(keys + batch)
    q = torch.randn(batch, HEADS, keys, HEAD_DIM, generator=gen).bfloat16()
    k = torch.randn(batch, KV_HEADS, keys, HEAD_DIM, generator=gen).bfloat16()
    v = torch.randn(batch, KV_HEADS, keys, HEAD_DIM, generator=gen).bfloat16()
    grad_out = torch.randn(q.shape, generator=gen).bfloat16()
    mask = torch.ones(batch, keys, dtype=torch.bool)
    mask[-1, keys - keys // 4 :] = False
    call = {"grad_out": grad_out, "q": q, "k": k, "v": v, "causal": True, "key_padding_mask": mask,
            "sm_scale": HEAD_DIM**-0.5}  # fmt: skip
    results = {}

    def timed(precision: str) -> float:
        start = time.perf_counter()
        results[precision] = ops._proxy_grads(precision, call)
        return time.perf_counter() - start

    times = interleaved({p: (lambda p=p: timed(p)) for p in ("native", "fp32")}, repeats)
    diff = max(
        float((a.float() - b.float()).abs().max() / b.float().abs().max())
        for a, b in zip(results["fp32"], results["native"], strict=True)
    )
    case = backward_precision.case_of(q, k, True, True)
    return {
        "batch": batch, "keys": keys, "seconds": {p: statistics.median(t) for p, t in times.items()},
        "max_rel_grad_diff": diff, "decision": backward_precision.precision_for(case, ops._proxy_grads),
        "case": case.name(),
    }  # fmt: skip


def plot(path: Path, cells: list[dict], title: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for batch, marker in ((1, "o"), (4, "s")):
        row = [c for c in cells if c["batch"] == batch]
        ax.plot([c["keys"] for c in row], [c["seconds"]["fp32"] / c["seconds"]["native"] for c in row],
                marker=marker, label=f"batch {batch}")  # fmt: skip
    ax.axhline(backward_precision.FP32_MAX_RATIO, color="grey", lw=0.8, ls="--", label="fp32 chosen below")
    ax.set(xscale="log", xlabel="keys (= queries)", ylabel="fp32 / bf16 backward time")
    ax.legend()
    save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, nargs="+", default=[64, 128, 163, 192, 256, 384, 512, 1024, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    machine = machine_description()
    stem = args.out or RESULTS / f"attention_backward_{cpu_kind(machine)}"
    os.environ[backward_precision.PRECISION_ENV] = "auto"
    os.environ["RETMASK_CACHE"] = tempfile.mkdtemp(prefix="retmask-bwd-")  # decide afresh, not from a cache
    cells = [cell(b, n, args.repeats) for b in args.batches for n in args.keys]
    rows = [
        [str(c["batch"]), str(c["keys"]), f"{c['seconds']['native'] * 1e3:.2f} ms", f"{c['seconds']['fp32'] * 1e3:.2f} ms",
         f"{c['seconds']['fp32'] / c['seconds']['native']:.2f}x", f"{c['max_rel_grad_diff']:.1e}", c["decision"]]
        for c in cells
    ]  # fmt: skip
    title = f"bf16 attention backward on the CPU: bf16 vs fp32 ({cpu_label(machine)})"
    lines = [
        f"# {title}",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + ".",
        "",
        f"SDPA recompute + backward (`retmask.kernels.ops.recompute_grads`), {HEADS} / {KV_HEADS} heads, head dim "
        f"{HEAD_DIM}, causal, last row right-padded by a quarter. Median of {args.repeats} interleaved calls. "
        f"`auto` decides fp32 at <= {backward_precision.FP32_MAX_RATIO} of the bf16 time on its own proxy "
        f"(the same keys below {backward_precision.EXACT_KEYS}, rounded up to a multiple of "
        f"{backward_precision.KEYS_BUCKET} from there); from {backward_precision.MAX_KEYS} keys on it keeps bf16 "
        "without measuring. Separate measurements of one cell move by 10-15% on this machine.",
        "",
        markdown_table(
            ["batch", "keys", "bf16", "fp32", "fp32 / bf16", "grad Δ / scale", "auto decides"], rows
        ),
        "",
        f"![ratios]({stem.name}.png)",
        "",
    ]
    write_page(
        stem, lines, {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "cells": cells}
    )
    plot(stem.with_suffix(".png"), cells, title)


if __name__ == "__main__":
    main()
