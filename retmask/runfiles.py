"""Files of long runs: atomic writes, settings fingerprints and the resume check, in one place.

Every resumable run (detect, ablate, the single-head sweep, eval's per-model cache, RetMask pair
generation, the pipeline, MuDAF training) follows the same rules:

* results are written with :func:`atomic_write_json` / :func:`atomic_write_text`, so a crash (even
  ``kill -9``) leaves either the old or the new file, never a torn one, and no temporary file behind;
* a run records the *fingerprint* of the settings that determine its results (a JSON-able dict, or its
  :func:`digest`); a resumed run must present the same fingerprint, otherwise :func:`check_same_settings`
  refuses with the list of settings that differ;
* a results file that cannot be read is an error naming the file and the way out (:func:`read_json`);
* outputs are checked before any work: :func:`check_writable` (the folder can be written, the path is not a
  folder), :func:`check_fresh_or_resume` (an earlier run's files are continued with ``--resume`` or
  deleted with ``--overwrite``, never silently replaced);
* one process at a time writes a run's outputs: :class:`RunLock` (``fcntl.flock`` on ``<out>.lock``,
  non-blocking: a second run on the same output fails at once, naming the process that holds it).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from retmask.errors import UsageError


class RunFileError(UsageError):
    """An output that cannot be written, an earlier run in the way, or a run already writing it."""


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (temp file in the same folder, fsync, rename); parents created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old or the new file, never half of one
    finally:
        if tmp.exists():  # the write or the rename failed: leave nothing behind
            tmp.unlink()
    return path


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = None) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically (see :func:`atomic_write_text`)."""
    return atomic_write_text(path, json.dumps(obj, indent=indent))


def read_json(path: str | os.PathLike, *, what: str = "results file", fix: str = "") -> Any:
    """Parse a JSON file; a missing or corrupt file is a :class:`RunFileError` (a ``ValueError``) naming it (and ``fix``, if given)."""
    path = Path(path)
    hint = f"; {fix}" if fix else ""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunFileError(f"{what} {path} does not exist{hint}") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
        raise RunFileError(f"{what} {path} cannot be read ({err}){hint}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise RunFileError(
            f"{what} {path} is not valid JSON ({err}); it is truncated or was edited by hand{hint}"
        ) from None


def read_jsonl(
    path: str | os.PathLike,
    *,
    what: str = "JSON-lines file",
    fix: str = "",
    error: type[Exception] = RunFileError,
) -> Iterator[tuple[str, Any]]:
    """Yield ``("<path>:<line>", object)`` for every non-blank line of a JSON-lines file.

    A missing or unreadable file or a line that is not JSON raises ``error`` naming the file and the line
    (and ``fix``, if given); checking what each object holds is the caller's (``where`` locates it).
    """
    path = Path(path)
    hint = f"; {fix}" if fix else ""
    try:
        f = path.open(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist{hint}") from None
    except (IsADirectoryError, PermissionError) as err:
        raise error(f"{what} {path} cannot be read ({err}){hint}") from None
    with f:
        try:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    raise error(
                        f"{where}: not valid JSON ({err.msg}); each line must be one JSON object{hint}"
                    ) from None
                yield where, obj
        except UnicodeDecodeError as err:
            raise error(f"{what} {path} is not UTF-8 text ({err}){hint}") from None


def digest(obj: Any) -> str:
    """sha256 (hex) of ``obj``'s canonical JSON (sorted keys; non-JSON values by ``str``)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def without_default_dtype(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` without its ``"dtype"`` entry when that is the default ``"float32"``: fingerprints of
    float32 runs stay those written before the dtype was a setting, so their results remain valid."""
    return {k: v for k, v in settings.items() if not (k == "dtype" and v == "float32")}


def file_digest(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """sha256 (hex) of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def settings_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``["key: saved -> current", ...]`` for every top-level setting that differs (sorted by key)."""
    keys = sorted(set(saved) | set(current))
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]


def check_same_settings(
    saved: Any,
    current: Any,
    *,
    path: str | os.PathLike,
    fix: str = "rerun with the same flags, or drop --resume to start over",
    error: type[Exception] = RunFileError,
) -> None:
    """Refuse to resume ``path`` when its recorded fingerprint ``saved`` differs from ``current``.

    The message lists the differing settings when both are dicts (long values are cut to keep it readable).
    """
    if saved == current:
        return
    if isinstance(saved, Mapping) and isinstance(current, Mapping):
        diff = [d if len(d) <= 160 else d[:157] + "..." for d in settings_diff(saved, current)]
        what = "; ".join(diff)
    else:
        what = "its settings fingerprint differs"
    raise error(f"--resume: {path} was written by a run with other settings ({what}); {fix}")


# --------------------------------------------------------------------------------------------------
# Before any work: outputs writable, earlier runs continued or removed on purpose, one writer at a time
# --------------------------------------------------------------------------------------------------


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(path: str | os.PathLike, *, what: str = "output", directory: bool = False) -> Path:
    """Refuse, before any work, an output ``path`` that cannot be written.

    ``directory=False``: ``path`` is a file (written atomically, so its folder must be writable) and must not
    be an existing folder; ``directory=True``: ``path`` is a folder and must not be an existing file. Missing
    parents are fine when the nearest existing one is a writable folder (nothing is created here: the check
    writes and removes one probe file in that folder).
    """
    path = Path(path)
    if path.exists():
        if directory and not path.is_dir():
            raise RunFileError(f"{what} {path} is an existing file, not a folder; choose a folder path")
        if not directory and path.is_dir():
            raise RunFileError(
                f"{what} {path} is a folder; give a file path (e.g. {path / 'out.json'}) or another name"
            )
    folder = _nearest_existing(path if directory else path.parent)
    if not folder.is_dir():
        raise RunFileError(
            f"cannot create {what} {path}: {folder} is a file, not a folder; choose another path"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".retmask-write-test-", dir=folder)
    except OSError as err:
        raise RunFileError(
            f"cannot write {what} {path}: folder {folder} is not writable ({err.strerror}); choose another "
            "location or fix its permissions"
        ) from None
    os.close(fd)
    os.unlink(probe)
    return path


def check_fresh_or_resume(
    paths: Iterable[str | os.PathLike],
    *,
    resume: bool,
    overwrite: bool,
    remove: bool = True,
    what: str = "an earlier run",
) -> list[Path]:
    """Files (or folders) of an earlier run among ``paths``: continued (``resume``), deleted (``overwrite``,
    when ``remove``), or a refusal naming them and both ways out. Returns the ones that existed."""
    if resume and overwrite:
        raise RunFileError(
            "--resume and --overwrite exclude each other (--resume continues the earlier run, --overwrite "
            "deletes it); pick one"
        )
    found = [Path(p) for p in paths if Path(p).exists()]
    if found and not (resume or overwrite):
        names = ", ".join(str(p) for p in found[:3]) + (
            f" and {len(found) - 3} more" if len(found) > 3 else ""
        )
        verb = "exists" if len(found) == 1 else "exist"
        raise RunFileError(
            f"{names} already {verb} ({what}); pass --resume to continue or --overwrite to start over, or "
            "choose another output"
        )
    if overwrite and remove:
        for p in found:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
    return found


def check_not_replacing(paths: Iterable[str | os.PathLike | None], *, overwrite: bool) -> None:
    """Outputs of a command that cannot resume: existing files among ``paths`` (None entries ignored) are
    refused unless ``overwrite`` (the command then replaces them when it writes)."""
    found = [Path(p) for p in paths if p is not None and Path(p).exists()]
    if found and not overwrite:
        names = ", ".join(str(p) for p in found)
        verb = "exists" if len(found) == 1 else "exist"
        raise RunFileError(
            f"{names} already {verb}; pass --overwrite to replace it, or choose another output"
        )


def lock_path(path: str | os.PathLike) -> Path:
    """``<path>.lock``: the lock file of the run writing ``path``."""
    path = Path(path)
    return path.with_name(path.name + ".lock")


class RunLock:
    """Exclusive lock on the output ``path`` of a run: ``with RunLock(out): ...``.

    ``fcntl.flock`` on ``<path>.lock``, non-blocking: while one process holds it, another fails at once with
    an error naming the holder's pid. The lock file holds the pid and is removed on release (a process
    killed with ``kill -9`` leaves the file, but the kernel drops its lock, so the next run takes it).
    Two opens of the same lock file conflict even inside one process (``flock`` locks open files).
    """

    def __init__(self, path: str | os.PathLike, *, flag: str = "--out"):
        self.path = Path(path)
        self.lock_path = lock_path(self.path)
        self.flag = flag
        self._fd: int | None = None
        self._existing: Path | None = None  # nearest folder that existed before the lock (kept on release)

    def holder(self) -> str:
        """The pid written in the lock file, or ``"unknown"``."""
        try:
            return self.lock_path.read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def acquire(self) -> RunLock:
        if self._fd is not None:
            return self
        self._existing = _nearest_existing(self.lock_path.parent)
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunFileError(
                    f"another retmask run is writing {self.path} (pid {self.holder()}); wait for it or choose "
                    f"another {self.flag}"
                ) from None
            try:  # the holder may have released (and removed the file) between our open and our flock
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        # Remove the file while still holding the lock: a process that opened it meanwhile sees another
        # inode after its flock and retries on a fresh file.
        try:
            if os.fstat(self._fd).st_ino == os.stat(self.lock_path).st_ino:
                self.lock_path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
        # folders made only for the lock (the run failed before writing anything there) go too
        folder = self.lock_path.parent
        while self._existing is not None and folder != self._existing and folder != folder.parent:
            try:
                folder.rmdir()
            except OSError:  # not empty (outputs are there) or gone
                break
            folder = folder.parent

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
