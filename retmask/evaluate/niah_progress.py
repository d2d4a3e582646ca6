"""The progress file of a run of needle tests: the tests answered so far, so an interrupted run resumes.

``retmask niah`` keeps one next to its ``--out``; ``retmask ablate`` and ``retmask kv`` one for the
configuration that is running. ``<out>.progress.json`` holds ``{"version": 1, "settings": {...},
"entries": [entry, ...]}``, every entry with the ``"index"`` of its test. It is rewritten atomically after
every answered test and deleted once ``<out>`` is written, so it exists only while a run is unfinished.
``settings`` is everything that decides the answers (the grid fingerprint of
:func:`retmask.evaluate.niah.grid_fingerprint`, the masked heads or the KV heads kept); a resume with
other settings is refused, naming what differs. Here each entry's shape is checked (``check_entry``:
the NIAH evaluation's entries by default); whether it belongs to the grid being run is checked where the
entries are used (``evaluate_niah(done=...)``, ``kv_budget.run_config(done=...)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from retmask.runfiles import JsonFile, atomic_write_json, check_same_settings

PROGRESS_VERSION = 1
PROGRESS_SUFFIX = ".progress.json"  # what a progress file's name ends with
_FIX = "resume with the same flags, or pass --overwrite to start over"
# what every saved entry must hold (besides "index"), and its JSON kind
_ENTRY_FIELDS: tuple[tuple[str, type], ...] = (
    ("key", str),
    ("needle_index", int),
    ("length", int),
    ("depth", int),
    ("response", str),
    ("rouge1_recall", float),
    ("tokens", list),
)


def check_niah_entry(f: JsonFile, entry: dict, where: str) -> None:
    """Raise naming ``where`` unless ``entry`` has the fields of an ``evaluate_niah`` entry."""
    for name, kind in _ENTRY_FIELDS:
        f.key(entry, name, kind, where)
    f.number(entry["rouge1_recall"], f"{where}.rouge1_recall", lo=0, hi=1)
    for j, token in enumerate(entry["tokens"]):
        f.number(token, f"{where}.tokens[{j}]", integer=True, lo=0)


def progress_path(out: Path) -> Path:
    """``<out>.progress.json``: the progress file of a run writing ``out``."""
    return out.with_name(out.name + PROGRESS_SUFFIX)


def write_progress(path: Path, settings: Mapping[str, Any], entries: Mapping[int, dict]) -> None:
    """Save ``entries`` (test index -> entry) with the run's ``settings``, atomically (a crash leaves the
    previous version). Each entry is saved with its ``"index"``."""
    ordered = [{**entries[i], "index": i} for i in sorted(entries)]
    atomic_write_json(path, {"version": PROGRESS_VERSION, "settings": dict(settings), "entries": ordered})


def read_progress(
    path: Path,
    settings: Mapping[str, Any],
    check_entry: Callable[[JsonFile, dict, str], None] = check_niah_entry,
) -> dict[int, dict]:
    """The entries of the progress file ``path`` by test index (each still holding its ``"index"``), if it
    was written with ``settings``; a file of other settings, another version or a wrong shape (an entry
    ``check_entry`` refuses) raises ``RunFileError`` naming it."""
    f = JsonFile(path, "progress file", _FIX)
    data = f.expect(f.read(), dict, "the file")
    version = data.get("version")
    if version != PROGRESS_VERSION:
        f.fail(f"version {version!r} is not {PROGRESS_VERSION} (written by another retmask version)")
    check_same_settings(f.key(data, "settings", dict), dict(settings), path=path, fix=_FIX)
    done: dict[int, dict] = {}
    for i, entry in enumerate(f.key(data, "entries", list)):
        where = f"entries[{i}]"
        f.expect(entry, dict, where)
        index = int(f.number(entry.get("index"), f"{where}.index", integer=True, lo=0))
        check_entry(f, entry, where)
        if index in done:
            f.fail(f"{where}: test {index} is listed twice")
        done[index] = entry
    return done


__all__ = [
    "PROGRESS_SUFFIX",
    "PROGRESS_VERSION",
    "check_niah_entry",
    "progress_path",
    "read_progress",
    "write_progress",
]
