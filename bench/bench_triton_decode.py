"""Where a decode call's time goes on a CUDA GPU: host overhead against the kernels' own GPU time.

Usage:  python bench/bench_triton_decode.py [--model smollm2|llama] [--dtype bf16] [--lengths 2048 8192 ...]
                                            [--batch 1] [--graph-calls 20] [--out DIR]

A decode call (one query row per head, M = 1) does microseconds of GPU work, so in eager mode its time is
what the host needs to issue it. This separates the two, per case, at each N keys:
- eager us:    triton.testing.do_bench median of one eager call;
- host us:     the Python time to issue one call (``--host-calls`` calls back to back, no sync inside);
- graph us:    GPU time per call: ``--graph-calls`` calls captured in one CUDA graph, the replay's
               median divided by that count (no host work left);
Cases: our ``attention()`` without and with argmax, with half the query heads skipped (eager in the exact
grid and in the sync-free grid; under capture the grid switches to the sync-free mode by itself), our
decode launcher called directly (no validation, no custom op), the first and the last of those again with
the kernels launched through retmask's launcher cache instead of Triton's JIT entry ("cached launch",
``retmask.kernels.triton.launch``), and PyTorch SDPA (``enable_gqa``) as the alternative. The ratios compare with SDPA in the same column. The eager column is do_bench's, which
clears the L2 cache between calls and so lets the host run ahead: for a host-bound call the host column
is what a decoding loop pays. Writes bench/results/attention_triton_decode_<model>_<dtype>_<gpu>.{md,json,png}
(or --out). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from retmask.commands.argtypes import positive_int

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_triton import DTYPES, MODELS, add_shape_args, sync_free_grid  # noqa: E402
from common import (  # noqa: E402
    cached_triton_launch,
    gpu_slug,
    markdown_table,
    median,
    plot_lines,
    save_figure,
    write_page,
)

RESULTS = Path(__file__).resolve().parent / "results"


def _cases(
    hq: int, hkv: int, d: int, n: int, batch: int, dtype: torch.dtype
) -> dict[str, Callable[[], object]]:
    """{case: callable} for one decode call at N keys; the inputs are fixed tensors, so a captured
    graph replays the same call."""
    from retmask.kernels import attention
    from retmask.kernels.triton.decode import decode_forward

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n)
    q = torch.randn(batch, hq, 1, d, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(batch, hkv, n, d, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(batch, hkv, n, d, device=dev, dtype=dtype, generator=gen)
    skip = (torch.arange(hq, device=dev) % 2 == 1).expand(batch, hq).contiguous()
    scale = d**-0.5

    def cached(fn: Callable[[], object]) -> Callable[[], object]:
        def run():
            with cached_triton_launch(True):
                return fn()

        return run

    launcher_only = lambda: decode_forward(  # noqa: E731
        q, k, v, key_padding_mask=None, skip_heads=None, sm_scale=scale, argmax_rows=1, return_lse=False
    )
    return {
        "triton": lambda: attention(q, k, v, backend="triton"),
        "triton+argmax": lambda: attention(q, k, v, backend="triton", return_argmax=True),
        "triton, half heads skipped": lambda: attention(q, k, v, backend="triton", skip_heads=skip),
        "triton, half heads skipped, sync-free grid": sync_free_grid(
            lambda: attention(q, k, v, backend="triton", skip_heads=skip)
        ),
        "triton launcher only (+argmax)": launcher_only,
        "triton, cached launch": cached(lambda: attention(q, k, v, backend="triton")),
        "triton+argmax, cached launch": cached(
            lambda: attention(q, k, v, backend="triton", return_argmax=True)
        ),
        "triton launcher only (+argmax), cached launch": cached(launcher_only),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }


def _host_us(fn: Callable[[], object], calls: int) -> float:
    """Microseconds of host time per call: ``calls`` calls issued back to back (the GPU queue absorbs
    them), median of 3 rounds."""
    rounds = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return median(rounds)


def _graph_us(fn: Callable[[], object], calls: int) -> float:
    """GPU microseconds per call: ``calls`` calls captured in one CUDA graph, replay median / calls."""
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph's recipe asks
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median")
    return ms * 1e3 / calls


def _plot(rows: list[dict], stem: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in (
        (axes[0], "eager_us", "eager call (us)"),
        (axes[1], "graph_us", "GPU time in a graph (us)"),
    ):
        plot_lines(ax, rows, "case", key)
        ax.set(ylabel=label)
    save_figure(fig, stem.with_suffix(".png"), title)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(parser)
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--graph-calls", type=positive_int, default=20, help="calls captured per graph")
    parser.add_argument("--host-calls", type=positive_int, default=200, help="calls per host-time round")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the result page")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench_triton_decode.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured.",
            file=sys.stderr,
        )
        return 1
    import triton
    import triton.testing

    hq, hkv, d = MODELS[args.model]
    dtype = DTYPES[args.dtype]
    rows: list[dict] = []
    for n in args.lengths:
        measured = {}
        for case, fn in _cases(hq, hkv, d, n, args.batch, dtype).items():
            fn()  # compile outside the timing
            eager_us = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
            host_us = _host_us(fn, args.host_calls)
            try:
                graph_us = _graph_us(fn, args.graph_calls)
                graph_error = None
            except Exception as err:  # noqa: BLE001 - a case that cannot be captured is reported, not fatal
                graph_us, graph_error = None, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
            measured[case] = dict(
                eager_us=eager_us, host_us=host_us, graph_us=graph_us, graph_error=graph_error
            )
            print(
                f"N={n:6d} {case:34s} eager {eager_us:8.1f} us  host {host_us:7.1f} us  "
                f"graph {'-' if graph_us is None else f'{graph_us:7.2f}'} us {graph_error or ''}",
                flush=True,
            )
        sdpa = measured["sdpa"]
        for case, m in measured.items():
            rows.append(
                dict(
                    n=n, case=case, **m,
                    eager_vs_sdpa=m["eager_us"] / sdpa["eager_us"],
                    graph_vs_sdpa=None if m["graph_us"] is None or not sdpa["graph_us"] else m["graph_us"] / sdpa["graph_us"],
                )
            )  # fmt: skip
        torch.cuda.empty_cache()

    device_name = torch.cuda.get_device_name()
    stem = args.out / f"attention_triton_decode_{args.model}_{args.dtype}_{gpu_slug(device_name)}"
    title = f"Decode (M = 1) on {device_name}: {args.model} (Hq={hq}, Hkv={hkv}, D={d}), {args.dtype}, batch {args.batch}"
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    lines = [
        f"# {title}",
        "",
        f"Machine: {device_name}; torch {torch.__version__}, triton {triton.__version__}. eager: do_bench median "
        f"of one call; host: Python time to issue one call; graph: GPU time per call, {args.graph_calls} calls "
        "captured in one CUDA graph (replay median / calls). Ratios are to SDPA in the same column.",
        "",
        markdown_table(
            ["N", "case", "eager us", "vs sdpa", "host us", "graph us", "vs sdpa"],
            [
                [
                    r["n"],
                    r["case"],
                    fmt(r["eager_us"], ".1f"),
                    fmt(r["eager_vs_sdpa"], ".2f") + "x",
                    fmt(r["host_us"], ".1f"),
                    fmt(r["graph_us"], ".2f") if r["graph_us"] is not None else f"failed: {r['graph_error']}",
                    fmt(r["graph_vs_sdpa"], ".2f") + ("x" if r["graph_vs_sdpa"] is not None else ""),
                ]
                for r in rows
            ],
        ),  # fmt: skip
        "",
    ]
    payload = dict(
        device=device_name, torch=torch.__version__, triton=triton.__version__, args=vars(args), rows=rows
    )
    payload["args"]["out"] = str(args.out)
    write_page(stem, lines, payload)
    _plot(rows, stem, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
