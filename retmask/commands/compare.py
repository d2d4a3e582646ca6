"""``retmask compare``: do two or more retrieval-score files of one model find the same heads?

Register with ``retmask.commands.compare.add_parser(subparsers)``; the parser's ``func`` default runs it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from retmask.commands.argtypes import png_path, positive_int, unit_float
from retmask.commands.common import example, print_error, reports_errors
from retmask.heads.keys import RETRIEVAL_TAU


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``compare`` sub-command to an ``argparse`` sub-parsers object and return its parser."""
    p = subparsers.add_parser(
        "compare",
        help="compare retrieval-score files of one model (rank correlation, τ sets, top-K, what moved)",
        description=(
            "Compare each OTHER scores file with BASE, head by head: Spearman and Pearson over all heads, the "
            "heads with mean score >= τ on each side (shared, only in one, Jaccard), the overlap of the top K, "
            "and the heads whose score moved most. Files are in the published head_score format "
            "({'<layer>-<head>': [per-test scores]}), as `retmask detect` and `retmask mdqa-score` write them: "
            "float32 against bfloat16, CPU against GPU, before against after training, ours against a "
            "published file. Reads only the files (no model, no torch)."
        ),
        epilog=example(
            "retmask compare runs/f32/scores.json runs/bf16/scores.json --labels float32,bfloat16 "
            "--plot runs/compare.png"
        ),
    )
    p.add_argument("base", type=Path, help="scores file everything else is compared with")
    p.add_argument(
        "others", type=Path, nargs="+", metavar="other", help="scores file(s) to compare with BASE"
    )
    p.add_argument(
        "--labels",
        help="comma-separated names of BASE and each OTHER in the report and plot (default: the file names)",
    )
    p.add_argument("--tau", type=unit_float, default=RETRIEVAL_TAU, help="retrieval-head threshold τ")
    p.add_argument("--top-k", type=positive_int, default=10, help="K of the top-K overlap")
    p.add_argument(
        "--changes", type=positive_int, default=10, help="how many of the most-moved heads to list"
    )
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the comparisons as JSON here")
    p.add_argument(
        "--plot",
        type=png_path,
        metavar="FILE",
        help="also write a PNG: score scatter and difference heatmap per OTHER",
    )
    p.set_defaults(func=run)
    return p


def labels_for(paths: list[Path], given: str | None) -> list[str]:
    """One label per file: ``--labels`` as given, else the file names, else (names repeat) the paths as given."""
    from retmask.heads import SelectionError

    if given is not None:
        labels = [x.strip() for x in given.split(",")]
        if len(labels) != len(paths) or not all(labels):
            raise SelectionError(
                f"--labels names {len(labels)} files but {len(paths)} were given (BASE and each OTHER, in order); "
                "give one non-empty name per file, separated by commas"
            )
    else:
        labels = [p.name for p in paths]
        if len(set(labels)) < len(labels):
            labels = [str(p) for p in paths]
    return labels


@reports_errors(interrupt_hint=None)
def run(args: argparse.Namespace) -> int:
    """Run ``retmask compare``; returns the process exit code."""
    from retmask.heads import SelectionError, load_scores
    from retmask.heads.compare import compare_scores, format_comparison, score_matrix
    from retmask.runfiles import atomic_write_json, check_distinct_paths, check_writable

    try:
        paths = [args.base, *args.others]
        labels = labels_for(paths, args.labels)
        check_distinct_paths(
            {"--json": args.json, "--plot": args.plot},
            {f"compared file {i}": p for i, p in enumerate(paths, 1)},
        )
        for path, what in ((args.json, "--json"), (args.plot, "--plot")):
            if path is not None:
                check_writable(path, what=what)
        tables = [load_scores(p) for p in paths]
        comparisons = [
            compare_scores(
                tables[0],
                table,
                labels=(labels[0], label),
                tau=args.tau,
                top_k=args.top_k,
                changes=args.changes,
            )
            for table, label in zip(tables[1:], labels[1:], strict=True)
        ]
    except SelectionError as e:
        print_error("retmask compare", e)
        return 2
    print("\n\n".join(format_comparison(c) for c in comparisons))
    if args.json is not None:
        atomic_write_json(
            args.json,
            {"files": [{"label": label, "path": str(p)} for label, p in zip(labels, paths, strict=True)],
             "comparisons": [c.to_json() for c in comparisons]},
            indent=1,
        )  # fmt: skip
        print(f"comparison JSON -> {args.json}")
    if args.plot is not None:
        from retmask.plotting import score_comparison_plot

        grid = comparisons[0].grid
        rows = [
            (score_matrix(tables[0], grid), score_matrix(table, grid), labels[0], label, args.tau)
            for table, label in zip(tables[1:], labels[1:], strict=True)
        ]
        score_comparison_plot(rows, args.plot, title=f"retrieval scores against {labels[0]}")
        print(f"plot -> {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m retmask.commands.compare``)."""
    parser = argparse.ArgumentParser(prog="retmask")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["compare", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
