"""Command-line flags shared by several commands: the model (``add_model_args``) and the NIAH grid,
needles and haystack (``add_grid_args``), with the helpers that turn them into objects.

Heavy imports (torch, transformers) happen inside the helpers, so ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from retmask.commands.argtypes import depth_count, file_stem, length_count, positive_int, token_count
from retmask.errors import UsageError
from retmask.model_names import NAMED_MODELS

# What --model accepts, in every command's help; the short names are the loader's own table.
MODEL_SPEC = "hub id (owner/name), local HF folder, .gguf file, or a short name: " + ", ".join(NAMED_MODELS)
MODEL_DEFAULT = "(default: smollm2, the embedded SmolLM2-135M-Instruct)"


def model_help(what: str) -> str:
    """Help of a ``--model`` flag: ``what`` it is, what it accepts (the short names too), its default."""
    return f"{what}: {MODEL_SPEC} {MODEL_DEFAULT}"


def example(command_line: str) -> str:
    """A command's ``epilog``: one realistic command line, printed as typed at the end of its ``--help``
    (tests parse it with the real parser, so it stays valid for the current flags)."""
    return "example:\n  " + command_line


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=model_help("the model"))
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model (or a path)")
    add_dtype_arg(p)
    add_device_arg(p)


def add_device_arg(
    p: argparse.ArgumentParser | argparse._ActionsContainer, *, help: str | None = None
) -> None:
    """``--device``: where the model runs (cpu unless given; on a GPU the fused attention runs as Triton
    kernels)."""
    p.add_argument(
        "--device",
        default="cpu",
        help=help
        or "where the model runs: cpu, cuda, cuda:1, ... (on a GPU the attention runs as Triton kernels)",
    )


def check_device_arg(device: str, command: str) -> None:
    """A wrong or missing ``--device``, or a bad ``$RETMASK_*`` setting, as a usage error naming it (before
    any loading or output); one line on stderr when a command runs on the CPU although a CUDA GPU is
    visible (cpu is every command's default, so a GPU is used only when asked for)."""
    import torch

    from retmask.hf.loading import check_device
    from retmask.kernels.paths import check_settings

    check_device(device)
    check_settings()
    if torch.device(device).type == "cpu" and torch.cuda.is_available():
        print(f"retmask {command}: running on the CPU; a CUDA GPU is available: pass --device cuda to use it",
              file=sys.stderr)  # fmt: skip


def _training_dtype(name: str) -> str:
    """``--dtype`` of a training command, as typed; float16 is refused with the reason (argparse's choices
    check would only list the others)."""
    if name == "float16":
        raise argparse.ArgumentTypeError(
            "float16 is not a training precision here (it needs loss scaling, which retmask does not do); use "
            "bfloat16 (bf16 autocast over float32 master weights), float32 or auto"
        )
    return name


def add_dtype_arg(
    p: argparse.ArgumentParser | argparse._ActionsContainer,
    *,
    training: bool = False,
    help: str | None = None,
) -> None:
    """``--dtype auto|float32|bfloat16|...``. ``training=True``: float32 or bfloat16 only, the precision of
    the forward and backward passes (bf16 autocast over float32 master weights, as transformers' Trainer
    does with ``bf16=True``). ``help`` replaces the default help text."""
    if training:
        p.add_argument(
            "--dtype",
            default="float32",
            type=_training_dtype,
            choices=["auto", "float32", "bfloat16"],
            help=help
            or "training precision: bfloat16 = bf16 autocast with float32 master weights and optimizer "
            "state; auto = bfloat16 on CUDA and on CPUs that compute bf16 natively (AMX or AVX512-BF16), "
            "float32 elsewhere (the resolved choice is recorded)",
        )
        return
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["auto", "float32", "bfloat16", "float16", "float64"],
        help=help
        or "dtype of the weights and activations; auto = bfloat16 on CUDA and on CPUs that compute bf16 "
        "natively (AMX or AVX512-BF16), float32 elsewhere (the resolved dtype is recorded)",
    )


def add_grid_args(
    p: argparse.ArgumentParser,
    *,
    num_needles: int | None = None,
    needle_subset: bool = True,
    grid: dict[str, int] | None = None,
) -> None:
    """Grid, needles and haystack flags; ``needle_subset=False`` leaves out ``--num-needles`` (detection
    always uses the whole needles file, as the published script does). ``grid={"num_lengths": 3,
    "num_depths": 3}`` makes those counts the command's defaults instead of the protocol's, and the help
    says so."""
    from retmask.niah.grid import PROTOCOLS

    grid = grid or {}
    protocol_help = "grid preset: " + "; ".join(f"{k}: {v.description}" for k, v in PROTOCOLS.items())
    if grid:
        protocol_help += (
            f" (this command keeps the preset's length range but runs {grid.get('num_lengths', 'its')} "
            f"lengths x {grid.get('num_depths', 'its')} depths unless --num-lengths / --num-depths say otherwise)"
        )
    p.add_argument("--protocol", default="default", choices=sorted(PROTOCOLS), help=protocol_help)
    p.add_argument(
        "--min-len", type=token_count, default=None, help="shortest context (tokens); overrides the protocol"
    )
    p.add_argument(
        "--max-len", type=token_count, default=None, help="longest context (tokens); overrides the protocol"
    )
    for flag, what, count in (
        ("num_lengths", "number of lengths", length_count),  # <= distinct lengths: checked with the grid
        ("num_depths", "number of depths in [0, 100]", depth_count),
    ):
        own = grid.get(flag)
        p.add_argument(
            "--" + flag.replace("_", "-"),
            type=count,
            default=own,
            help=f"{what}; overrides the protocol"
            + ("" if own is None else f" (default: {own} here, not the protocol's)"),
        )
    p.add_argument(
        "--needles",
        default=None,
        help="needles JSONL {needle, question, real_needle} (default: the needles shipped with retmask)",
    )
    if needle_subset:
        p.add_argument(
            "--num-needles",
            type=positive_int,
            default=num_needles,
            help="use only the first N needles of the file"
            + (" (default: all)" if num_needles is None else ""),  # else the formatter shows the default
        )
    p.add_argument(
        "--haystack",
        default=None,
        help="haystack text file or directory of *.txt; 'pydoc' = the haystack used before 2026-11-26, which "
        "depends on the Python version (default: the essays shipped with retmask)",
    )
    p.add_argument("--max-new-tokens", type=token_count, default=50, help="answer tokens per test at most")
    p.add_argument(
        "--prompt-style",
        choices=["auto", "base", "chat"],
        default="auto",
        help="NIAH prompt template: chat (the model's chat template, one user turn) or base (context + "
        "question, for base models); auto = chat when the tokenizer has a chat template (recorded in the run)",
    )


def grid_from_args(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """(lengths, depths) of the grid flags; a ``GridError`` (exit 2) naming the flag when the grid is empty
    or holds more than it can (distinct lengths in [min, max], 101 depths, prompt memory), before any model
    loads."""
    from retmask.niah.grid import resolve_grid

    return resolve_grid(
        args.protocol, min_len=args.min_len, max_len=args.max_len,
        num_lengths=args.num_lengths, num_depths=args.num_depths,
    )  # fmt: skip


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
    from retmask.hf.loading import load_model, parse_dtype

    model, tok = load_model(
        args.model, gguf_file=args.gguf_file, dtype=parse_dtype(args.dtype, args.device), device=args.device
    )
    name = args.model or args.gguf_file or "embedded:SmolLM2-135M-Instruct"
    return model, tok, name


RESUME_HINT = "continue with the same command plus --resume"
TRACEBACK_SETTING = "RETMASK_TRACEBACK"  # =1: an error's traceback follows its one-line message


def print_error(name: str, err: BaseException, message: str | None = None) -> None:
    """``<name>: error: <message>`` on stderr (``message``, or ``err``'s own). A command reports its
    refusals (bad input, a model it cannot run) and failed writes this way, without a traceback; an
    exception raised outside retmask's own code (inside torch or transformers) also says where, since it
    may be a retmask bug rather than a mistake in the input. With ``RETMASK_TRACEBACK=1`` the traceback
    follows."""
    text = f"{err}{_raised_outside(err)}" if message is None else message
    print(f"{name}: error: {text}", file=sys.stderr)
    if os.environ.get(TRACEBACK_SETTING) == "1":
        traceback.print_exception(err, file=sys.stderr)


def _raised_outside(err: BaseException) -> str:
    """`` (raised in <module>; ...)`` when the innermost frame of ``err``'s traceback is not retmask's."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return ""
    package = str(Path(__file__).resolve().parents[1])
    if str(Path(frames[-1].filename).resolve()).startswith(package + os.sep):
        return ""
    return (
        f" (raised in {frames[-1].filename}, line {frames[-1].lineno}: if the input looks right this may be a "
        f"retmask bug; rerun with {TRACEBACK_SETTING}=1 and report the traceback)"
    )


def reports_errors(
    interrupt_hint: str | Callable[[argparse.Namespace], str | None] | None = RESUME_HINT,
) -> Callable:
    """Decorator for a command's ``run(args)``: Ctrl-C prints ``retmask <command>: interrupted; <hint>``
    (no traceback) and exits 130; a :class:`~retmask.errors.UsageError` (bad input or output path, an
    earlier run in the way, a model that cannot be loaded) and an ``OSError`` naming a file print
    ``retmask <command>: error: <message>`` and exits 2. ``interrupt_hint=None``: nothing to resume (the
    message says nothing was written); a callable gives the hint for the command's ``args``."""

    def wrap(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        @functools.wraps(run)
        def wrapped(args: argparse.Namespace) -> int:
            name = f"retmask {getattr(args, 'command', None) or ''}".strip()
            try:
                return run(args)
            except KeyboardInterrupt:
                hint = interrupt_hint(args) if callable(interrupt_hint) else interrupt_hint
                hint = hint or "nothing was written; run the same command again"
                print(f"\n{name}: interrupted; {hint}", file=sys.stderr)
                return 130
            except UsageError as err:
                print_error(name, err)
                return 2
            except OSError as err:
                # A file the machine refused (full disk, over-long name, permissions) that no writer above
                # named itself: still one line naming the file, not a traceback.
                if err.filename is None:
                    raise
                print_error(name, err, f"cannot use {err.filename}: {err.strerror or err}")
                return 2

        return wrapped

    return wrap


def add_configuration_run_args(p: argparse.ArgumentParser, *, name: str) -> None:
    """--out-dir (default runs/<name>), --prefix (default <name>), --resume, --overwrite, --limit and
    --no-progress of a command that runs a list of configurations, each saved as it completes
    (``ablate``, ``kv``)."""
    p.add_argument("--out-dir", type=Path, default=Path("runs") / name, help="folder for the outputs")
    p.add_argument("--prefix", type=file_stem, default=name, help="file name stem of the outputs")
    p.add_argument(
        "--resume", action="store_true", help="skip configurations already saved by the same settings"
    )
    p.add_argument("--overwrite", action="store_true", help="discard earlier results in --out-dir")
    p.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        help="run at most N new configurations, then stop (use with --resume)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run_configurations(args: argparse.Namespace, body: Callable[[argparse.Namespace], int]) -> int:
    """Run ``body(args)`` for a configuration-run command: ``--out-dir`` must be a writable folder,
    ``--resume`` and ``--overwrite`` exclude each other, and a lock on ``<out-dir>/<prefix>`` keeps a
    second run of the same outputs out while this one works."""
    from retmask.runfiles import RunLock, check_fresh_or_resume, check_writable

    check_writable(args.out_dir, what="--out-dir", directory=True)
    check_fresh_or_resume([], resume=args.resume, overwrite=args.overwrite)  # not both
    with RunLock(args.out_dir / args.prefix, flag="--out-dir or --prefix"):
        return body(args)
