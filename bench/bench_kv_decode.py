"""Decode with a head-sparse KV cache: attention time per token and memory against the full cache.

Usage:  python bench/bench_kv_decode.py [--prompt 8000] [--steps 64] [--rounds 3] [--budgets 0.25,0.1] [--batch 1]
                                        [--window 256] [--sink-tokens 4] [--scores FILE] [--out DIR]

A head-sparse cache (``retmask.head_sparse_cache``) keeps every key only for the chosen KV heads and the
first S + last W keys for the others, so a decode step's attention reads fewer keys. This measures, on the
embedded SmolLM2-135M-Instruct (fp32, ``--batch`` rows of the same prompt, default 1), after a ``--prompt``-token
prefill of the shipped haystack:

- ``sdpa, full cache``: transformers' SDPA attention and ``DynamicCache``, what a user gets by default;
- ``retmask, full cache``: retmask attention and ``DynamicCache``, the baseline of every ratio;
- ``retmask, head-sparse B``: the KV heads with the best retrieval scores (``--scores``) whole, budget B
  (fraction of the KV heads), the others ``--sink-tokens`` + ``--window`` keys;
- ``retmask, streaming``: every KV head windowed (budget 0, StreamingLLM's cache).

Time: greedy decoding of ``--steps`` tokens after an untimed prefill, median of ``--rounds`` rounds in
A B B A order; ``attention ms`` is the time inside the attention function per token (a timing wrapper:
on a CPU that is its compute), the figure the sparse cache changes; ``kernel ms`` the part of it spent in
the fused kernel's C++ binding (retmask cases; what is left is host work in Python: checks, the choice of
path, the split of a layer's heads), so the page shows how low attention could go with no host cost at
all; ``ms / token`` is the whole step.
Memory: each case's generation (prefill + ``--steps`` tokens, ``model.generate``) once more in a fresh
process, its peak RSS above the loaded model (``bench/common.py``'s ``PeakMemory``; allocations above 128 KB
mmap-ed, so RSS follows live memory), and the bytes the cache holds at the end.
Writes bench/results/kv_decode_smollm2_<machine>[_batch<B>].{md,json,png} (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from retmask.commands.argtypes import positive_int
from retmask.evaluate.kv_budget import cache_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_step import timed_attention  # noqa: E402
from common import (  # noqa: E402
    PeakMemory,
    cell_ratio,
    cpu_kind,
    cpu_label,
    fmt_bytes,
    interleaved,
    machine_description,
    markdown_table,
    page_tail,
    run_worker,
    save_figure,
    timed_wrapper,
    write_page,
)

RESULTS = Path(__file__).resolve().parent / "results"
SCORES = RESULTS / "smollm2_scores_shipped-haystack.json"
BASELINE = "retmask, full cache"
MMAP_THRESHOLD = 128 * 1024  # bytes: glibc's MALLOC_MMAP_THRESHOLD_ in the memory workers


def case_names(budgets: list[float]) -> list[str]:
    return [
        "sdpa, full cache",
        BASELINE,
        *[f"retmask, head-sparse {b:g}" for b in budgets],
        "retmask, streaming",
    ]


def make_cache(model: Any, case: str, args: argparse.Namespace, max_length: int) -> Any:
    """A new cache for ``case``: ``DynamicCache`` for the full ones, else a head-sparse cache."""
    from transformers import DynamicCache

    import retmask

    if case.endswith("full cache"):
        return DynamicCache(config=model.config)
    common = {"window": args.window, "sink_tokens": args.sink_tokens, "max_length": max_length}
    if case == "retmask, streaming":
        return retmask.head_sparse_cache(model, full_heads=[], **common)
    budget = float(case.rsplit(" ", 1)[1])
    return retmask.head_sparse_cache(model, scores=str(args.scores), budget=budget, **common)


def implementation_of(case: str) -> str:
    return case.split(",", 1)[0]


def load(args: argparse.Namespace) -> tuple[Any, torch.Tensor]:
    """The embedded model and a ``[batch, prompt]`` prompt of haystack tokens (the same in every row)."""
    import retmask
    from retmask.hf.linears import decide_linears
    from retmask.niah import load_haystack
    from retmask.niah.haystack import haystack_token_ids

    model, tokenizer = retmask.load_model()
    decide_linears(model)  # measured here, not by whichever timed call first runs a new linear case
    ids = haystack_token_ids(tokenizer, load_haystack(None), args.prompt)[: args.prompt]
    return model, torch.tensor([ids] * args.batch, dtype=torch.long)


def json_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as JSON values (for the workers and the page's payload)."""
    return {**vars(args), "scores": str(args.scores), "out": str(args.out)}


@contextlib.contextmanager
def timed_kernel(spent: list[float]) -> Iterator[None]:
    """While active, the seconds inside the fused CPU kernel's binding (``retmask._C.attention_fwd``, every
    retmask attention call's compute) are appended to ``spent``, one entry per kernel call."""
    from retmask.kernels.cpu import backend

    library = backend._library()
    if library is None:
        raise SystemExit("retmask._C is not built: the kernel time cannot be measured")
    original = library.module.attention_fwd
    library.module.attention_fwd = timed_wrapper(original, spent)
    try:
        yield
    finally:
        library.module.attention_fwd = original


def decode_run(
    model: Any,
    case: str,
    prompt: torch.Tensor,
    args: argparse.Namespace,
    attention: list[float],
    kernel: list[float],
    held: dict[str, int],
) -> Callable[[], float]:
    """A callable that prefills (untimed), decodes ``args.steps`` greedy tokens and returns seconds per token;
    it appends the attention and kernel seconds per token to ``attention`` and ``kernel`` and sets
    ``held[case]`` to the cache's bytes."""

    implementation = implementation_of(case)

    def run() -> float:
        model.set_attn_implementation(implementation)
        cache = make_cache(model, case, args, prompt.shape[1] + args.steps)
        spent: list[float] = []
        in_kernel: list[float] = []
        with torch.no_grad():
            out = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            with timed_attention(model, implementation, spent), timed_kernel(in_kernel):
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    out = model(input_ids=token, cache=cache, use_cache=True)
                    token = out.logits[:, -1:].argmax(-1)
                seconds = time.perf_counter() - t0
        attention.append(sum(spent) / args.steps)
        kernel.append(sum(in_kernel) / args.steps)
        held[case] = cache_bytes(cache)
        print(f"  {case}: {seconds / args.steps * 1e3:.2f} ms/token", flush=True)
        return seconds / args.steps

    return run


def worker(config: dict[str, Any]) -> dict[str, Any]:
    """One generation of ``config["case"]`` in this fresh process: peak RSS above the loaded model."""
    from transformers import GenerationConfig

    args = argparse.Namespace(**config["args"])
    args.scores = Path(args.scores)
    model, prompt = load(args)
    case = config["case"]
    model.set_attn_implementation(implementation_of(case))
    generation = GenerationConfig(
        max_new_tokens=args.steps, min_new_tokens=args.steps, do_sample=False, use_cache=True,
        pad_token_id=0,
    )  # fmt: skip
    with torch.no_grad():  # first calls allocate once-per-process state (thread pools, packed weights)
        warm = prompt[:, :32]
        model.generate(
            input_ids=warm, attention_mask=torch.ones_like(warm), generation_config=generation,
            cache=make_cache(model, case, args, warm.shape[1] + args.steps),
        )  # fmt: skip
    peak = PeakMemory()
    peak.start()
    cache = make_cache(model, case, args, prompt.shape[1] + args.steps)
    with torch.no_grad():
        model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=generation,
            cache=cache,
        )  # fmt: skip
    return {"peak_bytes": peak.stop(), "exact": peak.exact, "held_bytes": cache_bytes(cache)}


def measure(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    model, prompt = load(args)
    cases = case_names(args.budgets)
    attention: dict[str, list[float]] = {case: [] for case in cases}
    kernel: dict[str, list[float]] = {case: [] for case in cases}
    held: dict[str, int] = {}
    runs = {
        case: decode_run(model, case, prompt, args, attention[case], kernel[case], held) for case in cases
    }
    times = interleaved(runs, args.rounds)
    del model
    # Workers allocate large blocks with mmap, so that freeing returns them and RSS follows the memory live
    # at each moment: glibc's heap otherwise keeps freed blocks, and peaks then varied by +-150 MB run to run.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    cells: dict[str, dict[str, Any]] = {}
    for case in cases:
        memory = run_worker(__file__, {"case": case, "args": json_args(args)})
        print(f"  {case}: peak {fmt_bytes(memory.get('peak_bytes'))}", memory.get("error", ""), flush=True)
        cells[case] = {
            "ms_per_token": statistics.median(times[case]) * 1e3,
            # the first entry is interleaved()'s untimed warm-up call
            "attention_ms": statistics.median(attention[case][1:]) * 1e3,
            "rounds_ms": [t * 1e3 for t in times[case]],
            "held_bytes": held[case],
            **{k: memory.get(k) for k in ("peak_bytes", "exact", "error") if k in memory},
        }
        if implementation_of(case) == "retmask":  # sdpa never enters the binding: no kernel time
            cells[case]["kernel_ms"] = statistics.median(kernel[case][1:]) * 1e3
    return cells


def page_lines(cells: dict[str, dict[str, Any]], title: str, args: argparse.Namespace) -> list[str]:
    base = cells[BASELINE]
    rows = [
        [
            case,
            fmt_bytes(c["held_bytes"]),
            cell_ratio(c, base, "held_bytes"),
            f"{c['attention_ms']:.2f}",
            cell_ratio(c, base, "attention_ms"),
            f"{c['kernel_ms']:.2f}" if "kernel_ms" in c else "-",
            cell_ratio(c, base, "kernel_ms"),
            f"{c['ms_per_token']:.2f}",
            cell_ratio(c, base, "ms_per_token"),
            fmt_bytes(c.get("peak_bytes")),
            cell_ratio(c, base, "peak_bytes"),
        ]  # fmt: skip
        for case, c in cells.items()
    ]
    headers = [
        "case", "KV held", "vs full", "attention ms / token", "vs full", "of which kernel ms", "vs full",
        "ms / token", "vs full",
        "peak memory of the generation", "vs full",
    ]  # fmt: skip
    return [
        f"# {title}",
        "",
        f"Prompt {args.prompt} tokens of the shipped haystack, then {args.steps} greedy tokens, batch {args.batch}, fp32; "
        f"windowed KV heads keep {args.sink_tokens} sink + {args.window} recent keys; head-sparse budgets rank "
        f"KV heads by `{args.scores.name}`. Times: median of {args.rounds} rounds (A B B A order); "
        "'vs full' is the ratio to retmask attention with the full cache in the same run. Kernel ms: the "
        "part of the attention time inside the fused kernel's C++ binding (the rest is host work). KV held: bytes the "
        "cache holds after the prefill and the decoded tokens. Peak memory: RSS above the loaded model during "
        "one `model.generate` of the same prompt and length, in a fresh process whose large allocations are "
        "mmap-ed (`MALLOC_MMAP_THRESHOLD_`), so that RSS follows the memory live at each moment.",
        "",
        markdown_table(headers, rows),
    ]


def plot(cells: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    names = list(cells)
    ys = range(len(names))
    left.barh(ys, [cells[n]["ms_per_token"] for n in names], color="#bbbbbb", label="whole step")
    left.barh(ys, [cells[n]["attention_ms"] for n in names], color="#1f77b4", label="attention")
    kernel = [cells[n].get("kernel_ms", 0.0) for n in names]
    left.barh(ys, kernel, color="#0b3d66", height=0.4, label="of which in the fused kernel")
    left.set_yticks(list(ys), names, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("ms per generated token")
    left.legend(fontsize=8)
    right.barh(ys, [cells[n]["held_bytes"] / 2**20 for n in names], color="#2ca02c", label="KV held")
    peaks = [(cells[n].get("peak_bytes") or 0) / 2**20 for n in names]
    right.scatter(peaks, list(ys), color="black", marker="|", s=200, label="peak of the generation")
    right.set_yticks(list(ys), [])
    right.invert_yaxis()
    right.set_xlabel("MiB")
    right.legend(fontsize=8)
    save_figure(fig, path, title)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        import json

        print(json.dumps(worker(json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=positive_int, default=8000, help="prompt tokens (default: 8000)")
    ap.add_argument("--steps", type=positive_int, default=64, help="decoded tokens (default: 64)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="timed rounds per case (default: 3)")
    ap.add_argument("--batch", type=positive_int, default=1, help="rows decoded together (default: 1)")
    ap.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.1],
                    help="head-sparse budgets, comma-separated (default: 0.25,0.1)")  # fmt: skip
    ap.add_argument("--window", type=positive_int, default=256, help="recent keys (default: 256)")
    ap.add_argument("--sink-tokens", type=int, default=4, help="sink keys (default: 4)")
    ap.add_argument("--scores", type=Path, default=SCORES, help=f"retrieval scores (default: {SCORES.name})")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder of the page (default: bench/results)")
    args = ap.parse_args()
    machine = machine_description()
    stem = (
        args.out / f"kv_decode_smollm2_{cpu_kind(machine)}{f'_batch{args.batch}' if args.batch > 1 else ''}"
    )
    title = f"Decode with a head-sparse KV cache (SmolLM2-135M-Instruct, fp32, {cpu_label(machine)})"
    cells = measure(args)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(cells, stem.with_suffix(".png"), title)
    payload = {"machine": machine, "args": json_args(args), "cells": cells}
    write_page(stem, page_lines(cells, title, args) + page_tail(stem, machine), payload)


if __name__ == "__main__":
    main()
