"""Benchmark: the attention backward on the CPU, the C++ kernel (``retmask.kernels.cpu.backward``, what
eager CPU calls take by the rule of ``retmask.kernels.paths``) against PyTorch SDPA's backward (the
recompute ``ops._sdpa_grads``: in the inputs' dtype, and for bf16 also on fp32 copies rounded back, the
paths of traced calls).

SmolLM2's attention shape (9 query heads, 3 kv heads, head dim 64) at batch 1 and 4, Llama-3.1-8B's
(32 / 8, head dim 128) at batch 1, and Gemma-3-270M's sliding-window layers (4 / 1, head dim 256, a window
of 512 keys; against the query-chunked recompute) at batch 1; causal, square (training), the last batch row right-padded by a
quarter; fp32 and bf16. All candidates interleaved in one process, median of ``--repeats`` calls; the
gradients' largest difference from SDPA's fp32 ones, relative to their scale.

Writes bench/results/attention_backward_<cpu kind>.{md,json,png}.

    flock /tmp/retmask-heavy.lock python bench/bench_attention_backward.py
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
    interleaved,
    machine_description,
    markdown_table,
    save_figure,
    write_page,
)

from retmask.kernels import ops  # noqa: E402
from retmask.kernels.chunked import chunked_grads  # noqa: E402
from retmask.kernels.cpu import backend as cpu  # noqa: E402
from retmask.kernels.cpu import backward as cpu_backward  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"SmolLM2": (9, 3, 64), "Llama-3.1-8B": (32, 8, 128), "Gemma-3-270M": (4, 1, 256)}
GEMMA_WINDOW = 512  # Gemma-3's sliding-window layers (5 of every 6)


def grads_by(choice: str, call: dict) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of ``call`` by ``choice``: the C++ backward ("kernel"), or a recompute: the query-row
    chunks with a window (which SDPA cannot express without an [M, N] mask), else SDPA in the dtype
    ("native") or on fp32 copies ("fp32")."""
    kwargs = {name: call[name] for name in ("causal", "sm_scale", "key_padding_mask")}
    args, window = (call["grad_out"], call["q"], call["k"], call["v"]), call["window"]
    if choice == "kernel":
        return cpu_backward.backward(*args, skip_heads=None, window=window, **kwargs)
    if window is not None:
        grads = chunked_grads(*args, skip_heads=None, window=window, softcap=None, sinks=None, **kwargs)
        return grads[:3]
    return ops._sdpa_grads(*args, skip_heads=None, fp32=choice == "fp32", **kwargs)


def cell(
    model: str, dtype: torch.dtype, batch: int, keys: int, repeats: int, window: int | None = None
) -> dict:
    heads, kv_heads, head_dim = SHAPES[model]
    gen = torch.Generator().manual_seed(keys + batch)
    q = torch.randn(batch, heads, keys, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, keys, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, keys, head_dim, generator=gen).to(dtype)
    grad_out = torch.randn(q.shape, generator=gen).to(dtype)
    mask = torch.ones(batch, keys, dtype=torch.bool)
    mask[-1, keys - keys // 4 :] = False
    call = {"grad_out": grad_out, "q": q, "k": k, "v": v, "causal": True, "key_padding_mask": mask,
            "sm_scale": head_dim**-0.5, "window": window}  # fmt: skip
    results = {}

    def timed(choice: str) -> float:
        start = time.perf_counter()
        results[choice] = grads_by(choice, call)
        return time.perf_counter() - start

    names = ["kernel", "native"] + (["fp32"] if dtype != torch.float32 and window is None else [])
    times = interleaved({name: (lambda name=name: timed(name)) for name in names}, repeats)
    exact = results.get("fp32", results["native"])
    diff = {
        name: max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                  for a, b in zip(results[name], exact, strict=True))
        for name in names if results[name] is not exact
    }  # fmt: skip
    seconds = {name: statistics.median(t) for name, t in times.items()}
    return {
        "model": model + (f" window {window}" if window else ""), "dtype": str(dtype).removeprefix("torch."),
        "batch": batch, "keys": keys,
        "seconds": seconds, "kernel_over_best_sdpa": seconds["kernel"] / min(seconds[n] for n in names[1:]),
        "max_rel_grad_diff_vs_sdpa_fp32": diff,
    }  # fmt: skip


def plot(path: Path, cells: list[dict], title: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    series = sorted({(c["model"], c["batch"], c["dtype"]) for c in cells})
    for model, batch, dtype in series:
        row = [c for c in cells if (c["model"], c["batch"], c["dtype"]) == (model, batch, dtype)]
        ax.plot([c["keys"] for c in row], [c["kernel_over_best_sdpa"] for c in row],
                marker="o" if dtype == "float32" else "s", ls="-" if batch == 1 else "--",
                label=f"{model} B{batch} {dtype}")  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set(
        xscale="log", xlabel="keys (= queries)", ylabel="kernel / fastest SDPA backward time", ylim=(0, None)
    )
    ax.legend(fontsize=7)
    save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, nargs="+", default=[64, 163, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--llama-keys", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--gemma-keys", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--batch4-max-keys", type=int, default=2048, help="batch 4 only up to this many keys")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not cpu.cpp_available():
        raise SystemExit("retmask._C is not built: build it (pip install --no-build-isolation -e .)")
    machine = machine_description()
    stem = args.out or RESULTS / f"attention_backward_{cpu_kind(machine)}"
    plan = [("SmolLM2", b, n) for b in (1, 4) for n in args.keys if b == 1 or n <= args.batch4_max_keys]
    plan += [("Llama-3.1-8B", 1, n) for n in args.llama_keys]
    plan += [("Gemma-3-270M", 1, n) for n in args.gemma_keys]
    cells = []
    for model, batch, keys in plan:
        window = GEMMA_WINDOW if model.startswith("Gemma") else None
        for dtype in (torch.float32, torch.bfloat16):
            cells.append(cell(model, dtype, batch, keys, args.repeats, window))
            print(cells[-1], flush=True)

    def ms(c: dict, name: str) -> str:
        return f"{c['seconds'][name] * 1e3:.2f} ms" if name in c["seconds"] else "-"

    rows = [
        [c["model"], c["dtype"], str(c["batch"]), str(c["keys"]), ms(c, "native"), ms(c, "fp32"), ms(c, "kernel"),
         f"{c['kernel_over_best_sdpa']:.2f}x", f"{c['max_rel_grad_diff_vs_sdpa_fp32']['kernel']:.1e}"]
        for c in cells
    ]  # fmt: skip
    title = f"Attention backward on the CPU: C++ kernel vs SDPA ({cpu_label(machine)})"
    lines = [
        f"# {title}",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + ".",
        "",
        "Gradients of q, k, v for a given output gradient; causal, square, the last batch row right-padded by a "
        "quarter. `SDPA` = recompute + backward through `torch.nn.functional.scaled_dot_product_attention` in "
        "the inputs' dtype (with Gemma-3's sliding window of 512 keys, which SDPA cannot express without an [M, N] "
        "mask: the query-chunked recompute of `retmask.kernels.chunked`), `SDPA fp32` = the same on fp32 copies, "
        "rounded back (bf16 only), `kernel` = "
        f"`retmask.kernels.cpu.backward` (fp32 inside, rounded once). Median of {args.repeats} interleaved calls. "
        "`kernel / best` = the kernel's time over the faster SDPA variant's. `Δ` = the kernel's largest gradient "
        "difference from SDPA fp32's (fp32 and windows: the recompute's in the dtype), relative to the gradient's "
        "scale. Eager CPU calls take the kernel (`retmask/kernels/paths.py`); traced bf16 calls SDPA fp32. "
        "Separate measurements of one cell move by 10-15% on this machine.",
        "",
        markdown_table(
            ["model", "dtype", "batch", "keys", "SDPA", "SDPA fp32", "kernel", "kernel / best", "Δ"],
            rows,
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
