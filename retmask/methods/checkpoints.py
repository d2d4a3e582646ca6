"""Resumable ``retmask train``: the Trainer's checkpoints in ``--out`` and the settings they belong to.

With ``save_every = N`` the Trainer writes ``<out>/checkpoint-<step>`` every N optimizer steps (weights,
optimizer, scheduler, RNG states, ``trainer_state.json`` with the log history) and keeps only the newest (the
older one is deleted after the new one is complete). Next to them ``<out>/train_settings.json`` holds what
decides the result (mode, model, the pairs file's SHA-256, every training setting but ``save_every``,
``device`` and ``gradient_checkpointing``), so a resume with other settings is refused, naming what differs.
``trainer_state.json`` is the last file a checkpoint gets: a folder without it was cut off while being written
and is passed over for the one before it; so is one whose ``trainer_state.json`` does not parse (torn, empty),
which a resume names. When the trained model is saved, the checkpoints and the settings file are deleted: they
exist only while a run is unfinished.
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from retmask.model_files import files_stamp
from retmask.runfiles import (
    JsonFile,
    RunFileError,
    atomic_write_json,
    check_same_settings,
    file_digest,
    kind_of,
    read_json,
)

SETTINGS_NAME = "train_settings.json"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
_COMPLETE_MARKER = "trainer_state.json"  # written last into a checkpoint folder
_FIX = "resume with the same flags, or pass --overwrite to start over"
# settings that may change between an interrupted run and its resume (none changes the result)
_FREE = ("save_every", "device", "gradient_checkpointing")


def training_settings(mode: str, cfg: Any, pairs_path: str | Path, model_name: str) -> dict[str, Any]:
    """What decides a training run's result: ``mode`` ("dpo" / "sft"), the model, the pairs file's content and
    the :class:`TrainConfig` fields (``cfg``) but those in ``_FREE``."""
    config = {k: v for k, v in asdict(cfg).items() if k not in _FREE}
    return {
        "mode": mode,
        "model": model_name,
        **files_stamp(model_name),  # a model folder changed since the run began is another model
        "pairs_sha256": file_digest(pairs_path),
        **config,
    }  # flat: a change is named


def _step(folder: Path) -> int:
    return int(_CHECKPOINT.fullmatch(folder.name).group(1))


def _damage(folder: Path) -> str | None:
    """Why ``folder``'s ``trainer_state.json`` (present) does not make it a checkpoint to resume from, or None."""
    marker = folder / _COMPLETE_MARKER
    try:
        state = read_json(marker, what="checkpoint state file")
    except RunFileError as err:  # torn or empty (a crash while the file was written), unreadable
        return str(err)
    if not isinstance(state, dict):
        return f"checkpoint state file {marker} holds {kind_of(state)}, not an object"
    return None


def _scan(out: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """(the complete checkpoint folders in ``out``, oldest step first; those whose ``trainer_state.json``
    exists but does not parse, with why). Folders without one (cut off while being written) are in neither."""
    if not out.is_dir():
        return [], []
    found, damaged = [], []
    for path in out.iterdir():
        if not (_CHECKPOINT.fullmatch(path.name) and (path / _COMPLETE_MARKER).is_file()):
            continue
        problem = _damage(path)
        if problem is None:
            found.append((_step(path), path))
        else:
            damaged.append((_step(path), path, problem))
    return [p for _, p in sorted(found)], [(p, why) for _, p, why in sorted(damaged)]


def checkpoints(out: str | Path) -> list[Path]:
    """The complete checkpoint folders in ``out``, oldest step first (a folder without a parsable
    ``trainer_state.json`` is not one)."""
    return _scan(Path(out))[0]


def has_run_files(out: str | Path) -> bool:
    """Whether ``out`` holds checkpoints (complete or cut off) or a settings file of an unfinished run."""
    out = Path(out)
    return out.is_dir() and (
        (out / SETTINGS_NAME).exists() or any(_CHECKPOINT.fullmatch(p.name) for p in out.iterdir())
    )


def start(out: str | Path, settings: dict[str, Any]) -> None:
    """Record ``settings`` for a run that will write checkpoints into ``out`` (atomically)."""
    atomic_write_json(Path(out) / SETTINGS_NAME, settings)


def resume_point(out: str | Path, settings: dict[str, Any], error: type[Exception]) -> Path | None:
    """The newest complete checkpoint in ``out``, after checking that it was written with ``settings``;
    None (start from step 0) for a run with these settings stopped before it wrote any checkpoint;
    ``error`` (naming ``out`` and the fix) when there is nothing to resume or the settings differ."""
    out = Path(out)
    saved_at = out / SETTINGS_NAME
    found, damaged = _scan(out)
    # no complete checkpoint is resumable only as a run stopped before its first one: its settings file, and
    # no checkpoint cut off (which would say it got further)
    if not saved_at.is_file() or (not found and damaged):
        why = "".join(f"; {path.name} is passed over: {problem}" for path, problem in damaged)
        raise error(
            f"--resume: {out} holds no complete checkpoint to continue from (they are written every --save-every "
            f"N steps; without it nothing resumable is kept){why}; run without --resume, with --overwrite to "
            "start over"
        )
    f = JsonFile(saved_at, "training settings file", _FIX)
    check_same_settings(f.expect(f.read(), dict, "the file"), settings, path=saved_at, fix=_FIX)
    if not found:  # the same run starts over (the interruption said --resume)
        print("retmask train: the run stopped before its first checkpoint: training starts from step 0",
              file=sys.stderr)  # fmt: skip
        return None
    for path, problem in damaged:
        if _step(path) > _step(found[-1]):  # an older damaged one changes nothing
            print(f"retmask train: warning: passing over {path}: {problem}; resuming from {found[-1].name}",
                  file=sys.stderr)  # fmt: skip
    return found[-1]


def clear(out: str | Path) -> None:
    """Delete the checkpoints (complete or not) and the settings file of a run in ``out``."""
    out = Path(out)
    if not out.is_dir():
        return
    for path in out.iterdir():
        if _CHECKPOINT.fullmatch(path.name) and path.is_dir():
            shutil.rmtree(path)
    (out / SETTINGS_NAME).unlink(missing_ok=True)


__all__ = [
    "SETTINGS_NAME",
    "checkpoints",
    "clear",
    "has_run_files",
    "resume_point",
    "start",
    "training_settings",
]
