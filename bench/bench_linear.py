"""CPU linears: torch's (what ``nn.Linear`` runs) against oneDNN's fp32 inner product and retmask's
few-row kernel, and what ``retmask.cpu_speedups.linear``'s choice does to whole-model calls.

Part 1, the products (one process, the candidates interleaved call by call, median), the same weight
every call (cache-warm, as the per-machine decision measures): every linear shape of SmolLM2-135M and of
Llama-3.1-8B (without its 128K-row LM head: 2 GB of fp32 weight) at 1 row (a decode step:
matrix-vector), 4 rows (a verification pass, a small batch), 16, 256 (a prefill chunk) and 2048 rows (a
prefill); the backward's two products (grad_x, grad_w) at 256 and 2048 rows; bfloat16 at 1 and 4 rows.
Each cell also shows what ``retmask.cpu_speedups.linear`` decides for the shape on this machine (its own
proxy measurement, cached).

Part 2, weights streamed from memory: 1 and 4 rows, each call on the next of several copies of the weight
(at least 256 MB in all), as a decode step reads every layer's weight once per token.

Part 3, the embedded SmolLM2-135M-Instruct end to end with its linears on torch's ``nn.Linear``
(``retmask.hf.linears.torch_linears``) against retmask's measured choice (``retmask``), interleaved,
median: a prefill of 2,048 tokens, 32 greedy decode steps at batch 1, 4 and 16, and a training step
(forward + backward of 4 rows x 256 tokens, loss over every token), in float32; 32 decode steps at batch
1 in bfloat16.

    flock /tmp/retmask-heavy.lock python bench/bench_linear.py            # ~12 min on 2 cores
    python bench/bench_linear.py --quick --out /tmp/lin                   # a smoke test

Writes bench/results/linear_<cpu kind>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {  # model: {layer: (out, in, bias)}
    "SmolLM2-135M": {
        "q/o proj": (576, 576, False),
        "k/v proj": (192, 576, False),
        "gate/up proj": (1536, 576, False),
        "down proj": (576, 1536, False),
        "lm head": (49152, 576, False),
    },
    "Llama-3.1-8B": {
        "q/o proj": (4096, 4096, False),
        "k/v proj": (1024, 4096, False),
        "gate/up proj": (14336, 4096, False),
        "down proj": (4096, 14336, False),
    },
}
ROWS = (1, 4, 16, 256, 2048)
BACKWARD_ROWS = (256, 2048)
BF16_ROWS = (1, 4)
STREAM_ROWS = (1, 4)
STREAM_BYTES = 256 * 2**20
NAMES = {"torch": "torch", "onednn": "oneDNN", "retmask": "retmask kernel"}


def _time_candidates(call: dict, names: tuple[str, ...], quick: bool) -> dict[str, float]:

    from retmask.cpu_speedups import linear as linear_cpu
    from retmask.cpu_speedups.decisions import interleaved_medians

    fns = {n: functools.partial(linear_cpu.run_backend, n, call) for n in names}
    for fn in fns.values():  # warm-up
        fn()
    t, _ = interleaved_medians(lambda n: fns[n](), list(fns), min_calls=3, max_calls=1000,
                               budget_s=0.5 if quick else 1.5)  # fmt: skip
    return t


def products(quick: bool) -> list[dict[str, Any]]:
    import torch

    from retmask.cpu_speedups import linear as linear_cpu

    rows_list = ROWS[:3] if quick else ROWS
    out = []
    for model, layers in SHAPES.items():
        for layer, (n_out, n_in, bias) in layers.items():
            gen = torch.Generator().manual_seed(0)
            w = torch.randn(n_out, n_in, generator=gen) * n_in**-0.5
            b = torch.randn(n_out, generator=gen) if bias else None
            passes = [("forward", "float32", rows_list), ("backward", "float32", BACKWARD_ROWS[: 1 if quick else 2]),
                      ("forward", "bfloat16", BF16_ROWS)]  # fmt: skip
            for kind, dtype, rows_set in passes:
                for rows in rows_set:
                    if model == "Llama-3.1-8B" and rows > 256 and kind == "forward":
                        continue  # a Llama prefill chunk is 256 rows here; 2048 adds minutes, not news
                    to = getattr(torch, dtype)
                    x = torch.randn(rows, n_in, generator=gen)
                    call = {"x": x.to(to), "weight": w.to(to), "bias": None if b is None else b.to(to)}
                    if kind == "forward":
                        case_kind = linear_cpu.row_kind(rows)
                        flop = 2 * rows * n_out * n_in
                    else:
                        call["grad"] = torch.randn(rows, n_out, generator=gen)
                        case_kind = "backward-long" if rows >= linear_cpu.LONG_BACKWARD_ROWS else "backward"
                        flop = 4 * rows * n_out * n_in
                    case = linear_cpu.LinearCase(n_out, n_in, bias, case_kind, torch.get_num_threads(), dtype)
                    names = linear_cpu.candidates(case)
                    t = _time_candidates(call, names, quick)
                    decided = linear_cpu.choose(case)["backend"] if len(names) > 1 else "torch"
                    cell = {"model": model, "layer": layer, "out": n_out, "in": n_in, "kind": kind, "dtype": dtype,
                            "rows": rows, "times_s": t, "gflops": {n: flop / v / 1e9 for n, v in t.items()},
                            "ratios": {n: v / t["torch"] for n, v in t.items() if n != "torch"},
                            "decision": decided}  # fmt: skip
                    ratios = "  ".join(f"{NAMES[n]} {r:.2f}x" for n, r in cell["ratios"].items())
                    print(f"{model:13s} {layer:13s} {kind:8s} {dtype:8s} rows {rows:5d}: torch "
                          f"{t['torch'] * 1e3:9.3f} ms  {ratios}  -> {decided}", flush=True)  # fmt: skip
                    out.append(cell)
    return out


def streamed(quick: bool) -> list[dict[str, Any]]:
    """Each call on the next of several copies of the weight (>= STREAM_BYTES in all): read from memory."""
    import torch

    from retmask.cpu_speedups import linear as linear_cpu

    out = []
    for model, layers in SHAPES.items():
        for layer, (n_out, n_in, bias) in layers.items():
            if quick and model != "SmolLM2-135M":
                continue
            for dtype in ("float32", "bfloat16"):
                to = getattr(torch, dtype)
                nbytes = n_out * n_in * to.itemsize
                copies = max(1, -(-STREAM_BYTES // nbytes))
                gen = torch.Generator().manual_seed(1)
                weights = [
                    (torch.randn(n_out, n_in, generator=gen) * n_in**-0.5).to(to) for _ in range(copies)
                ]
                for rows in STREAM_ROWS:
                    x = torch.randn(rows, n_in, generator=gen).to(to)
                    case = linear_cpu.LinearCase(n_out, n_in, bias, linear_cpu.row_kind(rows),
                                                 torch.get_num_threads(), dtype)  # fmt: skip
                    names = linear_cpu.candidates(case)
                    sweep = [{"x": x, "weight": w, "bias": None} for w in weights]
                    times: dict[str, list[float]] = {n: [] for n in names}
                    for _ in range(2 if quick else 5):
                        for n in names:
                            t0 = time.perf_counter()
                            for call in sweep:
                                linear_cpu.run_backend(n, call)
                            times[n].append((time.perf_counter() - t0) / copies)
                    t = {
                        n: min(v) for n, v in times.items()
                    }  # the least disturbed sweep: a memory-bound figure
                    cell = {"model": model, "layer": layer, "out": n_out, "in": n_in, "dtype": dtype, "rows": rows,
                            "copies": copies, "times_s": t, "gb_per_s": {n: nbytes / v / 1e9 for n, v in t.items()},
                            "ratios": {n: v / t["torch"] for n, v in t.items() if n != "torch"}}  # fmt: skip
                    ratios = "  ".join(f"{NAMES[n]} {r:.2f}x ({cell['gb_per_s'][n]:.1f} GB/s)"
                                       for n, r in cell["ratios"].items())  # fmt: skip
                    print(f"streamed {model:13s} {layer:13s} {dtype:8s} rows {rows}: torch {t['torch'] * 1e3:8.3f} "
                          f"ms ({cell['gb_per_s']['torch']:.1f} GB/s)  {ratios}", flush=True)  # fmt: skip
                    out.append(cell)
                del weights
    return out


def end_to_end(quick: bool) -> list[dict[str, Any]]:
    import torch

    import retmask
    from retmask.hf.linears import torch_linears

    out = []
    for dtype in ("float32", "bfloat16"):
        model, tok = retmask.load_model(cpu_linears=True, dtype=getattr(torch, dtype))
        linears = {"torch": lambda model=model: torch_linears(model), "retmask": contextlib.nullcontext}
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prefill_ids = torch.randint(100, vocab, (1, 512 if quick else 2048), generator=gen)
        train_ids = torch.randint(100, vocab, (4, 128 if quick else 256), generator=gen)
        steps = 8 if quick else 32

        def decode(batch: int, model=model, tok=tok, steps=steps, vocab=vocab, gen=gen):
            ids = torch.randint(100, vocab, (batch, 64), generator=gen)
            kw = dict(
                max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=tok.pad_token_id
            )
            return lambda: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)

        def train_step(model=model, train_ids=train_ids):
            model.train()
            model.zero_grad(set_to_none=True)
            model(input_ids=train_ids, labels=train_ids).loss.backward()
            model.eval()

        def prefill(model=model, prefill_ids=prefill_ids):
            with torch.no_grad():
                model(input_ids=prefill_ids, logits_to_keep=1)

        calls = {f"decode {steps} steps, batch 1": decode(1)}
        if dtype == "float32":
            calls = {
                f"prefill {prefill_ids.shape[1]} tokens": prefill,
                **calls,
                f"decode {steps} steps, batch 4": decode(4),
                f"decode {steps} steps, batch 16": decode(16),
                f"training step, 4 x {train_ids.shape[1]} tokens": train_step,
            }
        for name, fn in calls.items():
            grad = torch.enable_grad if "training" in name else torch.no_grad
            times: dict[str, list[float]] = {"torch": [], "retmask": []}
            for backend in times:  # warm-up: decisions measured, caches filled
                with linears[backend](), grad():
                    fn()
            for _ in range(2 if quick else 5):
                for backend, ts in times.items():
                    with linears[backend](), grad():
                        t0 = time.perf_counter()
                        fn()
                        ts.append(time.perf_counter() - t0)
            med = {k: common.median(v) for k, v in times.items()}
            cell = {"call": name, "dtype": dtype, "torch_s": med["torch"], "retmask_s": med["retmask"],
                    "ratio": med["retmask"] / med["torch"]}  # fmt: skip
            print(f"{dtype:8s} {name:40s} torch linears {med['torch']:.3f} s  retmask linears "
                  f"{med['retmask']:.3f} s  {cell['ratio']:.2f}x", flush=True)  # fmt: skip
            out.append(cell)
        del model
    return out


def plot(path: Path, cells: list[dict[str, Any]], stream_cells: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"onednn": "tab:green", "retmask": "tab:blue"}
    panels = [(m, [c for c in cells if c["model"] == m and c["kind"] == "forward" and c["rows"] <= 16])
              for m in SHAPES]  # fmt: skip
    panels.append(("weights streamed from memory", stream_cells))
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.6), sharey=True)
    for ax, (name, mine) in zip(axes, panels, strict=True):
        labels = [f"{c['model'][:5]} {c['layer']} {c['dtype'][:4]} {c['rows']}" for c in mine]
        for j, backend in enumerate(("onednn", "retmask")):
            xs = [i + (j - 0.5) * 0.4 for i, c in enumerate(mine) if backend in c["ratios"]]
            ys = [c["ratios"][backend] for c in mine if backend in c["ratios"]]
            ax.bar(xs, ys, width=0.4, color=colors[backend], label=NAMES[backend])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(mine)), labels, rotation=90, fontsize=5)
        ax.set_title(name, fontsize=9)
        ax.set_ylim(0, 2.5)
    axes[0].set_ylabel("time / torch's linear (< 1: faster)")
    axes[0].legend(fontsize=7)
    common.save_figure(fig, path, title)


def _cell_time(c: dict[str, Any], name: str) -> str:
    if name not in c["times_s"]:
        return "-"
    text = f"{c['times_s'][name] * 1e3:.3f} ms"
    return text if name == "torch" else f"{text} ({c['ratios'][name]:.2f}x)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rows and shorter calls (a smoke test)")
    ap.add_argument("--out", default=None, help="output prefix (default bench/results/linear_<cpu kind>)")
    ap.add_argument(
        "--no-model", action="store_true", help="only part 1 (the products), no streamed weights or model"
    )
    args = ap.parse_args()
    import torch

    from retmask import cpu_speedups
    from retmask.cpu_speedups import linear as linear_cpu

    if not cpu_speedups.enabled():
        ap.error(f"${cpu_speedups.SWITCH_ENV}=0 turns retmask's linears off: unset it for this benchmark")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    machine = common.machine_description()
    kind = common.cpu_kind(machine)
    stem = Path(args.out) if args.out else RESULTS / f"linear_{kind}"
    cells = products(args.quick)

    stream_cells = [] if args.no_model else streamed(args.quick)
    model_cells = [] if args.no_model else end_to_end(args.quick)

    title = f"CPU linears: torch, oneDNN and retmask's few-row kernel ({common.cpu_label(machine)}, {machine['simd']})"
    blas = "MKL" if torch.backends.mkl.is_available() else "not MKL"
    lines = [f"# {title}", "", "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), ""]
    lines += [
        f"What `nn.Linear` runs (torch: {blas} for fp32, oneDNN for bf16) against oneDNN's fp32 inner product",
        "(`aten::mkldnn_linear`, with the copies into and out of oneDNN's layout) and retmask's few-row kernel",
        f"(`retmask::linear_rows`, a candidate for 1 to {linear_cpu.FEW_ROWS} rows), interleaved, median; "
        "(ratio) = time / torch's (< 1: faster).",
        "'decision' = what `retmask.cpu_speedups.linear` decides for the shape on this machine (own proxy, rows by "
        "kind: "
        + ", ".join(f"{k} {r}" for k, r in linear_cpu.PROXY_ROWS.items())
        + f"; another backend at <= {linear_cpu.MAX_RATIO} of torch's time).",
        "",
        "## The products, the same weight every call",
        "",
    ]
    headers = [
        "model",
        "layer",
        "out x in",
        "pass",
        "dtype",
        "rows",
        "torch",
        "oneDNN",
        "retmask kernel",
        "decision",
    ]
    rows = [[c["model"], c["layer"], f"{c['out']}x{c['in']}", c["kind"], c["dtype"], str(c["rows"]),
             _cell_time(c, "torch"), _cell_time(c, "onednn"), _cell_time(c, "retmask"), c["decision"]]
            for c in cells]  # fmt: skip
    lines.append(common.markdown_table(headers, rows))
    if stream_cells:
        lines += ["", f"## Weights streamed from memory (each call on the next of several copies, >= "
                  f"{STREAM_BYTES >> 20} MB in all; fastest of the sweeps)", ""]  # fmt: skip
        headers = ["model", "layer", "out x in", "dtype", "rows", "torch", "oneDNN", "retmask kernel",
                   "GB/s (torch / best)"]  # fmt: skip
        rows = [[c["model"], c["layer"], f"{c['out']}x{c['in']}", c["dtype"], str(c["rows"]), _cell_time(c, "torch"),
                 _cell_time(c, "onednn"), _cell_time(c, "retmask"),
                 f"{c['gb_per_s']['torch']:.1f} / {max(c['gb_per_s'].values()):.1f}"] for c in stream_cells]  # fmt: skip
        lines.append(common.markdown_table(headers, rows))
    if model_cells:
        lines += [
            "",
            "## SmolLM2-135M-Instruct end to end (linears on torch's `nn.Linear` vs retmask's choice)",
            "",
        ]
        rows = [[c["dtype"], c["call"], common.fmt_seconds(c["torch_s"]), common.fmt_seconds(c["retmask_s"]),
                 f"{c['ratio']:.2f}x"] for c in model_cells]  # fmt: skip
        lines.append(
            common.markdown_table(["dtype", "call", "torch linears", "retmask linears", "ratio"], rows)
        )
    lines.append("")
    common.write_page(stem, lines, {"machine": machine, "products": cells, "streamed": stream_cells,
                                    "model": model_cells, "decisions": linear_cpu.decisions()})  # fmt: skip
    plot(stem.with_suffix(".png"), cells, stream_cells, title)


if __name__ == "__main__":
    main()
