"""``retmask eval``: compare models (e.g. before/after RetMask) on the synthetic long-context suite."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from retmask.commands.argtypes import (
    depth_count,
    length_count,
    needle_count,
    percent_int,
    positive_int,
    seed_int,
    token_count,
)
from retmask.commands.common import (
    MODEL_SPEC,
    add_device_arg,
    add_dtype_arg,
    check_device_arg,
    example,
    print_error,
    reports_errors,
)
from retmask.evaluate.config import DEFAULT_MAX_LEN, TASK_LABELS, EvalConfig


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    d = EvalConfig()
    p = subparsers.add_parser(
        "eval",
        help="before/after comparison: NIAH grid, multi-needle recall, key-value retrieval, retrieval-score shift",
        description=(
            "Evaluate each --model (the first is the baseline of every change) on generated long-context tasks up "
            "to --max-len tokens, and the retrieval scores of its heads on the NIAH tests; with --heads, the "
            "mean score of those heads vs the other heads and its change. Writes report.md, eval.json and PNGs "
            "to --out-dir. Per-model results are cached (resumable; shared with --cache-dir)."
        ),
        epilog=example(
            "retmask eval --model smollm2 --model runs/dpo --label before --label after "
            "--heads runs/heads.json --out-dir runs/eval"
        ),
    )
    p.add_argument("--model", action="append", required=True,
                   help=f"model to evaluate: {MODEL_SPEC}, or 'embedded' (= smollm2); repeat for each model, the "
                        "first is the baseline")  # fmt: skip
    add_dtype_arg(p)
    add_device_arg(p)
    p.add_argument("--label", action="append", help="display name per --model (default: the folder name)")
    p.add_argument("--heads", action="append", type=Path, default=[],
                   help="heads JSON (retmask mask) for the score shift; repeatable")  # fmt: skip
    p.add_argument(
        "--out-dir", type=Path, default=Path("runs/eval"), help="folder for report.md, eval.json and the PNGs"
    )
    p.add_argument("--cache-dir", type=Path, help="per-model results cache (default: OUT_DIR/models)")
    p.add_argument("--min-len", type=token_count, default=d.min_len,
                   help="shortest context, tokens")  # fmt: skip
    p.add_argument("--max-len", type=token_count,
                   help=f"longest context, tokens (default: min({DEFAULT_MAX_LEN}, the model's maximum))")  # fmt: skip
    p.add_argument(
        "--num-lengths", type=length_count, default=d.num_lengths, help="number of context lengths"
    )
    p.add_argument(
        "--num-depths", type=depth_count, default=d.num_depths, help="NIAH needle depths, evenly in [0, 100]"
    )
    p.add_argument(
        "--niah-needles", type=positive_int, default=d.niah_needles, help="NIAH: the first N shipped needles"
    )
    p.add_argument(
        "--mn-needles",
        type=needle_count,
        default=d.mn_needles,
        help="needles per multi-needle context",
    )
    p.add_argument(
        "--kv-depths", type=percent_int, nargs="+", default=d.kv_depths, help="key-value query positions, %%"
    )
    p.add_argument(
        "--max-new-tokens", type=token_count, default=d.max_new_tokens, help="answer tokens per test at most"
    )
    p.add_argument("--tasks", nargs="+", choices=list(TASK_LABELS), default=d.tasks,
                   help="; ".join(f"{k}: {v}" for k, v in TASK_LABELS.items()))  # fmt: skip
    p.add_argument("--seed", type=seed_int, default=d.seed, help="seed of the generated tasks")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    from retmask.hf.loading import resolve_dtype_name
    from retmask.niah.grid import check_grid_counts

    check_device_arg(args.device, "eval")
    # the grid's bounds before any model loads; with no --max-len the longest context is at most the cap
    check_grid_counts(
        args.min_len, args.max_len or DEFAULT_MAX_LEN, args.num_lengths, args.num_depths,
        defaults=set() if args.max_len is not None else {"max_len"}, default_note=" (the default cap)",
    )  # fmt: skip
    return EvalConfig(
        min_len=args.min_len, max_len=args.max_len, num_lengths=args.num_lengths, num_depths=args.num_depths,
        niah_needles=args.niah_needles, mn_needles=args.mn_needles, kv_depths=list(args.kv_depths),
        max_new_tokens=args.max_new_tokens, seed=args.seed, tasks=list(args.tasks),
        dtype=resolve_dtype_name(args.dtype, args.device),
    )  # fmt: skip


@reports_errors(
    interrupt_hint="run the same command again: the models and tasks already evaluated are cached"
)
def run(args: argparse.Namespace) -> int:
    from retmask.runfiles import RunLock, check_writable

    check_writable(args.out_dir, what="--out-dir", directory=True)
    if args.cache_dir is not None:
        check_writable(args.cache_dir, what="--cache-dir", directory=True)
    with RunLock(args.out_dir / "eval.json", flag="--out-dir"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from retmask.evaluate.suite import run_suite
    from retmask.heads.selection import SelectionError

    try:
        data = run_suite(
            args.model, args.out_dir, config_from_args(args), labels=args.label, heads_files=args.heads,
            cache_dir=args.cache_dir, progress=not args.no_progress, device=args.device,
            command="retmask " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["eval"] else None,
        )  # fmt: skip
    except (ValueError, SelectionError) as e:
        print_error("retmask eval", e)
        return 2
    for r in data["models"]:
        scores = "  ".join(f"{k}={v:.3f}" for k, v in r["tasks"].items())
        print(f"{r['label']}: {scores}")
    return 0
