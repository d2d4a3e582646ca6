"""MuDAF against vanilla SFT over several seeds: does the one-seed result of ``mudaf_smollm2.md`` hold?

Runs ``bench/mudaf_smollm2.py`` once per seed. The data (train / selection / held-out eval sets), the MDQA
scores of the selection set and the original model's evaluation do not depend on the seed: the first seed
computes them and the other seeds reuse them (copied, so each work dir is complete and resumable). A seed
sets ``mudaf-train --seed``: which 8 heads are sampled (``P(h) ∝ exp(R_h / 0.05)``), the data order and the
initialisation, for MuDAF and for the vanilla-SFT run on the same heads. Per seed the two runs are paired
(same heads, data order and steps): the page gives the paired differences MuDAF - SFT of the selected
heads' MDQA retrieval score (mean F1), their attention mass on the golden passages and the answer
accuracy, with mean and standard deviation over seeds.

Writes bench/results/mudaf_seeds_smollm2.{md,json,png}.

    flock /tmp/retmask-heavy.lock python bench/mudaf_seeds.py --seeds 0,1,2,3,4,5,6,7,8,9   # the page (default: 0, 1, 2)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_label, machine_description, markdown_table, page_tail, paired_stats, write_page  # noqa: E402

from retmask.plotting import save_figure as save_png  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
# Seed-independent outputs of mudaf_smollm2.py (the data, the selection scores, the original's evaluation).
SHARED = ("train.jsonl", "select.jsonl", "eval.jsonl", "select_scores.json", "select_scores.run.json",
          "select_scores.masses.npz", "select_scores.png", "eval_base.json", "eval_base.run.json",
          "eval_base.masses.npz")  # fmt: skip
MEASURES = (("f1", "selected heads' MDQA F1"), ("golden_mass", "selected heads' golden-passage mass"),
            ("accuracy", "answer accuracy"))  # fmt: skip


def run_seed(work: Path, seed: int, first: Path | None) -> dict:
    """Run (or resume) mudaf_smollm2.py for one seed; returns its summary JSON."""
    work.mkdir(parents=True, exist_ok=True)
    if first is not None:
        for name in SHARED:
            if (first / name).is_file() and not (work / name).exists():
                shutil.copyfile(first / name, work / name)
    out = work / "summary"
    if not out.with_suffix(".json").is_file():
        cmd = [
            sys.executable,
            str(HERE / "mudaf_smollm2.py"),
            "--work",
            str(work),
            "--seed",
            str(seed),
            "--out",
            str(out),
        ]
        subprocess.run(cmd, check=True)
    return json.loads(out.with_suffix(".json").read_text())


def measures(summary: dict, run: str) -> dict[str, float]:
    return {
        "f1": summary["selected_mean"][run]["f1"],
        "golden_mass": summary["selected_mean"][run]["golden_mass"],
        "accuracy": summary["answer_accuracy"][run],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--work", type=Path, default=Path("runs/mudaf_seeds"))
    ap.add_argument("--out", type=Path, default=RESULTS / "mudaf_seeds_smollm2")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    summaries = {}
    for seed in seeds:
        print(f"== seed {seed}", flush=True)
        first = None if seed == seeds[0] else args.work / f"s{seeds[0]}"
        summaries[seed] = run_seed(args.work / f"s{seed}", seed, first)
    by_seed = {s: {run: measures(summaries[s], run) for run in ("base", "sft", "mudaf")} for s in seeds}
    paired = {
        key: paired_stats([by_seed[s]["mudaf"][key] - by_seed[s]["sft"][key] for s in seeds])
        for key, _ in MEASURES
    }
    machine = machine_description()
    rows = [
        [str(s), ", ".join(summaries[s]["heads"])]
        + [f"{by_seed[s]['base'][k]:.3f} → {by_seed[s]['sft'][k]:.3f} / {by_seed[s]['mudaf'][k]:.3f}" for k, _ in MEASURES]
        + [f"{summaries[s]['train']['sft']['seconds']:.0f} / {summaries[s]['train']['mudaf']['seconds']:.0f}"]
        for s in seeds
    ]  # fmt: skip
    cmp_rows = [
        [what, ", ".join(f"{x:+.3f}" for x in paired[k]["per_seed"]), f"{paired[k]['mean']:+.3f} ± {paired[k]['std']:.3f}",
         f"{paired[k]['ci95'][0]:+.3f} to {paired[k]['ci95'][1]:+.3f}",
         f"{paired[k]['ahead']} ahead, {paired[k]['behind']} behind", f"{paired[k]['p_sign_seeds']:.3g}"]
        for k, what in MEASURES
    ]  # fmt: skip
    s0 = summaries[seeds[0]]
    md = [
        f"# MuDAF vs vanilla SFT over {len(seeds)} seeds (embedded SmolLM2-135M-Instruct, {cpu_label(machine)})",
        "",
        f"Each seed: `bench/mudaf_smollm2.py --seed S` (settings as in `mudaf_smollm2.md`: {s0['settings']['steps']} "
        f"steps, batch {s0['settings']['batch_size']}, lr {s0['settings']['lr']:g}, λ {s0['settings']['lam']:g}, "
        f"ε {s0['epsilon']:g}, fp32); the seed samples the 8 heads and orders the data. Selection and held-out "
        "evaluation sets are shared by all seeds (generated once, different fictional worlds).",
        "",
        "## MuDAF - SFT, paired by seed (same heads, same data order and steps)",
        "",
        "Mean ± sample std of the per-seed differences; 95% CI: t-interval of that mean; p: exact two-sided sign "
        "test of the seeds ahead against those behind.",
        "",
        markdown_table(["measure", "per seed", "mean ± std", "95% CI", "MuDAF", "p (seeds)"], cmp_rows),
        "",
        "## Per seed (original → vanilla SFT / MuDAF)",
        "",
        markdown_table(
            ["seed", "sampled heads"] + [w for _, w in MEASURES] + ["train s (SFT / MuDAF)"], rows
        ),
        *page_tail(args.out, machine),
    ]
    write_page(args.out, md, {"seeds": seeds, "by_seed": by_seed, "paired_mudaf_minus_sft": paired,
                              "machine": machine, "heads": {s: summaries[s]["heads"] for s in seeds}})  # fmt: skip
    plot(by_seed, seeds, args.out.with_suffix(".png"))


def plot(by_seed: dict, seeds: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MEASURES), figsize=(4 * len(MEASURES), 3.6))
    x = np.arange(len(seeds))
    for ax, (key, what) in zip(axes, MEASURES, strict=True):
        for i, (run, label) in enumerate((("base", "original"), ("sft", "vanilla SFT"), ("mudaf", "MuDAF"))):
            ax.bar(x + (i - 1) * 0.27, [by_seed[s][run][key] for s in seeds], 0.27, label=label)
        ax.set_xticks(x, [f"seed {s}" for s in seeds])
        ax.set_title(what, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


if __name__ == "__main__":
    main()
