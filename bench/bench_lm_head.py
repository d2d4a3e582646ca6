"""Benchmark: the fused LM head of TRL's DPO on a CPU, retmask's ``CPUChunkedLogProb`` against TRL's own
``ChunkedLogProbFunction`` (its torch fallback for devices without Triton), in float32 and in bf16
autocast over fp32 weights (``retmask train --dtype bfloat16``).

1. The head alone, forward + backward, SmolLM2-135M's head (576 -> 49,152, fp32 weight) on 128-1024
   labelled rows (a DPO batch's completion tokens) with the outputs TRL's DPO policy asks for
   (log-probabilities, entropy, mean logit, top-1). Both implementations run interleaved (A B B A ...) in
   one process; median of the repeats. Also: largest |Δ log p| and the gradients' largest difference
   relative to their scale.
2. The policy's forward + backward of a DPO batch through the embedded SmolLM2 with TRL's fused head
   (``add_fused_lm_head``, only the labelled rows projected as ``retmask train`` does), once with each
   head, interleaved: the share of a training step the head change is worth.

Writes bench/results/lm_head_<cpu kind>.{md,json,png}.

    flock /tmp/retmask-heavy.lock python bench/bench_lm_head.py
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

RESULTS = Path(__file__).resolve().parent / "results"
POLICY_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")  # what TRL's DPO policy requests
DTYPES = ("float32", "bfloat16")
IMPLS = ("trl", "retmask")


def autocast(dtype: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")


def head_alone(rows: int, dtype: str, repeats: int) -> dict:
    from trl.kernels import ChunkedLogProbFunction

    from retmask.cpu_speedups.logprob import CPUChunkedLogProb

    g = torch.Generator().manual_seed(rows)
    weight = (torch.randn(49152, 576, generator=g) * 0.05).requires_grad_()
    hidden0 = torch.randn(rows, 576, generator=g)
    targets = torch.randint(0, 49152, (rows,), generator=g)
    fns = {"trl": ChunkedLogProbFunction, "retmask": CPUChunkedLogProb}
    last: dict[str, tuple] = {}

    def call(name: str) -> float:
        hidden = hidden0.clone().requires_grad_()
        weight.grad = None
        start = time.perf_counter()
        with autocast(dtype):
            out = fns[name].apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0, POLICY_OUTPUTS)
        out[0].sum().backward()
        seconds = time.perf_counter() - start
        last[name] = (out[0].detach(), hidden.grad, weight.grad)
        return seconds

    times = interleaved({n: (lambda n=n: call(n)) for n in IMPLS}, repeats)
    (lp_t, gh_t, gw_t), (lp_r, gh_r, gw_r) = last["trl"], last["retmask"]
    return {
        "rows": rows, "dtype": dtype, "seconds": {n: statistics.median(t) for n, t in times.items()},
        "max_abs_logprob_diff": float((lp_t - lp_r).abs().max()),
        "grad_hidden_rel_diff": float((gh_t - gh_r).abs().max() / gh_t.abs().max()),
        "grad_weight_rel_diff": float((gw_t - gw_r).abs().max() / gw_t.abs().max()),
    }  # fmt: skip


def dpo_batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four rows (2 pairs x chosen / rejected) of up to 163 tokens: a prompt of 110 unlabelled tokens, a
    completion of 30-53 labelled ones, right padding; random token ids (the cost does not depend on them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (4, 163), generator=g)
    attention = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :110] = -100
    for row, length in enumerate((163, 140, 151, 128)):
        attention[row, length:] = 0
        labels[row, length:] = -100
    return ids, attention, labels


def policy_step(dtype: str, repeats: int) -> dict:
    from trl.trainer.utils import add_fused_lm_head

    from retmask import load_model
    from retmask.methods.retmask.fused_head import cpu_lm_head, labelled_positions_only

    model, _ = load_model(None)
    model.train()
    add_fused_lm_head(model, outputs=POLICY_OUTPUTS)
    ids, attention, labels = dpo_batch(model.config.vocab_size)

    def call(impl: str) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with labelled_positions_only(), cpu_lm_head(impl), autocast(dtype):
            out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
        out.loss.backward()
        return time.perf_counter() - start

    times = interleaved({n: (lambda n=n: call(n)) for n in IMPLS}, repeats)
    return {
        "dtype": dtype, "labelled_rows": int((labels[:, 1:] != -100).sum()),
        "seconds": {n: statistics.median(t) for n, t in times.items()}, "all_seconds": times,
    }  # fmt: skip


def plot(path: Path, heads: list[dict], steps: list[dict], title: str) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for dtype, marker in zip(DTYPES, "os", strict=True):
        cells = [c for c in heads if c["dtype"] == dtype]
        left.plot([c["rows"] for c in cells], [c["seconds"]["retmask"] / c["seconds"]["trl"] for c in cells],
                  marker=marker, label=dtype)  # fmt: skip
    left.axhline(1.0, color="grey", lw=0.8)
    left.set(xscale="log", xlabel="labelled rows", ylabel="retmask / TRL time", title="head alone, fwd + bwd")
    left.legend()
    x = range(len(steps))
    for i, impl in enumerate(IMPLS):
        right.bar(
            [j + 0.4 * i for j in x], [s["seconds"][impl] for s in steps], width=0.4, label=f"{impl} head"
        )
    right.set_xticks([j + 0.2 for j in x], [s["dtype"] for s in steps])
    right.set(ylabel="seconds", title="SmolLM2 policy fwd + bwd, DPO batch")
    right.legend()
    save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--repeats", type=int, default=6, help="timed calls per implementation and cell")
    ap.add_argument(
        "--policy-repeats", type=int, default=None,
        help="timed policy steps per head and dtype (default --repeats)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="page stem (default bench/results/lm_head_<cpu>)")
    args = ap.parse_args()
    if args.repeats < 1 or (args.policy_repeats is not None and args.policy_repeats < 1):
        ap.error(f"--repeats and --policy-repeats must be >= 1, got {args.repeats} / {args.policy_repeats}")
    if min(args.rows) < 1:
        ap.error(f"--rows must be >= 1, got {args.rows}")
    machine = machine_description()
    from retmask.cpu_speedups.half_matmul import native_half_matmul

    products_line = (
        "native (AMX or AVX512-BF16): retmask's head runs them on oneDNN."
        if native_half_matmul(torch.bfloat16)
        else "emulated by torch (no AMX or AVX512-BF16): retmask's head multiplies the bf16-rounded operands "
        "in fp32, and so do the model's linears of 32 rows or more (`retmask.cpu_speedups.half_matmul`), in "
        "both columns of the policy step."
    )
    stem = args.out or RESULTS / f"lm_head_{cpu_kind(machine)}"
    # One line per measured cell: the page is written at the end, and a run can take over 18 min on a
    # 2-core AVX2 machine, so a run stopped early still shows what it measured.
    heads, steps = [], []
    for dtype in DTYPES:
        for rows in args.rows:
            heads.append(head_alone(rows, dtype, args.repeats))
            sec = heads[-1]["seconds"]
            print(
                f"head alone, {rows} rows, {dtype}: retmask / trl {sec['retmask'] / sec['trl']:.2f}",
                flush=True,
            )
    for dtype in DTYPES:
        steps.append(policy_step(dtype, args.policy_repeats or args.repeats))
        sec = steps[-1]["seconds"]
        print(f"policy step, {dtype}: retmask / trl {sec['retmask'] / sec['trl']:.2f}", flush=True)

    head_rows = [
        [c["dtype"], str(c["rows"]), f"{c['seconds']['trl'] * 1e3:.0f} ms", f"{c['seconds']['retmask'] * 1e3:.0f} ms",
         f"{c['seconds']['retmask'] / c['seconds']['trl']:.2f}x", f"{c['max_abs_logprob_diff']:.1e}",
         f"{c['grad_hidden_rel_diff']:.1e} / {c['grad_weight_rel_diff']:.1e}"]
        for c in heads
    ]  # fmt: skip
    step_rows = [
        [s["dtype"], str(s["labelled_rows"]), f"{s['seconds']['trl']:.3f} s", f"{s['seconds']['retmask']:.3f} s",
         f"{s['seconds']['retmask'] / s['seconds']['trl']:.2f}x"]
        for s in steps
    ]  # fmt: skip
    title = f"Fused LM head on the CPU, retmask vs TRL ({cpu_label(machine)})"
    lines = [
        f"# {title}",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + ".",
        "",
        f"Both implementations interleaved in one process (A B B A ...), median of {args.repeats} timed calls "
        f"each (policy steps: {args.policy_repeats or args.repeats}) after one untimed call. Compare ratios; "
        "the machine is shared and noisy.",
        "",
        f"bf16 products on this CPU: {products_line}",
        "",
        "## The head alone (576 -> 49,152, fp32 weight; forward + backward; DPO policy outputs)",
        "",
        markdown_table(
            [
                "dtype",
                "rows",
                "TRL",
                "retmask",
                "retmask / TRL",
                "max abs Δ log p",
                "grad Δ / scale (hidden / weight)",
            ],
            head_rows,
        ),  # fmt: skip
        "",
        "bf16 rows: bf16 autocast over the fp32 weight. TRL multiplies the forward in bf16 (autocast) and "
        "the backward's two products in fp32 (upcast bf16 operands); retmask takes all three products with "
        "bf16 operands, each rounded to bf16 once, on oneDNN's bf16 GEMM where the CPU has one and as fp32 "
        "products of the rounded operands where torch would emulate bf16 "
        "(see `retmask/cpu_speedups/logprob.py`): the gradient differences in that column are of bf16 size.",
        "",
        "## SmolLM2 policy forward + backward on a DPO batch (TRL's fused head, labelled rows only)",
        "",
        markdown_table(["dtype", "labelled rows", "TRL head", "retmask head", "retmask / TRL"], step_rows),
        "",
        f"![lm head]({stem.name}.png)",
        "",
    ]
    payload = {
        "machine": machine,
        "args": {k: str(v) for k, v in vars(args).items()},
        "head": heads,
        "policy": steps,
    }
    write_page(stem, lines, payload)
    plot(stem.with_suffix(".png"), heads, steps, title)


if __name__ == "__main__":
    main()
