"""Needles JSONL: one ``{"needle", "question", "real_needle"}`` object per line (the published key names)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from retmask.data import data_path
from retmask.runfiles import read_jsonl

DEFAULT_NEEDLES_PATH = data_path("needles.jsonl")
REQUIRED_KEYS = ("needle", "question", "real_needle")


class NeedleFileError(ValueError):
    """A needles file that cannot be used; the message names the file and the line."""


@dataclass(frozen=True)
class Needle:
    """One needle. ``needle`` is inserted into the haystack; ``real_needle`` is the expected answer."""

    needle: str
    question: str
    real_needle: str

    def to_dict(self) -> dict[str, str]:
        return {"needle": self.needle, "question": self.question, "real_needle": self.real_needle}


def load_needles(path: str | Path | None = None) -> list[Needle]:
    """Read a needles JSONL file (default: the project's own ``retmask/data/needles.jsonl``).

    Blank lines are ignored. Any other problem raises :class:`NeedleFileError` naming ``file:line``.
    """
    path = Path(path) if path is not None else DEFAULT_NEEDLES_PATH
    needles: list[Needle] = []
    lines = read_jsonl(path, what="needles file", fix="pass --needles FILE.jsonl", error=NeedleFileError)
    for where, obj in lines:
        if not isinstance(obj, dict):
            raise NeedleFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in REQUIRED_KEYS if k not in obj]
        if missing:
            raise NeedleFileError(
                f"{where}: missing key(s) {missing}; each line needs {list(REQUIRED_KEYS)} (published key names)"
            )
        for k in REQUIRED_KEYS:
            if not isinstance(obj[k], str) or not obj[k].strip():
                raise NeedleFileError(f"{where}: {k!r} must be a non-empty string, got {obj[k]!r}")
        needles.append(Needle(obj["needle"], obj["question"], obj["real_needle"]))
    if not needles:
        raise NeedleFileError(f"{path}: no needles found (file is empty); add at least one JSON line")
    return needles
