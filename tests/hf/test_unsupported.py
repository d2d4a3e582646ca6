"""Features the kernel cannot honour raise a clear error naming the model and the feature."""

from __future__ import annotations

import pytest
import torch
import transformers

import retmask
from retmask.hf.interface import retmask_attention

from .conftest import random_batch, tiny_config, tiny_model


def test_unsupported_layer_kinds_rejected_by_patch():
    """Layer kinds other than full and sliding-window attention (e.g. chunked) are refused by name."""
    config = tiny_config("qwen2", layer_types=["full_attention", "chunked_attention"])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="'qwen2'.*chunked_attention.*Supported.*sliding"):
        retmask.patch(model)


def test_chunked_mask_pattern_rejected_at_run_time():
    """A mask function other than causal / bidirectional / causal sliding window raises at run time."""
    from transformers.masking_utils import and_masks, causal_mask_function, chunked_overlay

    from retmask.hf.interface import retmask_mask

    pattern = and_masks(chunked_overlay(4, torch.zeros(1, dtype=torch.long)), causal_mask_function)
    with pytest.raises(NotImplementedError, match="attention pattern other than causal"):
        retmask_mask(1, 6, 6, mask_function=pattern, config=tiny_config("llama"))


@pytest.mark.parametrize(
    "kw, feature",
    [
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


@pytest.mark.parametrize("arch,setting", [("llama", "attention_dropout"), ("gpt2", "attn_pdrop")])
def test_dropout_in_training_rejected(arch, setting):
    """Refused by name, with the model's own setting that turns it off (GPT-2 names it attn_pdrop)."""
    model = tiny_model(arch, **{setting: 0.1})
    ids, _ = random_batch(1, 5)
    with torch.no_grad():
        model(input_ids=ids)  # eval: no dropout, fine
    model.train()
    with pytest.raises(NotImplementedError, match=rf"'{arch}' uses attention dropout \(0.1\).*{setting}=0.0"):
        model(input_ids=ids)
    model = tiny_model(arch, **{setting: 0.0}).train()  # what the message says to do
    model(input_ids=ids)


@pytest.mark.parametrize("arch,setting", [("llama", "attention_dropout"), ("gpt2", "attn_pdrop")])
def test_load_model_for_training_turns_attention_dropout_off(arch, setting, tmp_path, capsys):
    """load_model(..., attention_dropout=0.0), as the training commands load: the model trains on retmask
    attention, one stderr line names the setting it replaced, the config records 0.0."""
    folder = tmp_path / arch
    tiny_model(arch, **{setting: 0.1}).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(retmask.default_model_path()).save_pretrained(folder)
    ids, _ = random_batch(1, 5)
    model, _ = retmask.load_model(str(folder))  # as saved: refused in training
    with pytest.raises(NotImplementedError, match="attention dropout"):
        model.train()(input_ids=ids)
    model, _ = retmask.load_model(folder, attention_dropout=0.0)  # a pathlib.Path as well as a str
    assert f"attention dropout {setting} 0.1 -> 0" in capsys.readouterr().err
    assert getattr(model.config, setting) == 0.0
    model.train()(input_ids=ids).logits.sum().backward()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            dict(attention_dropout=-1.0),
            ValueError,
            r"attention_dropout must be a probability in \[0, 1\].*got -1.0",
        ),
        (
            dict(attention_dropout=float("nan")),
            ValueError,
            r"attention_dropout must be a probability.*got nan",
        ),
        (dict(attention_dropout=True), ValueError, r"attention_dropout must be a probability.*got True"),
        (dict(cpu_linears="no"), TypeError, r"cpu_linears must be True, False or None .*got 'no'"),
    ],
)
def test_load_model_refuses_bad_settings_before_loading(kwargs, error, message):
    """Eager attention refuses a negative dropout only at its first training call, and retmask's kernel
    computes none: a bad value is refused when the model loads, as is a string where a bool belongs."""
    with pytest.raises(error, match=message):
        retmask.load_model(**kwargs)


def test_custom_4d_mask_rejected():
    model = tiny_model("llama")
    ids, _ = random_batch(1, 4)
    mask4d = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="2D padding mask"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask4d)


def test_patch_switches_and_rejects_non_interface_models():
    model = tiny_model("qwen3", attn="sdpa")
    assert retmask.patch(model) is model and model.config._attn_implementation == "retmask"
    bloom = transformers.AutoModelForCausalLM.from_config(tiny_config("bloom", n_head=4))
    with pytest.raises(
        ValueError, match="'bloom' cannot use retmask attention.*AttentionInterface.*tested: Llama"
    ):
        retmask.patch(bloom)


def test_hybrids_outside_the_tested_ones_are_refused_by_name():
    """MiniMax's linear-attention layers (an out_proj, but no is_causal) are not counted as attention layers,
    yet MiniMax is refused, with the reason: its eager output_attentions lists those layers too, which the
    step-by-step oracle would misread. Falcon-H1 runs Mamba and attention in parallel in every layer (layer
    kind "hybrid"): refused by that kind."""
    from retmask.hf.layers import head_layout

    config = tiny_config(
        "minimax", num_hidden_layers=4, num_local_experts=2, num_experts_per_tok=1,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert head_layout(model).layer_ids == (1, 3) and head_layout(model).hybrid
    with pytest.raises(
        ValueError, match=r"'minimax' cannot use retmask attention: its linear-attention layers report"
    ):
        retmask.patch(model)
    jamba = transformers.AutoModelForCausalLM.from_config(
        tiny_config("jamba", num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, num_experts=1)
    )
    with pytest.raises(
        ValueError, match=r"'jamba' cannot use retmask attention: its Mamba layers give other"
    ):
        retmask.patch(jamba)
    falcon = transformers.AutoConfig.for_model("falcon_h1", num_hidden_layers=2)
    from retmask.heads.layout import attention_layer_ids

    with pytest.raises(ValueError, match=r"its layers use \['hybrid'\] attention"):
        attention_layer_ids(falcon)


def test_a_padding_mask_of_the_wrong_width_is_named():
    model = tiny_model("llama")
    ids, mask = random_batch(1, 8)
    with (
        pytest.raises(ValueError, match=r"attention_mask has 7 columns but attention sees 8 keys"),
        torch.no_grad(),
    ):
        model(input_ids=ids, attention_mask=mask[:, 1:])
