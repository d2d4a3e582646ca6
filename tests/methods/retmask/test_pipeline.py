"""retmask pipeline on a tiny model: all stages, artefacts in the run dir, resume after crashes, reuse."""

from __future__ import annotations

import json

import pytest

import retmask.methods.retmask.generate as contrastive
from retmask.cli import main as cli
from retmask.methods.retmask.generate import read_pairs
from retmask.methods.retmask.pipeline import Pipeline, PipelineConfig, run_pipeline, stratified
from retmask.methods.retmask.pipeline_config import STAGES

TINY = dict(detect_min_len=300, detect_max_len=300, detect_lengths=1, detect_depths=2, threshold=None, top_k=2,
            num_instructions=4, gen_max_new_tokens=8, gen_batch_size=2, max_steps=2, batch_size=2, grad_accum=1,
            max_length=256, lr=1e-3, telemetry_every=1, eval_min_len=300, eval_max_len=400, eval_lengths=2,
            eval_depths=2, eval_needles=1)  # fmt: skip


class Crash(RuntimeError):
    pass


def stages_run(logs):
    return [
        s.split()[1].rstrip(":")
        for s in logs
        if s.startswith("[pipeline]") and (" running" in s or " resuming" in s)
    ]


def test_training_stage_continues_from_its_checkpoint(tiny_dir, tmp_path, monkeypatch):
    """--save-every 1: a crash in the 2nd of 2 training steps; the rerun continues the training stage from
    checkpoint-1 (one step run) instead of starting it over, and leaves no checkpoint behind."""
    import trl

    run_dir = tmp_path / "run"
    cfg = PipelineConfig(model=str(tiny_dir), **{**TINY, "save_every": 1})
    monkeypatch.setattr("retmask.detect.run.RECALL_THRESHOLD", -1.0)  # see the test below
    real_step, steps = trl.DPOTrainer.training_step, []

    def training_step(self, *args, **kwargs):
        steps.append(1)
        if len(steps) == 2:
            raise Crash("simulated crash in the second training step")
        return real_step(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(trl.DPOTrainer, "training_step", training_step)
        with pytest.raises(Crash):
            run_pipeline(cfg, run_dir, progress=False, log=lambda *a: None, stop_after="train")
    model_dir = run_dir / "train" / "model"
    assert sorted(p.name for p in model_dir.glob("checkpoint-*")) == ["checkpoint-1"]

    steps.clear()
    logs: list[str] = []
    with monkeypatch.context() as m:
        m.setattr(
            trl.DPOTrainer, "training_step", lambda self, *a, **k: steps.append(1) or real_step(self, *a, **k)
        )
        run_pipeline(cfg, run_dir, progress=False, log=logs.append, stop_after="train")
    assert stages_run(logs) == ["train"] and "[pipeline] train: continuing from checkpoint-1" in logs
    assert len(steps) == 1
    assert json.loads((model_dir / "retmask_train.json").read_text())["steps"] == 2
    assert not list(model_dir.glob("checkpoint-*"))


def test_pipeline_runs_all_stages_and_resumes_after_crashes(tiny_dir, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    cfg = PipelineConfig(model=str(tiny_dir), **TINY)
    # A random model retrieves no needle and a detection with no counted test is an error: count every
    # answer, so the stages after detect have scores to work with (only the mechanics are tested here).
    monkeypatch.setattr("retmask.detect.run.RECALL_THRESHOLD", -1.0)

    # 1) crash in the middle of generation (after its first batch is committed)
    real = contrastive.contrast_batch
    calls = []

    def flaky(batch, *a, **k):
        calls.append(len(batch))
        if len(calls) == 2:
            raise Crash("simulated crash in generate")
        return real(batch, *a, **k)

    monkeypatch.setattr(contrastive, "contrast_batch", flaky)
    logs: list[str] = []
    with pytest.raises(Crash):
        run_pipeline(cfg, run_dir, progress=False, log=logs.append)
    state = json.loads((run_dir / "pipeline.json").read_text())
    assert [state["stages"][s]["status"] for s in ("detect", "mask", "generate")] == [
        "done",
        "done",
        "running",
    ]
    assert stages_run(logs) == ["detect", "mask", "generate"]

    # 2) crash between stages: generation resumes (first batch kept), training fails
    monkeypatch.setattr(contrastive, "contrast_batch", real)
    monkeypatch.setattr(
        Pipeline, "_train", lambda self, resume: (_ for _ in ()).throw(Crash("crash in train"))
    )
    logs.clear()
    with pytest.raises(Crash):
        run_pipeline(cfg, run_dir, progress=False, log=logs.append)
    assert stages_run(logs) == ["generate", "train"] and "[pipeline] generate: resuming" in logs
    stats = json.loads((run_dir / "generate" / "pairs.stats.json").read_text())
    rows = read_pairs(run_dir / "generate" / "pairs.jsonl")
    assert stats["pairs"] + sum(stats["dropped"].values()) == 4  # nothing lost, nothing repeated
    assert len({r["id"] for r in rows}) == len(rows) == stats["pairs"]

    # 3) the rest runs; the finished stages are skipped
    monkeypatch.undo()
    logs.clear()
    state = run_pipeline(cfg, run_dir, progress=False, log=logs.append)
    assert stages_run(logs) == ["train", "eval"]
    for f in ("detect/scores.json", "detect/scores.run.json", "mask/heads.json", "mask/retrieval_heads.json",
              "generate/pairs.jsonl", "train/model/config.json", "train/model/telemetry.json",
              "train/model/telemetry.png", "eval/report.md", "eval/eval.json", "eval/niah.png", "eval/shift.png"):  # fmt: skip
        assert (run_dir / f).exists(), f
    assert all(
        state["stages"][s]["status"] == "done" and state["stages"][s]["seconds"] >= 0 for s in state["stages"]
    )
    heads = json.loads((run_dir / "mask" / "heads.json").read_text())
    assert heads["num_heads"] == 2 and heads["method"] == "top-k"
    ev = json.loads((run_dir / "eval" / "eval.json").read_text())
    assert [m["label"] for m in ev["models"]] == ["original", "retmask-dpo"]
    assert ev["models"][0]["fingerprint"] != ev["models"][1]["fingerprint"]  # training changed the weights
    assert json.loads((run_dir / "train" / "model" / "retmask_train.json").read_text())["steps"] == 2

    # 4) nothing to do; 5) a train setting changes: refused, the trained model kept; with --overwrite train
    # (and, without --stop-after, eval) rerun and the rest is kept
    logs.clear()
    run_pipeline(cfg, run_dir, progress=False, log=logs.append)
    assert stages_run(logs) == [] and sum("skipped" in s for s in logs) == 5
    logs.clear()
    cfg2 = PipelineConfig(model=str(tiny_dir), **{**TINY, "lr": 2e-3})
    with pytest.raises(ValueError, match=r"the train stage of .* \(lr: 0.001 -> 0.002\)"):
        run_pipeline(cfg2, run_dir, progress=False, log=logs.append, stop_after="train")
    assert stages_run(logs) == [] and (run_dir / "train" / "model" / "config.json").exists()
    run_pipeline(cfg2, run_dir, progress=False, log=logs.append, stop_after="train", overwrite=True)
    assert stages_run(logs) == ["train"]


def test_scores_reuse_baseline_and_cli(tiny_dir, tmp_path, capsys):
    scores = tmp_path / "scores.json"
    scores.write_text(
        json.dumps({f"{a}-{b}": [0.5 if (a, b) == (1, 2) else 0.0] for a in range(2) for b in range(4)})
    )
    run_dir = tmp_path / "run"
    argv = ["pipeline", "--model", str(tiny_dir), "--run-dir", str(run_dir), "--scores", str(scores),
            "--baseline", "non-retrieval", "--stop-after", "mask", "--no-progress", "--train-seed", "3"]  # fmt: skip
    assert cli(argv) == 0
    heads = json.loads((run_dir / "mask" / "heads.json").read_text())
    assert heads["baseline"] == "non-retrieval" and heads["num_heads"] == 1 and heads["heads"] != [[1, 2]]
    assert json.loads((run_dir / "mask" / "retrieval_heads.json").read_text())["heads"] == [[1, 2]]
    assert (run_dir / "detect" / "scores.json").read_text() == scores.read_text()
    state = json.loads((run_dir / "pipeline.json").read_text())
    assert state["stages"]["detect"]["source"] == str(scores) and "generate" not in state["stages"]
    assert state["config"]["train_seed"] == 3 and state["config"]["gen_seed"] == 0
    # a threshold nobody reaches: a clear error
    argv = ["pipeline", "--model", str(tiny_dir), "--run-dir", str(tmp_path / "r2"), "--scores", str(scores),
            "--threshold", "0.9", "--stop-after", "mask", "--no-progress"]  # fmt: skip
    assert cli(argv) == 2
    assert "no head has a retrieval score >= 0.9" in capsys.readouterr().err


def test_sft_objective_reuses_the_pairs_and_trains_on_chosen(tiny_dir, tmp_path, monkeypatch, capsys):
    """--sft changes the train stage only: detect, mask and the pairs of a DPO run with the same seeds are
    reused, the model is trained by SFT on the chosen responses, and the eval labels it so."""
    monkeypatch.setattr("retmask.detect.run.RECALL_THRESHOLD", -1.0)
    run_dir = tmp_path / "run"
    dpo = PipelineConfig(model=str(tiny_dir), **TINY)
    assert "objective" not in Pipeline(dpo, run_dir).stage_config("train")  # earlier runs' fingerprints hold
    run_pipeline(dpo, run_dir, progress=False, log=lambda *a: None, stop_after="generate")
    before = json.loads((run_dir / "pipeline.json").read_text())["stages"]

    logs: list[str] = []
    sft = PipelineConfig(model=str(tiny_dir), **TINY, objective="sft")
    state = run_pipeline(sft, run_dir, progress=False, log=logs.append)
    assert stages_run(logs) == ["train", "eval"]
    for stage in ("detect", "mask", "generate"):
        assert state["stages"][stage]["fingerprint"] == before[stage]["fingerprint"]
    assert state["stages"]["train"]["config"]["objective"] == "sft"
    record = json.loads((run_dir / "train" / "model" / "retmask_train.json").read_text())
    assert record["mode"] == "sft" and record["steps"] == 2
    ev = json.loads((run_dir / "eval" / "eval.json").read_text())
    assert [m["label"] for m in ev["models"]] == ["original", "sft-chosen"]

    with pytest.raises(ValueError, match=r"objective must be one of \('dpo', 'sft'\), got 'ppo'"):
        run_pipeline(
            PipelineConfig(model=str(tiny_dir), **TINY, objective="ppo"), tmp_path / "r3", progress=False
        )
    # the command line's --sft
    argv = ["pipeline", "--model", str(tiny_dir), "--run-dir", str(tmp_path / "r2"), "--scores",
            str(run_dir / "detect" / "scores.json"), "--top-k", "2", "--sft", "--stop-after", "mask", "--no-progress"]  # fmt: skip
    assert cli(argv) == 0
    assert json.loads((tmp_path / "r2" / "pipeline.json").read_text())["config"]["objective"] == "sft"


def test_stratified_subset_covers_categories():
    class I:  # noqa: E742
        def __init__(self, i, c):
            self.id, self.category = i, c

    items = [I(i, "a") for i in range(5)] + [I(i + 5, "b") for i in range(2)] + [I(9, "c")]
    assert [x.id for x in stratified(items, 5)] == [0, 5, 9, 1, 6]
    assert len(stratified(items, 100)) == 8


def test_new_options_enter_the_fingerprints_only_when_set(tiny_dir, tmp_path):
    """--drop-unfinished (train) and --device (every stage that loads a model) change the fingerprints of
    the stages they affect; at their defaults the fingerprints of runs made before the options still hold."""
    import dataclasses

    base = PipelineConfig(model=str(tiny_dir), **TINY)
    default = {s: Pipeline(base, tmp_path / "a").stage_config(s) for s in STAGES}
    assert all("device" not in c and "drop_unfinished" not in c for c in default.values())
    drop = Pipeline(dataclasses.replace(base, drop_unfinished=True), tmp_path / "b")
    assert drop.stage_config("train") == default["train"] | {"drop_unfinished": True}
    assert all(drop.stage_config(s) == default[s] for s in STAGES if s != "train")
    gpu = Pipeline(dataclasses.replace(base, device="cuda"), tmp_path / "c")
    assert {s for s in STAGES if gpu.stage_config(s).get("device") == "cuda"} == set(STAGES) - {"mask"}


def test_training_schedule_options_reach_the_trainer_and_fingerprint_only_when_changed(
    tiny_dir, tmp_path, monkeypatch
):
    """--warmup-ratio, --min-lr-rate and --weight-decay enter the training stage's fingerprint when they
    differ from the published recipe's (a different result), --gradient-checkpointing never (the same
    result); the command line's values reach the TrainConfig the stage trains with."""
    import dataclasses
    from types import SimpleNamespace

    base = PipelineConfig(model=str(tiny_dir), **TINY)
    default = {s: Pipeline(base, tmp_path / "a").stage_config(s) for s in STAGES}
    assert not {"warmup_ratio", "min_lr_rate", "weight_decay", "gradient_checkpointing"} & set(
        default["train"]
    )
    changed = dataclasses.replace(base, warmup_ratio=0.0, min_lr_rate=0.5, weight_decay=0.0)
    pipe = Pipeline(changed, tmp_path / "b")
    assert pipe.stage_config("train") == default["train"] | {"warmup_ratio": 0.0, "min_lr_rate": 0.5,
                                                             "weight_decay": 0.0}  # fmt: skip
    assert all(pipe.stage_config(s) == default[s] for s in STAGES if s != "train")
    checkpointed = Pipeline(dataclasses.replace(base, gradient_checkpointing=True), tmp_path / "c")
    assert checkpointed.stage_config("train") == default["train"]

    run_dir, scores = tmp_path / "cli", tmp_path / "scores.json"
    scores.write_text(json.dumps({f"{a}-{b}": [0.5 * (a == b)] for a in range(2) for b in range(4)}))
    argv = ["pipeline", "--model", str(tiny_dir), "--run-dir", str(run_dir), "--scores", str(scores),
            "--top-k", "1", "--no-progress", "--stop-after", "mask", "--warmup-ratio", "0", "--min-lr-rate", "0.5",
            "--weight-decay", "0", "--gradient-checkpointing", "--telemetry-every", "0"]  # fmt: skip
    assert cli(argv) == 0
    recorded = json.loads((run_dir / "pipeline.json").read_text())["config"]
    cfg = PipelineConfig(**recorded)
    seen = []
    monkeypatch.setattr(
        "retmask.methods.retmask.pipeline.train_dpo",
        lambda pairs, out, model, train_cfg, **kw: (
            seen.append(train_cfg) or SimpleNamespace(steps=1, seconds_per_step=0.0)
        ),
    )
    Pipeline(cfg, run_dir)._train(resume=False)
    (train_cfg,) = seen
    assert (train_cfg.warmup_ratio, train_cfg.min_lr_rate, train_cfg.weight_decay) == (0.0, 0.5, 0.0)
    assert train_cfg.gradient_checkpointing and train_cfg.learning_rate == cfg.lr


def test_pipeline_schedule_flags_are_checked(tmp_path, capsys):
    argv = ["pipeline", "--run-dir", str(tmp_path / "r"), "--warmup-ratio", "1", "--stop-after", "detect"]
    with pytest.raises(SystemExit):
        cli(argv)
    assert "argument --warmup-ratio" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--warmup-ratio must be in \[0, 1\)"):
        PipelineConfig(warmup_ratio=1.5).check()


def test_a_failed_detection_suggests_the_pipelines_own_flags(tiny_dir, tmp_path, capsys):
    """The detection's failure messages name the pipeline's flags (--detect-max-len), never `retmask
    detect`'s that the pipeline does not have (--max-len, --max-new-tokens, --needles)."""
    base = ["pipeline", "--model", str(tiny_dir), "--top-k", "1", "--no-progress", "--detect-lengths", "1",
            "--detect-depths", "2"]  # fmt: skip
    # a random model retrieves nothing: no test counts
    assert (
        cli([*base, "--run-dir", str(tmp_path / "a"), "--detect-min-len", "300", "--detect-max-len", "300"])
        == 2
    )
    err = capsys.readouterr().err
    assert "no test counted" in err and "try shorter contexts (--detect-max-len), or another model" in err
    # contexts too short for any needle: no test runs
    assert (
        cli([*base, "--run-dir", str(tmp_path / "b"), "--detect-min-len", "60", "--detect-max-len", "60"])
        == 2
    )
    err = capsys.readouterr().err
    assert "no test could run" in err and err.rstrip().endswith("raise --detect-min-len/--detect-max-len")
    assert "--max-new-tokens" not in err and "--needles" not in err and " --max-len" not in err
