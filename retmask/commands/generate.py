"""``retmask generate``: RetMask preference pairs (chosen = original model, rejected = masked heads).

See :mod:`retmask.methods.retmask.generate` for the batching (per-row head masks on one model copy), the seeding
guarantee and the resume protocol.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from retmask.commands.argtypes import (
    nonneg_float,
    open_unit_float,
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
    model_help,
    print_error,
    reports_errors,
)
from retmask.methods.retmask.instructions import BUILTIN
from retmask.model_files import files_stamp


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate",
        help="sample chosen (original) and rejected (masked) responses: DPO preference pairs",
        description=(
            "For each instruction (first user turn, chat template), sample a chosen response from the model "
            "and a rejected one with the heads of --heads masked, both in the same batches (per-row head "
            "masks on one model copy); or, with --rejected-model, from a second model (the Smaller-Model "
            "baseline). Writes TRL's conversational preference format (JSONL) and <stem>.stats.json beside it."
        ),
        epilog=example(
            "retmask generate --model smollm2 --heads runs/heads.json --out runs/pairs.jsonl --limit 64"
        ),
    )
    p.add_argument("--instructions", default=BUILTIN,
                   help="'builtin' (the instructions shipped with retmask), a .json/.jsonl/.parquet file, a "
                        "save_to_disk folder or a datasets name")  # fmt: skip
    p.add_argument("--column", help="column holding the instruction or chat (default: auto-detected)")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--heads", type=Path, help="heads JSON from `retmask mask`: masked in the rejected rows")
    who.add_argument(
        "--rejected-model", help=f"model giving the rejected responses instead (no masks): {MODEL_SPEC}"
    )
    p.add_argument("--out", type=Path, required=True, help="pairs JSONL to write")
    p.add_argument("--model", help=model_help("policy model"))
    add_dtype_arg(p)
    add_device_arg(p)
    p.add_argument(
        "--temperature",
        type=nonneg_float,
        default=0.6,
        help="sampling temperature (0 = greedy; RetMask's published runs used 0.6)",
    )
    p.add_argument("--top-p", type=open_unit_float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--max-new-tokens", type=token_count, default=512, help="tokens per response at most")
    p.add_argument("--max-prompt-tokens", type=token_count, default=512,
                   help="an instruction longer than this (tokens) is an error")  # fmt: skip
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=8,
        help="instructions per batch (2x rows); larger batches are faster where memory allows",
    )
    p.add_argument("--limit", type=positive_int, help="use only the first N instructions")
    p.add_argument(
        "--seed", type=seed_int, default=0, help="run seed; each response has its own derived seed"
    )
    p.add_argument("--resume", action="store_true", help="continue an interrupted run of the same settings")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the pairs, progress and stats of an earlier run on --out",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


@reports_errors()
def run(args: argparse.Namespace) -> int:
    from retmask.methods.retmask.generate import progress_path, stats_path
    from retmask.runfiles import RunLock, check_fresh_or_resume, check_writable

    for path, what in ((args.out, "--out"), (stats_path(args.out), "statistics file")):
        check_writable(path, what=what)
    earlier = [args.out, progress_path(args.out), stats_path(args.out)]
    check_fresh_or_resume([], resume=args.resume, overwrite=args.overwrite)  # not both
    with RunLock(args.out):
        if not args.resume:  # with --resume, the pairs writer decides what can be continued
            check_fresh_or_resume(
                earlier, resume=False, overwrite=args.overwrite, what="an earlier generation"
            )
        return _run(args)


def check_generation_budget(args: argparse.Namespace, model: Any, which: str = "the model") -> None:
    """Refuse, right after ``model`` loads, a prompt + answer budget longer than its context: the KV cache
    of every batch is reserved for ``--max-prompt-tokens + --max-new-tokens`` positions up front, so an
    absurd --max-new-tokens would allocate gigabytes before the first token."""
    from retmask.hf.loading import max_context
    from retmask.methods.retmask.generate import GenerateError

    limit = max_context(model)
    total = args.max_prompt_tokens + args.max_new_tokens
    if limit is not None and total > limit:
        raise GenerateError(
            f"--max-prompt-tokens {args.max_prompt_tokens} + --max-new-tokens {args.max_new_tokens} = {total} "
            f"tokens exceed the context of {which} ({limit} tokens, max_position_embeddings); lower them to "
            f"{limit} tokens together"
        )


def _run(args: argparse.Namespace) -> int:
    import retmask
    from retmask.heads import SelectionError, model_shape, read_heads
    from retmask.hf.loading import check_model_spec, parse_dtype, resolve_dtype_name
    from retmask.methods.retmask.generate import GenerateError, SamplingConfig, generate_pairs, stats_path
    from retmask.methods.retmask.instructions import (
        InstructionError,
        check_lengths,
        load_instructions,
        source_digest,
    )

    try:
        sampling = SamplingConfig(args.temperature, args.top_p, args.max_new_tokens, args.seed)
        if args.max_prompt_tokens <= 0:
            raise GenerateError(f"--max-prompt-tokens must be positive, got {args.max_prompt_tokens}")
        check_device_arg(args.device, "generate")
        # "auto" resolved once, for the device: recorded and used for both models
        dtype = resolve_dtype_name(args.dtype, args.device)
        check_model_spec(args.rejected_model)  # a typo fails before the policy model is loaded
        # the inputs read before any model loads (a missing file fails in a second); the heads are checked
        # against the model's shape and the instructions' lengths with its tokenizer once it has loaded
        if args.heads is not None:
            read_heads(args.heads)
        instructions = load_instructions(args.instructions, args.limit, column=args.column)
        # the hash of the file just read (before the models load): what the resume fingerprint must match
        instructions_sha256 = source_digest(args.instructions)
        model, tokenizer = retmask.load_model(args.model, dtype=parse_dtype(dtype), device=args.device)
        check_generation_budget(args, model)
        heads = rejected_model = rejected_tokenizer = None
        if args.heads is not None:
            heads = read_heads(args.heads, model_shape=model_shape(model)).heads
        else:
            rejected_model, rejected_tokenizer = retmask.load_model(
                args.rejected_model, dtype=parse_dtype(dtype), device=args.device
            )
            check_generation_budget(args, rejected_model, "--rejected-model")
        check_lengths(instructions, tokenizer, args.max_prompt_tokens, "--max-prompt-tokens")
        fingerprint = {
            "model": args.model or "embedded",
            "rejected_model": args.rejected_model,
            **files_stamp(args.model),  # a model folder changed since the run began is another model
            **{f"rejected_{k}": v for k, v in files_stamp(args.rejected_model).items()},
            "instructions": str(args.instructions),
            "instructions_sha256": instructions_sha256,
            "column": args.column,
            "dtype": dtype,
            # only off the CPU, so pair files begun before the option still resume
            **({"device": args.device} if args.device != "cpu" else {}),
        }
        stats = generate_pairs(
            instructions, model, tokenizer, args.out, sampling, heads=heads, rejected_model=rejected_model,
            rejected_tokenizer=rejected_tokenizer, batch_size=args.batch_size, resume=args.resume,
            fingerprint=fingerprint, progress_bar=not args.no_progress,
        )  # fmt: skip
    except (GenerateError, InstructionError, SelectionError) as e:
        print_error("retmask generate", e)
        return 2
    print(stats.table())
    print(f"pairs -> {args.out}; statistics -> {stats_path(args.out)}")
    return 0
