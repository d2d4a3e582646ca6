"""`retmask pipeline` outputs and up-front checks, without a model run: the copy of --scores is atomic and a
full disk names it."""

from __future__ import annotations

import errno
import json
import os

import pytest

import retmask.runfiles as runfiles
from retmask.cli import main as cli


@pytest.fixture
def scores(tmp_path):
    """A scores file of 2 x 4 heads (the pipeline reads only the model's config for its shape), with the
    run record a detection writes next to it."""
    path = tmp_path / "good.json"
    path.write_text(
        json.dumps({f"{a}-{b}": [0.5 if (a, b) == (1, 2) else 0.1 * b] for a in range(2) for b in range(4)})
    )
    (tmp_path / "good.run.json").write_text(json.dumps({"tests_counted": 1}))
    return path


def pipeline(run_dir, *extra):
    return cli(["pipeline", "--run-dir", str(run_dir), "--no-progress", *extra])


def test_the_scores_copy_is_atomic_and_a_full_disk_names_it(tmp_path, scores, monkeypatch, capsys):
    run_dir = tmp_path / "P0"
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if os.path.basename(os.path.dirname(path)) == "detect" and "w" in mode:
            f.close()  # the temporary file exists, the scores do not fit
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return f

    with monkeypatch.context() as m:
        m.setattr(runfiles, "open", full_disk, raising=False)
        assert pipeline(run_dir, "--scores", str(scores), "--stop-after", "detect") == 2
    err = capsys.readouterr().err
    out = run_dir / "detect" / "scores.json"
    assert f"retmask pipeline: error: cannot write {out}: No space left on device" in err
    assert "Traceback" not in err and str(scores) not in err
    assert list((run_dir / "detect").iterdir()) == []  # no torn copy, no temporary file

    assert pipeline(run_dir, "--scores", str(scores), "--stop-after", "detect") == 0
    assert out.read_text() == scores.read_text()
    assert (run_dir / "detect" / "scores.run.json").read_text() == (tmp_path / "good.run.json").read_text()
