"""A/B of two builds of the fused C++ CPU kernel: the one installed now against a saved copy.

For a kernel change: copy the built ``retmask/_C*.so`` away first, change and rebuild, then run

    cp retmask/_C*.so /tmp/old_C.so            # before the change
    python setup.py build_ext --inplace        # after it
    flock /tmp/retmask-heavy.lock python bench/bench_kernel_ab.py --baseline /tmp/old_C.so --tag <name>

Both builds run the same inputs interleaved (A B A B ..., so drift of a shared machine hits both), on the
attention shapes of detection and generation: full-prefill argmax (2K and 8K keys), a 256-row prefill
chunk, a 1-row decode step (on the same K/V each call, and streamed: one call per layer over K/V sets
too large to stay in cache, as in a model; also with every odd query head skipped, as a
masked model decodes) and a 9-row verification pass, for SmolLM2-135M (9 query / 3
KV heads, D 64) and Llama-3.1-8B (32 / 8, D 128), and the decode cases for Gemma-3-270M (4 / 1, D 256);
B = 1; fp32 unless ``--dtype``, the fused fp32 FMA micro-kernels unless ``--path bf16dot`` (bfloat16: both
block products as bf16 dot products). Outputs and argmaxes must be bit-identical between the builds unless
the change is meant to alter arithmetic (reported per shape). Writes
bench/results/kernel_ab_<tag>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, markdown_table  # noqa: E402

from retmask.kernels.cpu import backend as cpu  # noqa: E402
from retmask.plotting import save_figure as save_png  # noqa: E402
from retmask.runfiles import atomic_write_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HEADS = {"SmolLM2": (9, 3, 64), "Llama-3.1-8B": (32, 8, 128), "Gemma-3-270M": (4, 1, 256)}
# Gemma 3's single KV head matters for decode (one work item per call unless the keys are split); its
# prefill tiles are the other shapes' story, so only its decode cases run.
DECODE_ONLY = {"Gemma-3-270M"}
# (name, M query rows, N keys, argmax rows, streamed, odd query heads skipped)
CASES = [
    ("prefill argmax all", 2048, 2048, 2048, False, False),
    ("prefill argmax all 8K", 8192, 8192, 8192, False, False),  # 256 tile rows per item (default_block_m)
    ("prefill chunk", 256, 4096, 0, False, False),
    ("decode step", 1, 5000, 1, False, False),
    ("decode step 1K, streamed", 1, 1024, 1, True, False),
    ("decode step 1K, streamed, odd heads skipped", 1, 1024, 1, True, True),
    ("decode step 16K, streamed", 1, 16384, 1, True, False),
    ("decode step 16K, streamed, odd heads skipped", 1, 16384, 1, True, True),
    ("verify 9 rows", 9, 5000, 9, False, False),
]
# Streamed cases time one call per "layer" over enough distinct K/V sets that they cannot stay in the CPU's
# caches (256 MiB in all, at most 30 sets, as many layers as a small model has): a model's decode reads
# each layer's cache from memory, while repeating one call on the same K/V reads it from cache.
STREAM_BYTES = 256 << 20


def odd_heads(hq: int) -> torch.Tensor:
    """skip_heads: bool [1, Hq], True for every odd query head (as the decode-step benchmark masks): every
    KV group of these models keeps an active head, so all its keys and values are still read."""
    return (torch.arange(hq) % 2 == 1).unsqueeze(0)


def run_case(
    lib: cpu.KernelLibrary,
    sets: list[tuple[torch.Tensor, ...]],
    argmax_rows: int,
    path: str = "cpp",
    skip_heads: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """One call per (q, k, v) of ``sets`` with build ``lib`` -> (the last call's out and argmax, seconds per
    call)."""
    cpu._library = lambda: lib  # cpp_forward() looks the library up on every call
    t0 = time.perf_counter()
    for q, k, v in sets:
        out, idx = cpu.cpp_forward(
            q, k, v, causal=True, sm_scale=q.shape[-1] ** -0.5, key_padding_mask=None, skip_heads=skip_heads,
            argmax_rows=argmax_rows, bf16_dot=path == "bf16dot",
        )  # fmt: skip
    return out, idx, (time.perf_counter() - t0) / len(sets)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="path of the other build's retmask/_C*.so")
    ap.add_argument("--tag", default="ab")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per build and case (after 1 warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--path", default="cpp", choices=["cpp", "bf16dot"], help="kernel layout to time (bf16dot: bfloat16)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--only", default="", help="run only cases whose '<model> <case>' contains this text")
    args = ap.parse_args()
    if args.path == "bf16dot" and args.dtype != "bfloat16":
        ap.error("--path bf16dot needs --dtype bfloat16")
    torch.set_num_threads(args.threads)
    new = cpu._library()
    if new is None:
        raise SystemExit("retmask._C is not built; run `python setup.py build_ext --inplace` first")
    old = cpu.load_library(args.baseline)

    rows, records = [], []
    gen = torch.Generator().manual_seed(0)
    for model, (hq, hkv, d) in HEADS.items():
        for name, m, n, t, streamed, skip_odd in CASES:
            if args.only not in f"{model} {name}" or (model in DECODE_ONLY and m != 1):
                continue
            dtype = getattr(torch, args.dtype)
            kv_bytes = 2 * hkv * n * d * dtype.itemsize
            n_sets = min(30, -(-STREAM_BYTES // kv_bytes)) if streamed else 1
            sets = [
                tuple(
                    torch.randn(1, h, rows, d, generator=gen).to(dtype)
                    for h, rows in ((hq, m), (hkv, n), (hkv, n))
                )
                for _ in range(n_sets)
            ]
            skip = odd_heads(hq) if skip_odd else None
            times: dict[str, list[float]] = {"baseline": [], "new": []}
            results = {}
            for rep in range(args.repeats + 1):
                for side, lib in (
                    (("baseline", old), ("new", new)) if rep % 2 else (("new", new), ("baseline", old))
                ):
                    out, idx, dt = run_case(lib, sets, t, args.path, skip)
                    results[side] = (out, idx)
                    if rep:  # the first round is the warm-up
                        times[side].append(dt)
            same = torch.equal(results["new"][0], results["baseline"][0]) and (
                t == 0 or torch.equal(results["new"][1], results["baseline"][1])
            )
            b, c = statistics.median(times["baseline"]), statistics.median(times["new"])
            records.append({"model": model, "case": name, "M": m, "N": n, "argmax_rows": t,
                            "baseline_s": b, "new_s": c, "ratio": c / b, "bit_identical": same})  # fmt: skip
            rows.append(
                [model, name, f"{m}x{n}", f"{b * 1e3:.2f}", f"{c * 1e3:.2f}", f"{c / b:.3f}", str(same)]
            )
            print(" | ".join(rows[-1]), flush=True)

    RESULTS.mkdir(parents=True, exist_ok=True)
    machine = machine_description()
    table = markdown_table(
        ["model", "case", "M x N", "baseline ms", "new ms", "new / baseline", "bit-identical"], rows
    )
    md = [
        f"# C++ kernel A/B: {args.tag}",
        "",
        f"Machine: {machine.get('cpu', '')} (SIMD {machine.get('simd', '?')}, native bf16: "
        f"{machine.get('native bf16', '?')}; new build runs {machine.get('kernel build', '?')}), "
        f"{args.threads} threads, torch {machine.get('torch', '')}. "
        f"Median of {args.repeats} interleaved calls per build; path {args.path}, {args.dtype}, B = 1, causal.",
        "",
        table,
    ]
    atomic_write_text(RESULTS / f"kernel_ab_{args.tag}.md", "\n".join(md) + "\n")
    atomic_write_text(
        RESULTS / f"kernel_ab_{args.tag}.json", json.dumps({"machine": machine, "cases": records}, indent=1)
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    labels = [f"{r['model']}\n{r['case']}" for r in records]
    ax.bar(range(len(records)), [r["ratio"] for r in records], color="#1f77b4")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(records)), labels, fontsize=6, rotation=30, ha="right")
    ax.set_ylabel("new / baseline time")
    ax.set_title(f"C++ kernel A/B: {args.tag}", fontsize=9)
    fig.tight_layout()
    save_png(fig, RESULTS / f"kernel_ab_{args.tag}.png", dpi=110)
    print("\n".join(md))


if __name__ == "__main__":
    main()
