"""More architectures on retmask attention: logits, gradients, ``generate``, argmax capture and head masks
equal eager attention, for every family whose attention module is built differently from Llama's (the
output projection's name and kind, fused QKV projections, partial rotary, learned positions, MQA, MoE
blocks, layers without RoPE, scaling multipliers), for popular Llama-like ones, and for the language
models of vision-language models.

Tiny random configs (tests/hf/conftest.py), one call each: these models are small enough that the whole
check of one architecture takes well under a second.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import retmask
from retmask.heads.layout import model_shape
from retmask.hf.export import check_zeroing_is_masking
from retmask.hf.layers import head_layout, output_norms
from retmask.hf.patch import uses_retmask

from .conftest import assert_argmax_matches, random_batch, tiny_config, with_attn, zeroed_copy

# architecture -> config overrides (what the tiny shape needs beyond tests/hf/conftest.py's)
ARCHITECTURES = {
    "gpt2": {},  # Conv1D projections (weight [in, out]) named c_attn / c_proj, learned positions
    "gpt_neox": {},  # Pythia: fused query_key_value, output "dense", partial rotary, head_size
    "phi": {},  # Phi-1/2: output "dense", partial rotary
    "opt": {},  # output "out_proj", learned positions with an offset
    "gptj": {"rotary_dim": 8},  # output "out_proj", interleaved partial rotary
    "codegen": {"rotary_dim": 8},  # fused qkv_proj, output "out_proj"
    "gpt_bigcode": {},  # StarCoder: multi-query attention, nn.Linear c_proj
    "persimmon": {},  # fused query_key_value, output "dense", query/key layer norms
    "phi3": {},  # fused qkv_proj
    "gemma": {},
    "granite": {},  # attention_multiplier instead of 1/sqrt(D)
    "starcoder2": {},
    "mixtral": {},  # mixture of experts
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2},  # QK-norm, mixture of experts
    "olmoe": {},
    "smollm3": {},  # some layers without RoPE
    "glm4": {},
    "nemotron": {},
    "exaone4": {},
    "helium": {},
    # Gemma 3n: the last two layers reuse earlier layers' keys and values, per-layer inputs, value norms.
    # Tested without left padding (LEFT_PAD): see there.
    "gemma3n_text": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=4,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128,
        laurel_rank=4,
        altup_num_inputs=2,
        intermediate_size=[128] * 4,
        activation_sparsity_pattern=[0.0] * 4,
    ),  # fmt: skip
}

# Hybrid models: attention layers between convolution, linear-attention (gated DeltaNet) or Mamba-2 layers;
# only the attention layers hold heads ([L, Hq] counts them). The Qwen3.5 config ends on a linear layer.
_GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)
_CONV_ATTN = ["conv", "full_attention"] * 2
_LINEAR_FULL = ["linear_attention", "full_attention"] * 2
HYBRIDS = {
    "lfm2": dict(num_hidden_layers=4, layer_types=_CONV_ATTN),
    "lfm2_moe": dict(num_hidden_layers=4, layer_types=_CONV_ATTN, num_dense_layers=1, **_MOE),
    "qwen3_5_text": dict(
        num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "full_attention", "linear_attention"],
        **_GDN,
    ),
    "qwen3_5_moe_text": dict(num_hidden_layers=4, layer_types=_LINEAR_FULL, shared_expert_intermediate_size=32,
                             **_GDN, **_MOE),
    "qwen3_next": dict(num_hidden_layers=4, layer_types=_LINEAR_FULL, shared_expert_intermediate_size=32, **_GDN,
                       **_MOE),
    "olmo_hybrid": dict(num_hidden_layers=4, layer_types=_LINEAR_FULL, linear_num_key_heads=2,
                        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16),
    "granitemoehybrid": dict(num_hidden_layers=4, layer_types=["mamba", "attention"] * 2, num_local_experts=0,
                             shared_intermediate_size=64, **_MAMBA2),
    "nemotron_h": dict(num_hidden_layers=4, hybrid_override_pattern="M*-*", mamba_num_heads=4, mamba_head_dim=32,
                       ssm_state_size=8, n_groups=1, chunk_size=8),
}  # fmt: skip
ARCHITECTURES.update(HYBRIDS)

# Multi-head latent attention: keys and values expanded per call from a compressed latent; query / key heads
# 24 wide (16 without rotary + 8 with), value heads 16 (DeepSeek) or 32 (MiniCPM3 here: wider than q / k).
_MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    head_dim=8,
)
_DEEPSEEK_MOE = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
)
LATENT = {
    "deepseek_v2": dict(_MLA, **_DEEPSEEK_MOE),
    "deepseek_v3": dict(_MLA, n_group=1, topk_group=1, **_DEEPSEEK_MOE),
    "minicpm3": dict(_MLA, q_lora_rank=16, v_head_dim=32),
}  # fmt: skip
ARCHITECTURES.update(LATENT)
# Kimi Linear: both, latent attention layers between its linear-attention (delta rule) layers
ARCHITECTURES["kimi_linear"] = dict(
    _MLA, num_hidden_layers=4, layer_types=_LINEAR_FULL, num_experts=4, num_experts_per_token=2,
    moe_intermediate_size=32, linear_head_dim=8, linear_num_heads=4, mlp_layer_types=["dense"] + ["sparse"] * 3,
)  # fmt: skip


# The padding of the test batch's second row. Gemma 3n takes the square root of each row's mean square
# (AltUp), whose gradient is NaN at an exactly zero row: a left-padding row without any key is one, as
# retmask attention and PyTorch SDPA leave it (eager's finite mask averages the masked keys instead), so
# its training gradients with left padding are NaN on SDPA and retmask alike. Right padding is fine.
LEFT_PAD = {"gemma3n_text": 0}

# Vision-language models run on text alone through their language model: Gemma 3 from 4B (local / global
# layers; AutoModelForCausalLM gives its ConditionalGeneration class), Mistral 3, LLaVA and Qwen2.5-VL
# (AutoModelForImageTextToText only). Text vocabulary 160 by default, the image tokens at its end: the
# token ids of random_batch (< 128) are never image tokens.
VOCAB = 160
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
               patch_size=14)  # fmt: skip


def _text(vocab: int, **overrides) -> dict:
    base = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    return {**base, **overrides}


def _qwen_vl(config_class: type, vocab: int, **text) -> transformers.PretrainedConfig:
    """A Qwen vision-language config: multimodal rotary sections (of D / 2 = 8 frequencies) for time, height
    and width; image, video and vision-start tokens at the vocabulary's end."""
    return config_class(
        text_config=_text(
            vocab,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
            **text,
        ),
        vision_config=dict(depth=2, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=64),
        image_token_id=vocab - 1,
        video_token_id=vocab - 2,
        vision_start_token_id=vocab - 3,
        tie_word_embeddings=False,
    )


VISION_LANGUAGE = {  # name -> config of a text vocabulary of the given size; image token = vocab - 1
    "gemma3": lambda vocab=VOCAB: transformers.Gemma3Config(
        text_config=_text(vocab, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
        vision_config=_VISION,
        mm_tokens_per_image=4,
        image_token_index=vocab - 1,
        boi_token_index=vocab - 3,
        eoi_token_index=vocab - 2,
        tie_word_embeddings=False,
    ),  # fmt: skip
    "mistral3": lambda vocab=VOCAB: transformers.Mistral3Config(
        text_config=_text(vocab, model_type="mistral"),
        vision_config=dict(_VISION, head_dim=16),
        image_token_index=vocab - 1,
        tie_word_embeddings=False,
    ),  # fmt: skip
    "llava": lambda vocab=VOCAB: transformers.LlavaConfig(
        text_config=_text(vocab, model_type="llama"),
        vision_config=_VISION,
        image_token_index=vocab - 1,
        tie_word_embeddings=False,
    ),  # fmt: skip
    "qwen2_5_vl": lambda vocab=VOCAB: _qwen_vl(transformers.Qwen2_5_VLConfig, vocab),
    # a hybrid: gated-DeltaNet layers 0 and 3, attention layers 1 and 2
    "qwen3_5": lambda vocab=VOCAB: _qwen_vl(transformers.Qwen3_5Config, vocab, **HYBRIDS["qwen3_5_text"]),
}


def _model(arch: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if arch in VISION_LANGUAGE:
        model = transformers.AutoModelForImageTextToText.from_config(
            VISION_LANGUAGE[arch](), attn_implementation="eager", dtype=torch.float32
        )
    else:
        model = transformers.AutoModelForCausalLM.from_config(
            tiny_config(arch, **ARCHITECTURES.get(arch, {})), attn_implementation="eager", dtype=torch.float32
        )
    return retmask.patch(model.eval())


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES) + sorted(VISION_LANGUAGE))
def test_architecture_equals_eager(arch):
    model = _model(arch)
    eager = with_attn(model, "eager")
    ids, mask = random_batch(2, 12, left_pad=[0, LEFT_PAD.get(arch, 3)], seed=1)
    valid = mask.bool()

    # logits, and the gradients of every parameter (eval mode: no dropout in either)
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 3] = -100  # predicted from a padding row, which has no valid key (implementations differ there)
    outputs = {}
    for name, m in (("retmask", model), ("eager", eager)):
        m.zero_grad()
        out = m(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        outputs[name] = out.logits.detach()
    torch.testing.assert_close(outputs["retmask"][valid], outputs["eager"][valid], atol=1e-4, rtol=1e-4)
    graded = 0
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=name)
        graded += 1
    assert graded > 0

    # a runtime head mask equals the checkpoint with those heads' output-projection inputs zeroed
    heads = [(0, 1), (1, 0), (1, 3)]
    zeroed = zeroed_copy(model, heads, attn="eager")
    with torch.no_grad(), retmask.head_mask(model, heads):
        got = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        want = zeroed(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got[valid], outputs["retmask"][valid], atol=1e-3)  # the mask changed something

    # the argmax key of the last 4 rows of every layer and head is eager attention's
    with torch.no_grad(), retmask.capture_argmax(model, rows=4) as cap:
        model(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        weights = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert_argmax_matches(cap.last, torch.stack([w[:, :, -4:, :] for w in weights]))

    # greedy generation with the KV cache: the same tokens and scores
    kw = dict(
        max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        got = model.generate(input_ids=ids, attention_mask=mask, **kw)
        want = eager.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=1e-4, rtol=1e-4)


def test_a_norm_over_the_heads_joint_output_refuses_zeroed_checkpoints(tmp_path):
    """BitNet normalises the concatenated head outputs (attn_sub_norm) before o_proj: the runtime mask still
    switches heads off, but a checkpoint with their o_proj inputs zeroed would be another model, so the
    export is refused by name instead of writing it."""
    model = _model("bitnet")
    layout = head_layout(model)
    with pytest.raises(
        ValueError, match=r"normalises the heads' joint output \(attn_sub_norm\) before o_proj"
    ):
        check_zeroing_is_masking(layout)
    with pytest.raises(ValueError, match="mask the heads at run time instead"):
        retmask.export_masked(model, [(0, 1)], tmp_path / "masked")
    assert not (tmp_path / "masked").exists()
    ids, mask = random_batch(1, 8, seed=2)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        with retmask.head_mask(model, [(0, 1)]):
            masked = model(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(plain, masked, atol=1e-3)
    check_zeroing_is_masking(head_layout(_model("olmo2")))  # query / key norms are not on the output
    attention = torch.nn.Module()  # Gemma 3n's per-head value norm is not on the output either
    attention.q_norm, attention.k_norm, attention.v_norm = (torch.nn.RMSNorm(16) for _ in range(3))
    assert output_norms(attention) == ()
    attention.o_norm = torch.nn.RMSNorm(64)
    assert output_norms(attention) == ("o_norm",)


def test_vision_language_model_with_an_image_equals_eager():
    """The vision tower (bidirectional attention over image patches) runs on retmask attention too, and the
    language model's argmax capture sees the image tokens' positions."""
    model = _model("gemma3")
    eager = with_attn(model, "eager")
    ids = torch.tensor([[1, VOCAB - 3] + [VOCAB - 1] * 4 + [VOCAB - 2, 7, 8, 9, 10, 11]])
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), retmask.capture_argmax(model, rows=2) as cap:
        got = model(input_ids=ids, pixel_values=pixels).logits
    with torch.no_grad():
        out = eager(input_ids=ids, pixel_values=pixels, output_attentions=True)
    torch.testing.assert_close(got, out.logits, atol=1e-4, rtol=1e-4)
    assert_argmax_matches(cap.last, torch.stack([w[:, :, -2:, :] for w in out.attentions]))


def test_load_model_takes_a_vision_language_folder(tmp_path):
    """A folder of a vision-language model without a causal-LM class loads (through
    AutoModelForImageTextToText) on retmask attention, with its [L, Hq] read from the text config."""
    model = _model("mistral3")
    model.save_pretrained(tmp_path / "vlm")
    _, tokenizer = retmask.load_model(cpu_linears=False)
    tokenizer.save_pretrained(tmp_path / "vlm")
    loaded, _ = retmask.load_model(str(tmp_path / "vlm"), cpu_linears=False)
    assert type(loaded).__name__ == "Mistral3ForConditionalGeneration" and uses_retmask(loaded)
    assert head_layout(loaded).shape == (2, 4) and model_shape(loaded) == (2, 4)


def test_a_hybrid_whose_attention_layers_come_first_is_still_hybrid():
    """Nemotron-H with attention in layers 0 and 1, then a Mamba-2 and an MLP layer: the attention layers
    are numbered 0..L-1 as in a plain model, but its cache holds a state that cannot be cut back, so
    detection rewinds it through kept copies of that state (a crop would fail on the Mamba layer), reuses
    the shared prefix and equals the oracle."""
    import numpy as np

    from retmask.detect import FastDetector, oracle_detect

    torch.manual_seed(0)
    config = tiny_config("nemotron_h", **dict(HYBRIDS["nemotron_h"], hybrid_override_pattern="**M-"))
    model = retmask.patch(transformers.AutoModelForCausalLM.from_config(config).eval())
    layout = head_layout(model)
    assert layout.layer_ids == (0, 1) and layout.total_layers == 4 and layout.hybrid
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 128, size=60)
    fast = FastDetector(model, {2}, max_new_tokens=6, chunk=16)
    computed = []
    for end in (50, 60):  # the second prompt extends the first: 48 tokens (3 chunks) come from the cache
        got = fast.run(prompt[:end], (10, 20))
        want = oracle_detect(model, prompt[:end], (10, 20), {2}, max_new_tokens=6, prefill_impl="retmask")
        assert got.tokens == want.tokens and (got.copies == want.copies).all()
        computed.append(got.prefill_tokens)
    assert computed == [49, 59 - 48]
