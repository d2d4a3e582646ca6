"""Compose ``bench/results/retmask_smollm2.md`` from the pipeline runs (no model computation of its own).

The runs (``runs/retmask_smollm2/run.sh`` in the results page) are ``retmask pipeline`` calls sharing the
detection (``bench/results/smollm2_scores.json``) and the original model's evaluation (``--eval-cache``).
This script reads their ``pipeline.json``, pair statistics, training logs and telemetry, and calls
``run_suite`` on all trained models at once: every model is in the shared eval cache, so nothing is
re-evaluated; it only renders the combined tables and figures.

    python bench/retmask_smollm2.py --runs runs/retmask_smollm2
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from retmask.runfiles import atomic_write_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # result pages and data live apart from the scripts
VARIANTS = [  # (run dir name, label, description)
    ("retmask", "RetMask", "retrieval heads (score >= 0.1) masked for the rejected responses"),
    ("non-retrieval", "Non-Retrieval-Mask", "as many random non-retrieval heads masked"),
    ("random", "Random-Mask", "as many random heads (any) masked"),
    (
        "retmask-lr2e-5",
        "RetMask, lr 2e-5 (deviation)",
        "same pairs as RetMask, peak lr 40x the published 5e-7",
    ),
    (
        "random-lr2e-5",
        "Random-Mask, lr 2e-5 (deviation)",
        "same pairs as Random-Mask, peak lr 40x the published one",
    ),
]


def _load(p: Path) -> dict:
    return json.loads(p.read_text(encoding="utf-8"))


def _table(head, rows) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def main() -> None:
    from retmask.evaluate.suite import EvalConfig, render_report, run_suite

    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=Path, default=Path("runs/retmask_smollm2"))
    ap.add_argument("--out", type=Path, default=RESULTS / "retmask_smollm2.md")
    ap.add_argument(
        "--notes", type=Path, default=RESULTS / "retmask_smollm2.notes.md", help="hand-written findings"
    )
    args = ap.parse_args()
    runs = [(d, lab, desc) for d, lab, desc in VARIANTS if (args.runs / d / "eval" / "eval.json").is_file()]
    states = {d: _load(args.runs / d / "pipeline.json") for d, _, _ in runs}

    # combined evaluation: every model is cached, this only renders
    first = states[runs[0][0]]["config"]
    ecfg = EvalConfig(min_len=first["eval_min_len"], max_len=first["eval_max_len"], num_lengths=first["eval_lengths"],
                      num_depths=first["eval_depths"], niah_needles=first["eval_needles"], tasks=first["eval_tasks"])  # fmt: skip
    models = [None] + [str(args.runs / d / "train" / "model") for d, _, _ in runs]
    labels = ["original"] + [lab for _, lab, _ in runs]
    heads = [args.runs / "retmask" / "mask" / "heads.json"] + [
        args.runs / d / "mask" / "heads.json" for d in ("non-retrieval", "random") if (args.runs / d).is_dir()
    ]
    with tempfile.TemporaryDirectory() as tmp:
        data = run_suite(models, tmp, ecfg, labels=labels, heads_files=heads, cache_dir=args.runs / "eval_cache",
                         progress=False)  # fmt: skip
        for name in ("niah.png", "tasks.png", "shift.png"):
            shutil.copyfile(Path(tmp) / name, RESULTS / f"retmask_smollm2_{name}")
    slim = {**data, "models": [{k: v for k, v in m.items() if k not in ("niah", "multi_needle", "kv")} | {
        "niah_grid": m["niah"]["grid"], "multi_needle_by_length": m["multi_needle"]["by_length"],
        "kv_by_length": m["kv"]["by_length"]} for m in data["models"]]}  # fmt: skip
    atomic_write_text(RESULTS / "retmask_smollm2.json", json.dumps(slim, indent=1))

    out = [
        "# RetMask on the embedded SmolLM2-135M-Instruct: pipeline vs Random-Mask and Non-Retrieval-Mask",
        "",
    ]
    out += ["Machine: the project's 2-core CPU (AMD EPYC, torch 2.13.0+cpu, 2 threads), shared with other jobs "
            "(heavy jobs serialised by a lock). fp32 everywhere.", ""]  # fmt: skip
    if args.notes.is_file():
        out += [args.notes.read_text(encoding="utf-8").strip(), ""]
    out += ["## Commands", "", "```bash"]
    for d, _, _ in runs:
        c = states[d]["config"]
        extra = "" if c["lr"] == 5e-7 else f" --lr {c['lr']:g}"
        out.append(f"retmask pipeline --run-dir runs/retmask_smollm2/{d} --baseline {c['baseline']}{extra} \\\n"
                   "    --scores bench/results/smollm2_scores.json --eval-cache runs/retmask_smollm2/eval_cache")  # fmt: skip
    out += ["python bench/retmask_smollm2.py   # this page (renders from the caches)", "```", ""]
    if any(d == "retmask-lr2e-5" for d, _, _ in runs):
        out += ["The deviation run copies `detect/`, `mask/`, `generate/` and `pipeline.json` of the RetMask run into "
                "its run dir first, so the pipeline's fingerprints skip those stages and only train + eval run.", ""]  # fmt: skip

    # stage times
    rows = []
    for d, lab, _ in runs:
        st = states[d]["stages"]
        cells = [lab] + [f"{st[s]['seconds']:.0f}" if s in st and "seconds" in st[s] else "-" for s in
                         ("detect", "mask", "generate", "train", "eval")]  # fmt: skip
        rows.append(cells)
    out += ["## Measured stage times (seconds, 2-core CPU)", "",
            "detect = copying the reused scores (the default detection grid itself took 345 s, "
            "`bench/results/smollm2_scores.run.json`); eval = the original model (first run only; then cached) "
            "+ the trained model.", "", _table(["run", "detect", "mask", "generate", "train", "eval"], rows), ""]  # fmt: skip

    # pairs and training
    rows = []
    for d, lab, _ in runs:
        st = _load(args.runs / d / "generate" / "pairs.stats.json")
        mask = _load(args.runs / d / "mask" / "heads.json")
        tr = _load(args.runs / d / "train" / "model" / "retmask_train.json")
        last = [h for h in tr["log_history"] if "loss" in h]
        margin = last[-1].get("rewards/margins", float("nan")) if last else float("nan")
        acc = last[-1].get("rewards/accuracies", float("nan")) if last else float("nan")
        rows.append([lab, mask["num_heads"], st["pairs"], sum(st["dropped"].values()),
                     f"{st.get('mean_prompt_tokens', float('nan')):.0f}", f"{st.get('mean_chosen_tokens', float('nan')):.0f} / "
                     f"{st.get('mean_rejected_tokens', float('nan')):.0f}", tr["steps"], f"{tr['losses'][0]:.4f} → {tr['losses'][-1]:.4f}",
                     f"{margin:.4f}", f"{acc:.2f}", f"{tr['seconds_per_step']:.1f}"])  # fmt: skip
    out += ["## Pairs and DPO", "",
            _table(["run", "masked heads", "pairs", "dropped", "mean prompt tok", "mean chosen / rejected tok", "steps",
                    "loss first → last", "last reward margin", "last reward acc.", "s/step"], rows), ""]  # fmt: skip

    # telemetry
    rows = []
    for d, lab, _ in runs:
        p = args.runs / d / "train" / "model" / "telemetry.json"
        if p.is_file():
            h = _load(p)["history"]
            rows.append([lab, " → ".join(f"{x['masked_mean']:.4f}" for x in h), " → ".join(f"{x['other_mean']:.4f}" for x in h),
                         " ".join(str(int(x["probe_counted"])) for x in h)])  # fmt: skip
    out += ["## Live retrieval telemetry during DPO (probe: 2 needles × 1000 tokens × depths 25/75 %)", "",
            "Mean retrieval score of the run's masked heads and of all other heads at each probe (steps 0, 2, 4, …, end).",
            "", _table(["run", "masked heads", "other heads", "counted probe tests"], rows), ""]  # fmt: skip

    report = render_report(data).split("\n", 1)[1]  # drop its title
    report = report.replace("(tasks.png)", "(retmask_smollm2_tasks.png)").replace(
        "(niah.png)", "(retmask_smollm2_niah.png)"
    )
    report = report.replace("(shift.png)", "(retmask_smollm2_shift.png)")
    out += ["## Evaluation (`retmask eval`, all models)", report]
    atomic_write_text(args.out, "\n".join(out) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
