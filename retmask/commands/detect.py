"""``retmask detect``: retrieval scores of every attention head (Wu et al. 2024), reference-compatible."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from retmask.niah.grid import PROTOCOLS

    p = subparsers.add_parser(
        "detect",
        help="detect retrieval heads (Needle-in-a-Haystack retrieval score of Wu et al. 2024)",
        description=(
            "Run the Needle-in-a-Haystack retrieval-head detection of Wu et al. (2024) exactly as the published "
            "script (context construction, prompt, needle span, greedy decoding, copy rule, ROUGE-1 filter), "
            "fast: fused-kernel argmax, prompt-lookup verification, KV-prefix reuse. Writes "
            "{'<layer>-<head>': [per-test scores]} (the published head_score format) and a run record."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="hub id, HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model (or a path)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--needles", default=None, help="needles JSONL {needle, question, real_needle} (default: shipped set)"
    )
    p.add_argument(
        "--haystack", default=None, help="haystack text file or directory of *.txt (default: shipped prose)"
    )
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
    p.add_argument(
        "--num-depths", type=int, default=None, help="number of depths in [0, 100]; overrides the protocol"
    )
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument(
        "--out", default="runs/detect/scores.json", help="scores JSON (run record: <stem>.run.json)"
    )
    p.add_argument("--plot", default=None, help="write a layers x heads heatmap PNG here")
    p.add_argument(
        "--resume", action="store_true", help="continue an interrupted run from <out>.progress.json"
    )
    p.add_argument(
        "--until-stable",
        action="store_true",
        help="stop once the τ=0.1 set and the top-10 ranking are unchanged for --patience consecutive counted tests",
    )
    p.add_argument("--patience", type=int, default=20, help="consecutive counted tests for --until-stable")
    p.add_argument(
        "--chunk", type=int, default=256, help="prefill chunk (tokens) = granularity of KV-prefix reuse"
    )
    p.add_argument(
        "--prefill-impl",
        default="retmask",
        choices=["retmask", "sdpa"],
        help="attention implementation for the prompt prefill (needs no argmax); answers use retmask",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from retmask.detect.run import DetectConfig, run_detect
    from retmask.niah.haystack import HaystackError
    from retmask.niah.needles import NeedleFileError

    cfg = DetectConfig(
        model=args.model,
        gguf_file=args.gguf_file,
        dtype=args.dtype,
        device=args.device,
        needles=args.needles,
        haystack=args.haystack,
        protocol=args.protocol,
        min_len=args.min_len,
        max_len=args.max_len,
        num_lengths=args.num_lengths,
        num_depths=args.num_depths,
        max_new_tokens=args.max_new_tokens,
        chunk=args.chunk,
        prefill_impl=args.prefill_impl,
        until_stable=args.until_stable,
        patience=args.patience,
        seed=args.seed,
    )
    try:
        run_detect(cfg, args.out, plot=args.plot, resume=args.resume, progress_bar=not args.no_progress)
    except (ValueError, NeedleFileError, HaystackError) as err:
        print(f"retmask detect: error: {err}", file=sys.stderr)
        return 2
    print(f"scores -> {args.out}", file=sys.stderr)
    return 0
