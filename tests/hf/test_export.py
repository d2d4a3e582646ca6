"""export_masked writes a plain HF checkpoint that reproduces the runtime-masked logits."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import retmask

from .conftest import random_batch, tiny_model

HEADS = [(0, 2), (1, 1)]


@pytest.mark.parametrize("arch", ["llama", "olmo2"])
def test_export_reload_with_plain_transformers(arch, tmp_path):
    # llama: with o_proj.bias (must stay intact); olmo2: tied embeddings (save_pretrained drops the copy).
    extra = {"attention_bias": True} if arch == "llama" else {"tie_word_embeddings": True}
    model = tiny_model(arch, **extra)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = retmask.export_masked(model, HEADS, tmp_path / "masked")
    # The model passed in is untouched.
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    config = json.loads((out / "config.json").read_text())
    assert "retmask" not in json.dumps(config)
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    layer0 = reloaded.model.layers[0].self_attn.o_proj
    assert layer0.weight[:, 32:48].abs().max() == 0 and layer0.weight[:, :32].abs().min() > 0
    if layer0.bias is not None:  # o_proj.bias is per output feature: never zeroed
        torch.testing.assert_close(layer0.bias, model.model.layers[0].self_attn.o_proj.bias)
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
