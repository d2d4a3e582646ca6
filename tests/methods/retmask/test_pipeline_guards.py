"""`retmask pipeline` outputs and up-front checks, without a model run (--scores, the later stages stubbed):
the copy of --scores is atomic and a full disk names it; a stage recorded with other settings is refused
before any work, naming what changed, and redone from there with --overwrite; flags that would fail late or
be ignored are refused up front."""

from __future__ import annotations

import errno
import json
import os

import pytest

import retmask.runfiles as runfiles
from retmask.cli import main as cli
from retmask.methods.retmask.pipeline import Pipeline, PipelineConfig, StageSettingsChanged, run_pipeline


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


def test_a_stage_run_with_other_settings_is_refused_before_any_work(tmp_path, scores, capsys):
    run_dir = tmp_path / "P0"
    argv = ["--scores", str(scores), "--stop-after", "mask"]
    assert pipeline(run_dir, *argv, "--top-k", "1") == 0
    (run_dir / "mask" / "notes.txt").write_text("mine")
    heads = (run_dir / "mask" / "heads.json").read_text()
    state = (run_dir / "pipeline.json").read_text()
    capsys.readouterr()

    assert pipeline(run_dir, *argv, "--top-k", "2") == 2
    err = capsys.readouterr().err
    assert (
        f"retmask pipeline: error: the mask stage of {run_dir} was run with other settings (top_k: 1 -> 2); "
        f"running it again deletes {run_dir / 'mask'}; pass --overwrite to run the pipeline again from mask, "
        "or choose a new --run-dir" in err
    )
    assert (run_dir / "mask" / "notes.txt").read_text() == "mine"  # nothing touched
    assert (run_dir / "mask" / "heads.json").read_text() == heads
    assert (run_dir / "pipeline.json").read_text() == state

    # --overwrite: from the changed stage on; the detection, whose settings did not change, is kept
    assert pipeline(run_dir, *argv, "--top-k", "2", "--overwrite") == 0
    printed = capsys.readouterr().out
    assert "[pipeline] detect: up to date" in printed and "[pipeline] mask: running" in printed
    assert json.loads((run_dir / "mask" / "heads.json").read_text())["num_heads"] == 2
    assert not (run_dir / "mask" / "notes.txt").exists()

    # a stage folder pipeline.json does not know of (the file removed) is not deleted unasked either
    (run_dir / "pipeline.json").unlink()
    assert pipeline(run_dir, *argv, "--top-k", "2") == 2
    assert (
        f"the detect stage of {run_dir} holds files that {run_dir / 'pipeline.json'} records no run of"
        in (capsys.readouterr().err)
    )
    assert pipeline(run_dir, *argv, "--top-k", "2", "--overwrite") == 0


def stub_later_stages(monkeypatch):
    """generate, train and eval write their outputs only (no model)."""

    def stub(name):
        def run(self, resume):
            for path in self.outputs(name):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(name)

        return run

    for name in ("generate", "train", "eval"):
        monkeypatch.setattr(Pipeline, f"_{name}", stub(name))


def test_a_trained_model_is_not_deleted_unasked(tmp_path, scores, monkeypatch):
    stub_later_stages(monkeypatch)
    run_dir = tmp_path / "P0"
    cfg = PipelineConfig(scores=str(scores), threshold=None, top_k=1)
    quiet = dict(progress=False, log=lambda *a: None)
    run_pipeline(cfg, run_dir, **quiet)
    model = run_dir / "train" / "model" / "retmask_train.json"
    assert model.read_text() == "train"

    with pytest.raises(StageSettingsChanged) as err:
        run_pipeline(PipelineConfig(scores=str(scores), threshold=None, top_k=1, lr=1e-6), run_dir, **quiet)
    assert "the train stage of" in str(err.value) and "lr: 5e-07 -> 1e-06" in str(err.value)
    assert f"deletes {run_dir / 'train'}, {run_dir / 'eval'};" in str(err.value)
    assert model.read_text() == "train"

    # an earlier stage redone with --overwrite up to mask: the later ones' inputs changed, still refused
    other = PipelineConfig(scores=str(scores), threshold=None, top_k=2)
    run_pipeline(other, run_dir, stop_after="mask", overwrite=True, **quiet)
    with pytest.raises(StageSettingsChanged, match="the generate stage of .* was run with the same settings, but "
                       "before an earlier stage ran with other ones"):  # fmt: skip
        run_pipeline(other, run_dir, **quiet)
    assert model.read_text() == "train"
    logs: list[str] = []
    run_pipeline(other, run_dir, progress=False, log=logs.append, overwrite=True)
    assert [s for s in logs if "running" in s] == [
        f"[pipeline] {s}: running" for s in ("generate", "train", "eval")
    ]


def test_inputs_that_would_fail_late_or_be_ignored_are_refused_up_front(tmp_path, scores, capsys):
    run_dir = tmp_path / "P0"
    base = ["--scores", str(scores), "--top-k", "1"]

    assert pipeline(run_dir, *base, "--instructions", str(tmp_path / "nope.jsonl")) == 2
    err = capsys.readouterr().err
    assert (
        f"retmask pipeline: error: --instructions: instruction file {tmp_path / 'nope.jsonl'} does not exist"
        in err
    )
    assert not run_dir.exists()  # before the detection (here: the copy of --scores)

    no_reference = tmp_path / "plain.jsonl"
    no_reference.write_text(json.dumps({"id": "a", "prompt": "Say hi."}) + "\n")
    assert pipeline(run_dir, *base, "--baseline", "win-lose", "--instructions", str(no_reference)) == 2
    err = capsys.readouterr().err
    assert (
        f"--baseline win-lose judges samples against the instructions' reference answers, and {no_reference} has none"
        in err
    )
    assert not run_dir.exists()  # it used to fail at the generate stage, after the detection

    cache = tmp_path / "cache"
    cache.write_text("a file")
    assert pipeline(run_dir, *base, "--stop-after", "mask", "--eval-cache", str(cache)) == 2
    err = capsys.readouterr().err
    assert (
        f"retmask pipeline: error: --eval-cache {cache} is an existing file, not a folder; choose a folder"
        in err
    )
    assert not run_dir.exists()

    for flags, named in ((["--protocol", "default"], "--protocol sets"),
                         (["--detect-lengths", "2", "--detect-min-len", "500"], "--detect-min-len and --detect-lengths set")):  # fmt: skip
        assert pipeline(run_dir, *base, "--stop-after", "mask", *flags) == 2
        err = capsys.readouterr().err
        assert f"retmask pipeline: error: {named} up the detection, which --scores replaces" in err
        assert "drop --scores to detect the heads with" in err
    assert not run_dir.exists()

    # the instructions are read only by a run that reaches generate; the protocol's default still applies
    assert (
        pipeline(run_dir, *base, "--stop-after", "mask", "--instructions", str(tmp_path / "nope.jsonl")) == 0
    )
    assert json.loads((run_dir / "pipeline.json").read_text())["config"]["protocol"] == "default"


def test_a_top_k_over_the_model_folders_heads_is_refused_before_the_detection(tiny_dir, tmp_path, capsys):
    run_dir = tmp_path / "P"
    assert pipeline(run_dir, "--model", str(tiny_dir), "--top-k", "9") == 2  # 2 layers x 4 heads
    assert f"--top-k 9 is more than the 8 heads of {tiny_dir}; lower --top-k" in capsys.readouterr().err
    assert not run_dir.exists()
    with pytest.raises(SystemExit):  # parse time, any model
        pipeline(run_dir, "--top-k", "65537")
    assert "argument --top-k: 65537 is out of range" in capsys.readouterr().err


def test_a_stage_that_failed_before_writing_anything_is_not_in_the_way(tmp_path, scores, capsys):
    """The mask stage fails (no head reaches the threshold) and writes nothing: the rerun with another
    threshold runs it without --overwrite, and keeps the detection."""
    run_dir = tmp_path / "P"
    assert pipeline(run_dir, "--scores", str(scores), "--threshold", "0.9", "--stop-after", "mask") == 2
    assert "no head has a retrieval score >= 0.9" in capsys.readouterr().err
    assert pipeline(run_dir, "--scores", str(scores), "--threshold", "0.3", "--stop-after", "mask") == 0
    out = capsys.readouterr().out
    assert "[pipeline] detect: up to date" in out and "[pipeline] mask: running" in out
    assert json.loads((run_dir / "mask" / "heads.json").read_text())["heads"] == [[1, 2], [0, 3], [1, 3]]
