"""``retmask niah``: Needle-in-a-Haystack accuracy grid (ROUGE-1 recall, lengths × depths), optionally with
heads masked (top-K by retrieval score, K random, or a heads file); JSON + classic heatmap PNG.

The grid and model flags are shared with ``retmask ablate`` and ``retmask detect`` (``add_model_args``,
``add_grid_args``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="hub id, HF folder or .gguf file (default: embedded SmolLM2)"
    )
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model (or a path)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")


def add_grid_args(
    p: argparse.ArgumentParser, *, num_needles: int | None = None, needle_subset: bool = True
) -> None:
    """Grid, needles and haystack flags; ``needle_subset=False`` leaves out ``--num-needles`` (detection
    always uses the whole needles file, as the published script does)."""
    from retmask.niah.grid import PROTOCOLS

    p.add_argument(
        "--protocol",
        default="default",
        choices=sorted(PROTOCOLS),
        help="grid preset: " + "; ".join(f"{k}: {v.description}" for k, v in PROTOCOLS.items()),
    )
    p.add_argument(
        "--min-len", type=int, default=None, help="shortest context (tokens); overrides the protocol"
    )
    p.add_argument(
        "--max-len", type=int, default=None, help="longest context (tokens); overrides the protocol"
    )
    p.add_argument("--num-lengths", type=int, default=None, help="number of lengths; overrides the protocol")
    p.add_argument("--num-depths", type=int, default=None, help="depths in [0, 100]; overrides the protocol")
    p.add_argument(
        "--needles", default=None, help="needles JSONL {needle, question, real_needle} (default: shipped)"
    )
    if needle_subset:
        p.add_argument(
            "--num-needles",
            type=int,
            default=num_needles,
            help="use only the first N needles of the file"
            + ("" if num_needles is None else f" (default {num_needles})"),
        )
    p.add_argument(
        "--haystack", default=None, help="haystack text file or directory of *.txt (default: shipped)"
    )
    p.add_argument("--max-new-tokens", type=int, default=50)


def grid_from_args(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    from retmask.detect.run import DetectConfig

    cfg = DetectConfig(
        protocol=args.protocol, min_len=args.min_len, max_len=args.max_len,
        num_lengths=args.num_lengths, num_depths=args.num_depths,
    )  # fmt: skip
    return cfg.grid()


def needles_from_args(args: argparse.Namespace):
    from retmask.niah import load_needles

    needles = load_needles(args.needles)
    if args.num_needles is not None:
        if args.num_needles < 1:
            raise ValueError(f"--num-needles must be >= 1, got {args.num_needles}")
        needles = needles[: args.num_needles]
    return needles


def load_from_args(args: argparse.Namespace):
    """(model, tokenizer, name) from --model/--gguf-file/--dtype/--device."""
    from retmask.detect.run import _dtype
    from retmask.models import load_model

    model, tok = load_model(
        args.model, gguf_file=args.gguf_file, dtype=_dtype(args.dtype), device=args.device
    )
    name = args.model or args.gguf_file or "embedded:SmolLM2-135M-Instruct"
    return model, tok, name


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "niah",
        help="Needle-in-a-Haystack accuracy grid (ROUGE-1 recall), optionally with heads masked",
        description=(
            "Evaluate Needle-in-a-Haystack retrieval on a lengths x depths grid (the detection protocol's "
            "context, prompt and needles; greedy answers, stopping at newline/EOS) and score each answer by "
            "ROUGE-1 recall of the needle. Optionally mask heads: the top K by retrieval score, K random "
            "heads, or a heads JSON from `retmask mask`. Prints the grid and the mean; writes JSON and a PNG."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_args(p)
    mask = p.add_mutually_exclusive_group()
    mask.add_argument("--mask-top", type=int, metavar="K", help="mask the K best heads of --scores")
    mask.add_argument("--mask-random", type=int, metavar="K", help="mask K random heads (seeded by --seed)")
    mask.add_argument("--mask-file", type=Path, help="mask the heads of a heads JSON (`retmask mask --out`)")
    p.add_argument("--scores", type=Path, help="retrieval-scores JSON (`retmask detect`), for --mask-top")
    p.add_argument("--seed", type=int, default=0, help="seed of --mask-random")
    add_grid_args(p)
    p.add_argument(
        "--chunk", type=int, default=256, help="prefill chunk (tokens) = granularity of KV-prefix reuse"
    )
    p.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write the NIAH heatmap PNG here")
    p.add_argument("--title", default=None, help="plot title (default: model and mask)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def select_mask(args: argparse.Namespace, shape: tuple[int, int]) -> tuple[list, str]:
    """The heads to mask from --mask-top/--mask-random/--mask-file, validated against the model's [L, Hq];
    and a short description."""
    from retmask.selection import (
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
        return sample_random(
            args.mask_random, universe, args.seed
        ), f"{args.mask_random} random heads (seed {args.seed}) masked"
    if args.mask_file is not None:
        sel = read_heads(args.mask_file, model_shape=list(shape))
        return sel.heads, f"{len(sel.heads)} heads of {args.mask_file} masked"
    return [], "no heads masked"


def run(args: argparse.Namespace) -> int:
    from retmask.detect.core import _layout
    from retmask.evaluate.niah import evaluate_niah, format_grid, plot_niah
    from retmask.niah import load_haystack
    from retmask.niah.haystack import HaystackError
    from retmask.niah.needles import NeedleFileError
    from retmask.selection import SelectionError

    try:
        lengths, depths = grid_from_args(args)
        needles = needles_from_args(args)
        haystack = load_haystack(args.haystack)
        model, tok, name = load_from_args(args)
        heads, what = select_mask(args, _layout(model))
        res = evaluate_niah(
            model, tok, lengths=lengths, depths=depths, needles=needles, haystack_text=haystack, heads=heads,
            max_new_tokens=args.max_new_tokens, progress=not args.no_progress, chunk=args.chunk,
        )  # fmt: skip
    except (ValueError, NeedleFileError, HaystackError, SelectionError) as err:
        print(f"retmask niah: error: {err}", file=sys.stderr)
        return 2
    res.meta["model"] = name
    res.meta["mask"] = what
    for s in res.meta["skipped"]:
        print(f"skipped test {s['key']}: {s['reason']}", file=sys.stderr)
    print(f"{name}: {what}")
    print(format_grid(res))
    print(f"{len(res.entries)} tests in {res.meta['timings']['run_s']:.1f} s")
    if args.out is not None:
        from retmask.detect.run import atomic_write_json

        atomic_write_json(args.out, res.to_json())
        print(f"result -> {args.out}", file=sys.stderr)
    if args.plot is not None:
        plot_niah(res, args.plot, args.title or f"NIAH: {name}, {what}")
        print(f"heatmap -> {args.plot}", file=sys.stderr)
    return 0
