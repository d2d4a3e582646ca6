"""MDQA records: passages, golden ids, question, answer; JSONL writing and validated loading.

One JSON object per line::

    {"id": "mdqa-00000", "passages": [{"id": "P3", "title": "...", "text": "..."}, ...],
     "golden_ids": ["P3", "P7"], "question": "...", "answer": "...", "kind": "bridge-employer-founded"}

``kind`` is optional (the generator records which question template made the example).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retmask.runfiles import atomic_write_text, jsonl_text, read_jsonl


class MDQAError(ValueError):
    """An MDQA record or file that cannot be used, with where and why."""


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str


@dataclass(frozen=True)
class MDQAExample:
    """A question answerable only from the ``golden_ids`` passages; passages are in prompt order."""

    id: str
    passages: list[Passage]
    golden_ids: list[str]
    question: str
    answer: str
    kind: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def golden_indices(self) -> list[int]:
        """Positions of the golden passages in prompt order (what per-passage attention is scored on)."""
        index = {p.id: i for i, p in enumerate(self.passages)}
        return [index[g] for g in self.golden_ids]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "passages": [asdict(p) for p in self.passages],
            "golden_ids": list(self.golden_ids),
            "question": self.question,
            "answer": self.answer,
        }
        if self.kind is not None:
            out["kind"] = self.kind
        if self.meta:
            out["meta"] = self.meta
        return out


def _string(rec: Mapping[str, Any], key: str, where: str, *, allow_empty: bool = False) -> str:
    if key not in rec:
        raise MDQAError(f"{where}: missing field {key!r}; fields are {sorted(rec)}")
    value = rec[key]
    if not isinstance(value, str):
        raise MDQAError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise MDQAError(f"{where}: field {key!r} is empty")
    return value


def example_from_json(rec: Any, where: str, default_id: str = "") -> MDQAExample:
    """Validate one record; errors name ``where`` (file and line) and the offending field or passage."""
    if not isinstance(rec, Mapping):
        raise MDQAError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    raw_passages = rec.get("passages")
    if not isinstance(raw_passages, list) or not raw_passages:
        raise MDQAError(f"{where}: 'passages' must be a non-empty list of {{'id', 'title', 'text'}} objects")
    passages: list[Passage] = []
    for i, p in enumerate(raw_passages):
        pw = f"{where}: passages[{i}]"
        if not isinstance(p, Mapping):
            raise MDQAError(f"{pw} must be an object with 'id', 'title', 'text'")
        pid = p.get("id")
        if isinstance(pid, int) and not isinstance(pid, bool):
            pid = str(pid)  # numeric ids are common in user files; compare them as strings
        if not isinstance(pid, str) or not pid:
            raise MDQAError(f"{pw}: 'id' must be a non-empty string")
        text = _string(p, "text", f"{pw} (id {pid!r})", allow_empty=True)
        if not text.strip():
            raise MDQAError(f"{pw} (id {pid!r}) has empty text; drop the passage or fill it in")
        title = p.get("title", "")
        if not isinstance(title, str):
            raise MDQAError(f"{pw} (id {pid!r}): 'title' must be a string")
        passages.append(Passage(pid, title, text))
    ids = [p.id for p in passages]
    dupes = sorted({x for x in ids if ids.count(x) > 1})
    if dupes:
        raise MDQAError(f"{where}: passage ids {dupes} are used more than once")
    golden = rec.get("golden_ids")
    if not isinstance(golden, list) or not golden:
        raise MDQAError(f"{where}: 'golden_ids' must be a non-empty list of passage ids")
    golden = [str(g) if isinstance(g, int) and not isinstance(g, bool) else g for g in golden]
    missing = [g for g in golden if g not in ids]
    if missing:
        raise MDQAError(f"{where}: golden ids {missing} are not among the passage ids {ids}")
    if len(set(golden)) != len(golden):
        raise MDQAError(f"{where}: 'golden_ids' lists a passage twice: {golden}")
    if len(golden) == len(passages):
        raise MDQAError(f"{where}: every passage is golden; MDQA needs at least one distractor")
    rid = rec.get("id", default_id)
    kind = rec.get("kind")
    return MDQAExample(
        id=str(rid),
        passages=passages,
        golden_ids=list(golden),
        question=_string(rec, "question", where),
        answer=_string(rec, "answer", where),
        kind=str(kind) if kind is not None else None,
        meta=dict(rec.get("meta") or {}),
    )


def load_mdqa(path: str | Path, limit: int | None = None) -> list[MDQAExample]:
    """Read and validate an MDQA JSONL file (the generator's format)."""
    path = Path(path)
    if not path.is_file():
        raise MDQAError(
            f"MDQA file {path} does not exist; make one with retmask.methods.mudaf.mdqa.generate_mdqa"
        )
    out: list[MDQAExample] = []
    for where, rec in read_jsonl(path, what="MDQA file", error=MDQAError):
        if limit is not None and len(out) >= limit:
            break
        lineno = where.rsplit(":", 1)[1]
        out.append(example_from_json(rec, where, default_id=f"{path.stem}-{lineno}"))
    if not out:
        raise MDQAError(f"{path}: no MDQA records (the file is empty)")
    return out


def write_mdqa(examples: Iterable[MDQAExample], path: str | Path) -> Path:
    """Write examples as JSONL, atomically (parent folders created)."""
    return atomic_write_text(path, jsonl_text(ex.to_json() for ex in examples))
