"""export_masked writes a plain HF checkpoint that reproduces the runtime-masked logits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import retmask
from retmask.hf.layers import head_inputs, head_layout

from .conftest import random_batch, tiny_model

HEADS = [(0, 2), (1, 1)]


@pytest.mark.parametrize("arch", ["llama", "olmo2", "gpt2", "gpt_neox", "qwen3_5_text"])
def test_export_reload_with_plain_transformers(arch, tmp_path):
    # llama: with o_proj.bias (must stay intact); olmo2: tied embeddings (save_pretrained drops the copy);
    # gpt2: a Conv1D c_proj (weight [in, out]: the heads are rows); gpt_neox: the projection named "dense";
    # qwen3_5_text: a hybrid, whose attention layer 0 is decoder layer 1 (gated DeltaNet layers 0 and 3).
    from .test_architectures import HYBRIDS

    extra = {"llama": {"attention_bias": True}, "olmo2": {"tie_word_embeddings": True}, **HYBRIDS}.get(
        arch, {}
    )
    model = tiny_model(arch, **extra)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = retmask.export_masked(model, HEADS, tmp_path / "masked")
    # The model passed in is untouched.
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    config = json.loads((out / "config.json").read_text())
    # no retmask attention is recorded (plain transformers loads it); the masked heads are
    assert "retmask" not in json.dumps({k: v for k, v in config.items() if not k.startswith("retmask_")})
    assert config["retmask_masked_heads"] == [list(h) for h in HEADS]
    name = head_layout(model).projection_name
    assert config["retmask_masking"]["edit"].startswith(f"{name} input features")
    assert not hasattr(model.config, "retmask_masked_heads")  # the model passed in is untouched
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    layer0 = head_layout(reloaded).projections[0]
    inputs = head_inputs(layer0)  # [Hq * D, hidden]: head 2 of layer 0 is rows 32..47
    assert inputs[32:48].abs().max() == 0 and inputs[:32].abs().min() > 0
    if layer0.bias is not None:  # the bias is per output feature: never zeroed
        torch.testing.assert_close(layer0.bias, head_layout(model).projections[0].bias)
    ids, mask = random_batch(2, 9, left_pad=[0, 2])
    valid = mask.bool()
    with torch.no_grad(), retmask.head_mask(model, HEADS):
        want = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        got = reloaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)


def test_export_rejects_per_row_masks(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"\[L, Hq\] = \[2, 4\]"):
        retmask.export_masked(model, torch.zeros(2, 2, 4, dtype=torch.bool), tmp_path)


def test_export_says_what_it_is_without_retmask(tmp_path):
    """The folder loads in plain transformers (eager attention, retmask not importable) and its config and
    model card name the heads, the base model, the selection rule and the scores file."""
    model = tiny_model("llama")
    selection = {"method": "top_k", "top_k": 2, "threshold": None, "baseline": None, "seed": None}
    out = retmask.export_masked(
        model, HEADS, tmp_path / "masked",
        provenance={"base_model": "org/base", "selection": selection, "scores_file": "runs/s.json"},
    )  # fmt: skip
    code = (
        "import sys\n"
        "sys.modules['retmask'] = None  # importing retmask now fails\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, attn_implementation='eager')\n"
        "assert m.config._attn_implementation == 'eager'\n"
        "assert m.config.retmask_masked_heads == [[0, 2], [1, 1]], m.config.retmask_masked_heads\n"
        "info = m.config.retmask_masking\n"
        "assert info['base_model'] == 'org/base' and info['scores_file'] == 'runs/s.json', info\n"
        "assert info['selection']['top_k'] == 2 and info['num_masked_heads'] == 2 and info['retmask_version']\n"
        "assert 'retmask' not in sys.modules or sys.modules['retmask'] is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    card = (out / "README.md").read_text()
    assert "base_model: org/base" in card and "0-2, 1-1" in card
    assert "the 2 heads with the highest mean retrieval score" in card and "`runs/s.json`" in card
    assert f"retmask version | {retmask.__version__}" in card


def test_interrupted_export_leaves_nothing_and_existing_folders_are_refused(tmp_path):
    class Interrupting:
        def save_pretrained(self, folder):
            raise KeyboardInterrupt  # Ctrl-C while the checkpoint is half written

    model = tiny_model("llama")
    with pytest.raises(KeyboardInterrupt):
        retmask.export_masked(model, HEADS, tmp_path / "masked", tokenizer=Interrupting())
    assert list(tmp_path.iterdir()) == [], "no partial checkpoint and no temporary folder left behind"
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="taken already exists and is not empty"):
        retmask.export_masked(model, HEADS, tmp_path / "taken")
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(FileExistsError, match="a_file is a file, not a folder; pick a new folder"):
        retmask.export_masked(model, HEADS, tmp_path / "a_file")
    (tmp_path / "empty").mkdir()
    assert (retmask.export_masked(model, HEADS, tmp_path / "empty") / "config.json").is_file()


def test_export_of_a_vision_language_model_keeps_it_whole(tmp_path):
    """A vision-language model exports whole: same class, vision tower, its folder's processor config, and
    a model card naming the auto class that loads it."""
    import shutil

    from transformers import AutoModelForImageTextToText

    from .test_architectures import VISION_LANGUAGE

    torch.manual_seed(0)
    base = tmp_path / "base"
    AutoModelForImageTextToText.from_config(VISION_LANGUAGE["qwen3_5"]()).save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(retmask.default_model_path() / name, base)
    (base / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "made-up"}))
    model, tokenizer = retmask.load_model(str(base))
    out = retmask.export_masked(model, [(0, 1)], tmp_path / "masked", tokenizer=tokenizer)
    assert json.loads((out / "preprocessor_config.json").read_text()) == {"image_processor_type": "made-up"}
    assert "`AutoModelForImageTextToText.from_pretrained(folder)`" in (out / "README.md").read_text()
    reloaded = AutoModelForImageTextToText.from_pretrained(out)
    assert type(reloaded) is type(model) and set(reloaded.state_dict()) == set(model.state_dict())


def test_export_takes_the_selection_in_words(tmp_path):
    """``provenance["selection"]`` may be a sentence instead of a heads-file dict: the card quotes it."""
    out = retmask.export_masked(
        tiny_model("llama"), HEADS, tmp_path / "masked", provenance={"selection": "picked by hand"}
    )
    assert "| chosen as | picked by hand |" in (out / "README.md").read_text()


def test_export_records_paths_and_numpy_values_as_plain_json(tmp_path):
    """Provenance values users have at hand (a Path, NumPy numbers) are stored as strings and numbers."""
    import numpy as np

    out = retmask.export_masked(
        tiny_model("llama"), HEADS, tmp_path / "masked",
        provenance={"scores_file": tmp_path / "s.json", "top_k": np.int64(2), "tau": np.float32(0.5)},
    )  # fmt: skip
    record = json.loads((out / "config.json").read_text())["retmask_masking"]
    assert (record["scores_file"], record["top_k"], record["tau"]) == (str(tmp_path / "s.json"), 2, 0.5)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(provenance="chosen by hand"), TypeError, r"provenance must be a dict .*got str"),
        (dict(provenance={"when": object()}), TypeError, r"provenance holds a object .*strings, numbers"),
        (dict(tokenizer="tok"), TypeError, r"tokenizer must be a tokenizer .*got str.*AutoTokenizer"),
    ],
)
def test_export_refuses_bad_arguments_by_name_before_writing(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        retmask.export_masked(tiny_model("llama"), HEADS, tmp_path / "masked", **kwargs)
    assert not (tmp_path / "masked").exists()
