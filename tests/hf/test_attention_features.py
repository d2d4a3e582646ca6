"""Models with sliding-window (local/global) layers, logit soft-capping and attention sinks on retmask
attention: logits, gradients, ``generate`` (sliding-window caches cutting in), argmax capture and head
masks equal eager attention, which implements each feature from its definition.

Tiny random configs (hidden 64, 2 layers, 4 query heads over 2 KV heads) with a window of 5 keys, shorter
than every test sequence, so the window matters everywhere, including the caches of local layers that
keep only the last ``window - 1`` keys.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

import retmask

from ..device import TEST_DEVICE
from .conftest import assert_argmax_matches, random_batch, tiny_config, with_attn, zeroed_copy

WINDOW = 5
LOCAL_GLOBAL = ["sliding_attention", "full_attention"]
FEATURE_ARCHS = {
    "mistral": dict(sliding_window=WINDOW),  # every layer local
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # layer 1 local
    "gemma2": dict(sliding_window=WINDOW, attn_logit_softcapping=5.0, query_pre_attn_scalar=16),
    # Gemma 3: local/global layers, QK-norm, head dim 256 (as Gemma-3-270M)
    "gemma3_text": dict(
        sliding_window=WINDOW, head_dim=256, layer_types=LOCAL_GLOBAL, query_pre_attn_scalar=256
    ),
    "olmo3": dict(sliding_window=WINDOW, layer_types=LOCAL_GLOBAL),
    "cohere2": dict(sliding_window=WINDOW, layer_types=LOCAL_GLOBAL),
    # gpt-oss: attention sinks on every layer, local/global, a tiny MoE
    "gpt_oss": dict(
        sliding_window=WINDOW, layer_types=LOCAL_GLOBAL, num_local_experts=2, num_experts_per_tok=1
    ),
}


def feature_model(arch: str, attn: str = "retmask", seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = tiny_config(arch, **FEATURE_ARCHS[arch])
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    if arch == "gpt_oss":  # sinks start at zero-mean noise; make them matter
        with torch.no_grad():
            for layer in retmask.hf.head_layout(model).layers:
                layer.sinks.normal_(0.0, 2.0)
    model.to(TEST_DEVICE).eval()
    return retmask.patch(model) if attn == "retmask" else model


@pytest.fixture(params=sorted(FEATURE_ARCHS))
def feature_arch(request) -> str:
    return request.param


def test_forward_equals_eager(feature_arch):
    model = feature_model(feature_arch)
    eager = with_attn(model, "eager")
    ids, mask = random_batch(2, 14, left_pad=[0, 4])
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = eager(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)


def test_gradients_equal_eager(feature_arch):
    model = feature_model(feature_arch)
    eager = with_attn(model, "eager")
    ids, mask = random_batch(2, 11, left_pad=[0, 3])
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 3] = -100  # predicted from a padding row, which has no valid key (implementations differ there)
    for m in (model, eager):
        m.train()
        m.zero_grad()
        m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=name)
    if feature_arch == "gpt_oss":
        assert retmask.hf.head_layout(model).layers[0].sinks.grad.abs().sum() > 0, "the sinks get a gradient"


def test_generate_equals_eager(feature_arch):
    """Prompt 9 + 8 new tokens with a window of 5: local layers' caches drop keys while generating."""
    model = feature_model(feature_arch)
    eager = with_attn(model, "eager")
    ids, mask = random_batch(3, 9, left_pad=[0, 2, 5], seed=3)
    kw = dict(
        max_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        got = model.generate(input_ids=ids, attention_mask=mask, **kw)
        want = eager.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=1e-4, rtol=1e-4)


def _eager_step(model, ids, mask, cache):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, output_attentions=True)
    return out.attentions


def test_capture_equals_eager_argmax_prefill_chunk_decode(feature_arch):
    """Prefill 8 tokens, a chunk of 4 against the cache, then 3 decode steps: the captured argmax (absolute
    positions) equals eager's, whose weights cover only the keys a local layer's cache still holds."""
    model = feature_model(feature_arch)
    eager = with_attn(model, "eager")
    ids, mask = random_batch(2, 15, left_pad=[0, 3], seed=5)
    steps = [(0, 8), (8, 12), (12, 13), (13, 14), (14, 15)]
    ours, theirs = DynamicCache(config=model.config), DynamicCache(config=eager.config)
    for start, stop in steps:
        chunk, seen = ids[:, start:stop], mask[:, :stop]
        with retmask.capture_argmax(model, rows=None) as cap, torch.no_grad():
            model(input_ids=chunk, attention_mask=seen, cache=ours, use_cache=True)
        weights = _eager_step(eager, chunk, seen, theirs)
        for layer, w in enumerate(weights):  # w: [B, Hq, S, kv_len of this layer]
            offset = stop - w.shape[-1]  # keys a sliding cache dropped
            got = cap.last[layer]
            local = torch.where(got >= 0, got - offset, got)
            valid_rows = seen[:, start:stop].bool()[:, None, :].expand_as(local)
            assert_argmax_matches(local[valid_rows], w[valid_rows])  # padding query rows excluded
            if layer_is_local(model, layer):
                pos = torch.arange(start, stop, device=got.device)
                assert bool(((got > pos - WINDOW) | (got < 0)).all()), (
                    "a local layer's argmax is in its window"
                )


def test_capture_reads_the_cache_under_either_keyword():
    """transformers still takes the cache as ``past_key_values=`` (deprecated for ``cache=``): the capture
    must see its length under either name, or a sliding layer's argmax stays window-relative."""
    model = feature_model("mistral")
    ids, mask = random_batch(1, 14, seed=5)
    captured = {}
    for keyword in ("cache", "past_key_values"):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :10], attention_mask=mask[:, :10], use_cache=True, **{keyword: cache})
            with retmask.capture_argmax(model, rows=None) as cap:
                model(input_ids=ids[:, 10:], attention_mask=mask, use_cache=True, **{keyword: cache})
        captured[keyword] = cap.last
    assert int(captured["cache"].max()) >= 10  # absolute positions past the window (WINDOW < 10)
    assert torch.equal(captured["past_key_values"], captured["cache"])


def layer_is_local(model, layer: int) -> bool:
    kinds = getattr(model.config, "layer_types", None)
    if kinds is None:
        return getattr(model.config, "sliding_window", None) is not None
    return kinds[layer] == "sliding_attention"


def test_head_mask_equals_o_proj_zeroing(feature_arch):
    model = feature_model(feature_arch)
    heads = [(0, 1), (1, 0), (1, 3)]
    zeroed = zeroed_copy(model, heads, attn="eager")
    retmask.set_head_mask(model, heads)
    ids, mask = random_batch(2, 12, left_pad=[0, 2], seed=7)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = zeroed(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)


def test_bidirectional_sliding_overlay_is_refused():
    """Gemma 3 used as a bidirectional encoder adds an overlay retmask cannot express: a clear error."""
    config = tiny_config("gemma3_text", **FEATURE_ARCHS["gemma3_text"], use_bidirectional_attention=True)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    retmask.patch(model.to(TEST_DEVICE).eval())
    ids, _ = random_batch(1, 8)
    with pytest.raises(NotImplementedError, match="gemma3_text.*attention pattern"), torch.no_grad():
        model(input_ids=ids)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        (
            "qwen2_moe",
            dict(
                use_sliding_window=True,
                sliding_window=WINDOW,
                max_window_layers=0,
                layer_types=["sliding_attention"] * 2,
                num_experts=2,
                num_experts_per_tok=1,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
            ),
        ),  # fmt: skip
        ("phimoe", dict(sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1)),
    ],
)
def test_a_sliding_mask_without_a_window_argument_is_refused(arch, overrides):
    """These models build a sliding-window mask but never pass ``sliding_window`` to the attention
    function, from which the kernel takes it: refused rather than attending to keys eager masks out."""
    torch.manual_seed(0)
    config = tiny_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    retmask.patch(model.to(TEST_DEVICE).eval())
    ids, mask = random_batch(1, 14, [0])
    refused = (
        f"'{arch}' uses a sliding-window mask of {WINDOW} keys while its attention call passes no window"
    )
    with torch.no_grad(), pytest.raises(NotImplementedError, match=refused):
        model(input_ids=ids, attention_mask=mask)


def test_an_unknown_tensor_argument_warns_once_known_ones_do_not():
    """A model passing attention inputs under a name retmask does not know gets a warning, not silence."""
    import warnings

    from retmask.hf.interface import UnknownAttentionArgumentWarning, retmask_attention

    model = feature_model("mistral")
    module = retmask.hf.head_layout(model).layers[0]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 6, 16, generator=g) for n in (4, 2, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        retmask_attention(module, q, k, v, None, position_ids=torch.arange(6)[None])
        assert not [w for w in caught if w.category is UnknownAttentionArgumentWarning]
        retmask_attention(module, q, k, v, None, sinks=torch.zeros(4))
    hits = [w for w in caught if w.category is UnknownAttentionArgumentWarning]
    assert len(hits) == 1 and "passes sinks to its attention function" in str(hits[0].message)


@pytest.mark.parametrize(
    "extra, problem",
    [
        ({"sinks": torch.zeros(4)}, UserWarning),
        ({"position_bias": torch.zeros(1, 4, 6, 6)}, NotImplementedError),
        ({"cu_seq_lens_q": torch.tensor([0, 6])}, ValueError),  # without cu_seq_lens_k
        ({"output_attentions": True}, ValueError),
    ],
)
def test_routine_arguments_do_not_hide_a_problem_beside_them(extra, problem):
    """Arguments every decode step passes (position ids, use_cache, ...) skip the argument scan only when
    they are all there is: one more argument beside them is still warned about or refused."""
    import warnings

    from retmask.hf.interface import ROUTINE_ARGS, UnknownAttentionArgumentWarning, retmask_attention

    model = feature_model("mistral")
    module = retmask.hf.head_layout(model).layers[0]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 6, 16, generator=g) for n in (4, 2, 2))
    routine = dict(position_ids=torch.arange(6)[None], cache_position=torch.arange(6), use_cache=True)
    assert routine.keys() <= ROUTINE_ARGS
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if problem is UserWarning:
            retmask_attention(module, q, k, v, None, **routine, **extra)
            assert [w for w in caught if w.category is UnknownAttentionArgumentWarning]
        else:
            with pytest.raises(problem):
                retmask_attention(module, q, k, v, None, **routine, **extra)


@pytest.mark.parametrize("qk_dim, v_dim", [(24, 16), (24, 32)])
def test_query_key_and_value_heads_of_different_widths(qk_dim, v_dim):
    """Multi-head latent attention gives the attention function q / k heads of one width and v heads of
    another: the output (v's width) and its gradients equal SDPA's, which takes them natively, with the
    default scale of the unpadded query."""
    from retmask.hf.interface import retmask_attention

    module = tiny_model_attention()
    gen = torch.Generator().manual_seed(qk_dim + v_dim)
    q = torch.randn(2, 4, 7, qk_dim, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 7, qk_dim, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 7, v_dim, generator=gen, requires_grad=True)
    out, _ = retmask_attention(module, q, k, v, None, scaling=None)  # [B, S, Hq, Dv]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-5, rtol=1e-5)
    grad = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(want.transpose(1, 2), (q, k, v), grad)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def tiny_model_attention() -> torch.nn.Module:
    """The first attention module of a tiny Llama on retmask attention (the attention function's module)."""
    config = tiny_config("llama")
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="retmask")
    return model.model.layers[0].self_attn
