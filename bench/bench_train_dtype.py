"""Benchmark: RetMask DPO in bfloat16 against float32 on the embedded SmolLM2-135M-Instruct: does the bf16
loss curve follow the fp32 one, and what does a bf16 optimizer step cost on this CPU?

Steps (each a ``retmask`` command, run as a subprocess; finished steps are skipped on a re-run):
  1. ``retmask mask``: the retrieval heads (mean score >= 0.1) of ``bench/results/smollm2_scores.json``.
  2. ``retmask generate``: chosen / rejected pairs for the first ``--instructions`` shipped instructions,
     in fp32, once: both trainings see the same pairs.
  3. ``retmask train`` in ``--dtype float32`` and ``--dtype bfloat16`` (bf16 autocast over fp32 master
     weights and optimizer state, as the Trainer's ``bf16=True``); in both dtypes with the CPU speed-ups
     off (``RETMASK_CPU_SPEEDUPS=0``: torch's ``nn.Linear`` instead of retmask's linears); and in both
     dtypes with the attention backward on PyTorch SDPA (in fp32; in bf16 on fp32 copies: what the CPU
     attention's autograd ran before retmask's C++ backward; forced in the subprocess by this script's
     ``--retmask-with-backward``, see ``common.force_cpu_backward``) instead of the C++ backward. Same
     pairs, seed, order and steps. The six variants run in A B ... F F ... B A order (``--repeats 2``,
     default) so that drift of the shared machine hits all alike.
     Each run's ``retmask_train.json`` gives the per-step losses and the seconds per optimizer step.

The learning rate defaults to 2e-5, 40x the published 5e-7: at 5e-7 the loss barely leaves ln 2 in a few
steps and any two curves "match". On a CPU without native bf16 (no AMX-BF16 / AVX512-BF16) torch emulates
bf16 matmuls; retmask's linears multiply the bf16-rounded operands in fp32 there (TRL's LM head stays
emulated), so a bf16 step gains nothing; ``--dtype auto`` keeps fp32 on such CPUs.

Writes bench/results/train_dtype_<cpu kind>.{md,json,png}.

    flock /tmp/retmask-heavy.lock python bench/bench_train_dtype.py --work runs/train_dtype
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    cpu_kind,
    cpu_label,
    force_cpu_backward,
    machine_description,
    markdown_table,
    run_step,
    save_figure,
)

from retmask.cpu_speedups import SWITCH_ENV  # noqa: E402
from retmask.methods.retmask.pair_file import stats_path  # noqa: E402
from retmask.runfiles import atomic_write_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SCORES = RESULTS / "smollm2_scores.json"
DTYPES = ("float32", "bfloat16")
# The CPU speed-ups off (RETMASK_CPU_SPEEDUPS=0): torch's nn.Linear, what a user without retmask runs,
# instead of retmask's linears.
NO_SPEEDUPS = {d: f"{d}/no-speedups" for d in DTYPES}
# The attention backward on PyTorch SDPA (fp32: in fp32; bf16: on fp32 copies) instead of retmask's C++
# backward.
SDPA_BACKWARD = {"float32": "float32/sdpa-backward", "bfloat16": "bfloat16/sdpa-fp32-backward"}
# What a variant's "/option" changes in its `retmask train` subprocess: its environment, and the CPU
# attention backward it forces (``force_cpu_backward``) through this script's --retmask-with-backward.
DEFAULT_ENV = {SWITCH_ENV: "1"}
OPTION_ENV = {"": {}, "no-speedups": {SWITCH_ENV: "0"}, "sdpa-backward": {}, "sdpa-fp32-backward": {}}
OPTION_BACKWARD = {"sdpa-backward": "sdpa", "sdpa-fp32-backward": "sdpa_fp32"}
VARIANTS = DTYPES + tuple(NO_SPEEDUPS.values()) + tuple(SDPA_BACKWARD.values())


def schedule(repeats: int) -> list[tuple[str, int]]:
    """(variant, repeat) in A B C D D C B A ... order: drift hits every variant alike."""
    order = []
    for r in range(repeats):
        variants = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        order += [(v, r) for v in variants]
    return order


def per_step(summary: dict, key: str) -> list[float]:
    """The value of ``key`` at each logged optimizer step (logging_steps = 1) of a ``retmask_train.json``."""
    return [float(h[key]) for h in summary["log_history"] if key in h and "loss" in h]


def plot(path: Path, losses: dict[str, list[float]], step_median: dict[str, float], title: str) -> None:
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
    x = np.arange(len(DTYPES))
    ax_time.bar(x, [step_median[d] for d in DTYPES], width=0.5, color="tab:green")
    ax_time.set_xticks(x, list(DTYPES))
    ax_time.set_ylabel("seconds per optimizer step (median of runs)")
    ax_time.grid(axis="y", alpha=0.3)
    save_figure(fig, path, title)


def retmask_with_backward(path: str, argv: list[str]) -> int:
    """``retmask <argv>`` in this process with the CPU attention backward forced onto ``path``."""
    from retmask.cli import main as retmask_main

    force_cpu_backward(path)
    return retmask_main(argv)


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--retmask-with-backward":
        sys.exit(retmask_with_backward(sys.argv[2], sys.argv[3:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/train_dtype"), help="run folder (resumable)")
    ap.add_argument("--instructions", type=int, default=16, help="first N shipped instructions -> pairs")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per training run")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument(
        "--repeats", type=int, default=2, help="training runs per variant (A B C D D C B A order)"
    )
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
    every: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for variant, r in schedule(args.repeats):
        dtype, _, option = variant.partition("/")
        out = w / f"train_{variant.replace('/', '_')}_{r}"
        os.environ.update(DEFAULT_ENV)
        os.environ.update(OPTION_ENV[option])  # the subprocess inherits it
        backward = OPTION_BACKWARD.get(option)
        cmd = [sys.executable, __file__, "--retmask-with-backward", backward] if backward else py
        run_step([*cmd, "train", "--pairs", str(pairs), "--out", str(out), "--dtype", dtype,
                  "--max-steps", str(args.steps),
                  "--batch-size", str(args.batch_size), "--grad-accum", str(args.grad_accum), "--lr", str(args.lr),
                  "--seed", "0", "--overwrite"],
                 out / "retmask_train.json", log)  # fmt: skip
        every[variant].append(json.loads((out / "retmask_train.json").read_text()))
    os.environ.update(DEFAULT_ENV)
    runs = {d: every[d] for d in DTYPES}  # the loss comparison: retmask's defaults

    # Runs of one variant are the same computation: their losses must agree (a check of the bench itself).
    losses = {d: runs[d][0]["losses"] for d in DTYPES}
    repeat_equal = {v: all(x["losses"] == every[v][0]["losses"] for x in every[v]) for v in VARIANTS}
    margins = {d: per_step(runs[d][0], "rewards/margins") for d in DTYPES}
    step_s = {d: [x["seconds_per_step"] for x in runs[d]] for d in DTYPES}
    step_median = {v: float(np.median([x["seconds_per_step"] for x in every[v]])) for v in VARIANTS}
    n = min(len(losses[d]) for d in DTYPES)
    diff = np.abs(np.array(losses["bfloat16"][:n]) - np.array(losses["float32"][:n]))
    drop = {d: losses[d][0] - losses[d][n - 1] for d in DTYPES}
    ratio = step_median["bfloat16"] / step_median["float32"]

    def against(other: dict[str, str]) -> dict[str, dict[str, float]]:
        """Each dtype's default run against the variant ``other[dtype]`` (same pairs)."""
        return {
            d: {
                "other_s": step_median[other[d]],
                "ratio": step_median[d] / step_median[other[d]],
                "max_abs_loss_diff": float(
                    np.max(np.abs(np.array(losses[d][:n]) - np.array(every[other[d]][0]["losses"][:n])))
                ),
            }
            for d in DTYPES
        }

    no_speedups = against(NO_SPEEDUPS)  # retmask's CPU linears against torch's
    sdpa_backward = against(SDPA_BACKWARD)  # retmask's C++ attention backward against SDPA's
    time_rows = [[f"{step_median['float32']:.2f}", f"{step_median['bfloat16']:.2f}", f"{ratio:.2f}x"]]

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
        f"grad-accum {args.grad_accum}, lr {args.lr:g} (40x the published 5e-7: the loss moves), seed 0; "
        "bf16 = bf16 autocast over fp32 master weights and optimizer state. "
        f"Runs per variant: {args.repeats}, in A B C D D C B A order.",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + ".",
        "",
        markdown_table(["step", "loss fp32", "loss bf16", "abs. Δ loss", "margin fp32", "margin bf16"], rows),
        "",
        f"- Largest absolute Δ loss over {n} steps: **{diff.max():.4f}**; loss drop over the run: fp32 "
        f"{drop['float32']:.4f}, bf16 {drop['bfloat16']:.4f}.",
        f"- Repeated runs of one variant give identical losses: {repeat_equal}."
        if args.repeats > 1
        else "- One run per variant (`--repeats 1`): the step times are single measurements.",
        "",
        "Seconds per optimizer step (median of runs):",
        "",
        markdown_table(["fp32 s/step", "bf16 s/step", "bf16 / fp32"], time_rows),
        "",
        f"- **bf16 / fp32 = {ratio:.2f}x**.",
        "- The CPU speed-ups off (`RETMASK_CPU_SPEEDUPS=0`: torch's `nn.Linear` instead of retmask's linears): "
        + "; ".join(
            f"{d} {no_speedups[d]['other_s']:.2f} s/step, with the speed-ups {no_speedups[d]['ratio']:.2f}x of it "
            f"(largest |Δ loss| {no_speedups[d]['max_abs_loss_diff']:.2e})"
            for d in DTYPES
        )
        + ".",
        "- The attention backward on PyTorch SDPA (in fp32; in bf16 on fp32 copies: the recompute the CPU "
        "attention used before retmask's C++ backward) instead of the C++ backward: "
        + "; ".join(
            f"{d} {sdpa_backward[d]['other_s']:.2f} s/step, the C++ backward takes {sdpa_backward[d]['ratio']:.2f}x of it "
            f"(largest |Δ loss| {sdpa_backward[d]['max_abs_loss_diff']:.2e})"
            for d in DTYPES
        )
        + ".",
        "",
        f"![loss curves]({stem.name}.png)",
        "",
    ]
    stem.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(stem.with_suffix(".md"), "\n".join(lines))
    summary = {
        "machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "pairs": stats.get("pairs"),
        "losses": losses, "margins": margins, "seconds_per_step": step_s, "bf16_over_fp32_step": ratio,
        "max_abs_loss_diff": float(diff.max()), "repeat_equal": repeat_equal, "commands": log,
        "seconds_per_step_median": step_median,
        "speedups_vs_no_speedups": no_speedups,
        "cpp_backward_vs_sdpa_backward": sdpa_backward,
    }  # fmt: skip
    atomic_write_text(stem.with_suffix(".json"), json.dumps(summary, indent=1))
    plot(stem.with_suffix(".png"), losses, step_median, title)
    print("\n".join(lines))
    print(f"-> {stem}.md")


if __name__ == "__main__":
    main()
