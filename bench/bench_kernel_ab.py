"""A/B of two builds of the fused C++ CPU kernel: the one installed now against a saved copy.

For a kernel change: copy the built ``retmask/_C*.so`` away first, change and rebuild, then run

    cp retmask/_C*.so /tmp/old_C.so            # before the change
    python setup.py build_ext --inplace        # after it
    flock /tmp/retmask-heavy.lock python bench/bench_kernel_ab.py --baseline /tmp/old_C.so --tag <name>

Both builds run the same inputs interleaved (A B A B ..., so drift of a shared machine hits both), on the
attention shapes of detection and generation: full-prefill argmax (2K and 8K keys), a 256-row prefill
chunk, a 1-row decode step and a 9-row verification pass, for SmolLM2-135M (9 query / 3 KV heads, D 64)
and Llama-3.1-8B (32 / 8, D 128), B = 1; fp32 unless ``--dtype``, the fused micro-kernels unless ``--path``
(``gemm`` / ``gemm_fp32``: the same kernel with its block products on torch's block GEMM). Outputs and argmaxes must be bit-identical between the builds unless the
change is meant to alter arithmetic (reported per shape). Writes bench/results/kernel_ab_<tag>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, markdown_table  # noqa: E402

from retmask.kernels import cpu  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HEADS = {"SmolLM2": (9, 3, 64), "Llama-3.1-8B": (32, 8, 128)}
# (name, M query rows, N keys, argmax rows)
CASES = [
    ("prefill argmax all", 2048, 2048, 2048),
    ("prefill argmax all 8K", 8192, 8192, 8192),  # 256 tile rows per item (default_block_m at 8K)
    ("prefill chunk", 256, 4096, 0),
    ("decode step", 1, 5000, 1),
    ("verify 9 rows", 9, 5000, 9),
]


def run_case(
    lib: ctypes.CDLL, q, k, v, argmax_rows: int, path: str = "cpp"
) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    cpu._library = lambda: lib  # forward() looks the library up on every call
    t0 = time.perf_counter()
    out, idx = cpu.cpp_forward(
        q, k, v, causal=True, sm_scale=q.shape[-1] ** -0.5, key_padding_mask=None, skip_heads=None,
        argmax_rows=argmax_rows, gemm=path != "cpp", gemm_fp32=path == "gemm_fp32",
    )  # fmt: skip
    return out, idx, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="path of the other build's retmask/_C*.so")
    ap.add_argument("--tag", default="ab")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per build and case (after 1 warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--path", default="cpp", choices=["cpp", "gemm", "gemm_fp32"], help="kernel layout to time"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--only", default="", help="run only cases whose '<model> <case>' contains this text")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    new = cpu._library()
    if new is None:
        raise SystemExit("retmask._C is not built; run `python setup.py build_ext --inplace` first")
    old = cpu.bind_library(ctypes.CDLL(args.baseline))

    rows, records = [], []
    gen = torch.Generator().manual_seed(0)
    for model, (hq, hkv, d) in HEADS.items():
        for name, m, n, t in CASES:
            if args.only not in f"{model} {name}":
                continue
            dtype = getattr(torch, args.dtype)
            q = torch.randn(1, hq, m, d, generator=gen).to(dtype)
            k = torch.randn(1, hkv, n, d, generator=gen).to(dtype)
            v = torch.randn(1, hkv, n, d, generator=gen).to(dtype)
            times: dict[str, list[float]] = {"baseline": [], "new": []}
            results = {}
            for rep in range(args.repeats + 1):
                for side, lib in (
                    (("baseline", old), ("new", new)) if rep % 2 else (("new", new), ("baseline", old))
                ):
                    out, idx, dt = run_case(lib, q, k, v, t, args.path)
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
    (RESULTS / f"kernel_ab_{args.tag}.md").write_text("\n".join(md) + "\n")
    (RESULTS / f"kernel_ab_{args.tag}.json").write_text(
        json.dumps({"machine": machine, "cases": records}, indent=1)
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
    fig.savefig(RESULTS / f"kernel_ab_{args.tag}.png", dpi=110)
    print("\n".join(md))


if __name__ == "__main__":
    main()
