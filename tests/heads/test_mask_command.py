"""`retmask mask` command: argument handling, heads file output, --export through the model layer."""

from __future__ import annotations

import argparse
import json

import pytest

import retmask
from retmask.commands import mask

from ..tiny import tiny_llama


def _scores(tmp_path):
    path = tmp_path / "scores.json"
    raw = {f"{ly}-{h}": [0.1 * ((ly + h) % 4)] for ly in range(3) for h in range(4)}
    path.write_text(json.dumps(raw))
    return path


def test_add_parser_registers_mask():
    parser = argparse.ArgumentParser(prog="retmask")
    mask.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["mask", "--scores", "s.json", "--top-k", "3"])
    assert args.func is mask.run and args.top_k == 3 and args.threshold is None
    with pytest.raises(SystemExit):
        parser.parse_args(["mask", "--scores", "s.json", "--top-k", "3", "--threshold", "0.1"])
    with pytest.raises(SystemExit):
        parser.parse_args(["mask", "--scores", "s.json"])


def test_mask_writes_heads(tmp_path, capsys):
    out = tmp_path / "heads.json"
    rc = mask.main(["--scores", str(_scores(tmp_path)), "--threshold", "0.3", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert sorted(map(tuple, data["heads"])) == [(0, 3), (1, 2), (2, 1)]
    assert data["method"] == "threshold" and data["baseline"] is None
    assert "3 heads" in capsys.readouterr().out


def test_mask_baseline_and_shape(tmp_path):
    out = tmp_path / "heads.json"
    args = ["--scores", str(_scores(tmp_path)), "--top-k", "3", "--baseline", "random", "--seed", "5"]
    assert mask.main([*args, "--out", str(out), "--model-shape", "3", "4"]) == 0
    data = json.loads(out.read_text())
    assert len(data["heads"]) == 3 and data["seed"] == 5 and data["model_shape"] == [3, 4]


def test_mask_errors_are_reported(tmp_path, capsys):
    rc = mask.main(["--scores", str(tmp_path / "none.json"), "--top-k", "2"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    rc = mask.main(["--scores", str(_scores(tmp_path)), "--top-k", "2", "--model-shape", "2", "4"])
    assert rc == 2 and "does not exist in a model" in capsys.readouterr().err
    rc = mask.main(["--scores", str(_scores(tmp_path)), "--top-k", "2", "--model", "m"])
    assert rc == 2 and "--export" in capsys.readouterr().err
    rc = mask.main(["--scores", str(_scores(tmp_path)), "--top-k", "2", "--dtype", "bfloat16"])
    assert rc == 2 and "--dtype only matter(s) with --export" in capsys.readouterr().err


def test_export_uses_model_layer(tmp_path, monkeypatch):
    """--export loads the model and calls retmask.export_masked with the selected heads."""
    calls = {}
    model = tiny_llama(layers=3)  # [L, Hq] = [3, 4], as the scores file

    def fake_load(spec=None, **kw):
        calls["load"] = kw
        return model, "tok"

    monkeypatch.setattr(retmask, "load_model", fake_load, raising=False)

    def fake_export(m, heads, out_dir, tokenizer, provenance=None):
        calls.update(model=m, heads=heads, out_dir=out_dir, tokenizer=tokenizer, provenance=provenance)

    monkeypatch.setattr(retmask, "export_masked", fake_export, raising=False)
    out = tmp_path / "heads.json"
    rc = mask.main(
        [
            "--scores",
            str(_scores(tmp_path)),
            "--top-k",
            "2",
            "--out",
            str(out),
            "--export",
            str(tmp_path / "ckpt"),
            "--model",
            "tiny",
            "--dtype",
            "bfloat16",
        ]
    )
    assert rc == 0
    import torch

    assert calls["load"] == {"gguf_file": None, "dtype": torch.bfloat16}  # the saved weights' dtype
    assert calls["model"] is model and calls["tokenizer"] == "tok" and calls["out_dir"] == tmp_path / "ckpt"
    assert calls["heads"] == [tuple(h) for h in json.loads(out.read_text())["heads"]]
    # the checkpoint will say where its heads came from
    prov = calls["provenance"]
    assert prov["base_model"] == "tiny" and prov["scores_file"] == str(_scores(tmp_path))
    assert (
        prov["selection"]["top_k"] == 2
        and prov["heads_file"] == str(out)
        and len(prov["scores_sha256"]) == 64
    )

    small = tiny_llama(layers=1)
    monkeypatch.setattr(retmask, "load_model", lambda spec=None, **kw: small, raising=False)
    calls.clear()
    rc = mask.main(
        [
            "--scores",
            str(_scores(tmp_path)),
            "--top-k",
            "2",
            "--out",
            str(out),
            "--export",
            str(tmp_path / "ckpt2"),
        ]
    )
    assert rc == 2
    assert rc == 2 and not calls  # scores naming heads the model lacks: nothing exported
    rc = mask.main(
        [
            "--scores",
            str(_scores(tmp_path)),
            "--top-k",
            "2",
            "--out",
            str(out),
            "--export",
            str(tmp_path / "ckpt3"),
            "--model-shape",
            "3",
            "8",
        ]
    )
    assert rc == 2 and not calls


def test_export_with_the_models_own_model_shape_runs(tmp_path, monkeypatch):
    """--model-shape equal to the loaded model's [L, Hq] is accepted (it was refused as disagreeing with
    itself: a list compared with a tuple)."""
    exported = []
    monkeypatch.setattr(
        retmask, "load_model", lambda spec=None, **kw: (tiny_llama(layers=3), None), raising=False
    )
    monkeypatch.setattr(retmask, "export_masked", lambda *a, **kw: exported.append(a[1]), raising=False)
    out = tmp_path / "heads.json"
    args = ["--scores", str(_scores(tmp_path)), "--top-k", "2", "--out", str(out), "--model-shape", "3", "4"]
    assert mask.main([*args, "--export", str(tmp_path / "ckpt"), "--model", "tiny"]) == 0
    assert json.loads(out.read_text())["model_shape"] == [3, 4] and len(exported[0]) == 2


def test_export_of_a_model_whose_zeroed_heads_are_not_masked_heads_is_refused_first(
    tmp_path, monkeypatch, capsys
):
    """A model that normalises its heads' joint output before o_proj (BitNet) cannot be exported as a
    zeroed checkpoint: refused by name after the model loads, before the heads file is written."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(
        "bitnet", vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    monkeypatch.setattr(retmask, "load_model", lambda spec=None, **kw: (model, None), raising=False)
    out = tmp_path / "heads.json"
    args = ["--scores", str(_scores(tmp_path)), "--top-k", "2", "--out", str(out)]
    rc = mask.main([*args, "--export", str(tmp_path / "ckpt"), "--model", "tiny-bitnet"])
    err = capsys.readouterr().err
    assert rc == 2 and "--export: model 'bitnet'" in err and "(attn_sub_norm) before o_proj" in err
    assert not out.exists() and not (tmp_path / "ckpt").exists()
