"""Benchmark: the prefill chunk of `retmask detect` (``--chunk``): total prefill time of the NIAH grid per
chunk size.

The chunk is two things at once. It is the call size of the prefill (every call streams all the model's
weights once, so small calls pay that cost more often per token), and it is the granularity of KV-prefix
reuse (a test reuses the previous test's cache in whole chunks aligned to absolute positions, so that every
KV entry comes from the same call shapes whatever ran before, and recomputes the rest of the chunk in which
the prompts diverge). Smaller chunks compute fewer tokens, larger chunks compute tokens more cheaply; this
script measures where the sum is lowest.

Every chunk size has its own detector and cache and sees the tests in prefix order; the sizes run
interleaved test by test, and the order of the sizes alternates, so drift of the shared machine hits all
of them alike. Only the prefill is timed (decoding does not depend on the chunk).

Writes bench/results/detect_chunk_<cpu kind>.{md,json,png}.

    flock /tmp/retmask-heavy.lock python bench/bench_detect_chunk.py                  # 64,128,256,384,512
    python bench/bench_detect_chunk.py --lengths 1000,2000 --chunks 128,256 --out /tmp/dc   # quick look
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    add_niah_grid_args,
    cpu_kind,
    cpu_label,
    dtype_suffix,
    load_niah_grid,
    machine_description,
    markdown_table,
    save_figure,
)

from retmask.detect import FastDetector  # noqa: E402
from retmask.detect.answers import prefix_order  # noqa: E402
from retmask.runfiles import atomic_write_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_CHUNK = 256  # `retmask detect`'s default: the ratios are against it
HEADERS = ["chunk", "tokens computed", "calls", "prefill s", "ms / token"]
READING = """Reading: smaller chunks compute fewer tokens (less of the chunk in which two prompts diverge is
recomputed) but each token costs more, because every call streams all the model's weights once (at a
few dozen rows per call SmolLM2's linear layers run at about half their large-call speed on a 2-core
EPYC); larger chunks the reverse. Differences of a few percent between neighbouring sizes are within this shared machine's noise:
compare several runs before changing the default."""


def measure(model, tests, stops, chunks: list[int]) -> dict[int, dict[str, float]]:
    """Seconds and tokens computed per chunk size over ``tests`` (prefix order), interleaved per test."""
    detectors = {c: FastDetector(model, stops, chunk=c) for c in chunks}
    totals = {c: {"seconds": 0.0, "tokens": 0, "calls": 0} for c in chunks}
    for i, t in enumerate(prefix_order(tests)):
        prefix = np.asarray(t.prompt_ids[:-1], dtype=np.int64)
        for c in chunks if i % 2 == 0 else chunks[::-1]:
            start = time.perf_counter()
            computed = detectors[c]._prefill(prefix)
            totals[c]["seconds"] += time.perf_counter() - start
            totals[c]["tokens"] += computed
            kept = len(prefix) - computed  # a multiple of c: the calls start at kept and end at chunk ends
            totals[c]["calls"] += -(-len(prefix) // c) - kept // c
        print(f"test {i + 1}/{len(tests)}: " + ", ".join(f"{c}: {totals[c]['seconds']:.1f}s" for c in chunks),
              flush=True)  # fmt: skip
    return totals


def plot(totals: dict[int, dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunks = sorted(totals)
    labels = [str(c) for c in chunks]
    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(9, 3.6))
    ax_s.bar(labels, [totals[c]["seconds"] for c in chunks], color="tab:blue")
    ax_s.set_xlabel("chunk")
    ax_s.set_ylabel("prefill seconds, whole grid")
    ax_t.bar(
        labels, [1000 * totals[c]["seconds"] / max(totals[c]["tokens"], 1) for c in chunks], color="tab:green"
    )
    ax_t.set_xlabel("chunk")
    ax_t.set_ylabel("ms per computed token")
    for ax in (ax_s, ax_t):
        ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_niah_grid_args(ap)
    ap.add_argument("--chunks", default="64,128,256,384,512")
    ap.add_argument(
        "--out", default=None, help="output path without suffix (default: results/detect_chunk_<cpu>)"
    )
    ap.add_argument(
        "--report", action="store_true", help="only re-render the .md/.png of --out from its .json"
    )
    args = ap.parse_args()
    from retmask.hf.loading import resolve_dtype_name

    dtype = resolve_dtype_name(args.dtype)
    default_out = RESULTS / f"detect_chunk_{cpu_kind(machine_description())}{dtype_suffix(dtype)}"
    if args.report:
        report(Path(args.out) if args.out else default_out)
        return
    chunks = sorted({int(x) for x in args.chunks.split(",")})
    if chunks[0] < 1:
        ap.error(f"--chunks must be >= 1, got {chunks[0]}")
    torch.set_num_threads(2)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [int(x) for x in args.depths.split(",")]
    model, _, tests, stops = load_niah_grid(args.model, lengths, depths, args.needles, dtype)
    with torch.no_grad():  # untimed warm-up (thread pool, allocator, the fp32 linears' first measurements)
        for c in chunks:
            FastDetector(model, stops, chunk=c)._prefill(np.asarray(tests[0].prompt_ids[:-1], dtype=np.int64))
    totals = measure(model, tests, stops, chunks)

    machine = machine_description()
    out = Path(args.out) if args.out else default_out
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine, "model": args.model or "embedded SmolLM2-135M-Instruct", "dtype": dtype, "lengths": lengths,
            "depths": depths, "needles": args.needles, "tests": len(tests),
            "totals": {str(c): v for c, v in totals.items()}}  # fmt: skip
    atomic_write_text(out.with_suffix(".json"), json.dumps(data, indent=1))
    report(out)


def report(out: Path) -> None:
    """Write ``out``.md and .png from ``out``.json (``--report`` re-renders without measuring)."""
    data = json.loads(out.with_suffix(".json").read_text())
    machine = data["machine"]
    totals = {int(c): v for c, v in data["totals"].items()}
    chunks = sorted(totals)
    base = totals.get(DEFAULT_CHUNK) or totals[chunks[0]]
    fastest = min(chunks, key=lambda c: totals[c]["seconds"])
    rows = [
        [str(c) + (" (default)" if c == DEFAULT_CHUNK else ""), str(totals[c]["tokens"]), str(totals[c]["calls"]),
         f"{totals[c]['seconds']:.1f}", f"{1000 * totals[c]['seconds'] / max(totals[c]['tokens'], 1):.2f}",
         f"{totals[c]['seconds'] / base['seconds']:.3f}"]
        for c in chunks
    ]  # fmt: skip
    md = [
        f"# `retmask detect --chunk`: prefill time of the NIAH grid per chunk size ({cpu_label(machine)}, "
        f"SIMD {machine['simd']})",
        "",
        f"{data['model']}, {data.get('dtype', 'float32')}, {data['tests']} tests = lengths {data['lengths']} x depths {data['depths']} x "
        f"{data['needles']} needles, in prefix order; each chunk size has its own cache; sizes interleaved test "
        "by test (alternating order). Prefill only.",
        "",
        markdown_table(HEADERS + [f"time / chunk {DEFAULT_CHUNK}'s"], rows),
        "",
        f"Fastest here: chunk {fastest}. {READING}",
        "",
        f"Machine: {', '.join(f'{k} {v}' for k, v in machine.items())}.",
        "",
        f"![chunk sizes]({out.name}.png)",
    ]
    atomic_write_text(out.with_suffix(".md"), "\n".join(md) + "\n")
    plot(
        totals,
        out.with_suffix(".png"),
        f"{data['model']}: detection prefill per chunk ({cpu_label(machine)})",
    )
    print("\n".join(md))


if __name__ == "__main__":
    main()
