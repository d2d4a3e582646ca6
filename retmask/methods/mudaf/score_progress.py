"""The progress folder of ``retmask mdqa-score``: the passage masses of every example scored so far, so an
interrupted run resumes where it stopped.

``<out>.progress/`` holds ``settings.json`` (``{"version": 1, "settings": {...}}``: everything that decides
the masses: the data file's SHA-256, the model, dtype, device, token limit, batch size and example limit)
and one ``<index>.json`` per scored example (``{"index", "id", "masses"}``, masses float32 [L, Hq, P] as
nested lists: a float32 value survives JSON exactly). Each file is written atomically once its batch is
scored, so a crash loses at most the batch that was running, and writing costs one small file per
example, whatever the run's size. The folder is deleted once the scores are written. A resume with other
settings is refused, naming what differs; ε is not a setting here, as the scores are re-derived from the
masses.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from retmask.runfiles import JsonFile, atomic_folder, atomic_write_json, check_same_settings

PROGRESS_VERSION = 1
_FIX = "resume with the same flags, or pass --overwrite to start over"


def progress_dir(out: Path) -> Path:
    """``<out>.progress``: the progress folder of a run writing ``out``."""
    return out.with_name(out.name + ".progress")


class ScoreProgress:
    """The progress folder of one run: :meth:`resume` (an interrupted run's examples), :meth:`save` after
    every batch (the first save of a new run creates the folder, so a run that fails before its first
    example leaves nothing to resume) and :meth:`finish` once the scores are written."""

    def __init__(self, out: Path, settings: Mapping[str, Any]):
        self.path = progress_dir(Path(out))
        self.settings = dict(settings)

    def resume(self) -> dict[int, tuple[str, np.ndarray]]:
        """The examples an interrupted run scored, by index: (example id, masses float32 [L, Hq, P]). A folder
        of other settings, another version, or a file of the wrong shape raises ``RunFileError`` naming it;
        whether the entries fit the data and the model is checked where they are used (``score_mdqa``)."""
        f = JsonFile(self.path / "settings.json", "progress file", _FIX)
        header = f.expect(f.read(), dict, "the file")
        if header.get("version") != PROGRESS_VERSION:
            f.fail(
                f"version {header.get('version')!r} is not {PROGRESS_VERSION} (written by another retmask version)"
            )
        check_same_settings(f.key(header, "settings", dict), self.settings, path=self.path, fix=_FIX)
        done: dict[int, tuple[str, np.ndarray]] = {}
        for file in sorted(self.path.glob("*.json")):
            if file.name == "settings.json":
                continue
            entry_file = JsonFile(file, "progress file", _FIX)
            entry = entry_file.expect(entry_file.read(), dict, "the file")
            index = int(entry_file.number(entry_file.key(entry, "index", int), "'index'", integer=True, lo=0))
            if file.stem != str(index):
                entry_file.fail(f"it holds example {index}, not {file.stem}")
            done[index] = (
                entry_file.key(entry, "id", str),
                _masses(entry_file, entry_file.key(entry, "masses", list)),
            )
        return done

    def save(self, index: int, example_id: str, masses: np.ndarray) -> None:
        """Keep one scored example (masses float32 [L, Hq, P]), atomically."""
        # the folder appears with its settings file, never without (a kill between would block a resume)
        if not self.path.is_dir():
            with atomic_folder(self.path) as staged:
                atomic_write_json(
                    staged / "settings.json", {"version": PROGRESS_VERSION, "settings": self.settings}
                )
        atomic_write_json(
            self.path / f"{index}.json", {"index": index, "id": example_id, "masses": masses.tolist()}
        )

    def finish(self) -> None:
        """The scores are written: nothing is left to resume."""
        shutil.rmtree(self.path, ignore_errors=True)


def _masses(f: JsonFile, value: list) -> np.ndarray:
    """float32 [L, Hq, P] from nested lists of finite numbers, or a failure naming the file."""
    try:
        masses = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        f.fail("'masses' must be nested lists [layers][heads][passages] of numbers, of equal lengths")
    if masses.ndim != 3 or not np.isfinite(masses).all():
        f.fail(
            f"'masses' must be [layers][heads][passages] of finite numbers, not of shape {list(masses.shape)}"
        )
    return masses


__all__ = ["PROGRESS_VERSION", "ScoreProgress", "progress_dir"]
