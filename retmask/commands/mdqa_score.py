"""``retmask mdqa-score``: MuDAF's MDQA retrieval score of every head (mean F1, EM) on an MDQA JSONL file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from retmask.commands.argtypes import png_path, positive_int, token_count, unit_float
from retmask.commands.common import (
    RESUME_HINT,
    add_device_arg,
    add_dtype_arg,
    check_device_arg,
    example,
    model_help,
    print_error,
    reports_errors,
)
from retmask.model_files import files_stamp


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from retmask.methods.mudaf.config import DEFAULT_EPSILON

    p = subparsers.add_parser(
        "mdqa-score",
        help="MDQA retrieval score of every head (MuDAF): attention mass of the last prompt token per passage",
        description=(
            "For every head, the attention mass from the last prompt token on each passage (one softmax row, "
            "from the tapped query and keys; no attention matrix), then F1 against the golden passages with "
            "threshold ε and EM (top-|golden| passages by mass). Writes {'layer-head': [per-example F1]} "
            "(the detection scores format, usable by `retmask mask` and `retmask mudaf-train --scores`), a "
            "<out>.run.json record with per-head mean F1 / EM / golden mass, and optionally a heatmap."
        ),
        epilog=example(
            "retmask mdqa-score --model smollm2 --data mdqa_eval.jsonl --out runs/mdqa/scores.json "
            "--epsilon 0.05"
        ),
    )
    p.add_argument(
        "--data",
        type=Path,
        required=True,
        help="MDQA JSONL (python -m retmask.methods.mudaf.mdqa writes one)",
    )
    p.add_argument("--model", help=model_help("the model"))
    add_dtype_arg(p)
    add_device_arg(p)
    p.add_argument("--out", type=Path, required=True, help="scores JSON to write")
    p.add_argument("--plot", type=png_path, help="heatmap PNG of the mean F1 per head")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run on --out: the examples it scored (kept in <out>.progress/ until "
        "the run finishes) are not scored again",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out and its run record, or start an interrupted run over (else refused)",
    )
    p.add_argument("--epsilon", type=unit_float, default=DEFAULT_EPSILON,
                   help="attended = mass > ε; small models spread their mass thinner: SmolLM2-135M with 8 "
                        "passages needs ~0.05, see bench/results/mudaf_smollm2.md "
                        f"(default: {DEFAULT_EPSILON}, the MuDAF reference code's value)")  # fmt: skip
    p.add_argument("--limit", type=positive_int, help="score only the first N examples")
    p.add_argument("--batch-size", type=positive_int, default=1, help="examples per forward call")
    p.add_argument(
        "--max-length", type=token_count, help="token limit per prompt (default: the model's context)"
    )
    p.add_argument("--answers", action="store_true",
                   help="also generate greedy answers and report answer accuracy (in the record)")  # fmt: skip
    p.add_argument("--masses", action="store_true",
                   help="also write <out stem>.masses.npz: per-example, per-head passage masses (re-score at any ε)")  # fmt: skip
    p.add_argument("--top", type=positive_int, default=10, help="print the N best heads")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def _interrupt_hint(args: argparse.Namespace) -> str | None:
    """Resume where the progress folder holds scored examples; else nothing was kept."""
    from retmask.methods.mudaf.score_progress import progress_dir

    return RESUME_HINT if progress_dir(args.out).exists() else None


@reports_errors(interrupt_hint=_interrupt_hint)
def run(args: argparse.Namespace) -> int:
    from retmask.methods.mudaf.score_progress import progress_dir
    from retmask.runfiles import RunLock, check_distinct_paths, check_progress_run, check_writable

    record = args.out.with_name(args.out.stem + ".run.json")
    # --masses: <out stem>.masses.npz is one of the run's results (checked, and not replaced unasked, like them)
    masses = args.out.with_name(args.out.stem + ".masses.npz") if args.masses else None
    check_distinct_paths(
        {"--out": args.out, "--plot": args.plot, "the run record": record, "the --masses file": masses},
        {"--data": args.data},
    )
    check_writable(args.out, what="--out")
    for path, what in ((args.plot, "--plot"), (record, "run record"), (masses, "--masses file")):
        if path is not None:
            check_writable(path, what=what)
    with RunLock(args.out):
        check_progress_run(
            args.out,
            progress_dir(args.out),
            [args.out, record, *([masses] if masses else [])],
            resume=args.resume,
            overwrite=args.overwrite,
            what="an interrupted run's scored examples",
        )
        return _run(args)


def _settings(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """What decides the passage masses, which a resumed run must share (ε only re-scores them)."""
    from retmask.runfiles import file_digest

    return {
        "data_sha256": file_digest(args.data),
        "model": args.model,
        **files_stamp(args.model),  # a model folder changed since the run began is another model
        "dtype": dtype,
        "device": args.device,
        "max_length": args.max_length,
        "batch_size": args.batch_size,
        "limit": args.limit,
    }


def _run(args: argparse.Namespace) -> int:
    import retmask
    from retmask.hf.loading import parse_dtype, resolve_dtype_name
    from retmask.methods.mudaf.mdqa import MDQAError, load_mdqa
    from retmask.methods.mudaf.score import (
        MDQAScoreConfig,
        answer_accuracy,
        score_mdqa,
        top_heads,
        write_scores,
    )
    from retmask.methods.mudaf.score_progress import ScoreProgress

    try:
        if args.limit is not None and args.limit < 1:
            raise MDQAError(f"--limit must be >= 1, got {args.limit}")
        cfg = MDQAScoreConfig(epsilon=args.epsilon, batch_size=args.batch_size, max_length=args.max_length)
        cfg.check()
        examples = load_mdqa(args.data, limit=args.limit)
        check_device_arg(args.device, "mdqa-score")
        dtype = resolve_dtype_name(args.dtype, args.device)
        # before the model loads: a resume with other settings fails in a second
        progress = ScoreProgress(args.out, _settings(args, dtype))
        done = progress.resume() if args.resume else None
        model, tokenizer = retmask.load_model(args.model, dtype=parse_dtype(dtype), device=args.device)
        scores = score_mdqa(
            model,
            tokenizer,
            examples,
            cfg,
            progress=not args.no_progress,
            done=done,
            on_example=progress.save,
        )
        extra = {
            "data": str(args.data),
            "model": args.model or "embedded SmolLM2-135M-Instruct",
            "dtype": dtype,
            "device": args.device,
        }
        if args.answers:
            extra["answers"] = answer_accuracy(
                model, tokenizer, examples, max_length=args.max_length, progress=not args.no_progress
            )
        paths = write_scores(scores, args.out, args.plot, masses=args.masses, **extra)
        progress.finish()
    except MDQAError as e:
        print_error("retmask mdqa-score", e)
        return 2
    n, resumed = len(scores.example_ids), scores.resumed
    per_example = scores.seconds / max(n - resumed, 1)
    print(f"{n} examples, {scores.seconds:.1f} s ({per_example:.2f} s/example), ε = {cfg.epsilon:g}"
          + (f"; {resumed} scored by the interrupted run" if resumed else ""))  # fmt: skip
    if args.answers:
        print(f"answer accuracy: {extra['answers']['accuracy']:.3f}")
    print("top heads by MDQA retrieval score (mean F1, mean EM):")
    for ly, h, f1, em in top_heads(scores, args.top):
        print(f"  {ly}-{h}: F1 {f1:.3f}  EM {em:.3f}")
    print(" ".join(f"{k} -> {v}" for k, v in paths.items()))
    return 0
