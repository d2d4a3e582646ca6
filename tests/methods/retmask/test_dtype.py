"""``--dtype`` on the RetMask commands: bf16 generation, DPO under bf16 autocast (float32 master weights)
on the CPU, the resolved dtype in every record, and fingerprints of float32 runs unchanged."""

from __future__ import annotations

import copy
import hashlib
import json

import torch

import retmask
from retmask.cli import main as cli
from retmask.evaluate.config import EvalConfig
from retmask.evaluate.suite import RESULT_VERSION, _fingerprint
from retmask.methods.retmask.dpo import train_dpo
from retmask.methods.retmask.pipeline import Pipeline
from retmask.methods.retmask.pipeline_config import STAGES, PipelineConfig
from retmask.methods.retmask.train_config import TrainConfig
from retmask.niah import load_haystack, load_needles
from retmask.runfiles import digest
from tests.methods.retmask.test_train import ROWS, conv


def _pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(conv(*r)) + "\n" for r in ROWS))
    return path


def _dpo(tiny_dir, tmp_path, dtype: str, seen: list):
    """Two DPO steps from the same weights; records the dtype of the first q_proj's outputs."""
    model, tok = retmask.load_model(str(tiny_dir))
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    cfg = TrainConfig(
        max_steps=2, batch_size=2, grad_accum=1, learning_rate=1e-2, max_length=128, dtype=dtype
    )
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    result = train_dpo(_pairs(tmp_path), tmp_path / dtype, cfg=cfg, model=model, ref_model=ref, tokenizer=tok)
    return model, result


def test_dpo_in_bf16_autocast_on_cpu_tracks_float32(tiny_dir, tmp_path):
    seen32, seen16 = [], []
    model32, res32 = _dpo(tiny_dir, tmp_path, "float32", seen32)
    model16, res16 = _dpo(tiny_dir, tmp_path, "bfloat16", seen16)
    assert set(seen32) == {torch.float32} and torch.bfloat16 in seen16  # autocast really ran in bf16
    assert all(p.dtype == torch.float32 for p in model16.parameters())  # float32 master weights
    assert res16.steps == res32.steps == 2
    # step 1: policy == reference, the loss is log 2 in any precision; step 2 follows fp32 closely
    torch.testing.assert_close(torch.tensor(res16.losses), torch.tensor(res32.losses), rtol=0.05, atol=0.01)
    record = json.loads((tmp_path / "bfloat16" / "retmask_train.json").read_text())
    assert record["config"]["dtype"] == "bfloat16"


def test_generate_in_bf16_records_the_dtype(tiny_dir, tmp_path):
    src = tmp_path / "inst.jsonl"
    src.write_text(
        "".join(json.dumps({"id": f"q{k}", "prompt": p}) + "\n" for k, p in enumerate(["Hi.", "Why?"]))
    )
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"heads": [[1, 0], [0, 3]]}))
    out = tmp_path / "pairs.jsonl"
    argv = ["generate", "--model", str(tiny_dir), "--instructions", str(src), "--heads", str(heads), "--out",
            str(out), "--max-new-tokens", "4", "--no-progress", "--dtype", "bfloat16"]  # fmt: skip
    assert cli(argv) == 0
    stats = json.loads(out.with_name("pairs.stats.json").read_text())
    assert stats["settings"]["dtype"] == "bfloat16" and stats["pairs"] + sum(stats["dropped"].values()) == 2
    # a resumed run must use the same dtype: float32 is another setting
    assert cli([*argv[:-2], "--resume"]) == 2


def test_float32_fingerprints_are_the_ones_before_dtype_existed(tmp_path):
    """Run dirs and eval caches written before --dtype keep their finished work; bf16 is another run."""
    pipe32 = Pipeline(PipelineConfig(), tmp_path / "a", progress=False)
    pipe16 = Pipeline(PipelineConfig(dtype="bfloat16"), tmp_path / "b", progress=False)
    for stage in STAGES:
        assert "dtype" not in pipe32.stage_config(stage)
        assert pipe16.stage_config(stage).get("dtype") == (None if stage == "mask" else "bfloat16")
    # the eval key leaves float32 out too (it also holds the shipped texts since 2026-11-26: test_keys.py)
    old = {k: v for k, v in vars(EvalConfig()).items() if k != "dtype"}
    texts = {
        "haystack_sha256": hashlib.sha256(load_haystack(None).encode("utf-8")).hexdigest(),
        "needles": [n.to_dict() for n in load_needles()[: EvalConfig().niah_needles]],
        "multi_needle_rule": "asked value named first",  # since the rule changed (test_keys.py)
    }
    want = digest({"version": RESULT_VERSION, "config": old, "model": "m", **texts})
    assert _fingerprint(EvalConfig(), "m") == want
    assert _fingerprint(EvalConfig(dtype="bfloat16"), "m") != _fingerprint(EvalConfig(), "m")
