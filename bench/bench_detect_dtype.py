"""Benchmark: `retmask detect` in bfloat16 against float32 on the same grid: do the scores, the retrieval
heads and the answers agree, and what does bf16 cost or save on this CPU?

Runs ``run_detect`` once per dtype (resumable: the runs live in ``--run-dir``; run the command again after
an interruption, or to re-render the page from finished runs, which are read back with their per-test
results), then compares per test (greedy answers, counted or not, per-head copy counts) and per
head (mean retrieval score: Spearman over heads, the τ = 0.1 sets, the top 10). Time is the sum of the
per-test prefill and decode seconds, so a resumed run is timed correctly.

The same machinery compares other run variants (``--dtypes``): the linears on torch's ``nn.Linear`` (the
CPU speed-ups off), an attention path forced (``float32/path=cpp,float32/path=blocked``: do the retrieval
heads depend on which CPU path a call takes?), another thread count.

bf16 and fp32 are different arithmetic: a greedy answer may change where the model's top two logits are
within bf16 rounding of each other. The page reports how often that happens and what it does to the scores.

Writes bench/results/detect_dtype_<cpu kind>.{md,json,png}.

    flock /tmp/retmask-heavy.lock python bench/bench_detect_dtype.py               # the default grid
    python bench/bench_detect_dtype.py --num-lengths 2 --num-depths 2 --out /tmp/dd  # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_kind, cpu_label, machine_description, markdown_table  # noqa: E402

from retmask.commands.argtypes import positive_int  # noqa: E402
from retmask.cpu_speedups import SWITCH_ENV  # noqa: E402
from retmask.detect import DetectConfig, run_detect  # noqa: E402
from retmask.detect.run import DetectResult, progress_path, record_path  # noqa: E402
from retmask.heads import head_key, mean_scores  # noqa: E402
from retmask.heads.compare import compare_scores  # noqa: E402
from retmask.kernels.paths import CPU_PATH_ENV, CPU_PATHS  # noqa: E402
from retmask.plotting import save_figure as save_png  # noqa: E402
from retmask.runfiles import atomic_write_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TAU = 0.1


def compare(runs: dict[str, object], base: str, other: str) -> dict:
    """Per-test and per-head agreement of two ``DetectResult``s of the same grid (the per-head part is
    ``retmask compare``'s)."""
    a, b = runs[base], runs[other]
    common = sorted(set(a.results) & set(b.results))
    same_answer = [i for i in common if a.results[i]["tokens"] == b.results[i]["tokens"]]
    same_copies = [i for i in same_answer if a.results[i]["copies"] == b.results[i]["copies"]]
    same_counted = sum(a.results[i]["counted"] == b.results[i]["counted"] for i in common)
    ma, mb = mean_scores(a.scores, source=base), mean_scores(b.scores, source=other)
    heads = compare_scores(ma, mb, labels=(base, other), tau=TAU, top_k=10).to_json()
    return {
        "tests": len(common),
        "identical_answers": len(same_answer),
        "identical_copies_where_answers_agree": f"{len(same_copies)}/{len(same_answer)}",
        "same_counted_decision": same_counted,
        "counted": {base: sum(a.results[i]["counted"] for i in common), other: sum(b.results[i]["counted"] for i in common)},
        "spearman_over_heads": heads["spearman"],
        "max_abs_score_difference": heads["max_abs_difference"],
        "tau_sets": {base: heads["tau_sets"]["base"], other: heads["tau_sets"]["other"]},
        "tau_sets_equal": heads["tau_sets_equal"],
        "tau_jaccard": heads["tau_jaccard"],
        "top10_overlap": heads["top_k_overlap"],
        "scores": {base: {head_key(*h): v for h, v in ma.items()}, other: {head_key(*h): v for h, v in mb.items()}},
    }  # fmt: skip


def detect_once(cfg: DetectConfig, out: Path) -> DetectResult:
    """The detection of ``cfg`` on ``out``: run, continued where an interrupted run left its progress file,
    or read back when it already finished. A finished run's per-test results (greedy tokens, per-head copy
    counts) are kept in ``<out stem>.results.json``, since the run record holds no copy counts."""
    saved = out.with_name(out.stem + ".results.json")
    unfinished = progress_path(out).exists()
    finished = out.is_file() and record_path(out).is_file() and not unfinished
    if finished and saved.is_file():
        record = json.loads(record_path(out).read_text())
        results = {int(k): v for k, v in json.loads(saved.read_text()).items()}
        return DetectResult(json.loads(out.read_text()), record.get("summary", {}), record, results)
    if finished:
        raise SystemExit(
            f"{out} finished before its per-test results were kept ({saved.name} is missing): delete {out} and "
            f"{record_path(out).name} to run it again"
        )
    result = run_detect(cfg, out, resume=unfinished, progress_bar=True)
    atomic_write_text(saved, json.dumps({str(k): v for k, v in result.results.items()}))
    return result


def parse_variant(variant: str) -> tuple[str, dict]:
    """``"float32/torch-linears/path=cpp/threads=1"`` -> ``("float32", {options})`` (see ``--dtypes``)."""
    dtype, *parts = variant.split("/")
    options = {"torch-linears": False, "path": "", "threads": 2}
    for part in parts:
        key, _, value = part.partition("=")
        if part == "torch-linears":
            options["torch-linears"] = True
        elif key == "path" and value in CPU_PATHS:
            options["path"] = value
        elif key == "threads" and value.isdigit() and int(value) > 0:
            options["threads"] = int(value)
        else:
            raise SystemExit(
                f"--dtypes: {variant!r}: unknown option {part!r}; after '/' use torch-linears, "
                f"path=<{'|'.join(CPU_PATHS)}> or threads=<N>"
            )
    return dtype, options


def set_env(name: str, value: str) -> None:
    """``$name`` = ``value``; unset for ""."""
    if value:
        os.environ[name] = value
    else:
        os.environ.pop(name, None)


def compute_seconds(result) -> float:
    return sum(e.get("prefill_s", 0.0) + e.get("decode_s", 0.0) for e in result.results.values())


def plot(cmp: dict, base: str, other: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ma, mb = cmp["scores"][base], cmp["scores"][other]
    heads = sorted(ma)
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter([ma[h] for h in heads], [mb[h] for h in heads], s=10)
    top = max(max(ma.values()), max(mb.values()), TAU) * 1.05
    ax.plot([0, top], [0, top], color="grey", lw=0.8)
    ax.axvline(TAU, color="red", lw=0.6, ls="--")
    ax.axhline(TAU, color="red", lw=0.6, ls="--")
    ax.set_xlabel(f"retrieval score, {base}")
    ax.set_ylabel(f"retrieval score, {other}")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name or path (default: the embedded SmolLM2)")
    ap.add_argument(
        "--dtypes", default="float32,bfloat16",
        help="runs to compare, baseline first: a dtype, optionally followed by options after '/': "
        "'torch-linears' (the linears kept on torch's nn.Linear: the CPU speed-ups off, RETMASK_CPU_SPEEDUPS=0), "
        "'path=P' (the CPU attention path forced, RETMASK_CPU_PATH=P), 'threads=N' (torch and kernel threads), "
        "e.g. float32/torch-linears,float32,bfloat16 or float32/path=cpp,float32/path=blocked",
    )  # fmt: skip
    ap.add_argument("--num-lengths", type=positive_int, default=None, help="override the protocol's grid")
    ap.add_argument("--num-depths", type=positive_int, default=None, help="override the protocol's grid")
    ap.add_argument("--min-len", type=positive_int, default=None, help="override the protocol's grid")
    ap.add_argument("--max-len", type=positive_int, default=None, help="override the protocol's grid")
    ap.add_argument(
        "--run-dir", type=Path, default=Path("runs/detect_dtype"), help="resumable runs live here"
    )
    ap.add_argument(
        "--out", default=None, help="output path without suffix (default: results/detect_dtype_<cpu>)"
    )
    args = ap.parse_args()
    torch.set_num_threads(2)
    variants = args.dtypes.split(",")
    args.run_dir.mkdir(parents=True, exist_ok=True)
    runs = {}
    for variant in variants:
        dtype, options = parse_variant(variant)
        set_env(SWITCH_ENV, "0" if options["torch-linears"] else "")
        set_env(CPU_PATH_ENV, options["path"])
        torch.set_num_threads(options["threads"])
        cfg = DetectConfig(
            model=args.model, dtype=dtype, num_lengths=args.num_lengths, num_depths=args.num_depths,
            min_len=args.min_len, max_len=args.max_len,
        )  # fmt: skip
        out = args.run_dir / f"{variant.replace('/', '_')}.json"
        print(f"== retmask detect --dtype {dtype} ({options}) -> {out}", flush=True)
        runs[variant] = detect_once(cfg, out)
    set_env(SWITCH_ENV, "")
    set_env(CPU_PATH_ENV, "")
    torch.set_num_threads(2)
    base, others = variants[0], variants[1:]
    cmps = {other: compare(runs, base, other) for other in others}
    secs = {d: compute_seconds(r) for d, r in runs.items()}
    machine = machine_description()
    target = Path(args.out) if args.out else RESULTS / f"detect_dtype_{cpu_kind(machine)}"
    target.parent.mkdir(parents=True, exist_ok=True)
    model_name = args.model or "embedded SmolLM2-135M-Instruct"
    grid = runs[base].record.get("grid", {})
    md_tables = []
    for other, cmp in cmps.items():
        rows = [
            ["tests", str(cmp["tests"])],
            ["identical greedy answers", f"{cmp['identical_answers']}/{cmp['tests']}"],
            ["identical per-head copy counts where the answers agree", cmp["identical_copies_where_answers_agree"]],
            ["same counted / not-counted decision (recall > 0.5)", f"{cmp['same_counted_decision']}/{cmp['tests']}"],
            ["tests counted", f"{base} {cmp['counted'][base]}, {other} {cmp['counted'][other]}"],
            ["Spearman over heads (mean score)", f"{cmp['spearman_over_heads']:.4f}"],
            ["largest per-head score difference", f"{cmp['max_abs_score_difference']:.4f}"],
            [f"τ = {TAU} sets", f"equal: {cmp['tau_sets_equal']} ({len(cmp['tau_sets'][base])} vs "
             f"{len(cmp['tau_sets'][other])} heads, Jaccard {cmp['tau_jaccard']:.2f})"],
            ["top-10 overlap", f"{cmp['top10_overlap']}/10"],
            ["compute time (sum of per-test prefill + decode)", f"{base} {secs[base]:.0f} s, {other} "
             f"{secs[other]:.0f} s ({secs[other] / secs[base]:.2f}x)"],
        ]  # fmt: skip
        only = {
            base: sorted(set(cmp["tau_sets"][base]) - set(cmp["tau_sets"][other])),
            other: sorted(set(cmp["tau_sets"][other]) - set(cmp["tau_sets"][base])),
        }
        md_tables += [
            f"## {other} vs {base}",
            "",
            markdown_table(["", "result"], rows),
            "",
            f"Heads at τ = {TAU} in one run only: {base}: {only[base] or 'none'}; {other}: {only[other] or 'none'}.",
            "",
        ]
    times = markdown_table(
        ["run", "compute time", f"vs {base}"],
        [[v, f"{secs[v]:.0f} s", f"{secs[v] / secs[base]:.2f}x"] for v in variants],
    )
    md = [
        f"# `retmask detect`: {', '.join(others)} vs {base} ({cpu_label(machine)}, SIMD {machine['simd']}, "
        f"native bf16 {machine['native bf16']}, kernel build {machine['kernel build']})",
        "",
        f"{model_name}, the same grid in every run ({grid}), weights and activations in the dtype named "
        "(the kernel accumulates in fp32 and takes the argmax of fp32 logits in both); '/torch-linears': "
        "the linears on torch's `nn.Linear` instead of retmask's (`RETMASK_CPU_SPEEDUPS=0`, "
        "`retmask.cpu_speedups`); '/path=P': every attention call forced onto CPU path P (`RETMASK_CPU_PATH`) "
        "instead of the rule of `retmask/kernels/paths.py`; '/threads=N': N torch and kernel threads.",
        "",
        times,
        "",
        *md_tables,
        f"Machine: {', '.join(f'{k} {v}' for k, v in machine.items())}.",
    ]
    atomic_write_text(target.with_suffix(".md"), "\n".join(md) + "\n")
    summary = {"comparisons": cmps, "seconds": secs, "machine": machine, "model": model_name, "base": base}
    atomic_write_text(target.with_suffix(".json"), json.dumps(summary, indent=1))
    last = others[-1]
    plot(cmps[last], base, last, target.with_suffix(".png"), f"{model_name}: per-head retrieval score")
    print("\n".join(md))


if __name__ == "__main__":
    main()
