"""Features the kernel cannot honour raise a clear error naming the model and the feature."""

from __future__ import annotations

import pytest
import torch
import transformers

import retmask
from retmask.hf.interface import retmask_attention

from .conftest import random_batch, tiny_config, tiny_model, with_attn


def test_sliding_window_rejected_by_patch_and_at_run_time():
    model = tiny_model("mistral", attn="sdpa", sliding_window=8)
    with pytest.raises(ValueError, match="'mistral'.*sliding-window.*Supported"):
        retmask.patch(model)
    # Even if someone bypasses patch(), the mask function refuses a sliding-window pattern.
    model.set_attn_implementation("retmask")
    ids, _ = random_batch(1, 6)
    with pytest.raises(NotImplementedError, match="'mistral'.*sliding-window"), torch.no_grad():
        model(input_ids=ids)


def test_qwen2_sliding_layers_rejected():
    config = tiny_config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="'qwen2'.*sliding_attention"):
        retmask.patch(model)


def test_softcap_rejected():
    config = transformers.AutoConfig.for_model(
        "gemma2", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=50.0,
        layer_types=["full_attention"] * 2,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with pytest.raises(ValueError, match="'gemma2'.*soft-capping"):
        retmask.patch(model)
    model.set_attn_implementation("retmask")  # bypassing patch(): the attention function still refuses
    ids, _ = random_batch(1, 6)
    with (
        pytest.raises(NotImplementedError, match="'gemma2'.*(soft-capping|attention pattern)"),
        torch.no_grad(),
    ):
        model(input_ids=ids)


@pytest.mark.parametrize(
    "kw, feature",
    [
        ({"sliding_window": 16}, "sliding-window"),
        ({"softcap": 30.0}, "soft-capping"),
        ({"s_aux": torch.zeros(4)}, "attention sinks"),
        ({"dropout": 0.1}, "dropout"),
        ({"output_attentions": True}, "capture_argmax"),
    ],
)
def test_attention_function_rejects_features(kw, feature):
    module = tiny_model("llama").model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    with pytest.raises((NotImplementedError, ValueError), match=f"'llama'.*{feature}"):
        retmask_attention(module, q, k, v, None, **kw)


def test_dropout_in_training_rejected():
    model = tiny_model("llama", attention_dropout=0.1)
    ids, _ = random_batch(1, 5)
    with torch.no_grad():
        model(input_ids=ids)  # eval: no dropout, fine
    model.train()
    with pytest.raises(NotImplementedError, match="'llama'.*dropout"):
        model(input_ids=ids)


def test_custom_4d_mask_rejected():
    model = tiny_model("llama")
    ids, _ = random_batch(1, 4)
    mask4d = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="2D padding mask"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask4d)


def test_patch_switches_and_rejects_non_interface_models():
    model = tiny_model("qwen3", attn="sdpa")
    assert retmask.patch(model) is model and model.config._attn_implementation == "retmask"
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    )
    with pytest.raises(ValueError, match="cannot use retmask attention.*tested: Llama"):
        retmask.patch(gpt2)


def test_static_cache_rejected():
    model = tiny_model("llama")
    ids, mask = random_batch(1, 5)
    with pytest.raises(NotImplementedError, match="static"), torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, cache_implementation="static",
                       pad_token_id=0)  # fmt: skip
    assert with_attn(model, "sdpa") is not None
