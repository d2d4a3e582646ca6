"""float32 CPU linears: torch's BLAS (what ``nn.Linear`` runs) vs oneDNN's inner product, and what the
choice does to whole-model calls.

Part 1, the products (one process, the two backends interleaved call by call, median): every linear
shape of SmolLM2-135M and of Llama-3.1-8B (without its 128K-row LM head: 2 GB of fp32 weight) at 1
row (a decode step: matrix-vector), 16 rows (a verification pass, a small generation batch), 256 rows (a
prefill chunk) and 2048 rows (a prefill); the backward's two products (grad_x, grad_w) at 256 and 2048
rows. Each cell also shows what ``retmask.cpu_speedups.linear`` decides for the shape on this machine
(its own proxy measurement, cached).

Part 2, the embedded SmolLM2-135M-Instruct end to end with its linears on torch's ``nn.Linear``
(``retmask.hf.linears.torch_linears``) against retmask's measured choice (``retmask``), interleaved,
median: a prefill of 2,048 tokens, 32 greedy decode steps at batch 1 and at batch 16, and a training step
(forward + backward of 4 rows x 256 tokens, loss over every token).

    flock /tmp/retmask-heavy.lock python bench/bench_linear.py            # ~6 min on 2 cores
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
ROWS = (1, 16, 256, 2048)
BACKWARD_ROWS = (256, 2048)


def products(quick: bool) -> list[dict[str, Any]]:
    import torch

    from retmask.cpu_speedups import linear as linear_cpu
    from retmask.cpu_speedups.decisions import interleaved_medians

    rows_list = ROWS[:3] if quick else ROWS
    out = []
    for model, layers in SHAPES.items():
        for layer, (n_out, n_in, bias) in layers.items():
            gen = torch.Generator().manual_seed(0)
            w = torch.randn(n_out, n_in, generator=gen) * n_in**-0.5
            b = torch.randn(n_out, generator=gen) if bias else None
            for kind, rows_set in (("forward", rows_list), ("backward", BACKWARD_ROWS[: 1 if quick else 2])):
                for rows in rows_set:
                    if model == "Llama-3.1-8B" and rows > 256 and kind == "forward":
                        continue  # a Llama prefill chunk is 256 rows here; 2048 adds minutes, not news
                    x = torch.randn(rows, n_in, generator=gen)
                    call = {"x": x, "weight": w, "bias": b}
                    if kind == "forward":
                        case_kind = "gemv" if rows == 1 else "gemm"
                        flop = 2 * rows * n_out * n_in
                    else:
                        call["grad"] = torch.randn(rows, n_out, generator=gen)
                        case_kind = "backward-long" if rows >= linear_cpu.LONG_BACKWARD_ROWS else "backward"
                        flop = 4 * rows * n_out * n_in
                    fns = {
                        b_: functools.partial(linear_cpu.run_backend, b_, call) for b_ in ("torch", "onednn")
                    }
                    for fn in fns.values():  # warm-up
                        fn()
                    t, _ = interleaved_medians(
                        lambda b_, fns=fns: fns[b_](),
                        list(fns),
                        min_calls=3,
                        max_calls=1000,
                        budget_s=0.5 if quick else 1.5,
                    )
                    case = linear_cpu.LinearCase(n_out, n_in, bias, case_kind, torch.get_num_threads())
                    decided = linear_cpu.choose(case)
                    cell = {
                        "model": model, "layer": layer, "out": n_out, "in": n_in, "kind": kind, "rows": rows,
                        "torch_s": t["torch"], "onednn_s": t["onednn"], "ratio": t["onednn"] / t["torch"],
                        "torch_gflops": flop / t["torch"] / 1e9, "onednn_gflops": flop / t["onednn"] / 1e9,
                        "decision": decided["backend"], "decision_proxy_ratio": decided.get("ratio"),
                    }  # fmt: skip
                    print(
                        f"{model:13s} {layer:13s} {kind:8s} rows {rows:5d}: torch {t['torch'] * 1e3:9.3f} ms "
                        f"({cell['torch_gflops']:5.0f} GFLOP/s)  oneDNN {t['onednn'] * 1e3:9.3f} ms "
                        f"({cell['onednn_gflops']:5.0f})  {cell['ratio']:.2f}x  -> {decided['backend']}",
                        flush=True,
                    )
                    out.append(cell)
    return out


def end_to_end(quick: bool) -> list[dict[str, Any]]:
    import torch

    import retmask
    from retmask.hf.linears import torch_linears

    model, tok = retmask.load_model(cpu_linears=True)
    linears = {"torch": lambda: torch_linears(model), "retmask": contextlib.nullcontext}
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefill_ids = torch.randint(100, vocab, (1, 512 if quick else 2048), generator=gen)
    steps = 8 if quick else 32

    def decode(batch: int):
        ids = torch.randint(100, vocab, (batch, 64), generator=gen)
        kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=tok.pad_token_id)
        return lambda: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)

    train_ids = torch.randint(100, vocab, (4, 128 if quick else 256), generator=gen)

    def train_step():
        model.train()
        model.zero_grad(set_to_none=True)
        model(input_ids=train_ids, labels=train_ids).loss.backward()
        model.eval()

    def prefill():
        with torch.no_grad():
            model(input_ids=prefill_ids, logits_to_keep=1)

    calls = {
        f"prefill {prefill_ids.shape[1]} tokens": prefill,
        f"decode {steps} steps, batch 1": decode(1),
        f"decode {steps} steps, batch 16": decode(16),
        f"training step, 4 x {train_ids.shape[1]} tokens": train_step,
    }
    out = []
    for name, fn in calls.items():
        times: dict[str, list[float]] = {"torch": [], "retmask": []}
        for backend in times:  # warm-up: decisions measured, caches filled
            with linears[backend](), torch.no_grad() if "training" not in name else torch.enable_grad():
                fn()
        for _ in range(2 if quick else 5):
            for backend, ts in times.items():
                with linears[backend](), torch.no_grad() if "training" not in name else torch.enable_grad():
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
        med = {k: common.median(v) for k, v in times.items()}
        cell = {
            "call": name,
            "torch_s": med["torch"],
            "retmask_s": med["retmask"],
            "ratio": med["retmask"] / med["torch"],
        }
        print(f"{name:40s} torch linears {med['torch']:.3f} s  retmask linears {med['retmask']:.3f} s  "
              f"{cell['ratio']:.2f}x", flush=True)  # fmt: skip
        out.append(cell)
    return out


def plot(path: Path, cells: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, model in zip(axes, SHAPES, strict=True):
        mine = [c for c in cells if c["model"] == model]
        labels = [f"{c['layer']}\n{c['kind'][:3]} {c['rows']}" for c in mine]
        colors = ["tab:green" if c["decision"] == "onednn" else "tab:gray" for c in mine]
        ax.bar(range(len(mine)), [c["ratio"] for c in mine], color=colors)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(mine)), labels, rotation=90, fontsize=6)
        ax.set_title(f"{model} (green: retmask picks oneDNN)", fontsize=9)
    axes[0].set_ylabel("oneDNN time / torch BLAS time")
    common.save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rows and shorter calls (a smoke test)")
    ap.add_argument("--out", default=None, help="output prefix (default bench/results/linear_<cpu kind>)")
    ap.add_argument("--no-model", action="store_true", help="only part 1 (the products)")
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
    model_cells = [] if args.no_model else end_to_end(args.quick)

    title = f"fp32 linears, oneDNN vs torch's BLAS ({common.cpu_label(machine)}, {machine['simd']})"
    lines = [f"# {title}", "", "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), ""]
    lines += [
        "oneDNN's fp32 inner product (`aten::mkldnn_linear`, with the copies into and out of oneDNN's layout)",
        "against what `nn.Linear` runs",
        f"(torch's BLAS: {torch.backends.mkl.is_available() and 'MKL' or 'not MKL'}), interleaved, median; "
        "ratio = oneDNN time / torch time (< 1: oneDNN faster). 'retmask' = what",
        "`retmask.cpu_speedups.linear` decides for the shape on this machine (own proxy, rows by kind: "
        + ", ".join(f"{k} {r}" for k, r in linear_cpu.PROXY_ROWS.items())
        + f"; oneDNN at <= {linear_cpu.ONEDNN_MAX_RATIO} of torch's time).",
        "",
        "## The products",
        "",
    ]
    rows = [
        [c["model"], c["layer"], f"{c['out']}x{c['in']}", c["kind"], str(c["rows"]),
         f"{c['torch_s'] * 1e3:.3f} ms ({c['torch_gflops']:.0f} GFLOP/s)",
         f"{c['onednn_s'] * 1e3:.3f} ms ({c['onednn_gflops']:.0f} GFLOP/s)", f"{c['ratio']:.2f}x", c["decision"]]
        for c in cells
    ]  # fmt: skip
    lines.append(
        common.markdown_table(
            ["model", "layer", "out x in", "pass", "rows", "torch", "oneDNN", "ratio", "retmask"], rows
        )
    )
    if model_cells:
        lines += [
            "",
            "## SmolLM2-135M-Instruct end to end (fp32, linears on torch's BLAS vs retmask's choice)",
            "",
        ]
        rows = [[c["call"], common.fmt_seconds(c["torch_s"]), common.fmt_seconds(c["retmask_s"]), f"{c['ratio']:.2f}x"]
                for c in model_cells]  # fmt: skip
        lines.append(common.markdown_table(["call", "torch linears", "retmask linears", "ratio"], rows))
    lines.append("")
    common.write_page(stem, lines, {"machine": machine, "products": cells, "model": model_cells,
                                    "decisions": linear_cpu.decisions()})  # fmt: skip
    plot(stem.with_suffix(".png"), cells, title)


if __name__ == "__main__":
    main()
