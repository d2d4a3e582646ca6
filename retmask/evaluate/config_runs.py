"""Resumable runs of many configurations, one result file per finished configuration.

``retmask ablate`` and ``retmask kv`` answer the same tests under many configurations (masked heads, KV
policies), minutes each. Each finished configuration is written atomically to
``<out_dir>/<prefix>.configs/<name>.json`` at once, so a crash or Ctrl-C loses at most the configuration
that was running, and ``--resume`` skips what is saved. A caller may also keep the running configuration's
finished tests in ``<name>.json.progress.json`` (:meth:`ConfigFolder.running`; ``ablate`` and ``kv`` do),
which ``save`` deletes. What a saved file must match to be reused (its settings' fingerprint, heads,
tests) is the caller's to check: this module only finds, writes and deletes the files and walks the
configurations left.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from retmask.evaluate.niah_progress import (
    PROGRESS_SUFFIX,
    check_niah_entry,
    progress_path,
    read_progress,
    write_progress,
)
from retmask.runfiles import JsonFile, atomic_write_json


class Named(Protocol):
    name: str


class ConfigFolder:
    """``<out_dir>/<prefix>.configs``, or nothing at all when ``out_dir`` is None (results kept in memory only).

    ``error``: the exception class the caller's command reports (a ``UsageError`` subclass).
    """

    def __init__(self, out_dir: str | Path | None, prefix: str, error: type[Exception]):
        self.path = Path(out_dir) / f"{prefix}.configs" if out_dir is not None else None
        self.error = error

    def saved(self, *, resume: bool, overwrite: bool) -> list[Path]:
        """The saved results to resume from, sorted: every one with ``resume``, none otherwise.

        A folder that holds results while neither flag is given is refused (a new run would mix with them);
        with ``overwrite`` they are deleted. Call this after every other check of the run passed, so a refused
        run deletes nothing.
        """
        if self.path is None or not self.path.is_dir():
            return []
        files = sorted(self.path.glob("*.json"))
        partial = [p for p in files if p.name.endswith(PROGRESS_SUFFIX)]
        existing = [p for p in files if not p.name.endswith(PROGRESS_SUFFIX)]
        if (existing or partial) and not (resume or overwrite):
            raise self.error(
                f"{self.path} already holds {len(existing)} configuration results"
                + (f" and the finished tests of {len(partial)} unfinished ones" if partial else "")
                + "; pass --resume to continue that run, --overwrite to start over, or another --out-dir"
            )
        if overwrite:
            for path in files:
                path.unlink(missing_ok=True)
            return []
        return existing

    def running(
        self,
        name: str,
        settings: dict[str, Any],
        *,
        resume: bool,
        check_entry: Callable[[JsonFile, dict, str], None] = check_niah_entry,
    ) -> tuple[dict[int, dict] | None, Callable[[Mapping[int, dict]], None] | None]:
        """(the tests configuration ``name`` answered before an interrupt, a function saving its answers so
        far) for the configuration about to run: its ``<name>.json.progress.json``, read with ``resume``
        (refused when written with other ``settings``; ``check_entry`` checks each entry) and rewritten after
        every answer. (None, None) without ``out_dir``."""
        if self.path is None:
            return None, None
        partial = progress_path(self.path / f"{name}.json")
        done = read_progress(partial, settings, check_entry) if resume and partial.exists() else None
        return done, functools.partial(write_progress, partial, settings)

    def save(self, name: str, payload: dict[str, Any]) -> None:
        """Write one finished configuration (atomically; nothing without an ``out_dir``) and delete its
        progress file."""
        if self.path is not None:
            atomic_write_json(self.path / f"{name}.json", payload)
            progress_path(self.path / f"{name}.json").unlink(missing_ok=True)


def remaining(
    configs: Sequence[Named],
    done: Container[str],
    *,
    limit: int | None,
    desc: str,
    progress: bool,
) -> Iterator[Any]:
    """The configurations whose name is not in ``done``, in order, at most ``limit`` of them, under one
    progress bar over all of them (advanced when the caller asks for the next one)."""
    from tqdm import tqdm

    finished = sum(1 for c in configs if c.name in done)
    with tqdm(total=len(configs), initial=finished, desc=desc, unit="config", disable=not progress) as bar:
        started = 0
        for config in configs:
            if config.name in done:
                continue
            if limit is not None and started >= limit:
                return
            started += 1
            bar.set_postfix_str(config.name)
            yield config
            bar.update(1)
