"""Time the Triton backend against torch SDPA and eager attention on a CUDA GPU.

Usage:  python bench/bench_triton.py [--model smollm2|llama] [--dtype bf16|fp16|fp32]
                                     [--lengths 1024 4096 8192 ...] [--argmax-rows 50]

Prefill (causal, M = N, batch 1) and decode (M = 1) for each length; the Triton backend with and
without argmax (last ``--argmax-rows`` rows, the teacher-forcing case, and all rows), with half of the
query heads skipped (both grid modes), SDPA (no argmax: the floor to approach) and eager softmax(QK^T)V + argmax (what
``output_attentions=True`` costs today; skipped where its [Hq, N, N] fp32 logits would not fit).
Prints a table and writes bench/results/attention_triton.md and attention_triton.png.
Without a CUDA GPU it exits with a message and measures nothing (the interpreter is no benchmark).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

MODELS = {"smollm2": (9, 3, 64), "llama": (32, 8, 128)}  # (Hq, Hkv, D)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
RESULTS = Path(__file__).resolve().parent / "results"


def _eager(q, k, v, argmax_rows):
    """Materialised attention + argmax, as transformers' eager path with output_attentions."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    m, n = q.shape[2], k.shape[2]
    logits = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    rows = torch.arange(m, device=q.device)[:, None] + (n - m)  # absolute position of each query row
    logits.masked_fill_(torch.arange(n, device=q.device)[None, :] > rows, float("-inf"))
    out = torch.softmax(logits, -1).to(q.dtype) @ v
    return out, logits[:, :, -argmax_rows:].argmax(-1)


def _sdpa(q, k, v):
    causal = q.shape[2] > 1
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _eager_fits(hq: int, m: int, n: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return 3 * hq * m * n * 4 < 0.8 * free  # logits, probabilities, a temporary


def _bench_shape(attention, hq, hkv, d, m, n, dtype, argmax_rows, skip_half):
    """Yield (method, median ms) for one (M, N) shape at batch 1."""
    import triton.testing

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n)
    q = torch.randn(1, hq, m, d, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(1, hkv, n, d, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(1, hkv, n, d, device=dev, dtype=dtype, generator=gen)
    t_rows = min(argmax_rows, m)
    cases = {
        "triton": lambda: attention(q, k, v, backend="triton"),
        f"triton+argmax(last {t_rows})": lambda: attention(
            q, k, v, backend="triton", return_argmax=True, argmax_rows=t_rows
        ),
        "triton+argmax(all)": lambda: attention(q, k, v, backend="triton", return_argmax=True),
        "triton, half heads skipped": lambda: attention(q, k, v, backend="triton", skip_heads=skip_half),
        "sdpa": lambda: _sdpa(q, k, v),
    }

    def sync_free_skip():
        os.environ["RETMASK_TRITON_SYNC_FREE"] = "1"
        try:
            return attention(q, k, v, backend="triton", skip_heads=skip_half)
        finally:
            del os.environ["RETMASK_TRITON_SYNC_FREE"]

    cases["triton, half heads skipped, sync-free grid"] = sync_free_skip
    if _eager_fits(hq, m, n):
        cases[f"eager+argmax(last {t_rows})"] = lambda: _eager(q, k, v, t_rows)
    for name, fn in cases.items():
        yield name, triton.testing.do_bench(fn, warmup=25, rep=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768, 50000]
    )
    parser.add_argument("--argmax-rows", type=int, default=50)
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print(
            "bench_triton.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured. "
            "See docs/triton_roofline.md for the estimated H100 numbers.",
            file=sys.stderr,
        )
        return 1

    from retmask.kernels import attention

    hq, hkv, d = MODELS[args.model]
    dtype = DTYPES[args.dtype]
    skip_half = torch.arange(hq, device="cuda") % 2 == 1
    rows: list[dict] = []
    for n in args.lengths:
        for phase, m in (("prefill", n), ("decode", 1)):
            for name, ms in _bench_shape(attention, hq, hkv, d, m, n, dtype, args.argmax_rows, skip_half):
                rows.append(dict(phase=phase, n=n, method=name, ms=ms))
                print(f"{phase:8s} N={n:6d} {name:44s} {ms:9.3f} ms", flush=True)
            torch.cuda.empty_cache()

    RESULTS.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name()
    lines = [
        f"# Triton attention benchmark ({args.model}: Hq={hq}, Hkv={hkv}, D={d}, {args.dtype}, batch 1)",
        "",
        f"Measured on {device_name} with triton.testing.do_bench (median ms). Prefill is causal with M = N.",
        "",
        "| phase | N | method | ms |",
        "|---|---:|---|---:|",
    ]
    lines += [f"| {r['phase']} | {r['n']} | {r['method']} | {r['ms']:.3f} |" for r in rows]
    (RESULTS / "attention_triton.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, phase in zip(axes, ("prefill", "decode"), strict=True):
        for method in dict.fromkeys(r["method"] for r in rows if r["phase"] == phase):
            pts = [(r["n"], r["ms"]) for r in rows if r["phase"] == phase and r["method"] == method]
            ax.plot(*zip(*pts, strict=True), marker="o", label=method)
        ax.set(xscale="log", yscale="log", xlabel="N (keys)", ylabel="ms", title=f"{phase} on {device_name}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "attention_triton.png", dpi=120)
    print(f"wrote {RESULTS / 'attention_triton.md'} and {RESULTS / 'attention_triton.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
