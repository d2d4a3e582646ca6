"""``retmask mudaf-train``: MuDAF (L_CLM + λ·L_CON on selected heads) or the vanilla-SFT baseline on MDQA data."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from retmask.commands.argtypes import (
    head_count,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    seed_int,
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
from retmask.model_files import files_stamp


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from retmask.methods.mudaf.config import SIMILARITIES, MuDAFConfig

    d = MuDAFConfig()
    p = subparsers.add_parser(
        "mudaf-train",
        help="MuDAF contrastive head training on MDQA data (--vanilla-sft: the CLM-only baseline)",
        description=(
            "Loss L_CLM + λ·L_CON; L_CON = cross-entropy over passages of cos(q, k̄_p)/τ, q = the "
            "last prompt token's post-RoPE query of the selected heads concatenated, k̄_p = the mean post-RoPE "
            "key of passage p (a query head uses its KV group's keys), golden passage(s) positive (two golden "
            "passages: one term each against the distractors, averaged). CLM on the answer tokens of the "
            "MDQA prompt. Heads from --heads, or sampled from MDQA scores with P(h) ∝ exp(R_h/τ_h). "
            "AdamW, constant lr after optional warm-up, fp32 or bf16 autocast (--dtype); saves an HF checkpoint and mudaf_train.json."
        ),
        epilog=example(
            "retmask mudaf-train --model smollm2 --data mdqa_train.jsonl --scores runs/mdqa/scores.json "
            "--out runs/mudaf --steps 200"
        ),
    )
    p.add_argument("--data", type=Path, required=True, help="MDQA training JSONL")
    p.add_argument("--model", help=model_help("the model to train"))
    p.add_argument("--out", type=Path, required=True, help="folder for the trained model")
    add_dtype_arg(p, training=True)
    add_device_arg(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--heads", type=Path, help="heads JSON (retmask mask / a list of [layer, head])")
    src.add_argument("--scores", type=Path, help="MDQA scores JSON (retmask mdqa-score): sample the heads")
    p.add_argument("--num-heads", type=head_count, default=8, help="heads to sample with --scores")
    p.add_argument(
        "--head-temperature",
        type=positive_float,
        default=0.05,
        help="sampling τ with --scores",
    )
    p.add_argument(
        "--vanilla-sft", action="store_true", help="λ = 0: CLM only (L_CON still logged if heads given)"
    )
    weight = p.add_mutually_exclusive_group()  # two ways to weight L_CON: one at a time
    weight.add_argument("--lambda", dest="lambda_con", type=nonneg_float, default=d.lambda_con,
                   help="λ in L_CLM + λ·L_CON")  # fmt: skip
    weight.add_argument("--alpha", type=unit_float,
                   help="use (1-α)·L_CLM + α·L_CON instead (the reference code's form; it used α = 0.3)")  # fmt: skip
    p.add_argument("--temperature", type=positive_float, default=d.temperature, help="L_CON temperature")
    p.add_argument("--similarity", choices=SIMILARITIES, default=d.similarity,
                   help="concat: one cosine over all heads' vectors (MuDAF's published choice); "
                        "per-head: one cross-entropy per head, summed")  # fmt: skip
    p.add_argument(
        "--lr",
        type=positive_float,
        default=d.learning_rate,
        help="learning rate",
    )
    p.add_argument("--steps", type=positive_int, default=d.max_steps, help="optimizer steps")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="examples per micro-batch")
    p.add_argument("--grad-accum", type=positive_int, default=d.grad_accum, help="micro-batches per step")
    p.add_argument("--warmup-steps", type=nonneg_int, default=d.warmup_steps, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=nonneg_float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument(
        "--max-length", type=token_count, help="token limit per example (default: the model's context)"
    )
    p.add_argument("--limit", type=positive_int, help="train on the first N examples only")
    p.add_argument("--seed", type=seed_int, default=d.seed, help="data order and head sampling seed")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each layer's forward in the backward pass: less memory for long examples, "
                        "the same gradients (a --resume may change it)")  # fmt: skip
    p.add_argument(
        "--save-every", type=nonneg_int, default=0, help="write <out>/resume.pt every N steps (0 = never)"
    )
    p.add_argument("--resume", action="store_true", help="continue from <out>/resume.pt")
    p.add_argument(
        "--overwrite", action="store_true", help="start over, replacing an earlier run's checkpoint in --out"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the final summary remains)")
    p.set_defaults(func=run)
    return p


def select(args: argparse.Namespace, model_shape: list[int]):
    """The target heads (a HeadSelection) from --heads or --scores, or None."""
    from retmask.heads.selection import load_scores, mudaf_selection, read_heads

    if args.heads is not None:
        return read_heads(args.heads, model_shape)
    if args.scores is not None:
        return mudaf_selection(
            load_scores(args.scores), n=args.num_heads, temperature=args.head_temperature, seed=args.seed,
            model_shape=model_shape, source=str(args.scores),
        )  # fmt: skip
    return None


@reports_errors(
    interrupt_hint="continue with the same command plus --resume (from the last <out>/resume.pt; "
    "written every --save-every N steps)"
)
def run(args: argparse.Namespace) -> int:
    from retmask.runfiles import RunLock, check_fresh_or_resume, check_writable

    check_writable(args.out, what="--out", directory=True)
    check_fresh_or_resume([], resume=args.resume, overwrite=args.overwrite)  # not both
    with RunLock(args.out):
        # the folder's own files only (never the whole folder: it may hold other things)
        earlier = [args.out / name for name in ("resume.pt", "mudaf_train.json")]
        check_fresh_or_resume(
            earlier, resume=args.resume, overwrite=args.overwrite, what="an earlier training"
        )
        if args.resume:  # before any work: a finished run is not retrained from the base model
            from retmask.methods.mudaf.train import check_not_finished

            check_not_finished(args.out)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import retmask
    from retmask.heads.selection import SelectionError, load_scores, read_heads, write_heads
    from retmask.hf.layers import head_layout
    from retmask.hf.precision import resolve_training_dtype
    from retmask.methods.mudaf.mdqa import MDQAError, load_mdqa
    from retmask.methods.mudaf.train import MuDAFConfig, train_mudaf
    from retmask.runfiles import file_digest

    try:
        if args.limit is not None and args.limit < 1:
            raise MDQAError(f"--limit must be >= 1, got {args.limit}")
        if not args.vanilla_sft and args.heads is None and args.scores is None:
            raise MDQAError("MuDAF needs target heads: --heads heads.json or --scores mdqa_scores.json")
        check_device_arg(args.device, "mudaf-train")  # and the $RETMASK_* settings
        dtype = resolve_training_dtype(args.dtype, args.device)  # before loading: a bad value fails fast
        cfg = MuDAFConfig(
            lambda_con=args.lambda_con, alpha=args.alpha,
            vanilla_sft=args.vanilla_sft, temperature=args.temperature, similarity=args.similarity,
            learning_rate=args.lr, weight_decay=args.weight_decay, warmup_steps=args.warmup_steps,
            max_steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum,
            max_length=args.max_length, seed=args.seed, save_every=args.save_every, dtype=dtype,
            gradient_checkpointing=args.gradient_checkpointing,
        )  # fmt: skip
        cfg.check(heads=False)  # the heads are known once the model has loaded
        examples = load_mdqa(args.data, limit=args.limit)
        model_name = args.model or "embedded SmolLM2-135M-Instruct"
        # what a resume must share besides the settings: the same data file (by content) and model
        identity = {"data_sha256": file_digest(args.data), "model": model_name, **files_stamp(args.model)}
        if args.heads is not None:  # the files read before the model loads; checked against its shape after
            read_heads(args.heads)
        elif args.scores is not None:
            load_scores(args.scores)
        # float32 master weights whatever --dtype says
        model, tokenizer = retmask.load_model(
            args.model, device=args.device, attention_dropout=0.0
        )  # retmask attention computes no dropout
        selection = select(args, list(head_layout(model).shape))
        cfg = dataclasses.replace(cfg, heads=list(selection.heads) if selection else [])
        cfg.check()
        if selection is not None:
            write_heads(selection, args.out / "heads.json")
        result = train_mudaf(
            model, tokenizer, examples, args.out, cfg, resume=args.resume, progress=not args.no_progress,
            extra_record={"data": str(args.data), "model": model_name,
                          "head_selection": selection.to_json() if selection else None}, identity=identity,
        )  # fmt: skip
    except (MDQAError, SelectionError) as e:
        print_error("retmask mudaf-train", e)
        return 2
    last = result.log[-1]
    con = f", L_CON {last['con']:.4f}" if "con" in last else ""
    mode = (
        "vanilla SFT" if cfg.vanilla_sft else f"MuDAF on heads {', '.join(f'{a}-{b}' for a, b in cfg.heads)}"
    )
    print(f"{mode}: {result.steps} steps in {result.seconds:.1f} s ({result.seconds_per_step:.2f} s/step); "
          f"last step L_CLM {last['clm']:.4f}{con}")  # fmt: skip
    print(f"model -> {args.out}")
    return 0
