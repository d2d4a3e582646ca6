"""``retmask detect``: retrieval scores of every attention head, reference-compatible."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from retmask.commands.argtypes import png_path, positive_int, seed_int, token_count
from retmask.commands.common import add_grid_args, add_model_args, example, print_error, reports_errors
from retmask.errors import UsageError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "detect",
        help="detect retrieval heads (Needle-in-a-Haystack retrieval score)",
        description=(
            "Run the Needle-in-a-Haystack retrieval-head detection exactly as the published "
            "script (context construction, prompt, needle span, greedy decoding, copy rule, ROUGE-1 filter), "
            "fast: fused-kernel argmax, prompt-lookup verification, KV-prefix reuse. Writes "
            "{'<layer>-<head>': [per-test scores]} (the published head_score format) and a run record."
        ),
        epilog=example("retmask detect --model smollm2 --out runs/detect/scores.json --until-stable"),
    )
    add_model_args(p)
    add_grid_args(p, needle_subset=False)
    p.add_argument(
        "--out", default="runs/detect/scores.json", help="scores JSON (run record: <stem>.run.json)"
    )
    p.add_argument(
        "--plot",
        type=png_path,
        default=None,
        help="the layers x heads heatmap of the mean scores, a PNG (default: <stem>.png next to --out)",
    )
    p.add_argument("--no-plot", action="store_true", help="write no heatmap")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run from <out>.progress.json (deleted when the run completes)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="delete the files of an earlier run on --out and start over"
    )
    p.add_argument(
        "--until-stable",
        action="store_true",
        help="stop once the τ=0.1 set and the top-10 ranking are unchanged for --patience consecutive counted tests",
    )
    p.add_argument(
        "--patience",
        type=positive_int,
        default=None,
        help="consecutive counted tests for --until-stable (default: 20)",
    )
    p.add_argument(
        "--chunk",
        type=token_count,
        default=None,
        help="prefill chunk (tokens) = granularity of KV-prefix reuse; the answers do not depend on it "
        "(default: 256 on a CPU, 4096 on a GPU, where each forward pass costs host time)",
    )
    p.add_argument(
        "--prefill-impl",
        default="retmask",
        choices=["retmask", "sdpa"],
        help="attention implementation for the prompt prefill (needs no argmax); answers use retmask",
    )
    p.add_argument(
        "--static-passes",
        action="store_true",
        help="verification passes of fixed shapes, replayed from CUDA graphs on a GPU (the host then issues "
        "two small copies and two replays per pass instead of a forward's few hundred kernel launches); same "
        "answers; models without sliding-window layers; not yet timed on a GPU, hence off unless given",
    )
    p.add_argument(
        "--no-draft-history",
        dest="draft_history",
        action="store_false",
        help="drafts do not reuse the model's earlier answers to the same needle (slower; answers are the "
        "same either way) and processes shard single tests instead of whole needles",
    )
    p.add_argument(
        "--span-rule",
        default="reference",
        choices=["reference", "tolerant"],
        help="how the needle's answer is located in the prompt: reference = the published rule (a window "
        "whose token set covers > 90%% of the answer's ids, answer tokenised alone); tolerant = the same, "
        "then, where it finds nothing, the answer tokenised mid-sentence (after a space), for tokenizers "
        "that split a sentence's first word differently, e.g. Gemma (scores are identical on every test "
        "the reference rule locates)",
    )
    p.add_argument(
        "--span-miss",
        default="zeros",
        choices=["zeros", "skip"],
        help="a test whose needle answer the span rule does not find in the prompt: zeros (as the "
        "published script) = it runs and, when its answer passes the ROUGE-1 filter, scores 0 for every head; "
        "skip = it is left out of the means (listed in the run record either way)",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="torch seed (answers are greedy)")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (the bar shows passed_filter = tests whose answer passed the ROUGE-1 filter so "
        "far, the only ones that score heads; and an ETA from the prompt tokens left to compute, since tests "
        "in prefix order share most of their prefill)",
    )
    p.set_defaults(func=run)
    return p


@reports_errors()
def run(args: argparse.Namespace) -> int:
    from retmask.detect.run import DetectConfig, record_path, run_detect
    from retmask.hf.loading import resolve_dtype_name
    from retmask.niah.grid import check_grid_tests
    from retmask.niah.haystack import HaystackError
    from retmask.niah.needles import NeedleFileError, load_needles

    if args.patience is not None and not args.until_stable:
        raise UsageError("--patience only applies with --until-stable; add --until-stable or drop --patience")
    cfg = DetectConfig(
        model=args.model,
        gguf_file=args.gguf_file,
        dtype=resolve_dtype_name(args.dtype, args.device),
        device=args.device,
        needles=args.needles,
        haystack=args.haystack,
        protocol=args.protocol,
        min_len=args.min_len,
        max_len=args.max_len,
        num_lengths=args.num_lengths,
        num_depths=args.num_depths,
        max_new_tokens=args.max_new_tokens,
        chunk=args.chunk,
        prefill_impl=args.prefill_impl,
        static_passes=args.static_passes,
        draft_history=args.draft_history,
        until_stable=args.until_stable,
        **({"patience": args.patience} if args.patience is not None else {}),
        seed=args.seed,
        prompt_style=args.prompt_style,
        span_rule=args.span_rule,
        span_miss=args.span_miss,
    )
    if args.no_plot and args.plot is not None:
        raise UsageError("--plot and --no-plot exclude each other; drop one")
    plot = None if args.no_plot else Path(args.plot) if args.plot is not None else default_plot_path(args.out)
    try:
        # the grid's bounds and the size of its prompts, before any file is touched or the model loads
        lengths, depths = cfg.grid()
        check_grid_tests(len(load_needles(cfg.needles)), lengths, depths)
        run_detect(
            cfg, args.out, plot=plot, resume=args.resume, overwrite=args.overwrite,
            progress_bar=not args.no_progress,
        )  # fmt: skip
    except (ValueError, NeedleFileError, HaystackError) as err:
        print_error("retmask detect", err)
        return 2
    print(f"scores -> {args.out}", file=sys.stderr)
    print(f"run record (settings, every answer, timings) -> {record_path(Path(args.out))}", file=sys.stderr)
    if plot is not None:
        print(f"heatmap -> {plot}", file=sys.stderr)
    return 0


def default_plot_path(out: str | Path) -> Path:
    """``<stem>.png`` next to the scores file (``<name>.heatmap.png`` if the scores file is itself a .png)."""
    out = Path(out)
    plot = out.with_name(out.stem + ".png")
    return plot if plot != out else out.with_name(out.name + ".heatmap.png")
