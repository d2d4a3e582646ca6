"""``retmask kv``: accuracy against KV memory with head-sparse caches: are retrieval heads the ones to keep?

Writes ``<out-dir>/<prefix>.json`` (every configuration: policy, budget, seed, full KV heads, bytes held
and the full cache's, each test's answer and score), ``<prefix>.md`` (table) and ``<prefix>.png``
(accuracy vs memory ratio); each configuration is saved atomically under ``<prefix>.configs/`` as it
completes, so ``--resume`` continues an interrupted run. The work is ``retmask.evaluate.kv_budget``'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from retmask.commands.argtypes import (
    MAX_TOKENS,
    draw_count,
    int_range,
    seed_int,
    token_count,
)
from retmask.commands.common import (
    add_configuration_run_args,
    add_grid_args,
    add_model_args,
    check_device_arg,
    example,
    grid_from_args,
    load_from_args,
    needles_from_args,
    print_error,
    reports_errors,
    run_configurations,
)
from retmask.errors import UsageError

# A small default grid: every configuration runs every test (17 configurations with the defaults).
DEFAULT_GRID = {"num_lengths": 3, "num_depths": 3}
DEFAULT_NEEDLES = 2
DEFAULT_POLICIES = "retrieval,random,non-retrieval,streaming,full"
DEFAULT_BUDGETS = "0.1,0.2,0.3"
DEFAULT_SEEDS, DEFAULT_SEED = 3, 0  # random-policy draws per budget, and the first one's seed

sink_count = int_range(0, cap=MAX_TOKENS, why="more tokens than any model's context")


def _list_type(parse_name: str, *extra: Any):
    """An argparse ``type`` calling ``retmask.evaluate.kv_budget.<parse_name>`` (imported on use: the
    module is light, but building the parsers imports nothing of it), its error as argparse's."""

    def parse(text: str):
        from retmask.evaluate import kv_budget

        try:
            return getattr(kv_budget, parse_name)(text, *extra)
        except UsageError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = "list"
    return parse


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "kv",
        help="accuracy vs KV memory: keep the retrieval heads' keys (head-sparse cache) vs random heads",
        description=(
            "The causal test of retrieval heads as the KV heads to keep. Answers the NIAH grid (and with "
            "--tasks niah,kv the key-value retrieval task of `retmask eval`) with model.generate under each "
            "KV-cache policy at each budget: retrieval = the KV heads with the best retrieval scores keep "
            "every key; random = as many random KV heads (--seeds draws); non-retrieval = the lowest-scoring "
            "ones; streaming = none (budget 0); full = the normal cache. Every other KV head keeps its first "
            "--sink-tokens keys and the last --window. BUDGET is the fraction of KV heads (of the global "
            "layers) kept full, not of query heads: with GQA, g query heads share one KV head, a KV head "
            "ranks by its best query head and keeps every key for all g of them, so budget 0.1 of SmolLM2's "
            "90 KV heads (270 query heads) keeps 9 KV heads (27 query heads) whole; fractions round up to "
            "whole KV heads. The memory ratio follows, measured from the cache after each generation. "
            "Writes a table, a plot PNG and a JSON with every configuration. Resumable."
        ),
        epilog=example(
            "retmask kv --scores runs/detect/scores.json --budgets 0.1,0.2,0.3 --window 256 "
            "--sink-tokens 4 --seeds 3 --out-dir runs/kv"
        ),
    )
    p.add_argument(
        "--scores",
        type=Path,
        default=None,
        help="retrieval-scores JSON of this model (`retmask detect`); needed by the retrieval and "
        "non-retrieval policies",
    )
    p.add_argument(
        "--budgets",
        type=_list_type("parse_budgets"),
        default=None,
        help="comma-separated fractions in (0, 1] of the KV heads (not query heads) kept full, for the "
        f"retrieval, random and non-retrieval policies (default: {DEFAULT_BUDGETS})",
    )
    p.add_argument(
        "--policies",
        type=_list_type(
            "parse_names", ("retrieval", "random", "non-retrieval", "streaming", "full"), "policy"
        ),
        default=DEFAULT_POLICIES,
        help="comma-separated policies to run",
    )
    p.add_argument(
        "--window",
        type=token_count,
        default=256,
        help="recent tokens every non-full KV head keeps (must be shorter than the shortest context)",
    )
    p.add_argument(
        "--sink-tokens", type=sink_count, default=4, help="first tokens (attention sinks) every KV head keeps"
    )
    p.add_argument(
        "--prefill",
        choices=("windowed", "full"),
        default="windowed",
        help="windowed: the windowed KV heads see only their sink + window keys from the prompt on (memory and "
        "work bounded from the first token); full: the prompt is computed with every key in every head and "
        "the cache is pruned after it, so only the answer's tokens see the pruned cache",
    )
    # None = not given: a policy list without the random policy refuses them rather than ignoring them
    p.add_argument(
        "--seeds",
        type=draw_count,
        default=None,
        help=f"random-policy draws per budget (default: {DEFAULT_SEEDS})",
    )
    p.add_argument(
        "--seed",
        type=seed_int,
        default=None,
        help=f"first seed of the random draws (then seed+1, ...; default: {DEFAULT_SEED})",
    )
    p.add_argument(
        "--tasks",
        type=_list_type("parse_names", ("niah", "kv"), "task"),
        default="niah",
        help="comma-separated tasks: niah = the NIAH grid (ROUGE-1 recall); kv = key-value retrieval of "
        "`retmask eval` at the grid's lengths, asked at its depths (exact match)",
    )
    add_model_args(p)
    add_grid_args(p, num_needles=DEFAULT_NEEDLES, grid=DEFAULT_GRID)
    add_configuration_run_args(p, name="kv")
    p.set_defaults(func=run)
    return p


def _as_list(value: Any, parse: Any) -> Any:
    """A flag's value: argparse applies ``type`` to a string default too, but not to one set in code."""
    return parse(value) if isinstance(value, str) else value


def check_policy_flags(args: argparse.Namespace, policies: list[str]) -> None:
    """Refuse flags the chosen policies would ignore: --budgets without a budgeted policy, --seeds / --seed
    without the random one."""
    from retmask.evaluate.kv_budget.plan import BUDGET_POLICIES

    if args.budgets is not None and not any(p in BUDGET_POLICIES for p in policies):
        raise UsageError(
            f"--budgets applies to the {', '.join(BUDGET_POLICIES)} policies, and --policies has none of them; "
            "drop --budgets or add one of those policies"
        )
    given = [flag for flag, value in (("--seeds", args.seeds), ("--seed", args.seed)) if value is not None]
    if given and "random" not in policies:
        raise UsageError(
            f"{' and '.join(given)} only set the random policy's draws, and --policies does not include it; "
            f"drop {' and '.join(given)} or add random"
        )


@reports_errors()
def run(args: argparse.Namespace) -> int:
    return run_configurations(args, _run)


def _run(args: argparse.Namespace) -> int:
    import time

    from retmask.evaluate.kv_budget import (
        BUDGET_POLICIES,
        POLICIES,
        SCORED_POLICIES,
        TASKS,
        KVBudgetError,
        check_window,
        parse_budgets,
        parse_names,
        plan,
        plot_kv_budget,
        run_kv_budget,
    )
    from retmask.heads.selection import SelectionError, load_scores
    from retmask.niah import load_haystack
    from retmask.niah.grid import check_grid_tests
    from retmask.niah.haystack import HaystackError
    from retmask.niah.needles import NeedleFileError
    from retmask.plotting import short_name
    from retmask.runfiles import check_fresh_or_resume

    t0 = time.perf_counter()
    policies = _as_list(args.policies, lambda s: parse_names(s, POLICIES, "policy"))
    check_policy_flags(args, policies)
    budgets = _as_list(args.budgets if args.budgets is not None else DEFAULT_BUDGETS, parse_budgets)
    args.seeds = DEFAULT_SEEDS if args.seeds is None else args.seeds
    args.seed = DEFAULT_SEED if args.seed is None else args.seed
    tasks = _as_list(args.tasks, lambda s: parse_names(s, TASKS, "task"))
    configs = args.out_dir / f"{args.prefix}.configs"  # checked again (with the settings) by run_kv_budget
    earlier = [configs] if configs.is_dir() and any(configs.glob("*.json")) else []
    earlier += [p for p in [args.out_dir / f"{args.prefix}.json"] if p.exists()]
    check_fresh_or_resume(earlier, resume=args.resume, overwrite=args.overwrite, remove=False,
                          what="an earlier KV-budget run")  # fmt: skip
    try:
        # everything that can be checked without the model, before it loads
        if args.scores is None and any(p in SCORED_POLICIES for p in policies):
            raise KVBudgetError(
                "--scores is required by the retrieval and non-retrieval policies (the scores JSON "
                "`retmask detect` wrote for this model); pass it, or --policies without them"
            )
        if args.scores is not None:
            load_scores(args.scores)  # readable and well-formed now; its shape is checked with the model
        if not any(p in BUDGET_POLICIES for p in policies):
            budgets = []  # streaming and full have no budget
        total = len(plan(policies, budgets, args.seeds, args.seed))
        lengths, depths = grid_from_args(args)
        check_window(args.window, args.sink_tokens, lengths)
        needles = needles_from_args(args)
        if "niah" in tasks:
            check_grid_tests(len(needles), lengths, depths)
        haystack = load_haystack(args.haystack)
        check_device_arg(args.device, "kv")
        per_config = len(needles) * len(lengths) * len(depths) * ("niah" in tasks)
        per_config += len(lengths) * len(depths) * ("kv" in tasks)
        print(
            f"grid: {len(lengths)} lengths {lengths} x {len(depths)} depths {depths}"
            + (f" x {len(needles)} needles" if "niah" in tasks else "")
            + f"; tasks {','.join(tasks)}: up to {per_config} tests per configuration x {total} configurations",
            file=sys.stderr,
        )
        model, tok, name = load_from_args(args)
        res = run_kv_budget(
            model, tok, scores=args.scores, policies=policies, budgets=budgets, seeds=args.seeds,
            base_seed=args.seed, window=args.window, sink_tokens=args.sink_tokens, prefill=args.prefill, tasks=tasks,
            lengths=lengths, depths=depths, needles=needles, haystack_text=haystack,
            max_new_tokens=args.max_new_tokens, prompt_style=args.prompt_style, out_dir=args.out_dir,
            prefix=args.prefix, resume=args.resume, overwrite=args.overwrite, limit=args.limit,
            model_name=name, progress=not args.no_progress, log=lambda msg: print(msg, file=sys.stderr),
        )  # fmt: skip
    except (ValueError, NeedleFileError, HaystackError, SelectionError) as err:
        print_error("retmask kv", err)
        return 2
    png = args.out_dir / f"{args.prefix}.png"
    if res.results:
        plot_kv_budget(
            res,
            png,
            f"Accuracy vs KV memory: {short_name(name)}, window {args.window} + {args.sink_tokens} sinks"
            + (", full prefill" if args.prefill == "full" else "")
            + "\n"
            + (
                f"{len(lengths)} lengths ({min(lengths)}-{max(lengths)})"
                if len(lengths) > 1
                else f"length {lengths[0]}"
            )
            + f" x {len(depths)} depth{'s' * (len(depths) > 1)}"
            + (f" x {len(needles)} needles" if "niah" in tasks else "")
            + (f"; scores: {args.scores.name}" if args.scores is not None else ""),
        )
    print(
        f"{name}: window {args.window}, {args.sink_tokens} sink tokens, {args.prefill} prefill; "
        f"grid lengths {lengths} x depths {depths}"
    )
    print(res.table())
    left = res.meta["configs_total"] - res.meta["configs_done"]
    if left:
        print(f"{left} configurations left: run the same command with --resume to continue")
    print(
        f"done in {time.perf_counter() - t0:.0f} s; outputs -> {args.out_dir}/{args.prefix}.{{json,md,png}}"
    )
    return 0
