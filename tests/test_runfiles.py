"""runfiles: outputs checked before any work, earlier runs refused unless --resume/--overwrite, one writer
per output (lock), unreadable files named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retmask.errors import UsageError
from retmask.runfiles import (
    RunFileError,
    RunLock,
    check_distinct_paths,
    check_fresh_or_resume,
    check_writable,
    lock_path,
    read_json,
)


def unwritable_dir(tmp_path: Path) -> Path:
    """A folder this process cannot write: chmod 555 (root ignores it: then /sys, read-only to root)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").write_text("x")
    except OSError:
        return folder
    (folder / "probe").unlink()
    for candidate in (Path("/sys"), Path("/proc/sys")):
        try:
            (candidate / ".retmask-probe").write_text("x")
        except OSError:
            return candidate
    raise AssertionError("found no unwritable folder to test with (chmod 555, /sys, /proc/sys all writable)")


def test_check_writable(tmp_path):
    assert check_writable(tmp_path / "a" / "b" / "out.json") == tmp_path / "a" / "b" / "out.json"
    assert not (tmp_path / "a").exists()  # nothing created by the check
    with pytest.raises(RunFileError, match="is a folder; give a file path"):
        check_writable(tmp_path, what="--out")
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunFileError, match="is an existing file, not a folder"):
        check_writable(tmp_path / "f", directory=True)
    with pytest.raises(RunFileError, match="is a file, not a folder"):
        check_writable(tmp_path / "f" / "sub" / "out.json")
    ro = unwritable_dir(tmp_path)
    with pytest.raises(RunFileError, match=f"folder {ro} is not writable"):
        check_writable(ro / "new" / "out.json", what="--out")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".retmask")] == []  # no probe left
    assert issubclass(RunFileError, UsageError) and issubclass(RunFileError, ValueError)


def test_check_distinct_paths(tmp_path):
    (tmp_path / "sub").mkdir()
    check_distinct_paths({"--out": tmp_path / "s.json", "--plot": tmp_path / "s.png", "--json": None})
    with pytest.raises(
        UsageError, match=r"--out and --plot name the same file .*s\.png: one would overwrite"
    ):
        check_distinct_paths({"--out": tmp_path / "s.png", "--plot": tmp_path / "sub" / ".." / "s.png"})
    (tmp_path / "link").symlink_to(tmp_path / "sub")
    with pytest.raises(UsageError, match=r"--out .* is also an input \(--scores\): writing it would replace"):
        check_distinct_paths(
            {"--out": tmp_path / "link" / "x.json"}, {"--scores": tmp_path / "sub" / "x.json"}
        )
    check_distinct_paths(
        {"--out": tmp_path / "x.json"}, {"--scores": tmp_path / "sub" / "x.json", "--n": None}
    )


def test_check_fresh_or_resume(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "dir"
    assert check_fresh_or_resume([a, b], resume=False, overwrite=False) == []
    a.write_text("{}")
    b.mkdir()
    (b / "x").write_text("1")
    with pytest.raises(
        RunFileError, match=r"already exist .*--resume to continue or --overwrite to start over"
    ):
        check_fresh_or_resume([a, b], resume=False, overwrite=False)
    assert check_fresh_or_resume([a, b], resume=True, overwrite=False) == [a, b] and a.exists()
    assert check_fresh_or_resume([a, b], resume=False, overwrite=True, remove=False) == [a, b] and b.exists()
    assert check_fresh_or_resume([a, b], resume=False, overwrite=True) == [a, b]
    assert not a.exists() and not b.exists()
    with pytest.raises(RunFileError, match="exclude each other"):
        check_fresh_or_resume([], resume=True, overwrite=True)


def test_run_lock_is_exclusive_and_cleans_up(tmp_path):
    out = tmp_path / "new" / "s.json"
    with RunLock(out) as lock:
        assert lock_path(out).read_text().strip() == str(os.getpid())
        with pytest.raises(
            RunFileError, match=rf"another retmask run is writing {out} \(pid {os.getpid()}\)"
        ):
            RunLock(out).acquire()
        lock.acquire()  # re-entrant on the same object
    assert not lock_path(out).exists() and not (tmp_path / "new").exists()  # folder made only for the lock
    with RunLock(out):
        out.write_text("{}")
    assert out.exists() and not lock_path(out).exists()


def test_run_lock_held_by_another_process_and_freed_by_its_death(tmp_path):
    out = tmp_path / "s.json"
    code = (
        "import sys, time; from retmask.runfiles import RunLock\n"
        f"RunLock({str(out)!r}).acquire(); print('locked', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(RunFileError, match=rf"pid {proc.pid}\); wait for it or choose another --out"):
            RunLock(out).acquire()
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # like kill -9: the lock file stays, the kernel drops the lock
        proc.wait()
    assert lock_path(out).exists()
    deadline = time.time() + 5
    while True:
        try:
            with RunLock(out):
                break
        except RunFileError:
            assert time.time() < deadline
            time.sleep(0.05)
    assert not lock_path(out).exists()


def test_read_json_names_the_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"results": {"0": ')
    with pytest.raises(RunFileError, match=rf"progress file {path} is not valid JSON.*truncated.*delete it"):
        read_json(path, what="progress file", fix="delete it")


def test_read_jsonl_names_file_and_line(tmp_path):
    from retmask.runfiles import RunFileError, read_jsonl

    path = tmp_path / "p.jsonl"
    path.write_text('{"a": 1}\n\n[2]\n{oops\n', encoding="utf-8")
    lines = read_jsonl(path, what="pairs file")
    assert next(lines) == (f"{path}:1", {"a": 1})
    assert next(lines) == (f"{path}:3", [2])  # blank lines skipped, numbering kept
    with pytest.raises(RunFileError, match=r"p\.jsonl:4: not valid JSON"):
        next(lines)
    with pytest.raises(RunFileError, match="pairs file .*missing.jsonl does not exist; pass X"):
        list(read_jsonl(tmp_path / "missing.jsonl", what="pairs file", fix="pass X"))
    path.write_bytes(b"\xff\xfe{}\n")
    with pytest.raises(RunFileError, match="not UTF-8"):
        list(read_jsonl(path))


def _fail_writes(monkeypatch, err: OSError) -> None:
    """Every ``os.write`` / buffered file write fails with ``err`` (a full disk, seen from Python)."""
    import builtins
    import io

    real_open = builtins.open

    class Full(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            raise err

    def failing_open(file, mode="r", *args, **kwargs):
        if "w" in mode:
            real_open(file, mode, *args, **kwargs).close()  # the file is created, as on a full disk
            return io.BufferedWriter(Full())
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", failing_open)
    monkeypatch.setattr(os, "write", lambda fd, data: (_ for _ in ()).throw(err))


def test_full_disk_is_a_message_naming_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    import errno

    from retmask.runfiles import OutputWriteError, atomic_write_json

    out = tmp_path / "scores.json"
    atomic_write_json(out, {"old": 1})
    _fail_writes(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OutputWriteError, match=f"cannot write {out}: No space left on device"):
        atomic_write_json(out, {"new": 2})
    monkeypatch.undo()
    assert json.loads(out.read_text()) == {"old": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores.json"]  # no temporary file left


def test_lock_on_a_full_disk_leaves_no_empty_lock_file(tmp_path, monkeypatch):
    import errno

    from retmask.runfiles import OutputWriteError, RunLock

    out = tmp_path / "run" / "scores.json"
    _fail_writes(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OutputWriteError, match="cannot write .*scores.json.lock: No space left on device"):
        RunLock(out).acquire()
    monkeypatch.undo()
    assert not (tmp_path / "run").exists()  # neither the lock file nor the folder made for it
    with RunLock(out):  # and the next run takes the lock
        pass


def test_atomic_folder_failure_leaves_nothing_behind(tmp_path):
    from retmask.runfiles import OutputWriteError, atomic_folder

    out = tmp_path / "model"
    (out / "old").mkdir(parents=True)  # a non-empty target: the final rename fails
    with pytest.raises(OutputWriteError, match=f"cannot write {out}"):
        with atomic_folder(out) as tmp:
            (tmp / "weights.bin").write_bytes(b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert sorted(p.name for p in out.iterdir()) == ["old"]
    with atomic_folder(tmp_path / "fresh") as tmp:
        (tmp / "weights.bin").write_bytes(b"x")
    assert (tmp_path / "fresh" / "weights.bin").read_bytes() == b"x"
