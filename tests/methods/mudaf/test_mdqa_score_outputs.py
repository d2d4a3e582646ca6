"""`retmask mdqa-score --masses`: the .npz is written atomically, a full disk is one line naming it (the
scores, the record and the scored examples stay, so --resume finishes), and an existing .npz is checked
up front like the command's other outputs."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import retmask
import retmask.runfiles as runfiles
from retmask.cli import main as cli_main
from retmask.methods.mudaf.mdqa import write_mdqa
from retmask.methods.mudaf.score_progress import progress_dir
from tests.tiny import tiny_llama_for


@pytest.fixture
def command(tmp_path, mdqa_examples, bpe_tokenizer):
    folder = tmp_path / "tiny"
    tiny_llama_for(bpe_tokenizer).save_pretrained(folder)
    bpe_tokenizer.save_pretrained(folder)
    data = write_mdqa(mdqa_examples[:3], tmp_path / "mdqa.jsonl")

    def run(out, *extra):
        return cli_main(["mdqa-score", "--data", str(data), "--model", str(folder), "--out", str(out),
                         "--batch-size", "2", "--no-progress", *extra])  # fmt: skip

    return run


def test_full_disk_on_the_masses_file_is_one_line_and_resume_finishes(tmp_path, command, monkeypatch, capsys):
    out, npz = tmp_path / "scores.json", tmp_path / "scores.masses.npz"
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "masses.npz" in os.fspath(path) and "w" in mode:
            f.close()  # the temporary file exists, its bytes do not fit
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return f

    with monkeypatch.context() as m:
        m.setattr(runfiles, "open", full_disk, raising=False)
        assert command(out, "--masses") == 2
    err = capsys.readouterr().err
    assert f"retmask mdqa-score: error: cannot write {npz}: No space left on device" in err
    assert "Traceback" not in err
    assert not npz.exists() and not [p.name for p in tmp_path.iterdir() if "masses" in p.name]  # no temp left
    assert out.is_file() and (tmp_path / "scores.run.json").is_file()  # written before it: kept
    assert progress_dir(out).is_dir()  # the scored examples too

    assert command(out, "--masses", "--resume") == 0
    assert "3 scored by the interrupted run" in capsys.readouterr().out
    assert np.load(npz)["masses_0"].shape[:2] == (2, 4)
    assert not progress_dir(out).exists()


def test_an_existing_masses_file_is_checked_before_any_work(tmp_path, command, monkeypatch, capsys):
    out, npz = tmp_path / "scores.json", tmp_path / "scores.masses.npz"
    npz.write_bytes(b"an earlier run's masses")
    with monkeypatch.context() as m:
        m.setattr(retmask, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
        assert command(out, "--masses") == 2
        assert f"{npz} already exists; pass --overwrite to replace it" in capsys.readouterr().err
        npz.unlink()
        npz.mkdir()
        assert command(out, "--masses") == 2
        assert f"--masses file {npz} is a folder" in capsys.readouterr().err
        npz.rmdir()
    npz.write_bytes(b"an earlier run's masses")
    assert command(out) == 0  # without --masses the file is not this run's: left alone
    assert npz.read_bytes() == b"an earlier run's masses"
    assert command(out, "--masses", "--overwrite") == 0
    assert np.load(npz)["masses_0"].shape[:2] == (2, 4)


def test_the_progress_folder_appears_with_its_settings(tmp_path, monkeypatch):
    """A kill between creating the progress folder and writing its settings left a folder that blocked
    both a plain rerun and --resume; the folder now appears whole, settings inside, or not at all."""
    import numpy as np

    import retmask.methods.mudaf.score_progress as score_progress

    progress = score_progress.ScoreProgress(tmp_path / "s.json", {"model": "m"})
    real = score_progress.atomic_write_json

    def killed(path, obj, **kw):
        if path.name == "settings.json":
            raise KeyboardInterrupt
        return real(path, obj, **kw)

    with monkeypatch.context() as m:
        m.setattr(score_progress, "atomic_write_json", killed)
        with pytest.raises(KeyboardInterrupt):
            progress.save(0, "ex0", np.zeros((1, 1, 2), dtype=np.float32))
    assert list(tmp_path.iterdir()) == []
    progress.save(0, "ex0", np.zeros((1, 1, 2), dtype=np.float32))
    assert sorted(p.name for p in score_progress.progress_dir(tmp_path / "s.json").iterdir()) == [
        "0.json",
        "settings.json",
    ]
    assert progress.resume()[0][0] == "ex0"
