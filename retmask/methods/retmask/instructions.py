"""Instructions for RetMask's preference data (``retmask generate --instructions SRC``).

``SRC`` is one of

* ``builtin`` (or ``None``): the instruction set shipped with the package, written by this project
  (``retmask/data/instructions/retmask_instructions.jsonl``, see ``generate.py`` there);
* a local ``.json`` (a list of records, or an object holding one list), ``.jsonl`` or ``.parquet`` file;
* a folder written by ``datasets.Dataset.save_to_disk``;
* a ``datasets`` hub name, optionally with a split: ``org/name`` or ``org/name:split`` (default ``train``).

A record gives its instruction in a prompt column (``prompt``, ``instruction`` or ``question``) or as chat
``messages``/``conversation``; for chats the first user turn is the instruction, as RetMask's published
runs do with LMSYS-Chat-1M. Problems are reported with the file and line (or row) and the column involved.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retmask.data import data_path

BUILTIN = "builtin"
BUILTIN_PATH = data_path("instructions", "retmask_instructions.jsonl")
PROMPT_COLUMNS = ("prompt", "instruction", "question")
CHAT_COLUMNS = ("messages", "conversation")
USER_ROLES = ("user", "human")
LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")


class InstructionError(ValueError):
    """An instruction source that cannot be used, with where and why."""


@dataclass(frozen=True)
class Instruction:
    """One instruction; ``reference`` is a known answer where the source has one (the shipped set does)."""

    id: str
    prompt: str
    category: str | None = None
    reference: str | None = None
    where: str = field(default="", compare=False)  # file and line (or row) in its source, for messages


def _first_user_turn(messages: Any, where: str, column: str) -> str:
    """The content of the first user message of a chat (``role``/``content`` or ShareGPT ``from``/``value``)."""
    if isinstance(messages, str):  # some exports store the chat as a JSON string
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError:
            raise InstructionError(
                f"{where}: column {column!r} is a string, not a list of messages"
            ) from None
    if not isinstance(messages, (list, tuple)):
        raise InstructionError(
            f"{where}: column {column!r} must be a list of messages, got {type(messages).__name__}"
        )
    for turn in messages:
        if not isinstance(turn, Mapping):
            raise InstructionError(
                f"{where}: column {column!r} holds a message that is not an object: {turn!r}"
            )
        role = turn.get("role", turn.get("from"))
        if role in USER_ROLES:
            content = turn.get("content", turn.get("value"))
            if isinstance(content, list):  # multimodal content parts: keep the text parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
            if not isinstance(content, str):
                raise InstructionError(f"{where}: the first user message in {column!r} has no text content")
            return content
    raise InstructionError(f"{where}: column {column!r} has no user message (roles: 'user' or 'human')")


def pick_column(record: Mapping[str, Any], where: str, column: str | None = None) -> str:
    """The column that holds the instruction: ``column`` if given, else the first known one present."""
    if column is not None:
        if column not in record:
            raise InstructionError(f"{where}: no column {column!r}; columns are {sorted(record)}")
        return column
    for name in PROMPT_COLUMNS + CHAT_COLUMNS:
        if name in record:
            return name
    raise InstructionError(
        f"{where}: no instruction column; expected one of {', '.join(PROMPT_COLUMNS + CHAT_COLUMNS)}, "
        f"found {sorted(record)} (pass column=... to choose one)"
    )


def record_to_instruction(record: Any, where: str, column: str, default_id: str) -> Instruction:
    """Turn one record into an :class:`Instruction`, or raise naming ``where`` and ``column``."""
    if not isinstance(record, Mapping):
        raise InstructionError(
            f"{where}: expected an object with an instruction column, got {type(record).__name__}"
        )
    if column not in record:
        raise InstructionError(f"{where}: missing column {column!r}; columns are {sorted(record)}")
    value = record[column]
    if column in CHAT_COLUMNS:
        prompt = _first_user_turn(value, where, column)
    elif isinstance(value, str):
        prompt = value
    else:
        raise InstructionError(f"{where}: column {column!r} must be a string, got {type(value).__name__}")
    if not prompt.strip():
        raise InstructionError(f"{where}: column {column!r} is empty; remove the record or fill it in")
    rid = record.get("id")
    category = record.get("category")
    reference = record.get("reference")
    return Instruction(
        id=str(rid) if rid is not None else default_id,
        prompt=prompt,
        category=str(category) if category is not None else None,
        reference=str(reference) if reference is not None else None,
        where=where,
    )


# ------------------------------------------------------------------ reading records -----------------------


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue  # blank lines (a trailing newline, say) are not records
            try:
                yield f"{path} line {lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise InstructionError(f"{path} line {lineno}: not valid JSON ({e.msg})") from None


def _json_records(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise InstructionError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}); a file of one JSON object per line "
            "must end in .jsonl"
        ) from None
    if isinstance(data, Mapping):  # {"data": [...]} style: accept exactly one list-valued key
        lists = [k for k, v in data.items() if isinstance(v, list)]
        if len(lists) != 1:
            raise InstructionError(
                f"{path}: expected a list of records or an object with one list, found keys {sorted(data)}"
            )
        data = data[lists[0]]
    if not isinstance(data, list):
        raise InstructionError(f"{path}: expected a list of records, got {type(data).__name__}")
    for i, rec in enumerate(data):
        yield f"{path} record {i}", rec


def _table_records(rows: Iterable[Mapping[str, Any]], name: str) -> Iterator[tuple[str, Any]]:
    for i, rec in enumerate(rows):
        yield f"{name} row {i}", rec


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq  # lazily: only parquet sources need it

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a broken file
        raise InstructionError(f"{path}: cannot read as parquet ({e})") from None
    return _table_records(table.to_pylist(), str(path))


def _dataset_records(src: str) -> Iterator[tuple[str, Any]]:
    import datasets  # lazily: importing datasets takes seconds

    path = Path(src)
    if path.is_dir():
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:
            raise InstructionError(
                f"{path}: a folder, but not one written by datasets' save_to_disk ({e})"
            ) from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise InstructionError(
                    f"{path}: a DatasetDict without a 'train' split (splits: {sorted(ds)})"
                )
            ds = ds["train"]
        return _table_records(ds, str(path))
    name, _, split = src.partition(":")
    try:
        ds = datasets.load_dataset(name, split=split or "train")
    except Exception as e:
        raise InstructionError(
            f"cannot load {src!r}: not a local file ({', '.join(LOCAL_SUFFIXES)}) and datasets failed: {e}"
        ) from None
    return _table_records(ds, src)


def _records(src: str | Path) -> tuple[str, Iterator[tuple[str, Any]]]:
    if src is None or str(src) == BUILTIN:
        return BUILTIN, _jsonl_records(BUILTIN_PATH)
    path = Path(src)
    suffix = path.suffix.lower()
    if suffix in LOCAL_SUFFIXES:
        if not path.is_file():
            raise InstructionError(
                f"instruction file {path} does not exist; give an existing {'/'.join(LOCAL_SUFFIXES)} file, a "
                f"datasets hub id, or {BUILTIN!r} for the shipped instructions"
            )
        reader = {".jsonl": _jsonl_records, ".json": _json_records, ".parquet": _parquet_records}[suffix]
        return str(path), reader(path)
    if path.is_file():
        raise InstructionError(
            f"{path}: unknown file type {suffix!r}; use one of {', '.join(LOCAL_SUFFIXES)}"
        )
    return str(src), _dataset_records(str(src))


def source_digest(src: str | Path | None) -> str | None:
    """SHA-256 of an instruction file (the shipped set's for ``"builtin"``), None for a datasets hub id: what
    a resumed generation must find unchanged (a path alone would let an edited file mix old and new
    prompts in one pairs file)."""
    from retmask.runfiles import file_digest

    path = BUILTIN_PATH if src is None or str(src) == BUILTIN else Path(src)
    return file_digest(path) if path.is_file() else None


def load_instructions(
    src: str | Path | None = BUILTIN,
    limit: int | None = None,
    *,
    column: str | None = None,
    tokenizer: Any = None,
    max_tokens: int | None = None,
) -> list[Instruction]:
    """Read instructions from ``src`` (see the module docstring), at most ``limit`` of them.

    With ``tokenizer`` and ``max_tokens``, an instruction longer than ``max_tokens`` tokens (without special
    tokens) is an error naming its location: training silently dropping long prompts is what we avoid.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
        raise InstructionError(f"limit must be a positive integer, got {limit!r}")
    if (tokenizer is None) != (max_tokens is None):
        raise InstructionError("give both tokenizer and max_tokens to check instruction lengths, or neither")
    name, records = _records(src)
    stem = Path(name).stem or "instruction"
    out: list[Instruction] = []
    for where, rec in records:
        if limit is not None and len(out) >= limit:
            break
        if column is None and not out:
            if not isinstance(rec, Mapping):
                raise InstructionError(
                    f"{where}: expected an object with an instruction column, got {type(rec).__name__}"
                )
            column = pick_column(rec, where)
        out.append(record_to_instruction(rec, where, column or "", f"{stem}-{len(out)}"))
    if not out:
        raise InstructionError(f"{name}: no instructions found (the source is empty)")
    if tokenizer is not None:
        check_lengths(out, tokenizer, max_tokens)  # type: ignore[arg-type]
    return out


def check_lengths(
    instructions: Iterable[Instruction], tokenizer: Any, max_tokens: int, limit_flag: str | None = None
) -> None:
    """Raise naming the first instruction longer than ``max_tokens`` tokens (without special tokens) and
    where it is in its source: training silently dropping long prompts is what we avoid. ``limit_flag``: the
    flag that raises the limit, if the caller has one."""
    for inst in instructions:
        n = len(tokenizer(inst.prompt, add_special_tokens=False)["input_ids"])
        if n > max_tokens:
            raise InstructionError(
                f"{inst.where or inst.id}: instruction has {n} tokens, more than the limit of {max_tokens}; "
                "shorten or remove it" + (f", or raise {limit_flag}" if limit_flag else "")
            )
