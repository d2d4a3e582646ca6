"""``retmask pipeline``: detect → mask → generate → train → eval in one run directory, resumable."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from retmask.commands.argtypes import (
    depth_count,
    float_range,
    head_count,
    length_count,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    seed_int,
    steps_or_off,
    token_count,
    unit_float,
)
from retmask.commands.common import (
    MODEL_SPEC,
    add_device_arg,
    add_dtype_arg,
    check_device_arg,
    example,
    model_help,
    print_error,
    reports_errors,
)
from retmask.methods.retmask.pipeline_config import STAGES, VARIANTS, PipelineConfig
from retmask.niah.grid import PROTOCOLS


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    d = PipelineConfig()
    p = subparsers.add_parser(
        "pipeline",
        help="detect -> mask -> generate -> train -> eval, every artefact in one run dir; resumable stages",
        description=(
            "The whole RetMask recipe. Each stage is skipped when run_dir/pipeline.json records it done with the "
            "same settings and inputs; an interrupted stage resumes (detect, generate, eval; train from its last "
            "--save-every checkpoint) or restarts (train without one). "
            "A stage run before with other settings is refused, since running it again deletes its outputs and "
            "the later stages': pass --overwrite to run the pipeline again from it, or choose a new --run-dir. "
            "Defaults: the embedded SmolLM2 takes about 17 minutes on 2 CPU cores (detection about 5)."
        ),
        epilog=example(
            "retmask pipeline --model smollm2 --run-dir runs/pipeline --top-k 10 --num-instructions 64"
        ),
    )
    p.add_argument("--model", help=model_help("the model"))
    add_dtype_arg(p, training=True, help=(
        "float32 or bfloat16: the weights of detect, generate and eval, and bf16 autocast over float32 "
        "master weights in train; auto = bfloat16 on CUDA and on CPUs that compute bf16 natively (AMX or "
        "AVX512-BF16), float32 elsewhere (recorded resolved)"
    ))  # fmt: skip
    add_device_arg(p, help="where every stage runs: cpu or cuda (training: the Trainer's first visible "
                           "GPU; pick one with CUDA_VISIBLE_DEVICES)")  # fmt: skip
    p.add_argument(
        "--run-dir",
        type=Path,
        default=Path("runs/pipeline"),
        help="folder for every stage's outputs and pipeline.json",
    )
    p.add_argument("--baseline", choices=VARIANTS, default=d.baseline,
                   help="what makes the rejected responses: the retrieval heads masked (retmask), as many "
                        "random or non-retrieval heads masked, or win-lose (Win-Lose-Pair: the worse "
                        "of two samples of the unmasked model, judged by ROUGE-L F1 against the instructions' "
                        "reference answers; it draws further instructions until it has --num-instructions pairs, "
                        "since that judge ties often), or smaller-model (Smaller-Model: the rejected "
                        "responses from --rejected-model, nothing masked)")  # fmt: skip
    p.add_argument("--rejected-model", help="with --baseline smaller-model: the smaller model whose responses are "
                   f"rejected (its own tokenizer and chat template): {MODEL_SPEC}")  # fmt: skip
    p.add_argument("--scores", help="reuse this retrieval-scores JSON (skips the detection)")
    p.add_argument("--stop-after", choices=STAGES, help="stop after this stage (run again to continue)")
    g = p.add_argument_group("detect")
    # default None (the config's protocol is used), so a --protocol given with --scores can be refused
    g.add_argument("--protocol", choices=sorted(PROTOCOLS),
                   help="detection grid preset: " + "; ".join(f"{k}: {v.description}" for k, v in PROTOCOLS.items())
                   + f" (default: {d.protocol}, 96 tests with the 6 shipped needles)")  # fmt: skip
    g.add_argument(
        "--detect-min-len", type=token_count, help="shortest context, tokens (default: the protocol's)"
    )
    g.add_argument(
        "--detect-max-len", type=token_count, help="longest context, tokens (default: the protocol's)"
    )
    g.add_argument(
        "--detect-lengths", type=length_count, help="number of context lengths (default: the protocol's)"
    )
    g.add_argument(
        "--detect-depths", type=depth_count, help="number of needle depths (default: the protocol's)"
    )
    g = p.add_argument_group("mask")
    sel = g.add_mutually_exclusive_group()
    sel.add_argument("--threshold", type=unit_float, help="retrieval heads: score >= τ (default: 0.1)")
    sel.add_argument("--top-k", type=head_count, help="retrieval heads: the K best")
    g.add_argument("--mask-seed", type=seed_int, default=d.mask_seed,
                   help="seed of the random and non-retrieval baselines' draw (the other baselines draw no "
                        "heads)")  # fmt: skip
    g = p.add_argument_group("generate")
    g.add_argument(
        "--instructions",
        default=d.instructions,
        help="'builtin' (shipped with retmask) or a file / datasets name",
    )
    g.add_argument("--num-instructions", type=positive_int, default=d.num_instructions,
                   help="stratified subset size; win-lose: the number of pairs to make")  # fmt: skip
    g.add_argument("--temperature", type=nonneg_float, default=d.temperature,
                   help="sampling temperature of the chosen and rejected responses (0 = greedy)")  # fmt: skip
    g.add_argument("--gen-max-new-tokens", type=token_count, default=d.gen_max_new_tokens,
                   help="tokens per response (longer ones are cut and counted as truncated)")  # fmt: skip
    g.add_argument("--gen-batch-size", type=positive_int, default=d.gen_batch_size,
                   help="instructions per generation batch (2x rows: chosen and rejected)")  # fmt: skip
    g.add_argument("--gen-seed", type=seed_int, default=d.gen_seed, help="seed of the sampled responses")
    g = p.add_argument_group("train")
    g.add_argument(
        "--lr", type=positive_float, default=d.lr, help="peak learning rate (RetMask's published one)"
    )
    g.add_argument("--min-lr-rate", type=unit_float, default=d.min_lr_rate,
                   help="final lr / peak lr (the cosine decay's end)")  # fmt: skip
    g.add_argument("--warmup-ratio", type=float_range(0.0, 1.0, hi_open=True), default=d.warmup_ratio,
                   help="share of the steps with a linear lr warm-up from 0")  # fmt: skip
    g.add_argument("--weight-decay", type=nonneg_float, default=d.weight_decay, help="AdamW weight decay")
    g.add_argument("--epochs", type=positive_float, default=d.epochs, help="passes over the pairs")
    g.add_argument("--max-steps", type=steps_or_off, default=d.max_steps,
                   help="stop DPO after N optimizer steps; -1: --epochs decides")  # fmt: skip
    g.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="pairs per device and step")
    g.add_argument("--grad-accum", type=positive_int, default=d.grad_accum,
                   help="gradient accumulation steps (global batch = batch size x this; the published "
                        "recipe's is 512)")  # fmt: skip
    g.add_argument("--max-length", type=token_count, default=d.max_length,
                   help="prompt + response tokens; longer responses are cut")  # fmt: skip
    g.add_argument("--beta", type=positive_float, default=d.beta, help="DPO beta")
    g.add_argument(
        "--train-seed",
        type=seed_int,
        default=d.train_seed,
        help="seed of DPO's data order and initialisation",
    )
    g.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute activations in the backward pass: less memory, the same result (not part "
                        "of the stage's settings)")  # fmt: skip
    g.add_argument(
        "--sft",
        action="store_true",
        help="train on the pairs' chosen responses only, without the contrast (the SFT baseline; the "
        "rejected responses are still generated, so a run with the same seeds trains on RetMask's chosen)",
    )
    g.add_argument(
        "--drop-unfinished",
        action="store_true",
        help="train only on pairs whose responses ended before --gen-max-new-tokens (a cut response is otherwise "
        "trained on as if complete)",
    )
    g.add_argument(
        "--telemetry-every",
        type=nonneg_int,
        default=d.telemetry_every,
        help="probe the retrieval score of the masked heads every N optimizer steps (0 = no telemetry)",
    )
    g.add_argument("--save-every", type=nonneg_int, default=d.save_every, metavar="N",
                   help="keep a training checkpoint every N optimizer steps, so a rerun after an interrupt continues "
                        "the training stage instead of starting it over (0: none)")  # fmt: skip
    g = p.add_argument_group("eval")
    g.add_argument(
        "--eval-min-len", type=token_count, default=d.eval_min_len, help="shortest context, tokens"
    )
    g.add_argument(
        "--eval-max-len",
        type=token_count,
        help="longest context, tokens (default: min(4000, the model's maximum))",
    )
    g.add_argument(
        "--eval-lengths", type=length_count, default=d.eval_lengths, help="number of context lengths"
    )
    g.add_argument("--eval-depths", type=depth_count, default=d.eval_depths, help="NIAH needle depths")
    g.add_argument(
        "--eval-needles", type=positive_int, default=d.eval_needles, help="the first N shipped needles"
    )
    g.add_argument("--eval-tasks", nargs="+", default=d.eval_tasks, choices=["niah", "multi_needle", "kv"],
                   help="NIAH grid (and the heads' retrieval scores), multi-needle recall, key-value retrieval")  # fmt: skip
    g.add_argument("--eval-cache", help="per-model eval cache shared between runs (the original model once)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="run the stages again, deleting their earlier outputs: from the first stage recorded with other "
        "settings (the earlier stages are kept), or every stage when none was",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars (the stage log lines remain)")
    p.set_defaults(func=run)
    return p


def check_pipeline_grids(args: argparse.Namespace) -> None:
    """The detection and evaluation grids' bounds (distinct lengths and depths, prompt memory), before the
    run dir is set up or a model loads; a GridError names the pipeline's flags."""
    from retmask.evaluate.config import DEFAULT_MAX_LEN
    from retmask.niah.grid import check_grid_counts, resolve_grid

    if args.scores is None:  # the pipeline detects the heads itself
        resolve_grid(
            _protocol(args), min_len=args.detect_min_len, max_len=args.detect_max_len,
            num_lengths=args.detect_lengths, num_depths=args.detect_depths,
            flags={"min_len": "--detect-min-len", "max_len": "--detect-max-len",
                   "num_lengths": "--detect-lengths", "num_depths": "--detect-depths"},
        )  # fmt: skip
    # with no --eval-max-len the longest evaluation context is at most the cap
    check_grid_counts(
        args.eval_min_len, args.eval_max_len or DEFAULT_MAX_LEN, args.eval_lengths, args.eval_depths,
        flags={"min_len": "--eval-min-len", "max_len": "--eval-max-len",
               "num_lengths": "--eval-lengths", "num_depths": "--eval-depths"},
        defaults=set() if args.eval_max_len is not None else {"max_len"}, default_note=" (the default cap)",
    )  # fmt: skip


DETECT_FLAGS = ("protocol", "detect_min_len", "detect_max_len", "detect_lengths", "detect_depths")


def _protocol(args: argparse.Namespace) -> str:
    """--protocol, or the configuration's default when it was not given."""
    return args.protocol if args.protocol is not None else PipelineConfig.protocol


def _reaches(args: argparse.Namespace, stage: str) -> bool:
    """Whether this run goes as far as ``stage`` (``--stop-after`` is not before it)."""
    return args.stop_after is None or STAGES.index(args.stop_after) >= STAGES.index(stage)


def check_pipeline_inputs(args: argparse.Namespace) -> None:
    """Flags that would be ignored or fail only at a later stage, refused before the run dir is set up or a
    model loads: the detection's flags with --scores (which replaces the detection), --instructions that
    cannot be read (when the run reaches generate), an --eval-cache that is not a writable folder, a --top-k
    over the heads of a model folder. (--mask-seed is taken with every baseline, though only random and
    non-retrieval draw heads, so that a sweep over baselines shares one command line.)"""
    from retmask.errors import UsageError
    from retmask.methods.retmask.instructions import InstructionError, load_instructions
    from retmask.runfiles import check_writable

    given = [f"--{name.replace('_', '-')}" for name in DETECT_FLAGS if getattr(args, name) is not None]
    if args.scores is not None and given:
        one = len(given) == 1
        names = given[0] if one else f"{', '.join(given[:-1])} and {given[-1]}"
        them = "it" if one else "them"
        raise UsageError(
            f"{names} {'sets' if one else 'set'} up the detection, which --scores replaces (the heads come from "
            f"its scores file); drop {them}, or drop --scores to detect the heads with {them}"
        )
    if _reaches(args, "generate"):
        try:
            pool = load_instructions(args.instructions)
        except InstructionError as e:
            raise UsageError(f"--instructions: {e}") from None
        if args.baseline == "win-lose" and not any(inst.reference for inst in pool):
            raise UsageError(
                f"--baseline win-lose judges samples against the instructions' reference answers, and "
                f"{args.instructions} has none; give instructions with a 'reference' column or another --baseline"
            )
    if args.eval_cache is not None:
        check_writable(args.eval_cache, what="--eval-cache", directory=True)
    if args.top_k is not None:  # a local folder's config tells the number of heads before any detection
        from retmask.heads import model_shape
        from retmask.hf.loading import peek_config

        config = peek_config(args.model)
        if config is not None and args.top_k > (heads := math.prod(model_shape(config))):
            raise UsageError(
                f"--top-k {args.top_k} is more than the {heads} heads of {args.model}; lower --top-k"
            )


@reports_errors(interrupt_hint="run the same command again to resume")
def run(args: argparse.Namespace) -> int:
    from retmask.heads.selection import SelectionError
    from retmask.hf.precision import resolve_training_dtype
    from retmask.methods.retmask.generate import GenerateError
    from retmask.methods.retmask.instructions import InstructionError
    from retmask.methods.retmask.pairs import PairsError
    from retmask.methods.retmask.pipeline import PipelineError, run_pipeline

    check_device_arg(args.device, "pipeline")
    if args.scores is not None:
        from retmask.heads import load_scores

        try:
            load_scores(args.scores)  # a missing or malformed file fails now, not after the run dir is set up
        except (SelectionError, OSError) as e:
            print_error("retmask pipeline", e, f"--scores: {e}")
            return 2
    check_pipeline_inputs(args)
    check_pipeline_grids(args)
    threshold = args.threshold if args.threshold is not None else (None if args.top_k is not None else 0.1)
    cfg = PipelineConfig(
        model=args.model, dtype=resolve_training_dtype(args.dtype, args.device), device=args.device, baseline=args.baseline, rejected_model=args.rejected_model,
        scores=args.scores, protocol=_protocol(args),
        detect_min_len=args.detect_min_len, detect_max_len=args.detect_max_len, detect_lengths=args.detect_lengths,
        detect_depths=args.detect_depths, threshold=threshold, top_k=args.top_k, mask_seed=args.mask_seed,
        instructions=args.instructions, num_instructions=args.num_instructions, temperature=args.temperature,
        gen_max_new_tokens=args.gen_max_new_tokens, gen_batch_size=args.gen_batch_size, gen_seed=args.gen_seed,
        lr=args.lr, min_lr_rate=args.min_lr_rate, warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay,
        gradient_checkpointing=args.gradient_checkpointing, epochs=args.epochs, max_steps=args.max_steps,
        batch_size=args.batch_size, grad_accum=args.grad_accum, max_length=args.max_length, beta=args.beta,
        train_seed=args.train_seed,
        objective="sft" if args.sft else "dpo", telemetry_every=args.telemetry_every,
        drop_unfinished=args.drop_unfinished, save_every=args.save_every,
        eval_min_len=args.eval_min_len, eval_max_len=args.eval_max_len, eval_lengths=args.eval_lengths,
        eval_depths=args.eval_depths, eval_needles=args.eval_needles, eval_cache=args.eval_cache,
        eval_tasks=list(args.eval_tasks),
    )  # fmt: skip
    try:
        state = run_pipeline(
            cfg,
            args.run_dir,
            stop_after=args.stop_after,
            progress=not args.no_progress,
            overwrite=args.overwrite,
        )
    except (PipelineError, SelectionError, GenerateError, InstructionError, PairsError, ValueError) as e:
        print_error("retmask pipeline", e)
        return 2
    times = ", ".join(
        f"{k} {v.get('seconds', 0):.0f} s" for k, v in state["stages"].items() if "seconds" in v
    )
    print(f"pipeline -> {args.run_dir} ({times})")
    return 0
