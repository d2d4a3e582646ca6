"""retmask train --save-every / --resume: an interrupted DPO run continues from its newest checkpoint to the
uninterrupted run's weights, losses and telemetry; what cannot be resumed is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import trl

from retmask.cli import main as cli

from .test_train import weights


def _argv(tiny_dir, pairs, out, *extra: str) -> list[str]:
    return ["train", "--pairs", str(pairs), "--model", str(tiny_dir), "--out", str(out), "--max-steps", "4",
            "--batch-size", "1", "--grad-accum", "1", "--lr", "1e-2", "--max-length", "128", "--save-every", "2",
            "--telemetry-every", "2", *extra]  # fmt: skip


def _history(out) -> list[dict]:
    """The telemetry probes, less their wall times."""
    history = json.loads((out / "telemetry.json").read_text())["history"]
    return [{k: v for k, v in h.items() if k != "probe_seconds"} for h in history]


def test_interrupted_training_resumes_to_the_uninterrupted_result(
    tiny_dir,
    pairs_with_heads,
    tmp_path,
    capsys,
    monkeypatch,
):
    ref = tmp_path / "ref"
    assert cli(_argv(tiny_dir, pairs_with_heads, ref)) == 0
    assert not list(ref.glob("checkpoint-*")) and not (ref / "train_settings.json").exists()  # run complete
    capsys.readouterr()

    # Ctrl-C in the 4th step: steps 1-3 done, the checkpoint of step 2 on disk
    out = tmp_path / "out"
    real_step, calls = trl.DPOTrainer.training_step, []

    def training_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(trl.DPOTrainer, "training_step", training_step)
        assert cli(_argv(tiny_dir, pairs_with_heads, out)) == 130
    assert "continue with the same command plus --resume" in capsys.readouterr().err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert (out / "train_settings.json").is_file() and not (out / "model.safetensors").exists()
    # a checkpoint torn while its trainer_state.json was written (the bare-folder case: the unit test below)
    (out / "checkpoint-4").mkdir()
    (out / "checkpoint-4" / "trainer_state.json").write_text('{"global_step": 4, "log_hi')

    assert cli(_argv(tiny_dir, pairs_with_heads, out)) == 2  # neither --resume nor --overwrite
    assert "holds the checkpoints of an unfinished training; pass --resume" in capsys.readouterr().err
    assert cli(_argv(tiny_dir, pairs_with_heads, out, "--resume", "--lr", "2e-2")) == 2
    assert "other settings (learning_rate: 0.01 -> 0.02)" in capsys.readouterr().err

    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(
            trl.DPOTrainer, "training_step", lambda self, *a, **k: calls.append(1) or real_step(self, *a, **k)
        )
        # activation checkpointing does not change the result: a resume may switch it on
        assert cli(_argv(tiny_dir, pairs_with_heads, out, "--resume", "--gradient-checkpointing")) == 0
    printed = capsys.readouterr()
    assert f"resuming from {out / 'checkpoint-2'}" in printed.out
    assert f"passing over {out / 'checkpoint-4'}: checkpoint state file" in printed.err
    assert "is not valid JSON" in printed.err and printed.err.count("passing over") == 1
    assert len(calls) == 2  # steps 3 and 4 only
    want, got = weights(ref), weights(out)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
    summary = {d: json.loads((d / "retmask_train.json").read_text()) for d in (ref, out)}
    assert summary[out]["steps"] == 4
    # the time is the resumed run's own, over its own steps, and says so
    assert (summary[ref]["resumed_from_step"], summary[out]["resumed_from_step"]) == (0, 2)
    assert "DPO: 4 steps, 2 of them in this run (resumed at step 2)" in printed.out
    assert summary[out]["seconds_per_step"] == pytest.approx(summary[out]["seconds"] / 2, abs=0.01)
    assert summary[out]["losses"] == pytest.approx(summary[ref]["losses"], rel=1e-5)
    # the probes of steps 0 and 2 come from the checkpoint's log, step 4's from the resumed run
    assert [h["step"] for h in _history(out)] == [0, 2, 4]
    assert _history(out) == pytest.approx(_history(ref), rel=1e-5)
    assert not list(out.glob("checkpoint-*")) and not (out / "train_settings.json").exists()


@pytest.mark.parametrize("steps", ["2", "4"], ids=["mid-epoch", "epoch-end"])
def test_resume_from_the_last_steps_checkpoint_trains_no_further(
    tiny_dir, pairs_with_heads, tmp_path, capsys, monkeypatch, steps
):
    """Killed after the checkpoint of the last step (here: while the model is saved), the resume saves that
    checkpoint's weights: no step past --max-steps (the Trainer ran one more mid-epoch) and no train_loss of
    0.0 over no steps (at an epoch's end)."""
    from retmask.methods.retmask import dpo

    ref = tmp_path / "ref"
    assert cli(_argv(tiny_dir, pairs_with_heads, ref, "--max-steps", steps)) == 0
    out = tmp_path / "out"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(dpo, "staged_model_save", killed)
        assert cli(_argv(tiny_dir, pairs_with_heads, out, "--max-steps", steps)) == 130
    assert (out / f"checkpoint-{steps}" / "trainer_state.json").is_file()
    assert not (out / "model.safetensors").exists()
    capsys.readouterr()

    real_step, calls = trl.DPOTrainer.training_step, []
    with monkeypatch.context() as m:
        m.setattr(
            trl.DPOTrainer, "training_step", lambda self, *a, **k: calls.append(1) or real_step(self, *a, **k)
        )
        assert cli(_argv(tiny_dir, pairs_with_heads, out, "--max-steps", steps, "--resume")) == 0
    assert calls == []
    printed = capsys.readouterr().out
    assert f"DPO: {steps} steps, 0 of them in this run (resumed at step {steps})" in printed
    assert f"checkpoint-{steps} is the planned last step ({steps})" in printed
    want, got = weights(ref), weights(out)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    summary = {d: json.loads((d / "retmask_train.json").read_text()) for d in (ref, out)}
    assert summary[out]["steps"] == summary[out]["resumed_from_step"] == int(steps)
    assert summary[out]["seconds_per_step"] == 0
    assert summary[out]["losses"] == pytest.approx(summary[ref]["losses"], rel=1e-5)
    assert not any("train_loss" in h for h in summary[out]["log_history"])  # not recomputed: not claimed
    assert _history(out) == pytest.approx(_history(ref), rel=1e-5)
    assert (out / "telemetry.png").is_file()
    assert not list(out.glob("checkpoint-*")) and not (out / "train_settings.json").exists()


def test_resume_without_a_checkpoint_is_refused(tiny_dir, pairs_with_heads, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli(_argv(tiny_dir, pairs_with_heads, out, "--resume")) == 2
    assert "holds no complete checkpoint to continue from" in capsys.readouterr().err
    assert cli(_argv(tiny_dir, pairs_with_heads, out, "--resume", "--overwrite")) == 2
    assert "--resume and --overwrite exclude each other" in capsys.readouterr().err


def test_a_run_stopped_before_its_first_checkpoint_resumes_from_step_0(
    tiny_dir, pairs_with_heads, tmp_path, capsys, monkeypatch
):
    """Ctrl-C before the first checkpoint leaves the run's settings file alone: --resume, as the interruption
    says, starts the same run over from step 0 (it used to be refused, and a plain rerun too)."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    steps = ("--max-steps", "2")
    assert cli(_argv(tiny_dir, pairs_with_heads, ref, *steps)) == 0
    capsys.readouterr()

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(trl.DPOTrainer, "training_step", interrupted)
        assert cli(_argv(tiny_dir, pairs_with_heads, out, *steps)) == 130
    assert "continue with the same command plus --resume" in capsys.readouterr().err
    assert (out / "train_settings.json").is_file() and not list(out.glob("checkpoint-*"))
    assert cli(_argv(tiny_dir, pairs_with_heads, out, *steps)) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert cli(_argv(tiny_dir, pairs_with_heads, out, *steps, "--resume", "--lr", "2e-2")) == 2
    assert "other settings (learning_rate: 0.01 -> 0.02)" in capsys.readouterr().err
    assert cli(_argv(tiny_dir, pairs_with_heads, out, *steps, "--resume")) == 0
    assert "stopped before its first checkpoint: training starts from step 0" in capsys.readouterr().err
    want, got = weights(ref), weights(out)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
    assert not (out / "train_settings.json").exists()


def test_checkpoints_in_step_order_and_cut_off_ones_passed_over(tmp_path, capsys):
    from retmask.methods import checkpoints

    assert checkpoints.checkpoints(tmp_path / "absent") == [] and not checkpoints.has_run_files(tmp_path)
    for step, complete in ((9, True), (10, True), (11, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()  # not the Trainer's name: ignored
    assert [p.name for p in checkpoints.checkpoints(tmp_path)] == [
        "checkpoint-9",
        "checkpoint-10",
    ]  # not by text
    assert checkpoints.has_run_files(tmp_path)
    with pytest.raises(ValueError, match="holds no complete checkpoint"):  # no settings file: not ours
        checkpoints.resume_point(tmp_path, {"mode": "dpo"}, ValueError)
    checkpoints.start(tmp_path, {"mode": "dpo", "seed": 0})
    assert checkpoints.resume_point(tmp_path, {"mode": "dpo", "seed": 0}, ValueError).name == "checkpoint-10"
    with pytest.raises(ValueError, match=r"other settings \(seed: 0 -> 1\)"):
        checkpoints.resume_point(tmp_path, {"mode": "dpo", "seed": 1}, ValueError)

    # a trainer_state.json that does not parse (torn, empty, not an object): passed over, the newer ones named
    for step, text in ((8, ""), (12, '{"global_step": 1'), (13, ""), (14, "[1]")):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(text)
    assert [p.name for p in checkpoints.checkpoints(tmp_path)] == ["checkpoint-9", "checkpoint-10"]
    capsys.readouterr()
    assert checkpoints.resume_point(tmp_path, {"mode": "dpo", "seed": 0}, ValueError).name == "checkpoint-10"
    warned = capsys.readouterr().err.splitlines()
    assert [line.split(": checkpoint state file")[0] for line in warned] == [
        f"retmask train: warning: passing over {tmp_path / f'checkpoint-{step}'}" for step in (12, 13, 14)
    ]  # one line each; checkpoint-8 is older than the one used
    assert "is not valid JSON (Expecting value: line 1 column 1 (char 0))" in warned[1]
    assert warned[2].endswith("holds a list, not an object; resuming from checkpoint-10")
    for step in (9, 10):
        shutil.rmtree(tmp_path / f"checkpoint-{step}")
    with pytest.raises(
        ValueError, match=r"no complete checkpoint .*; checkpoint-8 is passed over: .*not valid JSON"
    ):
        checkpoints.resume_point(tmp_path, {"mode": "dpo", "seed": 0}, ValueError)
    checkpoints.clear(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-x"]
