"""What the eval cache and the ablation resume files are keyed on, the report's shift section without
NIAH scores, and the key-value scorer's number reading."""

from __future__ import annotations

from dataclasses import asdict

import torch

from retmask.evaluate import suite
from retmask.evaluate.config import EvalConfig
from retmask.evaluate.niah import grid_fingerprint
from retmask.evaluate.report import render_report
from retmask.evaluate.synthetic import exact_number
from retmask.niah import load_needles
from tests.tiny import tiny_llama


def test_eval_cache_key_follows_the_shipped_texts(monkeypatch):
    """A new haystack or needle text must not be served results computed on the old one."""
    cfg = EvalConfig()
    key = suite._fingerprint(cfg, "sha256:x")
    assert suite._fingerprint(cfg, "sha256:x") == key and suite._fingerprint(cfg, "sha256:y") != key
    assert suite._fingerprint(cfg, "sha256:x", "cuda") != key
    monkeypatch.setattr(suite, "load_haystack", lambda _: "another haystack text.")
    assert suite._fingerprint(cfg, "sha256:x") != key
    monkeypatch.undo()
    edited = load_needles()
    edited[0] = type(edited[0])(**{**edited[0].to_dict(), "question": "A different question?"})
    monkeypatch.setattr(suite, "load_needles", lambda: edited)
    assert suite._fingerprint(cfg, "sha256:x") != key


def test_eval_cache_key_marks_the_multi_needle_scoring_rule():
    """Multi-needle results scored before the first-named rule are not served; a key without that task
    (the seed studies' NIAH-only evals) is unchanged."""
    niah_only = EvalConfig(tasks=["niah"])
    texts = {
        "haystack_sha256": suite.hashlib.sha256(suite.load_haystack(None).encode("utf-8")).hexdigest(),
        "needles": [n.to_dict() for n in load_needles()[: niah_only.niah_needles]],
    }
    config = suite.without_default_dtype(asdict(niah_only))
    before = suite.digest({"version": suite.RESULT_VERSION, "config": config, "model": "m", **texts})
    assert suite._fingerprint(niah_only, "m") == before
    with_mn = EvalConfig(tasks=["niah", "multi_needle"])
    config = suite.without_default_dtype(asdict(with_mn))
    old_rule = suite.digest({"version": suite.RESULT_VERSION, "config": config, "model": "m", **texts})
    assert suite._fingerprint(with_mn, "m") != old_rule


def test_ablation_key_holds_the_dtype_off_float32():
    """An ablation resumed in bf16 must not mix with float32 results (the default keeps old keys)."""
    model = tiny_llama()
    args = ("m", [300], [0], load_needles()[:1], "hay.", 8, "chat")
    fp32 = grid_fingerprint(model, *args)
    assert "dtype" not in fp32 and "device" not in fp32
    bf16 = grid_fingerprint(model.to(torch.bfloat16), *args)
    assert bf16 == fp32 | {"dtype": "bfloat16"}


def test_report_has_no_shift_section_without_niah_scores():
    data = {
        "config": asdict(EvalConfig(tasks=["kv"])),
        "models": [{"label": "a", "tasks": {"kv": 0.5}, "kv": {"by_length": {"1000": 0.5}}}],
        "heads": [{"file": "h.json", "name": "h", "heads": [[0, 1]], "shift": []}],
    }
    text = render_report(data)
    assert "shift.png" not in text and "Retrieval-score shift" not in text


def test_key_value_reads_numbers_with_thousands_separators():
    assert exact_number("48213", "The value is 48,213.")
    assert exact_number("48213", "48213")
    assert not exact_number("48213", "48,2130")  # not a separator: 48 is read
    assert exact_number("48", "48, 213") and not exact_number("1000", "1,000,000")


def test_model_identity_covers_weights_and_prompt_files(tmp_path):
    """Another chat template changes every prompt: it is part of a local model's identity, like its weights."""
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "a"}')
    first = suite.model_identity(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "b"}')
    second = suite.model_identity(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    third = suite.model_identity(str(tmp_path))
    assert len({first, second, third}) == 3
    (tmp_path / "notes.txt").write_text("not part of the model")
    assert suite.model_identity(str(tmp_path)) == third
