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

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from retmask.errors import UsageError


class RunFileError(UsageError):
    """An output that cannot be written, an earlier run in the way, a run already writing it, or a run
    file (progress, state, cache, scores) that cannot be read or does not hold what it should."""


MAX_INDEX = 1_000_000
"""Upper bound (exclusive) of an index read from a file (a layer, a head, a test): far above any model or
grid, far below what would exhaust memory when used as a size."""


class OutputWriteError(RunFileError):
    """An output that could not be written after the work was done (full disk, over-long name, a folder
    that became read-only). The message is ``cannot write PATH: REASON``; what was written before stays."""


def output_error(path: str | os.PathLike, err: OSError) -> OutputWriteError:
    """``cannot write PATH: REASON`` for an ``OSError`` raised while writing ``path``."""
    reason = err.strerror or str(err)
    return OutputWriteError(f"cannot write {path}: {reason}")


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def io_failure(err: BaseException) -> OSError | None:
    """The operating-system error behind ``err``, or None when it is not one.

    The writers under ``save_pretrained`` / ``torch.save`` do not raise ``OSError`` on a full disk:
    safetensors raises ``SafetensorError("... I/O error: No space left on device (os error 28)")`` and
    torch's zip writer a ``RuntimeError("... unexpected pos ...")`` whose ``__context__`` is the ``OSError``
    of the file object it wrote to. Both are found here (the exception itself, its cause / context chain,
    then an ``(os error N)`` in its text).
    """
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        # an explicit cause, else the error being handled when this one was raised (not after ``from None``)
        e = e.__cause__ if e.__cause__ is not None else (None if e.__suppress_context__ else e.__context__)
    m = _OS_ERROR.search(str(err))
    if m:
        code = int(m.group(1))
        return OSError(code, os.strerror(code) if code in errno.errorcode else str(err))
    return None


def temporary_path(path: Path) -> Path:
    """Where an atomic write of ``path`` stages its bytes: ``.<name>.tmp<pid>`` beside it (same folder, so
    the final rename stays on one file system)."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def stale_temporaries(path: Path) -> list[Path]:
    """The staging files of atomic writes of ``path`` that a ``kill -9`` left behind (``temporary_path``'s
    names, any process id; regular files only). Call it where no writer of ``path`` can be running (under
    the run's lock)."""
    stage = re.compile(re.escape(f".{path.name}.tmp") + r"\d+")
    if not path.parent.is_dir():
        return []
    return sorted(
        p for p in path.parent.iterdir() if stage.fullmatch(p.name) and p.is_file() and not p.is_symlink()
    )


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, rename); parents created.

    An ``OSError`` (full disk, over-long name, no permission) is an :class:`OutputWriteError` naming
    ``path``; the old file, if any, is untouched and no temporary file is left behind.
    """
    path = Path(path)
    tmp = temporary_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old or the new file, never half of one
    except OSError as err:
        raise output_error(path, err) from None
    finally:
        try:
            tmp.unlink(missing_ok=True)  # the write or the rename failed: leave nothing behind
        except OSError:
            pass
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_write_bytes`)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = None) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically (see :func:`atomic_write_bytes`)."""
    return atomic_write_text(path, json.dumps(obj, indent=indent))


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_folder(out) as tmp:`` write a folder's files into ``tmp`` (a hidden sibling of ``out``);
    on success ``tmp`` is renamed to ``out`` (which must be absent or an empty folder), on any error it is
    removed. An interrupted or failed save (Ctrl-C, a full disk) leaves no half-written folder that would
    load as if it were complete, and nothing that blocks a rerun. ``OSError`` becomes
    :class:`OutputWriteError` naming ``out``.
    """
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{out.name[:100]}.partial-", dir=out.parent))
    except OSError as err:
        raise output_error(out, err) from None
    try:
        yield partial
        if out.is_dir() and not out.is_symlink():
            out.rmdir()  # must be empty: a non-empty folder raises OSError (ENOTEMPTY) below
        os.rename(partial, out)
    except OSError as err:
        shutil.rmtree(partial, ignore_errors=True)
        raise output_error(out, err) from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


class DuplicateKeyError(ValueError):
    """A JSON object that names one key twice (``json.loads`` would silently keep the last value)."""

    def __init__(self, key: str):
        super().__init__(f"key {key!r} twice in one object")
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: the object as a dict, refusing a key named twice."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return obj


def _parse_int(digits: str) -> int:
    """``parse_int`` hook: Python refuses integers over 4300 digits with a message about
    ``sys.set_int_max_str_digits``; no retmask file holds more than a few digits, so say that plainly."""
    if len(digits.lstrip("-")) > 100:
        raise ValueError(f"it holds an integer of {len(digits.lstrip('-'))} digits")
    return int(digits)


def loads_strict(text: str) -> Any:
    """``json.loads`` that refuses what it would otherwise read silently or crash on: a key named twice in
    one object (:class:`DuplicateKeyError`), nesting deeper than the interpreter's recursion limit and
    integers of more than 100 digits (both a plain ``ValueError``). Every error is a ``ValueError``."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_int=_parse_int)
    except RecursionError:
        # no retmask file nests more than a few levels; a RecursionError would be a traceback
        raise ValueError("it is nested too deeply (thousands of levels)") from None


def read_json(
    path: str | os.PathLike,
    *,
    what: str = "results file",
    fix: str = "",
    error: type[Exception] = RunFileError,
) -> Any:
    """Parse a JSON file; a missing, unreadable or corrupt file raises ``error`` (default
    :class:`RunFileError`, a ``ValueError``) naming it (and ``fix``, if given).

    Refused besides invalid JSON (see :func:`loads_strict`): a key named twice in one object (which value
    counts would be a guess), absurd nesting, a folder, bytes that are not UTF-8. What the parsed object
    must hold is the caller's to check (:class:`JsonFile` names the file in those messages too).
    """
    path = Path(path)
    hint = f"; {fix}" if fix else ""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist{hint}") from None
    except IsADirectoryError:
        raise error(f"{what} {path} is a folder, not a file{hint}") from None
    except UnicodeDecodeError as err:
        raise error(f"{what} {path} is not UTF-8 text ({err}); it is not a JSON file{hint}") from None
    except OSError as err:  # permissions, an over-long name, an I/O error
        raise error(f"{what} {path} cannot be read ({err.strerror or err}){hint}") from None
    try:
        return loads_strict(text)
    except json.JSONDecodeError as err:
        raise error(
            f"{what} {path} is not valid JSON ({err}); it is truncated or was edited by hand{hint}"
        ) from None
    except DuplicateKeyError as err:
        raise error(
            f"{what} {path} holds {err} (edited or merged by hand?): JSON readers keep the last value "
            f"silently, so which one counts is ambiguous{hint}"
        ) from None
    except ValueError as err:
        raise error(f"{what} {path} cannot be read as JSON: {err}{hint}") from None


_KINDS: dict[type, str] = {
    dict: "an object",
    list: "a list",
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    type(None): "null",
}


def kind_of(value: Any) -> str:
    """How a JSON value's type reads in a message: ``"a list"``, ``"an object"``, ``"null"``, ..."""
    return _KINDS.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class JsonFile:
    """A JSON run file (progress, state, cache, scores) whose *shape* is checked after it parses.

    Every message names the file and the way out: ``"<what> <path>: <where> must be a list, not an object;
    <fix>"``, raised as ``error`` (default :class:`RunFileError`: ``retmask <command>: error: ...``, exit 2).
    Readers check what they use, so an edited or foreign file is refused where it is read instead of
    failing later with a ``KeyError`` / ``TypeError`` traceback, or resuming to a wrong result.
    """

    path: Path
    what: str
    fix: str = ""
    error: type[Exception] = RunFileError

    def read(self) -> Any:
        """The parsed file (:func:`read_json`, same ``what``, ``fix`` and ``error``)."""
        return read_json(self.path, what=self.what, fix=self.fix, error=self.error)

    def fail(self, problem: str) -> NoReturn:
        """Raise ``error`` with ``problem`` (what is wrong, where in the file)."""
        hint = f"; {self.fix}" if self.fix else ""
        raise self.error(f"{self.what} {self.path}: {problem}{hint}")

    def expect(self, value: Any, types: type | tuple[type, ...], where: str) -> Any:
        """``value`` if it is one of ``types`` (JSON kinds: dict, list, str, int, float, bool, NoneType);
        ``float`` admits ints, and ``int`` / ``float`` never admit true/false (bool is an int in Python)."""
        types = types if isinstance(types, tuple) else (types,)
        ok = isinstance(value, types) or (float in types and isinstance(value, int))
        if isinstance(value, bool) and bool not in types:
            ok = False
        if not ok:
            want = " or ".join(dict.fromkeys(_KINDS.get(t, t.__name__) for t in types))
            shown = repr(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            self.fail(f"{where} must be {want}, not {kind_of(value)} ({shown})")
        return value

    def key(self, obj: Mapping[str, Any], key: str, types: type | tuple[type, ...], where: str = "") -> Any:
        """``obj[key]``, which must be present and one of ``types`` (see :meth:`expect`)."""
        at = f"{where}.{key}" if where else repr(key)
        if key not in obj:
            self.fail(f"{where or 'the file'} lacks the entry {key!r}")
        return self.expect(obj[key], types, at)

    def number(
        self,
        value: Any,
        where: str,
        *,
        integer: bool = False,
        lo: float | None = None,
        hi: float | None = None,
    ) -> float:
        """A finite number (an int with ``integer``) in ``[lo, hi]`` (either end optional)."""
        self.expect(value, int if integer else float, where)
        if not math.isfinite(value):
            self.fail(f"{where} is {value!r}; it must be a finite number")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = [f">= {lo}"] * (lo is not None) + [f"<= {hi}"] * (hi is not None)
            self.fail(f"{where} is {value!r}; it must be {' and '.join(bounds)}")
        return value

    def index_key(self, key: str, where: str, *, limit: int = MAX_INDEX) -> int:
        """A key that holds a non-negative index (``"12"``): ASCII digits only, below ``limit``. ``int()``
        alone would accept ``"１２"``, ``"٣"``, ``" 1"`` and ``"1_0"``, and read 10**30 without complaint."""
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            self.fail(f"{where}: key {key!r} is not a non-negative integer written in the digits 0-9")
        if len(key.lstrip("0")) > len(str(limit)) or int(key) >= limit:
            self.fail(f"{where}: key {key!r} is out of range (at most {limit - 1})")
        return int(key)


def jsonl_text(records: Iterable[Any]) -> str:
    """JSON Lines: one JSON value per line, non-ASCII kept readable (what :func:`read_jsonl` reads)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


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


# Bytes a file name needs beside its own for the files written next to it: the atomic writer's
# ".NAME.tmpPID" (12), the lock "NAME.lock" (5) and a detection's "NAME.progress.json" temp (26).
_NAME_ROOM = 32


def _check_name_lengths(path: Path, *, what: str, directory: bool) -> None:
    """Refuse names the file system cannot hold (``NAME_MAX``, 255 bytes on most), before any work: the
    names of ``path`` and of its missing parents (the limit is that of the nearest existing folder); a
    file's name must leave ``_NAME_ROOM`` bytes for the temporary and lock files written beside it."""
    folder = path if directory else path.parent
    while True:  # the nearest existing folder; exists() itself fails on an over-long name (ENAMETOOLONG)
        try:
            if folder.exists() or folder == folder.parent:
                break
        except OSError:
            pass
        folder = folder.parent
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):  # not a folder, or a file system that reports no limit: nothing to check
        return
    missing = path.relative_to(folder).parts if path.is_relative_to(folder) else (path.name,)
    for i, part in enumerate(missing):
        own = not directory and i == len(missing) - 1  # the file itself
        room = _NAME_ROOM if own else 0
        size = len(os.fsencode(part))
        if size + room > limit:
            extra = f" less {room} for the temporary and lock files written beside it" if room else ""
            shown = part if len(part) <= 60 else part[:40] + "..."
            raise RunFileError(
                f"cannot write {what}: the name {shown} is {size} bytes, longer than the {limit - room} "
                f"bytes allowed ({limit} in {folder}{extra}); choose a shorter name"
            )


def check_writable(path: str | os.PathLike, *, what: str = "output", directory: bool = False) -> Path:
    """Refuse, before any work, an output ``path`` that cannot be written.

    ``directory=False``: ``path`` is a file (written atomically, so its folder must be writable) and must not
    be an existing folder; ``directory=True``: ``path`` is a folder and must not be an existing file. Missing
    parents are fine when the nearest existing one is a writable folder (nothing is created here: the check
    writes and removes one probe file in that folder). An existing device, FIFO or socket (``/dev/full``)
    is refused, and so is a name longer than the file system allows (``NAME_MAX``, leaving room for the
    temporary and lock files written beside it), which would otherwise fail only when the work is done.
    """
    path = Path(path)
    _check_name_lengths(path, what=what, directory=directory)  # first: exists() fails on over-long names
    if path.exists():
        if directory and not path.is_dir():
            raise RunFileError(f"{what} {path} is an existing file, not a folder; choose a folder path")
        if not directory and path.is_dir():
            raise RunFileError(
                f"{what} {path} is a folder; give a file path (e.g. {path / 'out.json'}) or another name"
            )
        if not directory and not path.is_file():
            # a device, FIFO or socket: the atomic writer would replace it by a regular file (or fail after
            # the work); /dev/null or /dev/full are not outputs
            raise RunFileError(
                f"{what} {path} is not a regular file (a device, FIFO or socket); give a file path"
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


def check_distinct_paths(
    outputs: Mapping[str, str | os.PathLike | None],
    inputs: Mapping[str, str | os.PathLike | None] | None = None,
) -> None:
    """Refuse, before any work, two outputs that name the same file, or an output that names an input:
    the later write would replace the earlier one (a heatmap over the scores) or the input. Keys are what
    the message calls each path (``"--out"``, ``"run record"``); None entries are ignored. Paths are
    compared after resolving symbolic links and ``..``."""

    def resolved(paths: Mapping[str, str | os.PathLike | None]) -> list[tuple[str, Path]]:
        return [(name, Path(os.path.realpath(p))) for name, p in paths.items() if p is not None]

    seen: dict[Path, str] = {}
    for name, path in resolved(outputs):
        if path in seen:
            raise RunFileError(
                f"{seen[path]} and {name} name the same file {path}: one would overwrite the other; give "
                "them different paths"
            )
        seen[path] = name
    for name, path in resolved(inputs or {}):
        if path in seen:
            raise RunFileError(
                f"{seen[path]} {path} is also an input ({name}): writing it would replace the input; give "
                f"{seen[path]} another path"
            )


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


def check_progress_run(
    out: Path, progress: Path, results: Sequence[Path], *, resume: bool, overwrite: bool, what: str
) -> None:
    """The checks of a run writing ``out`` that keeps its finished work in ``progress`` (a file or folder
    deleted once ``results`` are written): an unfinished run is continued with ``resume`` or deleted with
    ``overwrite`` (``check_fresh_or_resume``, ``what`` names it), ``resume`` without one is refused, and a
    new run does not replace finished ``results`` without ``overwrite``."""
    check_fresh_or_resume([progress], resume=resume, overwrite=overwrite, what=what)
    if resume and not progress.exists():
        raise RunFileError(
            f"--resume: {progress} does not exist, so there is no interrupted run on {out} to continue (a "
            "finished run deletes it); drop --resume"
        )
    if not resume:
        check_not_replacing(results, overwrite=overwrite)


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
        while True:
            try:
                self.lock_path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise output_error(self.lock_path, err) from None
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
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as err:  # a full disk: no 0-byte lock file left behind
            self.release()
            raise output_error(self.lock_path, err) from None
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
