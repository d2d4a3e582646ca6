"""Benchmark: RetMask DPO in bfloat16 against float32 on the embedded SmolLM2-135M-Instruct: does the bf16
loss curve follow the fp32 one, and what does a bf16 optimizer step cost on this CPU?

Steps (each a ``retmask`` command, run as a subprocess; finished steps are skipped on a re-run):
  1. ``retmask mask``: the retrieval heads (mean score >= 0.1) of ``bench/results/smollm2_scores.json``.
  2. ``retmask generate``: chosen / rejected pairs for the first ``--instructions`` shipped instructions,
     in fp32, once: both trainings see the same pairs.
  3. ``retmask train`` in ``--dtype float32`` and ``--dtype bfloat16`` (bf16 autocast over fp32 master
     weights and optimizer state, as the Trainer's ``bf16=True``), same pairs, seed, order and steps, in the
     order A B B A (``--repeats 2``, default) so that drift of the shared machine hits both dtypes alike.
     Each run's ``retmask_train.json`` gives the per-step losses and the seconds per optimizer step.

The learning rate defaults to 2e-5, 40x the paper's 5e-7: at 5e-7 the loss barely leaves ln 2 in a few
steps and any two curves "match". On a CPU without native bf16 (no AMX-BF16 / AVX512-BF16) torch emulates
bf16 matmuls, so a bf16 step is expected to be slower there; ``--dtype auto`` keeps fp32 on such CPUs.

Writes bench/results/train_dtype_<cpu kind>.{md,json,png}.

    flock /tmp/retmask-heavy.lock python bench/bench_train_dtype.py --work runs/train_dtype
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_kind, cpu_label, machine_description, markdown_table, run_step  # noqa: E402

from retmask.methods.retmask.pair_file import stats_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SCORES = RESULTS / "smollm2_scores.json"
DTYPES = ("float32", "bfloat16")


def schedule(repeats: int) -> list[tuple[str, int]]:
    """(dtype, repeat) in A B B A A B ... order: each dtype runs first as often as the other."""
    order = []
    for r in range(repeats):
        pair = DTYPES if r % 2 == 0 else DTYPES[::-1]
        order += [(d, r) for d in pair]
    return order


def per_step(summary: dict, key: str) -> list[float]:
    """The value of ``key`` at each logged optimizer step (logging_steps = 1) of a ``retmask_train.json``."""
    return [float(h[key]) for h in summary["log_history"] if key in h and "loss" in h]


def plot(path: Path, losses: dict[str, list[float]], step_s: dict[str, list[float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    for dtype, style in zip(DTYPES, ("-o", "--s"), strict=True):
        ax_loss.plot(range(1, len(losses[dtype]) + 1), losses[dtype], style, label=dtype, markersize=4)
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("DPO loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_time.bar(list(DTYPES), [float(np.median(step_s[d])) for d in DTYPES], color=["tab:blue", "tab:orange"])
    ax_time.set_ylabel("seconds per optimizer step (median of runs)")
    ax_time.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/train_dtype"), help="run folder (resumable)")
    ap.add_argument("--instructions", type=int, default=16, help="first N shipped instructions -> pairs")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per training run")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--repeats", type=int, default=2, help="training runs per dtype (A B B A order)")
    ap.add_argument(
        "--out", type=Path, default=None, help="page stem (default bench/results/train_dtype_<cpu>)"
    )
    args = ap.parse_args()
    for name in ("instructions", "max_new_tokens", "steps", "batch_size", "grad_accum", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    machine = machine_description()
    stem = args.out or RESULTS / f"train_dtype_{cpu_kind(machine)}"
    w = args.work
    w.mkdir(parents=True, exist_ok=True)
    log: list[dict] = []
    py = [sys.executable, "-m", "retmask"]
    heads, pairs = w / "heads.json", w / "pairs.jsonl"
    run_step([*py, "mask", "--scores", str(SCORES), "--threshold", "0.1", "--out", str(heads)], heads, log)
    run_step([*py, "generate", "--heads", str(heads), "--out", str(pairs), "--limit", str(args.instructions),
              "--max-new-tokens", str(args.max_new_tokens), "--dtype", "float32", "--no-progress", "--resume"],
             None, log)  # fmt: skip
    runs: dict[str, list[dict]] = {d: [] for d in DTYPES}
    for dtype, r in schedule(args.repeats):
        out = w / f"train_{dtype}_{r}"
        run_step([*py, "train", "--pairs", str(pairs), "--out", str(out), "--dtype", dtype,
                  "--max-steps", str(args.steps), "--batch-size", str(args.batch_size),
                  "--grad-accum", str(args.grad_accum), "--lr", str(args.lr), "--seed", "0", "--overwrite"],
                 out / "retmask_train.json", log)  # fmt: skip
        runs[dtype].append(json.loads((out / "retmask_train.json").read_text()))

    # Runs of one dtype are the same computation: their losses must agree (a check of the bench itself).
    losses = {d: runs[d][0]["losses"] for d in DTYPES}
    repeat_equal = {d: all(x["losses"] == losses[d] for x in runs[d]) for d in DTYPES}
    margins = {d: per_step(runs[d][0], "rewards/margins") for d in DTYPES}
    step_s = {d: [x["seconds_per_step"] for x in runs[d]] for d in DTYPES}
    n = min(len(losses[d]) for d in DTYPES)
    diff = np.abs(np.array(losses["bfloat16"][:n]) - np.array(losses["float32"][:n]))
    drop = {d: losses[d][0] - losses[d][n - 1] for d in DTYPES}
    ratio = float(np.median(step_s["bfloat16"]) / np.median(step_s["float32"]))

    stats = json.loads(stats_path(pairs).read_text())
    rows = [
        [str(i + 1), f"{losses['float32'][i]:.4f}", f"{losses['bfloat16'][i]:.4f}", f"{diff[i]:.4f}",
         f"{margins['float32'][i]:.4f}" if i < len(margins["float32"]) else "-",
         f"{margins['bfloat16'][i]:.4f}" if i < len(margins["bfloat16"]) else "-"]
        for i in range(n)
    ]  # fmt: skip
    cpu = cpu_label(machine)
    title = f"RetMask DPO, bf16 vs fp32 ({cpu}, native bf16: {machine['native bf16']})"
    lines = [
        f"# {title}",
        "",
        f"Embedded SmolLM2-135M-Instruct. {stats.get('pairs', '?')} pairs from the first {args.instructions} "
        f"shipped instructions (rejected rows: the τ = 0.1 retrieval heads of `smollm2_scores.json` masked; "
        f"generated once in fp32). `retmask train`: {args.steps} optimizer steps of batch {args.batch_size} x "
        f"grad-accum {args.grad_accum}, lr {args.lr:g} (40x the paper's 5e-7, so that the loss moves), seed 0; "
        "bf16 = bf16 autocast over fp32 master weights and optimizer state. "
        f"Runs per dtype: {args.repeats}, in A B B A order.",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + ".",
        "",
        markdown_table(["step", "loss fp32", "loss bf16", "abs. Δ loss", "margin fp32", "margin bf16"], rows),
        "",
        f"- Largest absolute Δ loss over {n} steps: **{diff.max():.4f}**; loss drop over the run: fp32 "
        f"{drop['float32']:.4f}, bf16 {drop['bfloat16']:.4f}.",
        (
            f"- Repeated runs of one dtype give identical losses: fp32 {repeat_equal['float32']}, "
            f"bf16 {repeat_equal['bfloat16']}."
            if args.repeats > 1
            else "- One run per dtype (`--repeats 1`): the step times are single measurements."
        ),
        f"- Seconds per optimizer step: fp32 {', '.join(f'{s:.1f}' for s in step_s['float32'])}; "
        f"bf16 {', '.join(f'{s:.1f}' for s in step_s['bfloat16'])}. **bf16 / fp32 = {ratio:.2f}x** "
        "(medians).",
        "",
        f"![loss curves]({stem.name}.png)",
        "",
    ]
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text("\n".join(lines), encoding="utf-8")
    summary = {
        "machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "pairs": stats.get("pairs"),
        "losses": losses, "margins": margins, "seconds_per_step": step_s, "bf16_over_fp32_step": ratio,
        "max_abs_loss_diff": float(diff.max()), "repeat_equal": repeat_equal, "commands": log,
    }  # fmt: skip
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    plot(stem.with_suffix(".png"), losses, step_s, title)
    print("\n".join(lines))
    print(f"-> {stem}.md")


if __name__ == "__main__":
    main()
