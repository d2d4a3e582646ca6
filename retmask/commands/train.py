"""``retmask train``: DPO on RetMask preference pairs (or ``--sft``: the SFT baseline on chosen responses)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from retmask.commands.argtypes import (
    float_range,
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
    add_device_arg,
    add_dtype_arg,
    check_device_arg,
    example,
    model_help,
    print_error,
    reports_errors,
)
from retmask.heads.selection import SelectionError
from retmask.methods.retmask.pairs import PairsError
from retmask.methods.retmask.train_config import TrainConfig


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    d = TrainConfig()
    p = subparsers.add_parser(
        "train",
        help="DPO on preference pairs with retmask attention (--sft: the SFT baseline)",
        description=(
            "TRL DPOTrainer (sigmoid loss), policy loaded with attn_implementation='retmask', reference = a "
            "frozen copy of the original model. Defaults are RetMask's published recipe: AdamW (0.9, 0.95), "
            "weight decay 0.1, lr 5e-7 with 10% linear warm-up then cosine to 5e-8, beta 0.1, 2 epochs. "
            "Prompts that alone reach --max-length are an error (TRL 1.16 would drop them silently)."
        ),
        epilog=example(
            "retmask train --model smollm2 --pairs runs/pairs.jsonl --out runs/dpo --telemetry-every 10"
        ),
    )
    p.add_argument("--pairs", type=Path, required=True, help="pairs JSONL from `retmask generate`")
    p.add_argument("--model", help=model_help("the policy model (the frozen reference is a copy of it)"))
    p.add_argument("--out", type=Path, required=True,
                   help="folder for the trained model (HF checkpoint), retmask_train.json (settings, losses, "
                        "timings) and, with telemetry, telemetry.json / .png")  # fmt: skip
    p.add_argument("--beta", type=positive_float, default=d.beta, help="DPO beta")
    p.add_argument(
        "--lr",
        type=positive_float,
        default=d.learning_rate,
        help="peak learning rate",
    )
    p.add_argument("--min-lr-rate", type=unit_float, default=d.min_lr_rate, help="final lr / peak lr")
    p.add_argument(
        "--warmup-ratio",
        type=float_range(0.0, 1.0, hi_open=True),
        default=d.warmup_ratio,
        help="share of the steps with a linear lr warm-up",
    )
    p.add_argument("--weight-decay", type=nonneg_float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument(
        "--epochs",
        type=positive_float,
        default=d.epochs,
        help="passes over the pairs",
    )
    p.add_argument("--max-steps", type=steps_or_off, default=d.max_steps,
                   help="stop after N optimizer steps; -1: --epochs decides")  # fmt: skip
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="pairs per device and step")
    p.add_argument("--grad-accum", type=positive_int, default=d.grad_accum,
                   help="gradient accumulation steps (global batch = batch size x this)")  # fmt: skip
    p.add_argument("--max-length", type=token_count, default=d.max_length,
                   help="prompt + response tokens; longer responses are truncated")  # fmt: skip
    p.add_argument("--seed", type=seed_int, default=d.seed, help="seed of the data order and initialisation")
    p.add_argument("--gradient-checkpointing", action="store_true", help="trade compute for memory")
    precision = p.add_mutually_exclusive_group()  # --bf16 --dtype float32 would be a contradiction
    add_dtype_arg(precision, training=True)
    precision.add_argument("--bf16", action="store_true", help="same as --dtype bfloat16")
    add_device_arg(p, help="where to train: cpu or cuda (the Trainer's first visible GPU; pick one "
                           "with CUDA_VISIBLE_DEVICES)")  # fmt: skip
    p.add_argument("--sft", action="store_true", help="SFT on the chosen responses only (the SFT baseline)")
    p.add_argument("--telemetry-every", type=positive_int, metavar="N",
                   help="every N optimizer steps (and at step 0 and the end) probe the retrieval score of the masked "
                        "heads vs the other heads (logged as retrieval/*; telemetry.json/.png in --out)")  # fmt: skip
    p.add_argument("--telemetry-heads", type=Path, metavar="FILE",
                   help="masked heads for the telemetry (default: the heads recorded with the pairs by `retmask generate`)")  # fmt: skip
    p.add_argument("--save-every", type=nonneg_int, default=d.save_every, metavar="N",
                   help="keep a checkpoint in --out every N optimizer steps (the newest only; deleted when "
                        "the run completes), so an interrupted run continues with --resume (0: none)")  # fmt: skip
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --out (same settings; --save-every, --device and "
                        "--gradient-checkpointing may change)")  # fmt: skip
    p.add_argument(
        "--overwrite", action="store_true", help="replace the files of an earlier run in --out (else refused)"
    )
    p.add_argument(
        "--drop-unfinished",
        action="store_true",
        help="train only on pairs whose responses ended by themselves, not at `retmask generate`'s "
        "--max-new-tokens (DPO: both responses; --sft: the chosen one); a cut response is otherwise closed with "
        "an end-of-turn token as if complete",
    )
    p.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="train on the pairs of an unfinished `retmask generate` run (refused by default)",
    )
    p.set_defaults(func=run)
    return p


def _interrupt_hint(args: argparse.Namespace) -> str:
    if args.save_every or args.resume:
        return (
            "continue with the same command plus --resume (from the newest checkpoint in --out, written every "
            "--save-every N steps)"
        )
    return "nothing resumable was written (training restarts from the beginning; --save-every N keeps checkpoints)"


@reports_errors(interrupt_hint=_interrupt_hint)
def run(args: argparse.Namespace) -> int:
    from retmask.hf.precision import resolve_training_dtype
    from retmask.methods import checkpoints
    from retmask.methods.retmask.dpo import train_dpo, train_sft
    from retmask.methods.retmask.pair_file import unfinished_generation
    from retmask.runfiles import RunLock, check_writable

    check_device_arg(args.device, "train")
    cfg = TrainConfig(
        learning_rate=args.lr, min_lr_rate=args.min_lr_rate, warmup_ratio=args.warmup_ratio,
        weight_decay=args.weight_decay, epochs=args.epochs, max_steps=args.max_steps, batch_size=args.batch_size,
        grad_accum=args.grad_accum, max_length=args.max_length, seed=args.seed,
        gradient_checkpointing=args.gradient_checkpointing, beta=args.beta,
        dtype=resolve_training_dtype("bfloat16" if args.bf16 else args.dtype, args.device),
        device=args.device, drop_unfinished=args.drop_unfinished,
        save_every=args.save_every,
    )  # fmt: skip
    try:
        for name in ("batch_size", "grad_accum", "max_length"):
            if getattr(cfg, name) <= 0:
                raise PairsError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
        if not (0.0 <= cfg.warmup_ratio < 1.0) or not (0.0 <= cfg.min_lr_rate <= 1.0):
            raise PairsError("--warmup-ratio must be in [0, 1) and --min-lr-rate in [0, 1]")
        unfinished = unfinished_generation(args.pairs)
        if unfinished and not args.allow_incomplete:
            raise PairsError(f"{unfinished}, or pass --allow-incomplete to train on it as it is")
        if unfinished:
            print(
                f"retmask train: warning: {unfinished}; training on it anyway (--allow-incomplete)",
                file=sys.stderr,
            )
        check_writable(args.out, what="--out", directory=True)
        if args.resume and args.overwrite:
            raise PairsError("--resume and --overwrite exclude each other; pick one")
        if args.out.is_dir() and any(args.out.iterdir()) and not (args.overwrite or args.resume):
            raise PairsError(
                f"--out {args.out} already holds "
                + ("the checkpoints of an unfinished training; pass --resume to continue it, "
                   if checkpoints.has_run_files(args.out) else "files (an earlier trained model?); pass ")
                + "--overwrite to replace them, or choose another folder"
            )  # fmt: skip
        callbacks = None
        if args.telemetry_every is not None:
            from retmask.methods.retmask.telemetry import RetrievalTelemetry, heads_for_pairs

            heads = heads_for_pairs(args.pairs, args.telemetry_heads)
            callbacks = [RetrievalTelemetry(heads, args.telemetry_every)]
        elif args.telemetry_heads is not None:
            raise PairsError("--telemetry-heads needs --telemetry-every N")
        fn = train_sft if args.sft else train_dpo
        with RunLock(args.out):
            if args.overwrite:
                checkpoints.clear(args.out)  # an earlier run's checkpoints must not be resumed later
            result = fn(args.pairs, args.out, args.model, cfg, callbacks=callbacks, resume=args.resume)
    except (PairsError, SelectionError, ValueError) as e:
        print_error("retmask train", e)
        return 2
    print(result.lengths.summary())
    ran = result.steps - result.resumed_from_step
    resumed = (
        f", {ran} of them in this run (resumed at step {result.resumed_from_step})"
        if result.resumed_from_step
        else ""
    )
    print(
        f"{'SFT' if args.sft else 'DPO'}: {result.steps} steps{resumed}; {result.seconds:.1f} s "
        f"({result.seconds_per_step:.2f} s/step); final loss {result.losses[-1] if result.losses else float('nan'):.4f}"
    )
    if args.telemetry_every is not None:
        print(f"retrieval telemetry -> {args.out / 'telemetry.json'}, {args.out / 'telemetry.png'}")
    print(f"model -> {args.out}")
    return 0
