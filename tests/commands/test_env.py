"""``retmask env``: the machine and the path of every kind of call, as text and as JSON."""

from __future__ import annotations

import json

import torch

from retmask import requirements
from retmask.cli import main
from retmask.kernels import paths


def test_env_prints_the_machine_and_every_kind_of_call(capsys, monkeypatch):
    monkeypatch.delenv("RETMASK_CPU_PATH", raising=False)
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert f"torch              {torch.__version__}" in text
    for dtype in ("float32", "bfloat16", "float16"):
        for kind in (*paths.KINDS, "backward"):
            assert f"cpu {dtype} {kind}" in text
    assert "RETMASK_CPU_SPEEDUPS" in text and "cpu speed-ups:" in text


def test_env_shows_each_dependency_against_retmask_range(capsys, monkeypatch):
    import transformers

    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert f"  transformers       {transformers.__version__:14} >=5.24,<6    ok\n" in text
    real = requirements.installed_version
    monkeypatch.setattr(
        requirements, "installed_version", lambda p: "1.0.0" if p == "accelerate" else real(p)
    )
    assert main(["env", "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)["dependencies"]["accelerate"]
    assert entry == {"installed": "1.0.0", "range": ">=1.1", "status": "older"}
    assert main(["env"]) == 0
    assert '  accelerate         1.0.0          >=1.1        older  pip install "accelerate>=1.1"' in (
        capsys.readouterr().out
    )


def test_env_json_and_a_bad_setting(capsys, monkeypatch):
    monkeypatch.setenv("RETMASK_CPU_SPEEDUPS", "0")
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cpu_speedups"]["enabled"] is False and data["settings"]["RETMASK_CPU_SPEEDUPS"] == "0"
    assert data["attention"]["cpu float32 backward"]["path"] == "kernel"
    monkeypatch.setenv("RETMASK_CPU_PATH", "gemm")
    assert main(["env"]) == 2
    assert "RETMASK_CPU_PATH must be one of" in capsys.readouterr().err


def _save_config(folder, tokenizer, arch: str, **overrides) -> str:
    """A model folder holding its config and a tokenizer, but no weights."""
    from tests.hf.conftest import tiny_config

    tiny_config(arch, **overrides).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_env_model_reports_support_and_layout_from_the_config_alone(tmp_path, tiny_dir, capsys):
    """No weights in the folders: the report builds the model on the meta device. A local/global model
    (Gemma 3), a model whose zeroed-head export is refused (BitNet), a hybrid (Qwen3.5) and an unsupported
    one (BLOOM: exit 2)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    gemma = _save_config(
        tmp_path / "gemma", tokenizer, "gemma3_text", sliding_window=4, head_dim=256, query_pre_attn_scalar=256,
        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=30.0,
    )  # fmt: skip
    assert main(["env", "--model", gemma]) == 0
    out = capsys.readouterr().out
    assert "machine:" in out and "retmask attention  supported" in out
    assert "2 layers x 4 query heads, 2 KV heads, head dim 256 (output projection o_proj)" in out
    assert "1 sliding_attention, 1 full_attention (window 4)" in out and "logit soft-capping 30.0" in out
    assert main(["env", "--json", "--model", _save_config(tmp_path / "bitnet", tokenizer, "bitnet")]) == 0
    report = json.loads(capsys.readouterr().out)["model"]
    assert report["supported"] and report["kv_heads"] == 2 and report["max_context"] == 256
    assert (
        report["zeroed_head_export"].startswith("refused: model 'bitnet'")
        and "attn_sub_norm" in report["zeroed_head_export"]
    )
    from tests.hf.test_architectures import HYBRIDS

    qwen35 = _save_config(tmp_path / "qwen3_5", tokenizer, "qwen3_5_text", **HYBRIDS["qwen3_5_text"])
    assert main(["env", "--model", qwen35]) == 0  # a hybrid: its heads are in 2 of its 4 layers
    out = capsys.readouterr().out
    assert "2 attention layers x 4 query heads" in out and "2 linear_attention, 2 full_attention" in out
    assert "attention layers   [1, 2] (score rows l = 0..1)" in out
    assert main(["env", "--model", _save_config(tmp_path / "bloom", tokenizer, "bloom", n_head=4)]) == 2
    assert "not supported: model 'bloom' cannot use retmask attention" in capsys.readouterr().out
    assert main(["env", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
