"""Padding-free (packed) training batches on the embedded SmolLM2: retmask attention packed against padded,
and against the attention implementations a user would otherwise pack with.

A batch of sequences of different lengths either goes in padded to the longest (``attention_mask``), or
packed end to end in one row with ``position_ids`` restarting at 0 (what ``DataCollatorWithFlattening``
and TRL's ``padding_free=True`` produce). Packed, the linears (most of a step) see only real tokens;
retmask attention runs each sequence as a row of its own (padded inside the attention only), SDPA and
eager take the block-diagonal mask transformers builds, [1, 1, T, T] for T packed tokens.

Methods (each cell in a fresh subprocess: median wall time of forward + backward of the CLM loss over
every token after a warm-up step, peak RSS above the loaded model during the warm-up):
  padded_retmask  the padded batch on retmask attention (what ``retmask train`` does).
  packed_retmask  the packed row on retmask attention.
  packed_sdpa     the packed row on PyTorch SDPA.
  packed_eager    the packed row on eager attention (only where its T x T weights per head fit).

Batches: ``--batches`` names "count x min-max", sequence lengths drawn uniformly between min and max
tokens (seeded: the same batch in every cell). The loss of each cell is printed too: padded and packed
take the same tokens, so they agree to float rounding.

    flock /tmp/retmask-heavy.lock python bench/bench_packed.py
    python bench/bench_packed.py --batches 4x16-64 --repeats 1 --out /tmp/packed     # smoke test

Writes bench/results/packed_<cpu kind>.{md,json,png}.
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
METHODS = ("padded_retmask", "packed_retmask", "packed_sdpa", "packed_eager")
EAGER_LIMIT_BYTES = 4 * 2**30  # eager keeps T x T weights per head and layer for the backward: skip beyond


def parse_batch(spec: str) -> tuple[int, int, int]:
    """'8x64-1024' -> (8, 64, 1024)."""
    count, lengths = spec.split("x")
    low, high = lengths.split("-")
    return int(count), int(low), int(high)


def sequence_lengths(spec: str) -> list[int]:
    import random

    count, low, high = parse_batch(spec)
    rng = random.Random(spec)
    return [rng.randint(low, high) for _ in range(count)]


def eager_bytes(total: int, heads: int = 9, layers: int = 30) -> int:
    """What eager attention keeps for the backward of a packed row: fp32 weights [heads, T, T] per layer."""
    return 4 * heads * total * total * layers


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import retmask

    torch.manual_seed(0)
    model, _ = retmask.load_model()
    method = cfg["method"]
    model.set_attn_implementation(method.split("_")[1])
    model.train()
    lengths = sequence_lengths(cfg["batch"])
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(100, model.config.vocab_size, (n,), generator=gen) for n in lengths]
    if method.startswith("padded"):
        longest = max(lengths)
        ids = torch.zeros(len(lengths), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(sequences):
            ids[row, : seq.numel()], mask[row, : seq.numel()] = seq, 1
        labels = ids.masked_fill(mask == 0, -100)
        inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    else:
        ids = torch.cat(sequences)[None]
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = ids.clone()
        labels[0, torch.tensor(lengths).cumsum(0)[:-1]] = -100  # no sequence predicts the next one's start
        inputs = dict(input_ids=ids, position_ids=positions, labels=labels)
    losses = []

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss = model(**inputs, use_cache=False).loss
        loss.backward()
        losses.append(float(loss))

    peak = common.PeakMemory()
    peak.start()
    step()
    peak_bytes = peak.stop()
    times = common.time_calls(step, cfg["repeats"], 0)
    return {
        "seconds": common.median(times),
        "all_seconds": times,
        "peak_bytes": peak_bytes,
        "loss": losses[0],
    }


def plot(path: Path, cells: dict[str, dict], batches: list[str], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(METHODS)
    for i, method in enumerate(METHODS):
        for ax, key, scale in ((axes[0], "seconds", 1.0), (axes[1], "peak_bytes", 2**-30)):
            xs = [b + i * width for b, spec in enumerate(batches) if key in cells[f"{method} {spec}"]]
            ys = [
                cells[f"{method} {spec}"][key] * scale for spec in batches if key in cells[f"{method} {spec}"]
            ]
            ax.bar(xs, ys, width, label=method)
    for ax, ylabel in zip(
        axes, ("seconds per forward + backward", "peak memory above the model (GiB)"), strict=True
    ):
        ax.set_xticks([b + 0.4 - width / 2 for b in range(len(batches))], batches)
        ax.set_xlabel("batch: sequences x length range (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    common.save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--batches", default="8x32-256,8x128-1024", help="comma-separated 'count x min-max' batches"
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per cell after the warm-up step")
    ap.add_argument("--out", type=Path, default=None, help="page stem (default results/packed_<cpu>)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    batches = args.batches.split(",")
    for spec in batches:
        try:
            count, low, high = parse_batch(spec)
        except ValueError:
            ap.error(f"--batches: {spec!r} is not 'count x min-max' (e.g. 8x32-256)")
        if not 1 <= low <= high or count < 1:
            ap.error(f"--batches: {spec!r} needs count >= 1 and 1 <= min <= max")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    machine = common.machine_description()
    stem = args.out or RESULTS / f"packed_{common.cpu_kind(machine)}"
    configs, skipped = {}, {}
    for spec in batches:
        total = sum(sequence_lengths(spec))
        for method in METHODS:
            if method == "packed_eager" and eager_bytes(total) > EAGER_LIMIT_BYTES:
                skipped[f"{method} {spec}"] = {
                    "error": f"not run: needs ~{common.fmt_bytes(eager_bytes(total))}"
                }
                continue
            configs[f"{method} {spec}"] = {"batch": spec, "method": method, "repeats": args.repeats}
    cells = {**common.run_cells(__file__, configs, timeout=3600), **skipped}

    rows = []
    for spec in batches:
        lengths = sequence_lengths(spec)
        padded, packed, sdpa, eager = (cells[f"{m} {spec}"] for m in METHODS)
        loss_gap = abs(padded["loss"] - packed["loss"]) if "loss" in padded and "loss" in packed else None
        rows.append([
            spec, f"{sum(lengths)} / {len(lengths) * max(lengths)}",
            *(common.time_and_peak(c) if "seconds" in c else c.get("error", "-") for c in (padded, packed, sdpa, eager)),
            common.cell_ratio(packed, padded, "seconds"), common.cell_ratio(packed, padded, "peak_bytes"),
            common.cell_ratio(packed, sdpa, "seconds"), common.cell_ratio(packed, sdpa, "peak_bytes"),
            "-" if loss_gap is None else f"{loss_gap:.1e}",
        ])  # fmt: skip
    headers = [
        "batch",
        "tokens packed / padded",
        "padded_retmask (time / peak)",
        "packed_retmask",
        "packed_sdpa",
        "packed_eager",
        "packed / padded time",
        "memory",
        "packed retmask / sdpa time",
        "memory",
        "loss packed - padded",
    ]
    title = f"Packed (padding-free) training batches, SmolLM2 ({common.cpu_label(machine)})"
    lines = [
        f"# {title}",
        "",
        "Embedded SmolLM2-135M-Instruct in fp32, one forward + backward of the CLM loss over every token of a "
        "batch of sequences of random lengths (uniform in the batch's range, random ids). `padded`: right-padded "
        "to the longest with an attention_mask; `packed`: one row with position_ids restarting at 0 per "
        f"sequence. Each cell in a fresh process: median of {args.repeats} timed steps after a warm-up step, peak "
        "RSS above the loaded model during the warm-up. Eager is run only where its saved attention weights "
        f"(fp32, 9 heads x T x T x 30 layers) stay under {common.fmt_bytes(EAGER_LIMIT_BYTES)}.",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + ".",
        "",
        common.markdown_table(headers, rows),
        "",
        f"![time and memory]({stem.name}.png)",
        "",
    ]
    plot(stem.with_suffix(".png"), cells, batches, title)
    common.write_page(stem, lines, {"machine": machine, "cells": cells})


if __name__ == "__main__":
    main()
