"""``retmask ablate``: NIAH score vs K, top-K retrieval heads masked vs K random heads.

Writes ``<out-dir>/<prefix>.json`` (curve + every configuration's grid and answers), ``<prefix>.md`` (table)
and ``<prefix>.png`` (line plot); each configuration is saved atomically under ``<prefix>.configs/`` as it
completes, so ``--resume`` continues an interrupted run. ``--each HEADS`` instead masks each listed head
alone (``<prefix>.each.{json,md}``): is a head safe to remove?
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from retmask.commands.argtypes import draw_count, seed_int, unit_float
from retmask.commands.common import (
    add_configuration_run_args,
    add_grid_args,
    add_model_args,
    example,
    grid_from_args,
    load_from_args,
    needles_from_args,
    print_error,
    reports_errors,
    run_configurations,
)
from retmask.errors import UsageError
from retmask.runfiles import OutputWriteError, atomic_write_text

# A small default grid: every K runs the whole grid 1 + seeds times (13 runs for --k 0,5,10,20 --seeds 3).
DEFAULT_GRID = {"num_lengths": 3, "num_depths": 3}
DEFAULT_NEEDLES = 2


# The K curve's flags default to None (not given), so --each can refuse them rather than ignore them; their
# values when not given (--tau's is the library's NON_RETRIEVAL_TAU, imported with the ablation code).
CURVE_DEFAULTS = {"k": "0,5,10,20,40", "seeds": 3, "seed": 0, "random_from": "all"}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ablate",
        help="NIAH score vs K: top-K retrieval heads masked vs K random heads",
        description=(
            "For each K, evaluate the NIAH grid with the K best heads of --scores masked and with K random "
            "heads masked (--seeds draws; mean ± std); K = 0 runs once. Prints and writes a markdown table, "
            "a line plot PNG and a JSON with every configuration's grid and answers. Resumable."
        ),
        epilog=example("retmask ablate --scores runs/detect/scores.json --k 0,5,10,20 --seeds 3"),
    )
    p.add_argument(
        "--scores",
        type=Path,
        default=None,
        help="retrieval-scores JSON (`retmask detect`); needed unless --each",
    )
    p.add_argument(
        "--each",
        default=None,
        metavar="HEADS",
        help="instead of the K curve, mask each of these heads alone ('1-5,26-3') and compare with no mask",
    )
    # None = not given: --each refuses the K curve's flags instead of ignoring them
    p.add_argument(
        "--k", default=None, help=f"comma-separated numbers of heads to mask (default: {CURVE_DEFAULTS['k']})"
    )
    p.add_argument(
        "--seeds",
        type=draw_count,
        default=None,
        help=f"random-head draws per K (default: {CURVE_DEFAULTS['seeds']})",
    )
    p.add_argument(
        "--seed",
        type=seed_int,
        default=None,
        help=f"first seed (draws use seed, seed+1, ...; default: {CURVE_DEFAULTS['seed']})",
    )
    p.add_argument(
        "--random-from",
        default=None,
        choices=["all", "non-retrieval"],
        help="draw random heads from all heads or only heads scoring below --tau "
        f"(default: {CURVE_DEFAULTS['random_from']})",
    )
    p.add_argument("--tau", type=unit_float, default=None,
                   help="with --random-from non-retrieval: heads scoring below this form the pool; RetMask uses "
                        "0.05 for Qwen3 and OLMo-3 (default: 0.1)")  # fmt: skip
    add_model_args(p)
    add_grid_args(p, num_needles=DEFAULT_NEEDLES, grid=DEFAULT_GRID)
    add_configuration_run_args(p, name="ablate")
    p.set_defaults(func=run)
    return p


def _grid_line(args: argparse.Namespace, lengths: list[int], depths: list[int], needles: list) -> str:
    """What grid runs, and why it is not the protocol's when the ablate defaults apply."""
    own = [f"--{k.replace('_', '-')} {v}" for k, v in DEFAULT_GRID.items() if getattr(args, k) == v]
    why = f" ({', '.join(own)}: ablate's default, not the protocol's)" if own else ""
    return (
        f"grid: {len(lengths)} lengths {lengths} x {len(depths)} depths {depths}{why} x {len(needles)} needles "
        f"= {len(lengths) * len(depths) * len(needles)} tests per configuration"
    )


@reports_errors()
def run(args: argparse.Namespace) -> int:
    return run_configurations(args, _run)


def _run(args: argparse.Namespace) -> int:
    import time

    from retmask.evaluate.ablate import (
        NON_RETRIEVAL_TAU,
        AblationError,
        parse_ks,
        plot_ablation,
        run_ablation,
    )
    from retmask.heads.selection import SelectionError, load_scores
    from retmask.niah import load_haystack
    from retmask.niah.haystack import HaystackError
    from retmask.niah.needles import NeedleFileError
    from retmask.plotting import short_name
    from retmask.runfiles import check_fresh_or_resume

    t0 = time.perf_counter()
    given = [
        f"--{name.replace('_', '-')}" for name in (*CURVE_DEFAULTS, "tau") if getattr(args, name) is not None
    ]
    if args.each is not None:
        if given:
            raise UsageError(
                f"{', '.join(given)} set the K curve, which --each replaces (each head masked alone); drop "
                f"{'it' if len(given) == 1 else 'them'} or drop --each"
            )
        return _run_each(args, t0)
    if args.tau is not None and args.random_from != "non-retrieval":
        raise UsageError("--tau sets the non-retrieval pool; add --random-from non-retrieval or drop --tau")
    for name, default in (CURVE_DEFAULTS | {"tau": NON_RETRIEVAL_TAU}).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    configs = args.out_dir / f"{args.prefix}.configs"  # checked again (with the settings) by run_ablation
    earlier = [configs] if configs.is_dir() and any(configs.glob("*.json")) else []
    check_fresh_or_resume(earlier, resume=args.resume, overwrite=args.overwrite, remove=False,
                          what="an earlier ablation")  # fmt: skip
    try:
        if args.scores is None:
            raise AblationError(
                "--scores is required (the retrieval scores of `retmask detect`), unless --each"
            )
        if args.resume and args.overwrite:
            raise AblationError("--resume and --overwrite exclude each other; pick one")
        if args.limit is not None and args.limit < 1:
            raise AblationError(f"--limit must be >= 1, got {args.limit}")
        ks = parse_ks(args.k)
        scores = load_scores(args.scores)
        lengths, depths = grid_from_args(args)
        needles = needles_from_args(args)
        haystack = load_haystack(args.haystack)
        print(_grid_line(args, lengths, depths, needles), file=sys.stderr)
        model, tok, name = load_from_args(args)
        res = run_ablation(
            model, tok, scores, ks=ks, seeds=args.seeds, lengths=lengths, depths=depths, needles=needles,
            haystack_text=haystack, out_dir=args.out_dir, prefix=args.prefix, resume=args.resume,
            overwrite=args.overwrite, random_from=args.random_from, tau=args.tau, base_seed=args.seed,
            max_new_tokens=args.max_new_tokens, model_name=name, progress=not args.no_progress, limit=args.limit,
            log=lambda msg: print(msg, file=sys.stderr), prompt_style=args.prompt_style,
        )  # fmt: skip
    except (ValueError, NeedleFileError, HaystackError, SelectionError) as err:
        print_error("retmask ablate", err)
        return 2
    png = args.out_dir / f"{args.prefix}.png"
    plot_ablation(
        res,
        png,
        f"NIAH vs heads masked: {short_name(name)}\n{len(lengths)} lengths x {len(depths)} depths x "
        f"{len(needles)} needles; scores: {args.scores.name}",
    )
    print(f"{name}: scores {args.scores}; grid lengths {lengths} x depths {depths} x {len(needles)} needles")
    print(res.table())
    print()
    print(res.kinds_table())
    left = res.meta["configs_total"] - res.meta["configs_done"]
    if left:
        print(f"{left} configurations left: run the same command with --resume to continue")
    print(
        f"done in {time.perf_counter() - t0:.0f} s; outputs -> {args.out_dir}/{args.prefix}.{{json,md,png}}"
    )
    return 0


def _run_each(args: argparse.Namespace, t0: float) -> int:
    import time

    from retmask.evaluate.single_heads import sweep_single_heads, sweep_table
    from retmask.heads import model_shape
    from retmask.heads.selection import SelectionError, load_scores, parse_heads_arg
    from retmask.niah import load_haystack
    from retmask.niah.haystack import HaystackError
    from retmask.niah.needles import NeedleFileError
    from retmask.runfiles import check_fresh_or_resume

    out = args.out_dir / f"{args.prefix}.each.json"
    check_fresh_or_resume([out], resume=args.resume, overwrite=args.overwrite, what="an earlier sweep")
    try:
        heads = parse_heads_arg(args.each)
        scores = load_scores(args.scores) if args.scores is not None else None
        lengths, depths = grid_from_args(args)
        needles = needles_from_args(args)
        haystack = load_haystack(args.haystack)
        print(_grid_line(args, lengths, depths, needles), file=sys.stderr)
        model, tok, name = load_from_args(args)
        L, H = model_shape(model)
        bad = [f"{a}-{b}" for a, b in heads if not (0 <= a < L and 0 <= b < H)]
        if bad:
            raise SelectionError(
                f"--each: heads {', '.join(bad)} do not exist in {name} ({L} layers x {H} heads)"
            )
        sweep = sweep_single_heads(
            model, tok, heads, lengths=lengths, depths=depths, needles=needles, haystack_text=haystack,
            scores=scores, max_new_tokens=args.max_new_tokens, out=out, resume=args.resume,
            progress=not args.no_progress, model_name=name, log=lambda msg: print(msg, file=sys.stderr),
            prompt_style=args.prompt_style,
        )  # fmt: skip
    except (ValueError, NeedleFileError, HaystackError, SelectionError) as err:
        print_error("retmask ablate", err)
        return 2
    table = sweep_table(sweep)
    print(
        f"{name}: each head masked alone; grid lengths {lengths} x depths {depths} x {len(needles)} needles"
    )
    print(table)
    try:
        atomic_write_text(out.with_suffix(".md"), table + "\n")
    except OutputWriteError as err:  # the sweep's results are in the JSON file and printed above
        print_error("retmask ablate", err, f"{err} (the table is printed above; the results are in {out})")
        return 2
    print(f"done in {time.perf_counter() - t0:.0f} s; outputs -> {out} and {out.with_suffix('.md')}")
    return 0
