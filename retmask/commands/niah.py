"""``retmask niah``: Needle-in-a-Haystack accuracy grid (ROUGE-1 recall, lengths × depths), optionally with
heads masked (top-K by retrieval score, K random, or a heads file); JSON + classic heatmap PNG. With
``--out`` the answered tests are saved after each one (``retmask.evaluate.niah_progress``), so an
interrupted run continues with ``--resume``.

The grid and model flags are shared with ``retmask ablate`` and ``retmask detect`` (``commands.common``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from retmask.commands.argtypes import head_count, png_path, seed_int, token_count
from retmask.commands.common import (
    RESUME_HINT,
    add_grid_args,
    add_model_args,
    example,
    grid_from_args,
    load_from_args,
    needles_from_args,
    print_error,
    reports_errors,
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "niah",
        help="Needle-in-a-Haystack accuracy grid (ROUGE-1 recall), optionally with heads masked",
        description=(
            "Evaluate Needle-in-a-Haystack retrieval on a lengths x depths grid (the detection protocol's "
            "context, prompt and needles; greedy answers, stopping at newline/EOS) and score each answer by "
            "ROUGE-1 recall of the needle. Optionally mask heads: the top K by retrieval score, K random "
            "heads, or a heads JSON from `retmask mask`. Prints the grid and the mean; with --out / --plot, writes the result JSON / a heatmap PNG."
        ),
        epilog=example(
            "retmask niah --model smollm2 --mask-top 10 --scores runs/detect/scores.json "
            "--plot runs/niah-top10.png"
        ),
    )
    add_model_args(p)
    mask = p.add_mutually_exclusive_group()
    mask.add_argument("--mask-top", type=head_count, metavar="K", help="mask the K best heads of --scores")
    mask.add_argument(
        "--mask-random", type=head_count, metavar="K", help="mask K random heads (seeded by --seed)"
    )
    mask.add_argument("--mask-file", type=Path, help="mask the heads of a heads JSON (`retmask mask --out`)")
    p.add_argument("--scores", type=Path, help="retrieval-scores JSON (`retmask detect`), for --mask-top")
    p.add_argument("--seed", type=seed_int, help="seed of --mask-random (default: 0)")
    add_grid_args(p)
    p.add_argument(
        "--chunk",
        type=token_count,
        default=None,
        help="prefill chunk (tokens) = granularity of KV-prefix reuse; the answers do not depend on it "
        "(default: 256 on a CPU, 4096 on a GPU, where each forward pass costs host time)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    p.add_argument("--plot", type=png_path, default=None, help="write the NIAH heatmap PNG here")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run on --out: the tests it answered (kept in <out>.progress.json "
        "until the run finishes) are not run again",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out file, or start an interrupted run over (else refused)",
    )
    p.add_argument("--title", default=None, help="plot title (default: model and mask)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def check_mask_args(args: argparse.Namespace) -> None:
    """The mask flags' consistency (and that --scores / --mask-file read), before any model is loaded; the
    heads are checked against the model's shape once it has loaded."""
    from retmask.heads.selection import SelectionError, load_scores, read_heads

    if args.mask_top is None and args.scores is not None:
        raise SelectionError("--scores is only used with --mask-top K; add --mask-top or drop --scores")
    if args.mask_top is not None:
        if args.scores is None:
            raise SelectionError("--mask-top K needs --scores FILE (the scores JSON of `retmask detect`)")
        load_scores(args.scores)
    if args.mask_file is not None:
        read_heads(args.mask_file)
    if args.mask_random is not None and args.mask_random <= 0:
        raise SelectionError(f"--mask-random must be a positive number of heads, got {args.mask_random}")


def mask_label(args: argparse.Namespace, heads: list) -> str:
    """A short description of the mask for the plot (file names only; the full paths are in the JSON)."""
    from pathlib import PurePath

    if args.mask_top is not None:
        return f"top-{args.mask_top} retrieval heads masked ({PurePath(args.scores).name})"
    if args.mask_random is not None:
        return f"{args.mask_random} random heads masked (seed {args.seed})"
    if args.mask_file is not None:
        return f"{len(heads)} heads masked ({PurePath(args.mask_file).name})"
    return "no heads masked"


def select_mask(args: argparse.Namespace, shape: tuple[int, int]) -> tuple[list, str]:
    """The heads to mask from --mask-top/--mask-random/--mask-file, validated against the model's [L, Hq];
    and a short description."""
    from retmask.heads.selection import (
        SelectionError,
        complete_scores,
        load_scores,
        read_heads,
        sample_random,
        select_top_k,
    )

    if args.mask_top is None and args.scores is not None:
        raise SelectionError("--scores is only used with --mask-top K; add --mask-top or drop --scores")
    if args.mask_top is not None:
        if args.scores is None:
            raise SelectionError("--mask-top K needs --scores FILE (the scores JSON of `retmask detect`)")
        full = complete_scores(load_scores(args.scores), shape)
        return select_top_k(full, args.mask_top), f"top-{args.mask_top} heads of {args.scores} masked"
    if args.mask_random is not None:
        universe = [(a, b) for a in range(shape[0]) for b in range(shape[1])]
        if args.mask_random <= 0:
            raise SelectionError(f"--mask-random must be a positive number of heads, got {args.mask_random}")
        if args.mask_random > len(universe):
            raise SelectionError(
                f"--mask-random {args.mask_random}: the model has only {len(universe)} heads"
            )
        return sample_random(
            args.mask_random, universe, args.seed
        ), f"{args.mask_random} random heads (seed {args.seed}) masked"
    if args.mask_file is not None:
        sel = read_heads(args.mask_file, model_shape=list(shape))
        return sel.heads, f"{len(sel.heads)} heads of {args.mask_file} masked"
    return [], "no heads masked"


def _interrupt_hint(args: argparse.Namespace) -> str | None:
    """Resume where the progress file holds answered tests (only with --out); else nothing was kept."""
    from retmask.evaluate.niah_progress import progress_path

    return RESUME_HINT if args.out is not None and progress_path(args.out).exists() else None


def check_ignored_flags(args: argparse.Namespace) -> None:
    """Refuse --seed without --mask-random and --title without --plot (they would change nothing), then
    set --seed's default."""
    from retmask.errors import UsageError

    if args.seed is not None and args.mask_random is None:
        raise UsageError(
            "--seed only applies with --mask-random K (its draw); add --mask-random or drop --seed"
        )
    if args.title is not None and args.plot is None:
        raise UsageError("--title is the heatmap's title; add --plot FILE.png or drop --title")
    args.seed = 0 if args.seed is None else args.seed


@reports_errors(interrupt_hint=_interrupt_hint)
def run(args: argparse.Namespace) -> int:
    from retmask.evaluate.niah_progress import progress_path
    from retmask.runfiles import (
        RunFileError,
        RunLock,
        check_distinct_paths,
        check_progress_run,
        check_writable,
    )

    if args.out is None and args.resume:
        raise RunFileError(
            "--resume continues the run on --out (its progress file sits next to it); add --out"
        )
    check_ignored_flags(args)
    check_distinct_paths(
        {"--out": args.out, "--plot": args.plot}, {"--mask-file": args.mask_file, "--scores": args.scores}
    )
    if args.out is not None:
        check_writable(args.out, what="--out")
    if args.plot is not None:
        check_writable(args.plot, what="--plot")
    if args.out is None:
        return _run(args)
    with RunLock(args.out):
        check_progress_run(
            args.out,
            progress_path(args.out),
            [args.out],
            resume=args.resume,
            overwrite=args.overwrite,
            what="an interrupted run's answers",
        )
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from retmask.evaluate.niah import evaluate_niah, format_grid, grid_fingerprint, plot_niah
    from retmask.evaluate.niah_progress import progress_path, read_progress, write_progress
    from retmask.heads import model_shape
    from retmask.heads.selection import SelectionError
    from retmask.niah import load_haystack, resolve_prompt_style
    from retmask.niah.grid import check_grid_tests
    from retmask.niah.haystack import HaystackError
    from retmask.niah.needles import NeedleFileError

    try:
        check_mask_args(args)
        lengths, depths = grid_from_args(args)
        needles = needles_from_args(args)
        check_grid_tests(len(needles), lengths, depths)  # the prompts' memory, before the model loads
        haystack = load_haystack(args.haystack)
        model, tok, name = load_from_args(args)
        heads, what = select_mask(args, model_shape(model))
        done, save = None, None
        if args.out is not None:
            # what decides the answers; a resume must match it (the chunk only changes the speed)
            settings = grid_fingerprint(
                model, name, lengths, depths, needles, haystack, args.max_new_tokens,
                resolve_prompt_style(tok, args.prompt_style),
            )  # fmt: skip
            settings["heads"] = sorted([int(a), int(b)] for a, b in heads)
            progress = progress_path(args.out)
            done = read_progress(progress, settings) if args.resume else None
            save = lambda entries: write_progress(progress, settings, entries)  # noqa: E731
        res = evaluate_niah(
            model, tok, lengths=lengths, depths=depths, needles=needles, haystack_text=haystack, heads=heads,
            max_new_tokens=args.max_new_tokens, progress=not args.no_progress, chunk=args.chunk,
            prompt_style=args.prompt_style, done=done, on_entry=save,
        )  # fmt: skip
    except (ValueError, NeedleFileError, HaystackError, SelectionError) as err:
        print_error("retmask niah", err)
        return 2
    res.meta["model"] = name
    res.meta["mask"] = what
    for s in res.meta["skipped"]:
        print(f"skipped test {s['key']}: {s['reason']}", file=sys.stderr)
    print(f"{name}: {what}")
    print(format_grid(res))
    resumed = res.meta.get("resumed_tests", 0)
    print(f"{len(res.entries)} tests in {res.meta['timings']['run_s']:.1f} s"
          + (f" ({resumed} of them answered by the interrupted run)" if resumed else ""))  # fmt: skip
    # the grid and mean are on stdout before any file is written: a full disk or a refused name (a one-line
    # OutputWriteError, exit 2) loses the files, not the results
    if args.out is not None:
        from retmask.runfiles import OutputWriteError, atomic_write_json

        try:
            atomic_write_json(args.out, res.to_json())
        except OutputWriteError as err:
            raise OutputWriteError(
                f"{err} (the grid and mean are printed above; the answers are kept: the same command plus "
                "--resume writes the result without running the tests again)"
            ) from None
        print(f"result -> {args.out}", file=sys.stderr)
    if args.plot is not None:
        from retmask.plotting import short_name

        plot_niah(res, args.plot, args.title or f"NIAH: {short_name(name)}", mask_label(args, heads))
        print(f"heatmap -> {args.plot}", file=sys.stderr)
    if args.out is not None:  # last: a run stopped before this point resumes to write what is missing
        progress_path(args.out).unlink(missing_ok=True)
    return 0
