"""Trained and exported models are written whole or not at all (issue 47): a write that fails after
training (full disk, file-size limit) is ``cannot write OUT: REASON`` with exit 2, leaves the output folder
as it was (no partial model, earlier files and MuDAF's resume.pt kept) and does not block a rerun; output
folders are checked before any model is loaded."""

from __future__ import annotations

# ruff: noqa: F811  (the fixtures imported from the subpackages' conftests are test parameters)
import errno
import json
import resource
import signal
from pathlib import Path

import pytest
import torch
import transformers

import retmask
from retmask.cli import main as cli
from retmask.methods import training_guards
from retmask.methods.mudaf.mdqa import write_mdqa
from retmask.methods.mudaf.train import read_record
from retmask.methods.retmask.dpo import train_dpo
from retmask.methods.training_guards import staged_model_save
from retmask.runfiles import OutputWriteError, RunFileError, atomic_write_json
from tests.methods.mudaf.conftest import bpe_tokenizer, mdqa_examples  # noqa: F401  (fixtures)
from tests.methods.retmask.conftest import tiny_dir, tokenizer  # noqa: F401  (fixtures)
from tests.methods.retmask.test_train import ROWS, conv
from tests.tiny import tiny_llama, tiny_llama_for

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def pairs_file(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(conv(*r)) + "\n" for r in ROWS[:2]))
    return path


def listing(folder: Path) -> dict[str, bytes]:
    """Every entry of ``folder`` (hidden ones included) with its bytes; {} when the folder is absent."""
    if not folder.exists():
        return {}
    return {p.name: p.read_bytes() if p.is_file() else b"<dir>" for p in folder.iterdir()}


def disk_full(monkeypatch) -> None:
    """Every ``save_pretrained`` of a model fails as on a full disk."""

    def full(self, save_directory, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(save_directory))

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full)


def test_train_full_disk_is_a_message_and_a_rerun_works(tiny_dir, pairs_file, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    argv = ["train", "--pairs", str(pairs_file), "--model", str(tiny_dir), "--out", str(out), "--max-steps", "1",
            "--batch-size", "2", "--grad-accum", "1", "--max-length", "128"]  # fmt: skip
    disk_full(monkeypatch)
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert f"retmask train: error: cannot write {out}: No space left on device" in err, err
    assert "Traceback" not in err
    # the Trainer made the (empty) folder; no model file, no partial folder beside or inside it
    assert listing(out) == {} and sorted(p.name for p in tmp_path.iterdir()) == ["out", "pairs.jsonl"]
    monkeypatch.undo()
    assert cli(argv) == 0  # nothing in the way
    names = set(listing(out))
    assert {"model.safetensors", "config.json", "retmask_train.json"} <= names
    assert not any(n.startswith(".") for n in names)


def test_mudaf_write_failure_keeps_resume_checkpoint(
    tmp_path, mdqa_examples, bpe_tokenizer, monkeypatch, capsys
):
    """A real failing write (a 16 KB file-size limit: safetensors raises its own error, not OSError) keeps
    the run's resume.pt; the same command with --resume then finishes."""
    folder = tmp_path / "tiny"
    tiny_llama_for(bpe_tokenizer).save_pretrained(folder)
    bpe_tokenizer.save_pretrained(folder)
    data = write_mdqa(mdqa_examples[:4], tmp_path / "train.jsonl")
    out = tmp_path / "run"
    argv = ["mudaf-train", "--data", str(data), "--model", str(folder), "--out", str(out), "--vanilla-sft",
            "--steps", "2", "--batch-size", "2", "--lr", "1e-4", "--save-every", "1", "--no-progress"]  # fmt: skip
    real = transformers.PreTrainedModel.save_pretrained

    def small_disk(self, *args, **kwargs):
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, limit[1]))
        try:
            return real(self, *args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            signal.signal(signal.SIGXFSZ, handler)

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", small_disk)
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert f"retmask mudaf-train: error: cannot write {out}: File too large" in err, err
    assert torch.load(out / "resume.pt", map_location="cpu", weights_only=True)["step"] == 1
    assert set(listing(out)) == {"resume.pt"}  # no model file, no record, no hidden partial folder
    monkeypatch.undo()
    assert cli([*argv, "--resume"]) == 0
    assert read_record(out)["steps"] == 2 and [r["step"] for r in read_record(out)["log"]] == [1, 2]
    assert (out / "model.safetensors").is_file() and not (out / "resume.pt").exists()


def test_mudaf_resume_checkpoint_write_failure_keeps_the_previous_one(
    tmp_path, mdqa_examples, bpe_tokenizer, monkeypatch
):
    """torch.save hitting a file-size limit (its zip writer raises a bare RuntimeError) is ``cannot write
    .../resume.pt: File too large``; the checkpoint of the step before stays, no temporary file is left."""
    from retmask.methods.mudaf.train import MuDAFConfig, train_mudaf

    real, calls = torch.save, {"n": 0}

    def save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            return real(*args, **kwargs)
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, limit[1]))
        try:
            return real(*args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            signal.signal(signal.SIGXFSZ, handler)

    monkeypatch.setattr(torch, "save", save)
    out = tmp_path / "run"
    cfg = MuDAFConfig(heads=[], vanilla_sft=True, learning_rate=1e-4, max_steps=3, batch_size=2, save_every=1)
    model = tiny_llama_for(bpe_tokenizer)
    with pytest.raises(OutputWriteError, match=f"cannot write {out / 'resume.pt'}: File too large"):
        train_mudaf(model, bpe_tokenizer, mdqa_examples[:4], out, cfg, progress=False)
    monkeypatch.undo()
    assert set(listing(out)) == {"resume.pt"}
    assert torch.load(out / "resume.pt", map_location="cpu", weights_only=True)["step"] == 1


@pytest.fixture
def earlier(tmp_path: Path) -> Path:
    """An output folder holding a run's telemetry and an earlier model that the new one replaces."""
    out = tmp_path / "out"
    out.mkdir()
    for name, text in [("telemetry.json", "t"), ("config.json", "old config"), ("model.safetensors", "old")]:
        (out / name).write_text(text)
    return out


def _write_model(folder: Path) -> None:
    for name, text in [
        ("model.safetensors", "new"),
        ("config.json", "new config"),
        ("tokenizer.json", "tok"),
    ]:
        (folder / name).write_text(text)
    atomic_write_json(folder / "summary.json", {"done": True})


def test_staged_save_replaces_the_model_and_keeps_other_files(earlier):
    with staged_model_save(earlier, last=("summary.json",)) as staged:
        assert staged.parent == earlier  # same file system as the destination: moves are renames
        _write_model(staged)
    assert listing(earlier) == {
        "telemetry.json": b"t", "config.json": b"new config", "model.safetensors": b"new", "tokenizer.json": b"tok",
        "summary.json": b'{"done": true}',
    }  # fmt: skip


def test_staged_save_removes_the_hidden_folder_a_killed_save_left(earlier, capsys):
    """kill -9 during a save leaves its model-sized hidden folder; the next save (under the run's lock)
    removes it, and only such folders."""
    dead = earlier / ".model-partial-abc123"
    dead.mkdir()
    (dead / "model.safetensors").write_text("half")
    (earlier / ".model-partial-note.txt").write_text("a file of the user's, not a save folder")
    with staged_model_save(earlier, last=("summary.json",)) as staged:
        _write_model(staged)
    assert not dead.exists() and (earlier / ".model-partial-note.txt").exists()
    assert f"removed 1 unfinished model save(s) of a killed run from {earlier}" in capsys.readouterr().err
    assert not [p for p in earlier.iterdir() if p.name.startswith(".model-partial-") and p.is_dir()]


def test_staged_save_failures_leave_the_folder_as_it_was(earlier, tmp_path, monkeypatch):
    before = listing(earlier)
    with pytest.raises(OutputWriteError, match=f"cannot write {earlier}: No space left on device"):
        with staged_model_save(earlier) as staged:
            (staged / "model.safetensors").write_text("half")
            raise ENOSPC
    assert listing(earlier) == before
    # a write inside names the output folder, not the hidden one
    with pytest.raises(OutputWriteError) as err:
        with staged_model_save(earlier) as staged:
            atomic_write_json(staged / ("x" * 300 + ".json"), {})
    assert str(err.value).startswith(f"cannot write {earlier}/xxx") and ".model-partial" not in str(err.value)
    assert listing(earlier) == before
    # the third rename into place fails (e.g. a full directory): the two done are undone
    real, calls = training_guards.os.rename, {"n": 0}

    def rename(src, dst):
        if Path(dst).parent == earlier and not Path(src).parent.name == ".replaced":
            calls["n"] += 1
            if calls["n"] == 3:
                raise ENOSPC
        return real(src, dst)

    monkeypatch.setattr(training_guards.os, "rename", rename)
    with pytest.raises(OutputWriteError, match="No space left on device"):
        with staged_model_save(earlier, last=("summary.json",)) as staged:
            _write_model(staged)
    monkeypatch.undo()
    assert calls["n"] >= 3 and listing(earlier) == before
    # a folder created for the save is removed again when the save fails
    fresh = tmp_path / "fresh" / "model"
    with pytest.raises(OutputWriteError):
        with staged_model_save(fresh) as staged:
            raise ENOSPC
    assert not fresh.exists()


@pytest.mark.parametrize(
    "failure",
    [ENOSPC, RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")],
    ids=["oserror", "safetensors"],
)
def test_export_write_failure_is_a_message_and_leaves_nothing(tmp_path, monkeypatch, failure):
    model = tiny_llama()

    def full(self, *args, **kwargs):
        raise failure

    monkeypatch.setattr(type(model), "save_pretrained", full)
    out = tmp_path / "masked"
    with pytest.raises(OutputWriteError, match=f"cannot write {out}: No space left on device"):
        retmask.export_masked(model, [(0, 1)], out)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert (retmask.export_masked(model, [(0, 1)], out) / "config.json").is_file()  # a rerun is not blocked


def test_outputs_are_checked_before_the_model_loads(pairs_file, tmp_path, capsys):
    taken = tmp_path / "a-file"
    taken.write_text("not a folder")
    missing = str(tmp_path / "no-such-model")  # loading it would fail: the output check comes first
    assert cli(["train", "--pairs", str(pairs_file), "--model", missing, "--out", str(taken)]) == 2
    assert (
        "--out" in (err := capsys.readouterr().err) and "existing file" in err and "no-such-model" not in err
    )
    data = tmp_path / "train.jsonl"
    data.write_text("")
    assert (
        cli(["mudaf-train", "--data", str(data), "--model", missing, "--out", str(taken), "--vanilla-sft"])
        == 2
    )
    assert (
        "--out" in (err := capsys.readouterr().err) and "existing file" in err and "no-such-model" not in err
    )
    with pytest.raises(RunFileError, match="output folder .* is an existing file"):
        train_dpo(pairs_file, taken, missing)
