"""``retmask <command>``: every module in ``retmask.commands`` that defines ``add_parser(subparsers)`` is a
sub-command (the parser sets ``func``, called with the parsed arguments). Adding a command = adding a
module there; this file does not change.

Every sub-command's help shows each option's default once, as ``(default: X)`` at the end of its help, and
ends with an example command line (:class:`HelpFormatter`). Command modules import
library code inside their ``run`` function, and ``import retmask`` loads nothing heavy, so ``--help`` and
argument errors need neither torch nor transformers."""

from __future__ import annotations

import argparse
import copy
import importlib
import pkgutil
import sys
import warnings
from pathlib import Path


class HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default once, in one form: appends ``(default: X)`` unless the help already
    has a hand-written ``(default: ...)`` (a computed default, or one described in words), the
    default is ``None`` or empty (the help says what happens then), or the option is an on/off flag
    (``(default: True)`` after ``--no-x`` would read as if the flag were on). Options without a help text
    get just the default. List defaults print as they are typed (``10 50 90``).

    Descriptions and epilogs are wrapped as usual, except lines that start with whitespace: those are kept
    as typed, so an epilog's example command line (``example:`` then an indented line) stays one line."""

    @staticmethod
    def _default_text(action: argparse.Action) -> str | None:
        default = action.default
        if (
            not action.option_strings
            or action.nargs == 0
            or default is None
            or default is argparse.SUPPRESS
            or default in ("", [], ())
            or "(default: " in (action.help or "")
        ):
            return None
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return "(default: " + shown.replace("%", "%%") + ")"  # help strings are %-formatted by argparse

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        paragraph: list[str] = []  # lines wrapped together
        for line in [*text.splitlines(), None]:
            if line is None or not line.strip() or line[0].isspace():
                if paragraph:
                    out.append(super()._fill_text(" ".join(paragraph), width, indent))
                    paragraph = []
                if line is not None:
                    out.append(indent + line.rstrip() if line.strip() else "")
            else:
                paragraph.append(line)
        return "\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = self._default_text(action)
        return text if default is None else f"{text} {default}".strip()

    def _format_action(self, action: argparse.Action) -> str:
        default = None if action.help else self._default_text(action)
        if default is not None:  # no help text: show the default alone
            action = copy.copy(action)
            action.help = default
        return super()._format_action(action)


def build_parser() -> argparse.ArgumentParser:
    import retmask.commands as commands

    parser = argparse.ArgumentParser(
        prog="retmask",
        description="Find the retrieval heads of a language model, switch them off, and train with the contrast.",
    )
    from importlib import metadata

    try:
        version = metadata.version("retmask")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        version = "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"retmask {version}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"retmask.commands.{info.name}")
        if hasattr(module, "add_parser"):
            module.add_parser(sub)
    for command_parser in sub.choices.values():
        command_parser.formatter_class = HelpFormatter
    parser.retmask_commands = sub.choices  # name -> its parser, for errors reported in its usage
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` for the command line: retmask's own warnings (a class defined in retmask, or
    raised from its code) print as ``retmask: warning: <message>``, like its errors, without the file:line
    and source line of Python's format; other libraries' warnings keep that format."""
    ours = category.__module__.split(".")[0] == "retmask" or Path(filename).resolve().is_relative_to(_PACKAGE)
    if ours:
        text = "retmask: warning: " + str(message).removeprefix("retmask: ") + "\n"
    else:
        text = warnings.formatwarning(message, category, filename, lineno, line)
    (file if file is not None else sys.stderr).write(text)


_PACKAGE = Path(__file__).resolve().parent
# commands that pick up their finished work on a rerun, without a flag (the others with work to keep take
# --resume; mask, compare and env finish in seconds and keep nothing)
RESUME_BY_THEMSELVES = ("eval", "pipeline")


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = _show_warning
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # reported by the sub-command's parser (its usage line), with a hint where the flag is a known habit
        command_parser = parser.retmask_commands.get(args.command, parser)
        hint = ""
        if "--resume" in unknown and args.command in RESUME_BY_THEMSELVES:
            hint = f"; retmask {args.command} resumes by itself: run the same command again"
        elif "--resume" in unknown:
            hint = f"; retmask {args.command} keeps nothing to resume: run the same command again"
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
