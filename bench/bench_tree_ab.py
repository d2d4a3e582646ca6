"""Benchmark: the same user jobs run from two checkouts of retmask, interleaved, on one machine.

What a change to the kernel layer must not cost: the main job and a training step. For each checkout
(``--baseline DIR``: another checkout with its extension built in place, e.g. ``git worktree add
/tmp/base main && cd /tmp/base && python setup.py build_ext --inplace``; ``--candidate DIR``: this one by
default), the jobs run as subprocesses with that checkout first on ``PYTHONPATH``, in A B B A ... order
(``--rounds``) so that drift of the shared machine hits both alike:

  detect  ``retmask detect`` on the embedded SmolLM2 with the default grid (fp32): the seconds of
          detection from the run record (model loading excluded) and whether the scores files of the
          two checkouts are byte-identical;
  dpo     ``retmask train`` (DPO through TRL, fp32, ``--max-steps`` steps) on a pairs file made once
          (``retmask mask`` + ``retmask generate`` from the candidate): the seconds per optimizer step
          from ``retmask_train.json`` and the largest difference of the per-step losses.

Writes bench/results/tree_ab_<cpu kind>.{md,json,png}.

    python bench/bench_tree_ab.py --baseline /tmp/base --work runs/tree_ab
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_kind, cpu_label, machine_description, markdown_table, save_figure  # noqa: E402

from retmask.commands.argtypes import positive_int  # noqa: E402
from retmask.runfiles import atomic_write_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
SCORES = RESULTS / "smollm2_scores.json"
JOBS = ("detect", "dpo")


def retmask(tree: Path, args: list[str], log: Path) -> float:
    """Run ``python -m retmask ARGS`` with ``tree`` first on PYTHONPATH; wall seconds. Raises on failure,
    naming the log."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run([sys.executable, "-m", "retmask", *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                            cwd=tree, check=False).returncode  # fmt: skip
    if rc != 0:
        raise SystemExit(f"retmask {' '.join(args)} from {tree} failed with exit code {rc}; see {log}")
    return time.perf_counter() - start


def make_pairs(tree: Path, work: Path, instructions: int) -> Path:
    pairs = work / "pairs.jsonl"
    if pairs.exists():
        return pairs
    heads = work / "heads.json"
    retmask(
        tree, ["mask", "--scores", str(SCORES), "--threshold", "0.1", "--out", str(heads)], work / "mask.log"
    )
    retmask(tree, ["generate", "--heads", str(heads), "--out", str(pairs), "--limit", str(instructions),
                   "--max-new-tokens", "64", "--no-progress"], work / "generate.log")  # fmt: skip
    return pairs


def run_detect(tree: Path, out: Path) -> dict:
    if out.parent.exists():
        shutil.rmtree(out.parent)
    out.parent.mkdir(parents=True)
    wall = retmask(tree, ["detect", "--out", str(out), "--no-progress"], out.parent / "detect.log")
    record = json.loads(out.with_name(out.stem + ".run.json").read_text())
    timings = record.get("timings", {})
    seconds = timings.get("tests_s") or wall  # detection only: no model loading, no test building
    return {"seconds": seconds, "wall_s": wall, "scores": out.read_bytes().decode()}


def run_dpo(tree: Path, pairs: Path, out: Path, steps: int) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    args = ["train", "--pairs", str(pairs), "--out", str(out / "model"), "--max-steps", str(steps), "--dtype",
            "float32"]  # fmt: skip
    wall = retmask(tree, args, out / "train.log")
    summary = json.loads((out / "model" / "retmask_train.json").read_text())
    return {"seconds": summary["seconds_per_step"], "wall_s": wall, "losses": summary["losses"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--baseline", type=Path, required=True, help="checkout to compare against (built in place)"
    )
    ap.add_argument("--candidate", type=Path, default=REPO, help="checkout under test (default: this one)")
    ap.add_argument("--jobs", nargs="+", choices=JOBS, default=list(JOBS))
    ap.add_argument(
        "--rounds", type=positive_int, default=1, help="A B rounds per job (each round runs B A after A B)"
    )
    ap.add_argument("--steps", type=positive_int, default=8, help="DPO optimizer steps per run")
    ap.add_argument("--instructions", type=positive_int, default=16, help="instructions for the DPO pairs")
    ap.add_argument("--work", type=Path, default=Path("runs/tree_ab"))
    ap.add_argument("--out", default=None, help="output path without suffix (default: results/tree_ab_<cpu>)")
    args = ap.parse_args()
    trees = {"baseline": args.baseline.resolve(), "candidate": args.candidate.resolve()}
    for name, tree in trees.items():
        if not (tree / "retmask" / "__init__.py").exists():
            raise SystemExit(f"--{name} {tree}: not a retmask checkout")
    args.work.mkdir(parents=True, exist_ok=True)
    order = [side for _ in range(args.rounds) for side in ("baseline", "candidate", "candidate", "baseline")]
    runs: dict[str, dict[str, list[dict]]] = {job: {"baseline": [], "candidate": []} for job in args.jobs}
    pairs = make_pairs(trees["candidate"], args.work, args.instructions) if "dpo" in args.jobs else None
    for job in args.jobs:
        for i, side in enumerate(order):
            where = args.work / job / f"{i}_{side}"
            print(f"== {job} {i + 1}/{len(order)}: {side} ({trees[side]})", flush=True)
            if job == "detect":
                result = run_detect(trees[side], where / "smollm2.json")
            else:
                result = run_dpo(trees[side], pairs, where, args.steps)
            print(f"   {result['seconds']:.3f} s", flush=True)
            runs[job][side].append(result)
    machine = machine_description()
    rows, summary = [], {}
    for job, sides in runs.items():
        base = statistics.median(r["seconds"] for r in sides["baseline"])
        cand = statistics.median(r["seconds"] for r in sides["candidate"])
        if job == "detect":
            same = len({r["scores"] for r in sides["baseline"] + sides["candidate"]}) == 1
            check = f"scores files byte-identical: {same}"
        else:
            diffs = [abs(a - b) for r in sides["candidate"] for a, b in zip(r["losses"], sides["baseline"][0]["losses"],
                                                                            strict=True)]  # fmt: skip
            same = max(diffs) if diffs else None
            check = f"largest loss difference per step: {same:.2e}"
        unit = "s of detection" if job == "detect" else "s per DPO step"
        summary[job] = {"baseline_s": base, "candidate_s": cand, "ratio": cand / base, "check": same,
                        "runs": {s: [r["seconds"] for r in rs] for s, rs in sides.items()}}  # fmt: skip
        rows.append([job, f"{base:.2f} {unit}", f"{cand:.2f} {unit}", f"{cand / base:.2f}x", check])
    table = markdown_table(["job", "baseline", "candidate", "candidate / baseline", "same results"], rows)
    print(table)
    stem = Path(args.out) if args.out else RESULTS / f"tree_ab_{cpu_kind(machine)}"
    lines = [
        f"# The same jobs from two checkouts ({cpu_label(machine)})",
        "",
        (args.label or f"Baseline: `{trees['baseline']}`; candidate: `{trees['candidate']}`.")
        + " Order per job: "
        f"{' '.join(order)} (medians). `detect`: `retmask detect`, default grid, fp32, seconds of detection "
        f"(the run record's `tests_s`); `dpo`: `retmask train`, fp32, {args.steps} steps on {args.instructions} "
        "pairs, "
        "seconds per optimizer step (`retmask train`'s defaults otherwise).",
        "",
        table,
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + ".",
    ]
    stem.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(stem.with_suffix(".md"), "\n".join(lines) + "\n")
    atomic_write_text(
        stem.with_suffix(".json"), json.dumps({"machine": machine, "order": order, "jobs": summary}, indent=1)
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    names = list(summary)
    ax.bar([n + "\nbaseline" for n in names], [1.0] * len(names), color="grey")
    ax.bar([n + "\ncandidate" for n in names], [summary[n]["ratio"] for n in names], color="tab:blue")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_ylabel("time / baseline's")
    save_figure(fig, stem.with_suffix(".png"), "Same jobs, two checkouts")
    print(f"wrote {stem.with_suffix('.md')}")


if __name__ == "__main__":
    main()
