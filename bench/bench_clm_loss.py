"""MuDAF's CLM loss on the embedded SmolLM2: the LM head on the answer rows only, against full logits.

MuDAF trains on long multi-document prompts whose loss covers only the short answer. transformers'
causal-LM loss (``model(..., labels=labels).loss``) projects every position through the LM head: [S,
vocab] logits in fp32 and their gradient, 49K columns for SmolLM2. ``retmask.methods.mudaf.train.
clm_loss`` keeps only the hidden states whose next token is labelled (``logits_to_keep`` as a bool mask)
and gives the same loss and gradients (tested).

Methods (each cell in a fresh subprocess: median wall time of forward + backward of one example after a
warm-up call, peak RSS above the loaded model during the warm-up call):
  full_logits   model(input_ids, attention_mask, labels).loss, then backward.
  answer_rows   clm_loss(model, input_ids, attention_mask, labels), then backward (retmask's MuDAF).
  checkpointed  answer_rows with activation checkpointing (``mudaf-train --gradient-checkpointing``): each
                decoder layer runs again in the backward pass instead of keeping its activations.

One example of S tokens (random ids), the last 16 labelled (an answer and its EOS), batch 1, fp32 and
bf16 autocast (``--dtypes``), retmask attention.

    flock /tmp/retmask-heavy.lock python bench/bench_clm_loss.py                  # S = 512, 2048, 8192
    python bench/bench_clm_loss.py --lengths 256 --repeats 1 --out /tmp/clm       # smoke test

Writes bench/results/clm_loss_<cpu kind>.{md,json,png}.
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
METHODS = ("full_logits", "answer_rows", "checkpointed")
ANSWER_TOKENS = 16


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import retmask
    from retmask.hf.precision import training_autocast
    from retmask.methods.mudaf.train import clm_loss

    torch.manual_seed(0)
    model, _ = retmask.load_model()
    model.train()
    if cfg["method"] == "checkpointed":
        model.activation_checkpointing_enable()  # non-reentrant, as mudaf-train runs it
    S = cfg["length"]
    ids = torch.randint(100, model.config.vocab_size, (1, S))
    mask = torch.ones_like(ids)
    labels = torch.full_like(ids, -100)
    labels[:, -ANSWER_TOKENS:] = ids[:, -ANSWER_TOKENS:]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with training_autocast(cfg["dtype"], "cpu"):
            if cfg["method"] == "full_logits":
                loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            else:
                loss = clm_loss(model, ids, mask, labels)
        loss.backward()

    peak = common.PeakMemory()
    peak.start()
    step()
    peak_bytes = peak.stop()
    times = common.time_calls(step, cfg["repeats"], 0)
    return {"seconds": common.median(times), "all_seconds": times, "peak_bytes": peak_bytes}


def plot(path: Path, cells: dict[str, dict], lengths: list[int], dtypes: list[str], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for dtype, style in zip(dtypes, ("-", "--"), strict=False):
        for method, color in zip(METHODS, ("tab:gray", "tab:green", "tab:blue"), strict=True):
            xs = [s for s in lengths if "seconds" in cells.get(f"{dtype} {method} {s}", {})]
            for ax, key, scale in ((axes[0], "seconds", 1.0), (axes[1], "peak_bytes", 2**-30)):
                ys = [cells[f"{dtype} {method} {s}"][key] * scale for s in xs]
                ax.plot(xs, ys, style, color=color, marker="o", label=f"{method} {dtype}")
    for ax, ylabel in zip(
        axes, ("seconds per forward + backward", "peak memory above the model (GiB)"), strict=True
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in the example (last 16 labelled)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    common.save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,2048,8192", help="comma-separated example lengths (tokens)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="training precisions to run")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per cell after the warm-up step")
    ap.add_argument("--out", type=Path, default=None, help="page stem (default results/clm_loss_<cpu>)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    dtypes = args.dtypes.split(",")
    if args.repeats < 1 or any(s <= ANSWER_TOKENS for s in lengths):
        ap.error(f"--repeats must be >= 1 and every length > {ANSWER_TOKENS}")
    machine = common.machine_description()
    stem = args.out or RESULTS / f"clm_loss_{common.cpu_kind(machine)}"
    configs = {
        f"{dtype} {method} {s}": {"length": s, "method": method, "dtype": dtype, "repeats": args.repeats}
        for dtype in dtypes
        for s in lengths
        for method in METHODS
    }
    cells = common.run_cells(__file__, configs, timeout=3600)

    rows = []
    for dtype in dtypes:
        for s in lengths:
            full, ours, ckpt = (cells[f"{dtype} {m} {s}"] for m in METHODS)
            rows.append([dtype, str(s), *(common.time_and_peak(c) for c in (full, ours, ckpt)),
                         common.cell_ratio(ours, full, "seconds"), common.cell_ratio(ours, full, "peak_bytes"),
                         common.cell_ratio(ckpt, ours, "seconds"), common.cell_ratio(ckpt, ours, "peak_bytes")])  # fmt: skip
    headers = [
        "dtype",
        "tokens",
        "full_logits (time / peak)",
        "answer_rows (time / peak)",
        "checkpointed (time / peak)",
        "answer_rows / full_logits time",
        "memory",
        "checkpointed / answer_rows time",
        "memory",
    ]
    title = f"MuDAF CLM loss: LM head on the answer rows vs full logits, and activation checkpointing ({common.cpu_label(machine)})"
    lines = [
        f"# {title}",
        "",
        f"Embedded SmolLM2-135M-Instruct (49,152-token vocabulary), retmask attention, one example of S random "
        f"tokens with the last {ANSWER_TOKENS} labelled, batch 1; bf16 = autocast over fp32 weights. Each cell in "
        f"a fresh process: median of {args.repeats} timed forward + backward steps after a warm-up step, peak "
        "RSS above the loaded model during the warm-up. `full_logits`: transformers' `model(labels=...).loss`; "
        "`answer_rows`: `retmask.methods.mudaf.train.clm_loss` (what `retmask mudaf-train` computes); "
        "`checkpointed`: the same with activation checkpointing (`--gradient-checkpointing`: each decoder layer "
        "runs again in the backward pass instead of keeping its activations).",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + ".",
        "",
        common.markdown_table(headers, rows),
        "",
        f"![time and memory]({stem.name}.png)",
        "",
    ]
    plot(stem.with_suffix(".png"), cells, lengths, dtypes, title)
    common.write_page(stem, lines, {"machine": machine, "cells": cells})


if __name__ == "__main__":
    main()
