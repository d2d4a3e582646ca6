"""Time the Triton backend against torch SDPA and eager attention on a CUDA GPU.

Usage:  python bench/bench_triton.py [--model smollm2|llama] [--dtype bf16|fp16|fp32]
                                     [--lengths 1024 4096 ...] [--train-max 16384] [--argmax-rows 50]
                                     [--verify-rows 9]

Batch 1, four phases per length N:
- prefill (causal, M = N): the Triton backend without argmax, with argmax of the last ``--argmax-rows`` rows
  (the teacher-forcing case of detection) and of all rows, with half of the query heads skipped (both
  grid modes); SDPA (no argmax: the floor to approach); eager softmax(QK^T)V + argmax, what
  ``output_attentions=True`` costs (only where its [Hq, N, N] fp32 logits fit);
- decode (M = 1): the same cases;
- verify (M = ``--verify-rows`` rows at the end of N keys, causal; a verification pass of detection):
  the Triton backend with and without the argmax of every row and with half the heads skipped (the kernel
  that ``paths.triton_forward_kernel`` picks), each Triton forward kernel called directly with the argmax
  (split-key and prefill: the measurement that sets ``paths.SPLIT_KEY_ROWS``), SDPA without a causal mask
  (its ``is_causal`` aligns the mask top-left; the few rows see all keys instead, a difference of
  M^2 / 2 of M * N logits);
- train (forward + backward, M = N, up to ``--train-max``): Triton, Triton with half the heads skipped, SDPA.

Each cell is triton.testing.do_bench's median and the peak memory the call allocated beyond its inputs;
"vs sdpa" is the ratio to SDPA's time in the same phase and N. Writes
bench/results/attention_triton_<model>_<dtype>_<gpu>.{md,json,png}. Without a CUDA GPU it exits with a
message and measures nothing (the interpreter is no benchmark).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from retmask.commands.argtypes import nonneg_int, positive_int

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import gpu_slug, markdown_table, plot_lines, save_figure, write_page  # noqa: E402

MODELS = {"smollm2": (9, 3, 64), "llama": (32, 8, 128)}  # (Hq, Hkv, D)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
RESULTS = Path(__file__).resolve().parent / "results"


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """--model (the attention shape) and --dtype, shared by the Triton benches."""
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")


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
    causal = q.shape[2] == k.shape[2]  # M = N; decode and verify: every row sees all keys (see the docstring)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _eager_fits(hq: int, m: int, n: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return 3 * hq * m * n * 4 < 0.8 * free  # logits, probabilities, a temporary


def _with_flag(flag: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with the test aid ``retmask.kernels.triton.common.<flag>`` set."""
    from retmask.kernels.triton import common as triton_common

    def run():
        setattr(triton_common, flag, True)
        try:
            return fn()
        finally:
            setattr(triton_common, flag, False)

    return run


def sync_free_grid(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run in the sync-free grid mode (one program per (batch, head) pair, no host sync), the mode
    a CUDA-graph capture uses."""
    return _with_flag("FORCE_SYNC_FREE", fn)


def _with_backward(fn: Callable[[], torch.Tensor], inputs, grad_out) -> Callable[[], None]:
    """One training call: ``fn``'s forward, then its backward into ``inputs``' gradients."""

    def run():
        for t in inputs:
            t.grad = None
        fn().backward(grad_out)

    return run


def _measure(fn: Callable[[], object]) -> tuple[float, int]:
    """(median ms, peak bytes allocated beyond what was live before) of ``fn``."""
    import triton.testing

    fn()  # compile / autotune outside the timing and the memory peak
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), peak


def _cases(attention, phase, hq, hkv, d, n, dtype, argmax_rows, skip_half, verify_rows):
    """{method: callable} for one phase at N keys (batch 1)."""
    dev = torch.device("cuda")
    m = {"decode": 1, "verify": verify_rows}.get(phase, n)
    gen = torch.Generator(device=dev).manual_seed(n)
    train = phase == "train"
    q = torch.randn(1, hq, m, d, device=dev, dtype=dtype, generator=gen, requires_grad=train)
    k = torch.randn(1, hkv, n, d, device=dev, dtype=dtype, generator=gen, requires_grad=train)
    v = torch.randn(1, hkv, n, d, device=dev, dtype=dtype, generator=gen, requires_grad=train)
    if train:
        grad_out = torch.randn(q.shape, device=dev, dtype=dtype, generator=gen)
        fwd = {
            "triton": lambda: attention(q, k, v, backend="triton"),
            "triton, half heads skipped": lambda: attention(q, k, v, backend="triton", skip_heads=skip_half),
            "sdpa": lambda: _sdpa(q, k, v),
        }
        return {name: _with_backward(fn, (q, k, v), grad_out) for name, fn in fwd.items()}
    skipped = lambda: attention(q, k, v, backend="triton", skip_heads=skip_half)  # noqa: E731
    if phase == "verify":
        from retmask.kernels.triton.decode import decode_forward
        from retmask.kernels.triton.fwd import attention_forward

        direct = dict(
            causal=True, sm_scale=d**-0.5, key_padding_mask=None, skip_heads=None, argmax_rows=m,
            return_lse=False,
        )  # fmt: skip
        return {
            "triton": lambda: attention(q, k, v, backend="triton"),
            "triton+argmax(all)": lambda: attention(q, k, v, backend="triton", return_argmax=True),
            "triton, half heads skipped": skipped,
            "split-key kernel+argmax(all)": lambda: decode_forward(q, k, v, **direct),
            "prefill kernel+argmax(all)": lambda: attention_forward(q, k, v, **direct),
            "sdpa": lambda: _sdpa(q, k, v),
        }
    t_rows = min(argmax_rows, m)
    cases = {
        "triton": lambda: attention(q, k, v, backend="triton"),
        f"triton+argmax(last {t_rows})": lambda: attention(
            q, k, v, backend="triton", return_argmax=True, argmax_rows=t_rows
        ),
        "triton+argmax(all)": lambda: attention(q, k, v, backend="triton", return_argmax=True),
        "triton, half heads skipped": skipped,
        "triton, half heads skipped, sync-free grid": sync_free_grid(skipped),
        "sdpa": lambda: _sdpa(q, k, v),
    }
    if _eager_fits(hq, m, n):
        cases[f"eager+argmax(last {t_rows})"] = lambda: _eager(q, k, v, t_rows)
    return cases


def _plot(rows: list[dict], stem: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = list(dict.fromkeys(r["phase"] for r in rows))
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4.5), squeeze=False)
    for ax, phase in zip(axes[0], phases, strict=True):
        plot_lines(ax, [r for r in rows if r["phase"] == phase], "method", "ms")
        ax.set(ylabel="ms (median)", title=phase)
    save_figure(fig, stem.with_suffix(".png"), title)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(parser)
    parser.add_argument(
        "--lengths", type=positive_int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768, 50000]
    )
    parser.add_argument("--train-max", type=nonneg_int, default=16384, help="longest N of the train phase")
    parser.add_argument("--argmax-rows", type=positive_int, default=50)
    parser.add_argument("--verify-rows", type=positive_int, default=9, help="query rows of the verify phase")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the result page")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print(
            "bench_triton.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured. "
            "Measured H200 numbers: bench/results/triton_h200_notes.md.",
            file=sys.stderr,
        )
        return 1

    import triton

    from retmask.kernels import attention

    hq, hkv, d = MODELS[args.model]
    dtype = DTYPES[args.dtype]
    skip_half = torch.arange(hq, device="cuda") % 2 == 1
    rows: list[dict] = []
    for n in args.lengths:
        phases = ["prefill", "decode", "verify"] + (["train"] if n <= args.train_max else [])
        for phase in phases:
            measured = {}
            for name, fn in _cases(
                attention, phase, hq, hkv, d, n, dtype, args.argmax_rows, skip_half, args.verify_rows
            ).items():
                try:
                    measured[name] = _measure(fn)
                except torch.OutOfMemoryError:
                    print(f"{phase:8s} N={n:6d} {name:44s} out of memory", flush=True)
                    torch.cuda.empty_cache()
                    continue
                ms, peak = measured[name]
                print(f"{phase:8s} N={n:6d} {name:44s} {ms:9.3f} ms  {peak / 2**20:9.1f} MiB", flush=True)
            sdpa_ms = measured.get("sdpa", (None, 0))[0]
            for name, (ms, peak) in measured.items():
                ratio = ms / sdpa_ms if sdpa_ms else None
                rows.append(dict(phase=phase, n=n, method=name, ms=ms, peak_bytes=peak, vs_sdpa=ratio))
            torch.cuda.empty_cache()

    device_name = torch.cuda.get_device_name()
    stem = args.out / f"attention_triton_{args.model}_{args.dtype}_{gpu_slug(device_name)}"
    title = (
        f"Triton attention ({args.model}: Hq={hq}, Hkv={hkv}, D={d}, {args.dtype}, batch 1) on {device_name}"
    )
    lines = [
        f"# {title}",
        "",
        f"Machine: {device_name}; torch {torch.__version__}, triton {triton.__version__}. "
        "triton.testing.do_bench medians; peak = memory the call allocated beyond its inputs. "
        "Prefill and train are causal with M = N; decode has M = 1; verify has "
        f"M = {args.verify_rows} causal rows at the end of the N keys (SDPA: no mask there); train is "
        "forward + backward.",
        "",
        markdown_table(
            ["phase", "N", "method", "ms", "vs sdpa", "peak"],
            [
                [
                    r["phase"],
                    r["n"],
                    r["method"],
                    f"{r['ms']:.3f}",
                    "-" if r["vs_sdpa"] is None else f"{r['vs_sdpa']:.2f}x",
                    f"{r['peak_bytes'] / 2**20:.1f} MiB",
                ]
                for r in rows
            ],
        ),  # fmt: skip
        "",
    ]
    payload = dict(device=device_name, torch=torch.__version__, triton=triton.__version__, args=vars(args))
    payload["args"]["out"] = str(args.out)
    payload["rows"] = rows
    write_page(stem, lines, payload)
    _plot(rows, stem, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
