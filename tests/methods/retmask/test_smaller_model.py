"""The pipeline's Smaller-Model baseline (`--baseline smaller-model --rejected-model M`): rejected responses
from a second model, nothing masked, telemetry on the retrieval heads, its label, its errors, and the
stage fingerprints of the other variants left as they were."""

from __future__ import annotations

import json

import pytest

import retmask
from retmask.cli import main as cli
from retmask.methods.retmask.generate import SamplingConfig, generate_rows, read_pairs, row_seed
from retmask.methods.retmask.pipeline import Pipeline, PipelineConfig, run_pipeline
from tests.methods.retmask.test_pipeline import TINY
from tests.tiny import tiny_llama_for


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory, tokenizer):
    """A smaller tiny random Llama (1 layer, other weights) over the same tokenizer."""
    path = tmp_path_factory.mktemp("tiny-smaller")
    tiny_llama_for(tokenizer, init=0.02, layers=1, seed=7).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_smaller_model_rejects_the_second_models_samples_and_masks_nothing(tiny_dir, small_dir, tmp_path,
                                                                          monkeypatch):  # fmt: skip
    monkeypatch.setattr("retmask.detect.run.RECALL_THRESHOLD", -1.0)  # a random model answers nothing
    import retmask.methods.retmask.generate as G

    batches, real = [], G.contrast_batch

    def recording(batch, *args, **kwargs):
        batches.append(list(batch))
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(G, "contrast_batch", recording)
    run_dir = tmp_path / "run"
    cfg = PipelineConfig(model=str(tiny_dir), **{**TINY, "baseline": "smaller-model", "temperature": 1.0},
                         rejected_model=str(small_dir))  # fmt: skip
    run_pipeline(cfg, run_dir, progress=False, log=lambda *a: None)

    heads = json.loads((run_dir / "mask" / "heads.json").read_text())
    retrieval = json.loads((run_dir / "mask" / "retrieval_heads.json").read_text())
    assert heads["heads"] == [] and heads["method"] == "none" and heads["baseline"] == "smaller-model"
    assert heads["retrieval_heads"] == retrieval["heads"] and len(retrieval["heads"]) == 2

    # every rejected response is the smaller model's sample of its batch with the row's own seed
    rows = {r["id"]: r for r in read_pairs(run_dir / "generate" / "pairs.jsonl")}
    assert rows and all(r["metadata"]["rejected_by"] == "smaller-model" for r in rows.values())
    sampling = SamplingConfig(1.0, cfg.top_p, cfg.gen_max_new_tokens, cfg.gen_seed)
    small, tok = retmask.load_model(str(small_dir))
    checked = 0
    for batch in batches:
        seeds = [row_seed(cfg.gen_seed, inst.id, "rejected") for inst in batch]
        for inst, got in zip(
            batch, generate_rows(small, tok, [i.prompt for i in batch], seeds, sampling), strict=True
        ):
            if inst.id in rows:
                assert rows[inst.id]["rejected"][0]["content"] == got.text, inst.id
                checked += 1
    assert checked == len(rows)
    settings = json.loads((run_dir / "generate" / "pairs.stats.json").read_text())["settings"]
    assert settings["rejected_model"] == str(small_dir) and settings["heads"] == []

    telemetry = json.loads((run_dir / "train" / "model" / "telemetry.json").read_text())
    assert (
        telemetry["heads"] == retrieval["heads"]
        and telemetry["heads_label"] == "retrieval heads, none masked"
    )
    ev = json.loads((run_dir / "eval" / "eval.json").read_text())
    assert [m["label"] for m in ev["models"]] == ["original", "smaller-model-dpo"]


def test_fingerprints_name_the_rejected_model_and_win_lose_target_only_where_they_apply(tiny_dir, tmp_path):
    def generate_config(**kw):
        return Pipeline(PipelineConfig(model=str(tiny_dir), **{**TINY, **kw}), tmp_path / "x").stage_config(
            "generate"
        )

    plain = generate_config()
    assert "rejected_model" not in plain and "target_pairs" not in plain  # earlier runs still resume
    assert generate_config(baseline="random") == plain
    assert generate_config(baseline="smaller-model", rejected_model="m")["rejected_model"] == "m"
    assert generate_config(baseline="win-lose")["target_pairs"] == TINY["num_instructions"]


def test_smaller_model_errors_name_the_missing_or_stray_flag(tiny_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="--baseline smaller-model needs --rejected-model"):
        PipelineConfig(baseline="smaller-model").check()
    with pytest.raises(
        ValueError, match="--rejected-model is the Smaller-Model baseline's; add --baseline smaller"
    ):
        PipelineConfig(baseline="retmask", rejected_model="m").check()
    argv = ["pipeline", "--model", str(tiny_dir), "--run-dir", str(tmp_path / "r"), "--baseline", "smaller-model",
            "--no-progress"]  # fmt: skip
    assert cli(argv) != 0
    assert "needs --rejected-model" in capsys.readouterr().err
