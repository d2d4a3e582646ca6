"""Reading and checking a preference-pairs file before any trainer sees it.

Accepted rows (JSONL, one object per line), all rows in the same format:

* conversational (what ``retmask generate`` writes, TRL's conversational preference format):
  ``{"prompt": [{"role": "user", "content": ...}], "chosen": [{"role": "assistant", "content": ...}],
  "rejected": [{"role": "assistant", "content": ...}]}``;
* standard: ``{"prompt": str, "chosen": str, "rejected": str}``.

Other keys (``id``, ``metadata``) are allowed and dropped before training.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEYS = ("prompt", "chosen", "rejected")


class PairsError(ValueError):
    """A pairs file that cannot be trained on, with the line and the reason."""


def _check_messages(value: Any, where: str, key: str, roles: Sequence[str]) -> None:
    if not isinstance(value, list) or not value:
        raise PairsError(f"{where}: {key!r} must be a non-empty list of messages")
    for i, msg in enumerate(value):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("content"), str) or "role" not in msg:
            raise PairsError(f"{where}: {key}[{i}] must be an object with 'role' and a string 'content'")
        if msg["role"] not in roles:
            raise PairsError(f"{where}: {key}[{i}] has role {msg['role']!r}; expected one of {list(roles)}")
    if not value[-1]["content"].strip():
        raise PairsError(f"{where}: {key!r} is empty")


def check_row(row: Any, where: str) -> str:
    """Validate one row; return its format, ``"conversational"`` or ``"standard"``."""
    if not isinstance(row, Mapping):
        raise PairsError(f"{where}: expected a JSON object with {', '.join(KEYS)}, got {type(row).__name__}")
    missing = [k for k in KEYS if k not in row]
    if missing:
        raise PairsError(
            f"{where}: missing {', '.join(repr(k) for k in missing)} (keys: {sorted(row)}); a pairs file needs "
            "prompt, chosen and rejected, as written by `retmask generate`"
        )
    if all(isinstance(row[k], str) for k in KEYS):
        for k in KEYS:
            if not row[k].strip():
                raise PairsError(f"{where}: {k!r} is empty")
        return "standard"
    _check_messages(row["prompt"], where, "prompt", ("system", "user", "assistant"))
    _check_messages(row["chosen"], where, "chosen", ("assistant",))
    _check_messages(row["rejected"], where, "rejected", ("assistant",))
    return "conversational"


@dataclass
class Pairs:
    rows: list[dict[str, Any]]  # only prompt / chosen / rejected
    format: str
    source: str


def read_pairs_file(path: str | Path) -> Pairs:
    """Read and validate a pairs JSONL; raises :class:`PairsError` naming the first bad line."""
    path = Path(path)
    if not path.is_file():
        raise PairsError(f"pairs file {path} does not exist; write one with `retmask generate`")
    rows, fmt = [], None
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PairsError(
                    f"{where}: not valid JSON ({e.msg}); expected one JSON object per line"
                ) from None
            kind = check_row(row, where)
            if fmt is None:
                fmt = kind
            elif kind != fmt:
                raise PairsError(f"{where}: a {kind} row in a file of {fmt} rows; use one format throughout")
            rows.append({k: row[k] for k in KEYS})
    if not rows:
        raise PairsError(f"{path}: no pairs (the file is empty)")
    return Pairs(rows=rows, format=fmt or "standard", source=str(path))
