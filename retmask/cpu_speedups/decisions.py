"""Decisions measured on this machine: in memory for the process, and in one JSON file per kind of
decision under the cache folder.

The fp32 linear backend (``linear``) times its candidates once per case and keeps the result: a later process on the same machine reuses it
instead of measuring again. The file holds ``{"format": F, "machines": {key: {"machine": {...}, "cases":
{case name: decision}}}}``; the key hashes what the decision is valid for (CPU model and flags, torch
version, ...), so a cache folder shared between machines (a network home) keeps each machine's own
decisions. A file of another format, torn, unreadable or of the wrong shape (edited by hand, another tool's
file) counts as empty and is rewritten (one warning names it); a folder that cannot be written keeps the
decisions in memory for the process. Deleting the file is safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("retmask.kernels")


class DecisionCache:
    """One JSON file of decisions under ``retmask.cache_dir.cache_root()``.

    Args:
        file_name: the file's name in the cache folder.
        file_format: the format number written into the file; a file of another format is ignored.
        valid: whether a stored decision (a dict) can be used (e.g. names a path that still exists).
        what: how warnings name the file ("the kernel path cache").
    """

    def __init__(self, file_name: str, file_format: int, valid: Callable[[dict], bool], what: str):
        self.file_name = file_name
        self.file_format = file_format
        self.valid = valid
        self.what = what
        self._warned: set[Path] = set()  # files already reported as ignored (one warning per file)

    def path(self) -> Path:
        from retmask.cache_dir import cache_root

        return cache_root() / self.file_name

    def _ignore(self, path: Path, why: object) -> dict[str, Any]:
        """Treat the file as empty, with one warning per file and process naming it."""
        if path not in self._warned:
            self._warned.add(path)
            log.warning("ignoring %s %s (%s); it will be rewritten", self.what, path, why)
        return {}

    def _read(self, path: Path) -> dict[str, Any]:
        """The file's content when it has this format and the shape ``{"format", "machines": {key:
        {"machine": {...}, "cases": {name: {...}}}}}``; else ``{}``.

        A cache, not a result: a wrong file costs one measurement per case, so it is measured again and
        rewritten (a warning names it) rather than refused; the commands that use it never stop for it.
        """
        from retmask.runfiles import loads_strict

        try:
            data = loads_strict(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:  # a torn or foreign file (a duplicated key too): measure again
            return self._ignore(path, exc)
        if isinstance(data, dict) and "format" in data and data["format"] != self.file_format:
            return {}  # another version's file: replaced without a warning (nothing is wrong with it)
        if not isinstance(data, dict) or not isinstance(data.get("machines"), dict):
            return self._ignore(path, 'not {"format": ..., "machines": {...}}')
        for key, entry in data["machines"].items():
            if not isinstance(entry, dict) or not isinstance(entry.get("cases"), dict):
                return self._ignore(path, f'machines[{key!r}] is not {{"machine": ..., "cases": {{...}}}}')
            bad = [name for name, d in entry["cases"].items() if not isinstance(d, dict)]
            if bad:
                return self._ignore(path, f"decision {bad[0]!r} is not an object")
        return data

    def _usable(self, decision: dict[str, Any]) -> bool:
        """``valid(decision)``; a check that fails on an edited decision (a list where a string was) means
        the decision is not usable, not a crash."""
        try:
            return bool(self.valid(decision))
        except (TypeError, KeyError, ValueError, AttributeError):
            return False

    def load(self, machine_key: str, case_name: str) -> dict[str, Any] | None:
        """The stored decision for ``case_name`` on the machine ``machine_key``, or None."""
        entry = self._read(self.path()).get("machines", {}).get(machine_key, {})
        found = entry.get("cases", {}).get(case_name)
        return found if isinstance(found, dict) and self._usable(found) else None

    def save(
        self, machine_key: str, machine: dict[str, str], case_name: str, decision: dict[str, Any]
    ) -> None:
        """Add ``decision`` (atomically: read, update, write a temporary file, rename)."""
        from retmask.runfiles import atomic_write_json

        path = self.path()
        data = self._read(path) or {"format": self.file_format, "machines": {}}
        entry = data["machines"].setdefault(machine_key, {"machine": machine, "cases": {}})
        entry["cases"][case_name] = decision
        try:
            atomic_write_json(path, data)
        except OSError as exc:  # a read-only home: keep the decision in memory only
            log.warning("could not save %s %s (%s); decisions last for this process", self.what, path, exc)


class DecisionStore:
    """The decisions of one autotuner: measured once per case name, then reused from memory (this process)
    or from its :class:`DecisionCache` file (later processes on the same machine).

    Args:
        cache: the file.
        machine: what the decisions are valid for (called once, then cached until ``clear_memory``); its
            hash is the key of this machine's decisions in the file.
    """

    def __init__(self, cache: DecisionCache, machine: Callable[[], dict[str, str]]):
        self.cache = cache
        self._machine_fn = machine
        self._machine: dict[str, str] | None = None
        self._lock = threading.Lock()
        self._decided: dict[str, dict[str, Any]] = {}

    def machine(self) -> dict[str, str]:
        if self._machine is None:
            self._machine = self._machine_fn()
        return self._machine

    def machine_key(self) -> str:
        return hashlib.sha256(json.dumps(self.machine(), sort_keys=True).encode()).hexdigest()[:16]

    def get(self, case_name: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The decision for ``case_name``: from memory, from the file, or ``measure()`` now and stored.
        One measurement per case, even with several threads calling."""
        with self._lock:
            decision = self._decided.get(case_name)
            if decision is None:
                decision = self.cache.load(self.machine_key(), case_name)
                if decision is None:
                    decision = measure()
                    self.cache.save(self.machine_key(), self.machine(), case_name, decision)
                self._decided[case_name] = decision
        return decision

    def decisions(self) -> dict[str, dict[str, Any]]:
        """Copies of the decisions this process used, by case name."""
        with self._lock:
            return {name: dict(d) for name, d in self._decided.items()}

    def clear_memory(self) -> None:
        """Forget the decisions held in memory and the machine description (the file stays)."""
        with self._lock:
            self._decided.clear()
            self._machine = None


def interleaved_medians(
    run: Callable[[str], Any], names: list[str], *, min_calls: int, max_calls: int, budget_s: float
) -> tuple[dict[str, float], int]:
    """Time ``run(name)`` for each of ``names`` in turn (a, b, c, a, b, c, ...), so that every candidate
    meets the same machine load: at least ``min_calls`` rounds, more (up to ``max_calls``) while under
    ``budget_s``. Returns (median seconds by name, rounds)."""
    times: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    while True:
        for name, ts in times.items():
            t0 = time.perf_counter()
            run(name)
            ts.append(time.perf_counter() - t0)
        n = len(times[names[0]])
        if n >= max_calls or (n >= min_calls and time.perf_counter() - start > budget_s):
            break
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}, n
