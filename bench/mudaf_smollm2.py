"""MuDAF vs vanilla SFT on the embedded SmolLM2-135M-Instruct (MuDAF's published comparison, small):
reproduces ``bench/results/mudaf_smollm2.{json,png}``.

    python bench/mudaf_smollm2.py --work runs/mudaf [--steps 60 ...]

Steps (each a ``retmask`` command, run as a subprocess; commands and wall times are recorded):
  1. synthetic MDQA: train / selection / held-out eval sets from different seeds (different fictional worlds)
  2. ``mdqa-score`` on the selection set -> MDQA retrieval scores R_h of every head
  3. ``mdqa-score --answers`` on the eval set with the original model (before)
  4. ``mudaf-train --scores`` (8 heads sampled, P(h) ∝ exp(R_h/0.05)); ``mudaf-train --vanilla-sft`` with the
     same heads (L_CON only logged), same data, order, steps and learning rate
  5. ``mdqa-score --answers`` on the eval set with both trained models (after)
Heads are selected on the selection set and measured on the eval set so that the before/after comparison is
not inflated by selecting on the measurement set. Finished steps are skipped on a re-run (resumable).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_step  # noqa: E402

from retmask.plotting import save_figure as save_png  # noqa: E402
from retmask.runfiles import atomic_write_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # result pages and data live apart from the scripts


def load(path: Path) -> tuple[dict, dict]:
    scores = json.loads(path.read_text())
    record = json.loads(path.with_name(path.stem + ".run.json").read_text())
    return scores, record


def rank_of(mean_f1: dict[str, float], key: str) -> int:
    """1-based rank of head ``key`` by mean F1 among all heads (ties share the best rank)."""
    return 1 + sum(v > mean_f1[key] for v in mean_f1.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("runs/mudaf"))
    p.add_argument("--train-n", type=int, default=96)
    p.add_argument("--select-n", type=int, default=48)
    p.add_argument("--eval-n", type=int, default=48)
    p.add_argument("--distractors", type=int, default=7)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--epsilon", type=float, default=0.05, help="F1 threshold of every mdqa-score call")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--lambda", dest="lam", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "mudaf_smollm2")
    args = p.parse_args()
    w = args.work
    w.mkdir(parents=True, exist_ok=True)
    log: list[dict] = []
    py = sys.executable
    for name, n, seed in (
        ("train", args.train_n, 100),
        ("select", args.select_n, 200),
        ("eval", args.eval_n, 300),
    ):
        f = w / f"{name}.jsonl"
        run_step([py, "-m", "retmask.methods.mudaf.mdqa", "--n", str(n), "--seed", str(seed), "--distractors", str(args.distractors),
            "--out", str(f)], f, log)  # fmt: skip
    run_step(["retmask", "mdqa-score", "--data", str(w / "select.jsonl"), "--out", str(w / "select_scores.json"),
        "--plot", str(w / "select_scores.png"), "--epsilon", str(args.epsilon), "--masses"], w / "select_scores.run.json", log)  # fmt: skip
    run_step(["retmask", "mdqa-score", "--data", str(w / "eval.jsonl"), "--out", str(w / "eval_base.json"), "--answers",
        "--epsilon", str(args.epsilon), "--masses"],
       w / "eval_base.run.json", log)  # fmt: skip
    common = ["--data", str(w / "train.jsonl"), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
              "--lr", str(args.lr), "--seed", str(args.seed), "--warmup-steps", str(args.warmup_steps)]  # fmt: skip
    run_step(["retmask", "mudaf-train", *common, "--scores", str(w / "select_scores.json"), "--lambda", str(args.lam),
        "--out", str(w / "mudaf")], w / "mudaf" / "mudaf_train.json", log)  # fmt: skip
    run_step(["retmask", "mudaf-train", *common, "--vanilla-sft", "--heads", str(w / "mudaf" / "heads.json"),
        "--out", str(w / "sft")], w / "sft" / "mudaf_train.json", log)  # fmt: skip
    for name in ("mudaf", "sft"):
        run_step(["retmask", "mdqa-score", "--model", str(w / name), "--data", str(w / "eval.jsonl"),
            "--out", str(w / f"eval_{name}.json"), "--answers", "--epsilon", str(args.epsilon), "--masses"], w / f"eval_{name}.run.json", log)  # fmt: skip

    # ---- summary -------------------------------------------------------------------------------------
    heads = json.loads((w / "mudaf" / "heads.json").read_text())
    sel_scores, sel_rec = load(w / "select_scores.json")
    runs = {name: load(w / f"eval_{name}.json")[1] for name in ("base", "sft", "mudaf")}
    train = {name: json.loads((w / name / "mudaf_train.json").read_text()) for name in ("mudaf", "sft")}
    keys = [f"{ly}-{h}" for ly, h in heads["heads"]]
    per_head = []
    for k in keys:
        row = {"head": k, "selection_R": round(float(np.mean(sel_scores[k])), 4)}
        for name, rec in runs.items():
            row[f"{name}_f1"] = rec["mean_f1"][k]
            row[f"{name}_em"] = rec["mean_em"][k]
            row[f"{name}_golden_mass"] = rec["mean_golden_mass"][k]
            row[f"{name}_rank"] = rank_of(rec["mean_f1"], k)
        per_head.append(row)

    def avg(name: str, metric: str, only: list[str] | None = None) -> float:
        vals = runs[name][metric]
        return round(float(np.mean([vals[k] for k in (only or vals)])), 4)

    def curve(rec: dict, key: str) -> dict[str, float]:
        vals = [r[key] for r in rec["log"] if key in r]
        n = max(1, len(vals) // 8)
        return {"first": round(float(np.mean(vals[:n])), 4), "last": round(float(np.mean(vals[-n:])), 4)}

    summary = {
        "machine": "2-core CPU (no GPU), fp32",
        "model": "embedded SmolLM2-135M-Instruct (30 layers x 9 query heads, 3 KV heads)",
        "settings": vars(args) | {"work": str(args.work), "out": str(args.out)},
        "epsilon": sel_rec["config"]["epsilon"],
        "heads": keys,
        "per_head": per_head,
        "selected_mean": {
            name: {m: avg(name, f"mean_{m}", keys) for m in ("f1", "em", "golden_mass")} for name in runs
        },
        "all_heads_mean": {
            name: {m: avg(name, f"mean_{m}") for m in ("f1", "em", "golden_mass")} for name in runs
        },
        "answer_accuracy": {name: runs[name]["answers"]["accuracy"] for name in runs},
        "train": {
            name: {
                "seconds": rec["seconds"],
                "seconds_per_step": rec["seconds_per_step"],
                "tokens_mean": rec["tokens_mean"],
                "clm": curve(rec, "clm"),
                "con": curve(rec, "con"),
                "loss": rec["loss"],
            }
            for name, rec in train.items()
        },  # fmt: skip
        "selection_epsilon_sweep": epsilon_sweep(w / "select_scores.masses.npz"),
        "eval_prompt_tokens_mean": round(float(np.mean(runs["base"]["prompt_tokens"])), 1),
        "commands": log,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out.with_suffix(".json"), json.dumps(summary, indent=1) + "\n")
    plot(per_head, summary, args.out.with_suffix(".png"))
    print(
        json.dumps(
            {k: summary[k] for k in ("selected_mean", "all_heads_mean", "answer_accuracy", "train")}, indent=1
        )
    )
    print(
        "| head | R (selection set) | F1 before | F1 vanilla SFT | F1 MuDAF | golden mass before | vanilla | MuDAF | rank before → SFT / MuDAF |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in per_head:
        print(f"| {r['head']} | {r['selection_R']:.3f} | {r['base_f1']:.3f} | {r['sft_f1']:.3f} | {r['mudaf_f1']:.3f} | "
              f"{r['base_golden_mass']:.3f} | {r['sft_golden_mass']:.3f} | {r['mudaf_golden_mass']:.3f} | "
              f"#{r['base_rank']} → #{r['sft_rank']} / #{r['mudaf_rank']} |")  # fmt: skip
    return 0


def epsilon_sweep(npz_path: Path, eps=(0.05, 0.08, 0.1, 0.15, 0.2, 0.3)) -> list[dict]:
    """F1 spread over heads on the selection set at several ε (from the saved masses, no model): why ε
    was lowered from the reference code's 0.3 for this model."""
    import torch

    from retmask.methods.mudaf.score import f1_em

    z = np.load(npz_path)
    masses = [torch.from_numpy(z[f"masses_{i}"]) for i in range(len(z["example_ids"]))]
    golden = [[int(x) for x in g.split(",")] for g in z["golden"]]
    out = []
    for e in eps:
        f1 = np.stack([f1_em(m, g, e)[0].numpy() for m, g in zip(masses, golden, strict=True)]).mean(0)
        top = np.argsort(-f1, axis=None, kind="stable")[:5]
        H = f1.shape[1]
        out.append({
            "epsilon": e, "max_f1": round(float(f1.max()), 3), "heads_f1_ge_0.2": int((f1 >= 0.2).sum()),
            "top5": [f"{i // H}-{i % H} ({f1.flat[i]:.3f})" for i in top],
        })  # fmt: skip
    return out


def plot(per_head: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    x = np.arange(len(per_head))
    for ax, metric, label in ((axes[0], "f1", f"MDQA retrieval score (mean F1, ε = {summary['epsilon']:g})"),
                              (axes[1], "golden_mass", "attention mass on golden passages")):  # fmt: skip
        for i, (name, title) in enumerate((("base", "original"), ("sft", "vanilla SFT"), ("mudaf", "MuDAF"))):
            vals = [r[f"{name}_{metric}"] for r in per_head]
            bars = ax.bar(x + (i - 1) * 0.27, vals, width=0.27, label=title)
            if metric == "f1":
                for b, r in zip(bars, per_head, strict=True):
                    ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"#{r[f'{name}_rank']}", ha="center",
                            va="bottom", fontsize=6)  # fmt: skip
        ax.set_xticks(x, [r["head"] for r in per_head])
        ax.set_xlabel("selected head (layer-head)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M, held-out synthetic MDQA: selected heads before / after (rank among 270 heads)",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    save_png(fig, path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
