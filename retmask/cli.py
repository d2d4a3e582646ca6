"""``retmask <command>``: every module in ``retmask.commands`` that defines ``add_parser(subparsers)`` is a
sub-command (the parser sets ``func``, called with the parsed arguments). Adding a command = adding a
module there; this file does not change."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def build_parser() -> argparse.ArgumentParser:
    import retmask.commands as commands

    parser = argparse.ArgumentParser(
        prog="retmask",
        description="Find the retrieval heads of a language model, switch them off, and train with the contrast.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"retmask.commands.{info.name}")
        if hasattr(module, "add_parser"):
            module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
