"""``retmask env``: this machine, and the code path each kind of attention call takes on it.

Register with ``retmask.commands.env.add_parser(subparsers)``; the parser's ``func`` default runs it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from retmask.commands.common import example, model_help, print_error, reports_errors


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``env`` sub-command to an ``argparse`` sub-parsers object and return its parser."""
    p = subparsers.add_parser(
        "env",
        help="print the machine (CPU, flags, kernel build, versions, GPU) and the path of every kind of call",
        description=(
            "Print what retmask runs on this machine: the CPU model and its SIMD flags, the kernel build it "
            "runs, the GPU if any, the releases of its dependencies (torch, transformers, TRL, Triton, ...) "
            "against the ranges retmask needs, the RETMASK_* settings in effect, and for each kind of "
            "attention call the project makes (prefill, chunk, verification, decode, backward; per dtype) the"
            " path it takes and why, and whether the CPU speed-ups (linears) are on. Run records of "
            "detect and training embed the same description. Include its output when you report a bug or a "
            "speed. With --model, also whether that model runs on retmask attention and its head layout, read"
            " from its config alone (no weights are loaded); the exit status is 2 when it does not."
        ),
        epilog=example("retmask env --model Qwen/Qwen2.5-7B-Instruct"),
    )
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.add_argument("--model", help=model_help("a model to check"))
    p.add_argument("--gguf-file", help="GGUF file name inside --model (or a path)")
    p.set_defaults(func=run)
    return p


def _lines(description: dict[str, Any]) -> list[str]:
    lines = ["machine:"]
    for key, value in description["machine"].items():
        shown = " ".join(value) if isinstance(value, list) else value
        lines.append(f"  {key:18} {shown}")
    lines.append("dependencies (installed, retmask's range, where it stands):")
    for package, entry in description["dependencies"].items():
        found, allowed, where = entry["installed"] or "-", entry["range"] or "-", entry["status"]
        fix = f'  pip install "{package}{allowed}"' if where in ("missing", "older", "newer") else ""
        lines.append(f"  {package:18} {found:14} {allowed:12} {where}{fix}")
    lines.append("settings:")
    for key, value in description["settings"].items():
        lines.append(f"  {key:22} {value or '(unset)'}")
    lines.append("attention path by kind of call:")
    for kind, entry in description["attention"].items():
        lines.append(f"  {kind:46} {entry['path']:10} {entry['why']}")
    lines.append("cpu speed-ups:")
    for key, value in description["cpu_speedups"].items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items()) or "(none decided in this process)"
        lines.append(f"  {key:24} {value}")
    return lines


@reports_errors(interrupt_hint=None)
def run(args: argparse.Namespace) -> int:
    from retmask import requirements
    from retmask.kernels import describe

    try:
        description = describe()
    except ValueError as err:  # a bad RETMASK_* setting
        print_error("retmask env", err)
        return 2
    # After the machine, before the settings (the order the lines print in).
    description = {
        "machine": description.pop("machine"),
        "dependencies": requirements.report(),
        **description,
    }
    lines = _lines(description)
    if args.model is not None or args.gguf_file is not None:
        from retmask.hf.model_report import model_report, report_lines

        description["model"] = model_report(args.model, args.gguf_file)
        lines += report_lines(description["model"])
    print(json.dumps(description, indent=1) if args.json else "\n".join(lines))
    return 0 if description.get("model", {}).get("supported", True) else 2
