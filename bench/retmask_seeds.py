"""RetMask against its baselines over several seeds: is the retrieval-head contrast separable from noise?

One ``retmask pipeline`` per (baseline, seed), all reusing one detection (``--scores``) and one evaluation
cache (the original model is evaluated once). A seed sets the sampling of the chosen / rejected responses
(``--gen-seed``), the random baselines' heads (``--mask-seed``) and DPO's data order and initialisation
(``--train-seed``); RetMask's heads are the same in every seed (score >= 0.1). Each pipeline is resumable
(its stage fingerprints), so running this script again continues where it stopped and then only renders.

Reported per run: NIAH (mean ROUGE-1 recall over the evaluation grid) of the trained model against the
original, and the mean retrieval score of the retrieval heads (the detection's τ set) and of all other
heads on the evaluation's NIAH tests (the retrieval-score shift). Per seed the RetMask run is paired with each
baseline run of the same seed (same instructions, same generation seed): the page gives the paired
differences, their mean and standard deviation over seeds, and on how many seeds RetMask is ahead.

Writes bench/results/retmask_seeds_smollm2.{md,json,png}.

    flock /tmp/retmask-heavy.lock python bench/retmask_seeds.py                  # 3 seeds x RetMask / Random-Mask
    python bench/retmask_seeds.py --seeds 0 --baselines retmask --runs /tmp/rs    # one run, quick look
    flock /tmp/retmask-heavy.lock python bench/retmask_seeds.py --seeds 0,1,2,3,4 \
        --baselines retmask,random,non-retrieval,sft,win-lose   # the page's study: every published baseline
    python bench/retmask_seeds.py --no-launch --seeds 0,1,2,3,4,5,6,7,8,9 \
        --baselines retmask,random,non-retrieval,sft,win-lose   # render the finished runs only: each
                                                                # comparison over the seeds both sides have
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    cpu_label,
    machine_description,
    markdown_table,
    page_tail,
    paired_stats,
    sign_test_p,
    write_page,
)

from retmask.evaluate.shift import split_means  # noqa: E402
from retmask.heads import load_scores  # noqa: E402
from retmask.heads.keys import RETRIEVAL_TAU  # noqa: E402
from retmask.plotting import save_figure as save_png  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LABELS = {
    "retmask": "RetMask",
    "random": "Random-Mask",
    "non-retrieval": "Non-Retrieval-Mask",
    "sft": "SFT on chosen",
    "win-lose": "Win-Lose-Pair",
}


def pipeline_argv(args: argparse.Namespace, baseline: str, seed: int) -> list[str]:
    """The ``retmask pipeline`` command of one (baseline, seed) run. "sft" is the SFT baseline: the
    RetMask run's pairs (same seeds), trained on the chosen responses only."""
    variant = ["--baseline", "retmask", "--sft"] if baseline == "sft" else ["--baseline", baseline]
    return [
        sys.executable, "-m", "retmask", "pipeline", "--run-dir", str(run_dir(args, baseline, seed)),
        *variant, "--scores", str(args.scores), "--dtype", args.dtype, "--lr", str(args.lr),
        "--num-instructions", str(args.num_instructions), "--gen-seed", str(seed), "--mask-seed", str(seed),
        "--train-seed", str(seed), "--telemetry-every", "0", "--eval-tasks", "niah",
        "--eval-lengths", str(args.eval_lengths), "--eval-depths", str(args.eval_depths),
        "--eval-needles", str(args.eval_needles), "--eval-cache", str(args.runs / "eval_cache"), "--no-progress",
    ]  # fmt: skip


def run_dir(args: argparse.Namespace, baseline: str, seed: int) -> Path:
    return args.runs / f"{baseline}-s{seed}"


def finished(args: argparse.Namespace, baseline: str, seed: int) -> bool:
    return (run_dir(args, baseline, seed) / "eval" / "eval.json").is_file()


def seeds_label(shared: dict[str, list[int]]) -> str:
    """How many seeds the comparisons use: "5", or "5-10" when they differ."""
    counts = sorted({len(v) for v in shared.values()})
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def read_run(path: Path, retrieval: list[tuple[int, int]]) -> dict:
    """NIAH and retrieval-score shift of one finished pipeline run (its eval.json: original, trained)."""
    data = json.loads((path / "eval" / "eval.json").read_text())
    original, trained = data["models"][0], data["models"][-1]
    state = json.loads((path / "pipeline.json").read_text())
    (ret0, oth0), (ret1, oth1) = (
        split_means(np.asarray(m["scores"]["mean"]), retrieval) for m in (original, trained)
    )
    train_record = json.loads((path / "train" / "model" / "retmask_train.json").read_text())
    pair_stats = json.loads((path / "generate" / "pairs.stats.json").read_text())
    return {
        "niah_original": original["tasks"]["niah"],
        "niah": trained["tasks"]["niah"],
        "niah_change": trained["tasks"]["niah"] - original["tasks"]["niah"],
        "niah_tests": len(trained["niah"]["entries"]),
        "per_test_recall": [e["rouge1_recall"] for e in trained["niah"]["entries"]],
        "original_per_test_recall": [e["rouge1_recall"] for e in original["niah"]["entries"]],
        "retrieval_heads_change": ret1 - ret0,
        "other_heads_change": oth1 - oth0,
        "counted": trained["scores"]["counted"],
        "stage_seconds": {k: v.get("seconds") for k, v in state["stages"].items()},
        "masked_heads": len(json.loads((path / "mask" / "heads.json").read_text())["heads"]),
        "pairs": pair_stats["pairs"],
        "instructions_used": pair_stats["instructions"],
        "train_record": train_record,
    }


def paired(runs: dict, seeds: list[int], base: str, other: str, key: str) -> dict:
    """Per-seed ``runs[base, s][key] - runs[other, s][key]`` and their statistics (``common.paired_stats``)."""
    return paired_stats([runs[base, s][key] - runs[other, s][key] for s in seeds])


def sign_test(runs: dict, seeds: list[int], base: str, other: str) -> dict:
    """Per-test recall of ``base`` against ``other`` pooled over seeds (test i of one seed is the same
    prompt in both runs): tests won / lost / tied, and the exact two-sided sign-test p-value of the
    wins against the losses (ties dropped)."""
    wins = losses = ties = 0
    for s in seeds:
        for a, b in zip(runs[base, s]["per_test_recall"], runs[other, s]["per_test_recall"], strict=True):
            wins, losses, ties = wins + (a > b), losses + (a < b), ties + (a == b)
    return {"won": wins, "lost": losses, "tied": ties, "p_two_sided": sign_test_p(wins, losses)}


def plot(runs: dict, seeds: list[int], baselines: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # side by side for a few seeds; one above the other for many, so each panel keeps room for 5 bars a seed
    stacked = len(seeds) > 6
    fig, axes = plt.subplots(2 if stacked else 1, 1 if stacked else 2,
                             figsize=(max(10.0, 1.1 * len(seeds) + 1), 7 if stacked else 4))  # fmt: skip
    width = 0.8 / len(baselines)
    x = np.arange(len(seeds))
    for i, b in enumerate(baselines):
        for ax, key in zip(axes, ("niah_change", "retrieval_heads_change"), strict=True):
            ax.bar(x + (i - (len(baselines) - 1) / 2) * width,
                   [runs[b, s][key] if (b, s) in runs else np.nan for s in seeds], width,
                   label=LABELS[b])  # fmt: skip
    for ax, title in zip(
        axes, ("NIAH change (trained - original)", "retrieval heads' score change"), strict=True
    ):
        ax.set_xticks(x, [f"seed {s}" for s in seeds])
        ax.axhline(0, color="grey", lw=0.7)
        ax.set_title(title, fontsize=9)
    # one legend under both panels: inside a panel it hides the bars of the last seeds
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncols=len(baselines), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.04 if stacked else 0.07, 1, 1))
    save_png(fig, path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--baselines", default="retmask,random", help="RetMask first, then the baselines")
    ap.add_argument("--runs", type=Path, default=Path("runs/retmask_seeds"))
    ap.add_argument("--scores", type=Path, default=RESULTS / "smollm2_scores_shipped-haystack.json")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--num-instructions", type=int, default=32)
    ap.add_argument("--eval-lengths", type=int, default=3)
    ap.add_argument("--eval-depths", type=int, default=5)
    ap.add_argument("--eval-needles", type=int, default=6)
    ap.add_argument("--out", type=Path, default=RESULTS / "retmask_seeds_smollm2")
    ap.add_argument("--no-launch", action="store_true",
                    help="start no pipeline: render the finished runs among --seeds x --baselines, each comparison "
                         "over the seeds where both of its runs are finished")  # fmt: skip
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    baselines = args.baselines.split(",")
    if baselines[0] != "retmask" or not set(baselines) <= set(LABELS):
        raise SystemExit(f"--baselines: retmask first, then any of {list(LABELS)[1:]}")
    args.runs.mkdir(parents=True, exist_ok=True)
    wall = {}
    for seed in seeds:  # seed-major: an interrupted study still has complete pairs
        for baseline in baselines:
            if args.no_launch or finished(args, baseline, seed):
                continue
            print(f"== {LABELS[baseline]}, seed {seed}", flush=True)
            start = time.perf_counter()
            subprocess.run(pipeline_argv(args, baseline, seed), check=True)
            wall[baseline, seed] = time.perf_counter() - start
    retrieval = sorted(h for h, s in load_scores(args.scores).items() if s >= RETRIEVAL_TAU)
    runs = {
        (b, s): read_run(run_dir(args, b, s), retrieval)
        for b in baselines
        for s in seeds
        if finished(args, b, s)
    }
    shared = {
        other: [s for s in seeds if ("retmask", s) in runs and (other, s) in runs] for other in baselines[1:]
    }
    if not all(shared.values()) or ("retmask", seeds[0]) not in runs:
        raise SystemExit(f"no seed with finished runs of RetMask and each baseline: {shared}")
    comparisons = {
        other: {
            key: paired(runs, shared[other], "retmask", other, key)
            for key in ("niah", "retrieval_heads_change")
        }
        for other in baselines[1:]
    }
    tests = {other: sign_test(runs, shared[other], "retmask", other) for other in baselines[1:]}
    machine = machine_description()
    first = runs[baselines[0], seeds[0]]
    rows = [
        [LABELS[b], str(s), "-" if b == "sft" else str(runs[b, s]["masked_heads"]), f"{runs[b, s]['niah']:.3f}",
         f"{runs[b, s]['pairs']} / {runs[b, s]['instructions_used']}",
         f"{runs[b, s]['niah_change']:+.3f}", f"{runs[b, s]['retrieval_heads_change']:+.4f}",
         f"{runs[b, s]['other_heads_change']:+.4f}", str(runs[b, s]["counted"]),
         f"{runs[b, s]['stage_seconds'].get('generate') or 0:.0f} / {runs[b, s]['stage_seconds'].get('train') or 0:.0f}"
         f" / {runs[b, s]['stage_seconds'].get('eval') or 0:.0f}"]
        for s in seeds for b in baselines if (b, s) in runs
    ]  # fmt: skip
    cmp_rows = []
    for other, c in comparisons.items():
        for key, what in (("niah", "NIAH"), ("retrieval_heads_change", "retrieval heads' score change")):
            d = c[key]
            cmp_rows.append([
                f"RetMask - {LABELS[other]}", what, str(len(shared[other])), ", ".join(f"{x:+.4f}" for x in d["per_seed"]),
                f"{d['mean']:+.4f} ± {d['std']:.4f}", f"{d['ci95'][0]:+.4f} to {d['ci95'][1]:+.4f}",
                f"{d['ahead']} ahead, {d['behind']} behind", f"{d['p_sign_seeds']:.3g}",
            ])  # fmt: skip
    test_rows = [
        [
            f"RetMask vs {LABELS[o]}",
            str(len(shared[o])),
            str(t["won"]),
            str(t["lost"]),
            str(t["tied"]),
            f"{t['p_two_sided']:.3g}",
        ]
        for o, t in tests.items()
    ]
    md = [
        f"# RetMask vs baselines over {seeds_label(shared)} seeds (embedded SmolLM2-135M-Instruct, "
        f"{cpu_label(machine)})",
        "",
        f"Each run: `retmask pipeline` with `--dtype {args.dtype}` (bf16 autocast where the CPU has native "
        f"bf16), lr {args.lr:g} (the published lr is 5e-7: see `retmask_smollm2.md`, where 5e-7 changed "
        "no answer at "
        f"this scale), {args.num_instructions} instructions, DPO 2 epochs at global batch 8 (SFT on chosen: the "
        "RetMask run's pairs of the same seed, the chosen responses only, same optimiser settings; Win-Lose-Pair: "
        "two samples of the unmasked model per instruction, the one with the higher ROUGE-L F1 against the "
        "instruction's reference answer chosen, instructions drawn from those with a reference; its judge ties "
        "often, and tied pairs are dropped and made up by further instructions, so it trains on as many pairs "
        "as the others; the published runs' judge is Gemma-3-27B-IT), telemetry off; "
        f"detection reused from `{args.scores.name}` ({len(retrieval)} retrieval heads at τ = {RETRIEVAL_TAU}); "
        f"evaluation: NIAH only, {first['niah_tests']} tests ({args.eval_lengths} lengths in 1000-4000 tokens x "
        f"{args.eval_depths} depths x {args.eval_needles} needles), greedy. Original model NIAH: "
        f"{first['niah_original']:.3f}.",
        "",
        "## Paired by seed (same generation seed; same instructions except Win-Lose-Pair's, drawn from those "
        "with a reference answer)",
        "",
        "Mean ± sample std of the per-seed differences; 95% CI: t-interval of that mean (the seeds are the "
        "independent units); p: exact two-sided sign test of the seeds ahead against those behind.",
        "",
        markdown_table(
            ["difference", "measure", "seeds", "per seed", "mean ± std", "95% CI", "RetMask", "p (seeds)"],
            cmp_rows,
        ),  # fmt: skip
        "",
        f"Per NIAH test, pooled over the seeds (the same {first['niah_tests']} prompts in every run; a test is won "
        "when its ROUGE-1 recall is higher; p: exact two-sided sign test of won against lost, ties dropped; "
        "tests of one seed share the trained model, so they are not independent and p is optimistic):",
        "",
        markdown_table(["comparison", "seeds", "tests won", "lost", "tied", "p"], test_rows),
        "",
        "## Runs",
        "",
        markdown_table(
            [
                "run",
                "seed",
                "masked heads",
                "NIAH",
                "pairs / instructions",
                "NIAH change",
                "retrieval heads' score change",
                "other heads' change",
                "counted NIAH tests",
                "generate / train / eval s",
            ],
            rows,
        ),  # fmt: skip
        *page_tail(args.out, machine),
    ]
    summary = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seeds": seeds, "seeds_per_comparison": shared, "baselines": baselines, "retrieval_heads": [f"{ly}-{h}" for ly, h in retrieval],
        "runs": {f"{b}-s{s}": r for (b, s), r in runs.items()}, "comparisons": comparisons, "sign_tests": tests,
        "wall_seconds_this_invocation": {f"{b}-s{s}": w for (b, s), w in wall.items()}, "machine": machine,
    }  # fmt: skip
    write_page(args.out, md, summary)
    plot(runs, seeds, baselines, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
