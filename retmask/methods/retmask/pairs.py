"""Reading and checking a preference-pairs file before any trainer sees it.

Accepted rows (JSONL, one object per line), all rows in the same format:

* conversational (what ``retmask generate`` writes, TRL's conversational preference format):
  ``{"prompt": [{"role": "user", "content": ...}], "chosen": [{"role": "assistant", "content": ...}],
  "rejected": [{"role": "assistant", "content": ...}]}``;
* standard: ``{"prompt": str, "chosen": str, "rejected": str}``.

Other keys (``id``, ``metadata``) are allowed and dropped before training; ``metadata``'s
``chosen_finished`` / ``rejected_finished`` (written by ``retmask generate``: False when a response hit the
token limit) are kept aside for :func:`drop_unfinished`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from retmask.niah.prompt import is_chat_tokenizer

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
    # per row {"chosen": bool | None, "rejected": bool | None}: whether the response ended by itself (EOS)
    # rather than at the token limit; None where the file does not say (hand-made rows)
    finished: list[dict[str, bool | None]] = field(default_factory=list)


def check_chat_template(pairs: Pairs, tokenizer: Any) -> None:
    """Chat-message rows become tokens through the tokenizer's chat template: refuse them for a tokenizer
    without one, naming the fix, instead of failing in the trainer at the first row."""
    if pairs.format == "conversational" and not is_chat_tokenizer(tokenizer):
        raise PairsError(
            f"{pairs.source}: the rows are chat messages, and the model's tokenizer has no chat template (a "
            "base model?) to turn them into tokens; give the rows as plain text "
            '({"prompt": str, "chosen": str, "rejected": str}), as `retmask generate` writes them for a model '
            "without a chat template, or train a model whose tokenizer has one"
        )


def drop_unfinished(pairs: Pairs, sides: Sequence[str] = ("chosen", "rejected")) -> tuple[Pairs, int]:
    """The pairs whose ``sides`` all ended by themselves, and how many were dropped.

    A response cut at the generation limit would otherwise be trained on as if complete: the chat template
    closes it with an end-of-turn token, teaching the policy (DPO: also the contrast) to stop mid-sentence.
    Raises :class:`PairsError` when the file does not record it or when no pair is left."""
    unknown = [i for i, f in enumerate(pairs.finished) if any(f.get(s) is None for s in sides)]
    if unknown or len(pairs.finished) != len(pairs.rows):
        raise PairsError(
            f"{pairs.source}: row {unknown[0] + 1 if unknown else 1} does not record whether its responses were "
            "finished (metadata chosen_finished / rejected_finished, written by `retmask generate`); drop "
            "--drop-unfinished for this file"
        )
    keep = [i for i, f in enumerate(pairs.finished) if all(f[s] for s in sides)]
    if not keep:
        raise PairsError(
            f"{pairs.source}: every one of the {len(pairs.rows)} pairs has a response cut at the token limit; "
            "generate them with a larger token limit (`retmask generate --max-new-tokens`, `retmask pipeline "
            "--gen-max-new-tokens`), or drop --drop-unfinished"
        )
    kept = replace(pairs, rows=[pairs.rows[i] for i in keep], finished=[pairs.finished[i] for i in keep])
    return kept, len(pairs.rows) - len(keep)


def read_pairs_file(path: str | Path) -> Pairs:
    """Read and validate a pairs JSONL; raises :class:`PairsError` naming the first bad line."""
    path = Path(path)
    if not path.is_file():
        raise PairsError(f"pairs file {path} does not exist; write one with `retmask generate`")
    rows, finished, fmt = [], [], None
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
            meta = row.get("metadata") if isinstance(row.get("metadata"), Mapping) else {}
            finished.append({s: meta.get(f"{s}_finished") for s in ("chosen", "rejected")})
    if not rows:
        raise PairsError(f"{path}: no pairs (the file is empty)")
    return Pairs(rows=rows, format=fmt or "standard", source=str(path), finished=finished)
