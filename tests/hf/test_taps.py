"""tap_qk hands out the post-RoPE q / k exactly as recomputed from the layer weights, keeps autograd,
and leaves the model's outputs unchanged."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from retmask.hf.taps import tap_qk

from .conftest import random_batch, tiny_model


def _by_hand(model, ids, mask, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, S, D], k [B, Hkv, S, D] of ``layer`` from its input hidden state, q_proj/k_proj and RoPE."""
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    block = model.model.layers[layer]
    attn = block.self_attn
    h = block.input_layernorm(out.hidden_states[layer])  # hidden_states[l] = input of layer l
    B, S, _ = h.shape
    D = attn.head_dim
    q = attn.q_proj(h).view(B, S, -1, D).transpose(1, 2)
    k = attn.k_proj(h).view(B, S, -1, D).transpose(1, 2)
    positions = torch.arange(S)[None].expand(B, S)
    cos, sin = model.model.rotary_emb(h, positions)
    return apply_rotary_pos_emb(q, k, cos, sin)


@torch.no_grad()
def test_tap_equals_q_k_by_hand_and_outputs_unchanged():
    model = tiny_model("llama")
    ids, mask = random_batch(2, 10)
    ref_logits = model(input_ids=ids, attention_mask=mask).logits
    with tap_qk(model, layers=[0, 1]) as tap:
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(logits, ref_logits)
    for layer in (0, 1):
        q, k = _by_hand(model, ids, mask, layer)
        assert tap.q[layer].shape == (2, 4, 10, 16) and tap.k[layer].shape == (2, 2, 10, 16)
        torch.testing.assert_close(tap.q[layer], q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tap.k[layer], k, rtol=1e-5, atol=1e-5)
        assert tap.scaling[layer] == pytest.approx(16**-0.5)
    assert tap.num_kv_groups == 2
    # Outside the context nothing is recorded or hooked.
    assert all(m.self_attn._retmask_tap is None for m in model.model.layers)


@torch.no_grad()
def test_query_rows_select_last_and_per_batch_rows():
    model = tiny_model("llama")
    ids, mask = random_batch(3, 9)
    with tap_qk(model, layers=[1]) as full:
        model(input_ids=ids, attention_mask=mask)
    q_all = full.q[1]
    with tap_qk(model, layers=[1], query_rows=2) as last:
        model(input_ids=ids, attention_mask=mask)
    assert torch.equal(last.q[1], q_all[:, :, -2:])
    rows = torch.tensor([3, 8, 0])
    with tap_qk(model, layers=[1], query_rows=rows) as per_row:
        model(input_ids=ids, attention_mask=mask)
    assert per_row.q[1].shape == (3, 4, 1, 16)
    for b, r in enumerate(rows.tolist()):
        assert torch.equal(per_row.q[1][b, :, 0], q_all[b, :, r])
    assert 0 not in per_row.q  # untapped layer


def test_tap_keeps_autograd_into_projections():
    model = tiny_model("llama")
    ids, mask = random_batch(1, 8)
    with tap_qk(model, layers=[1], query_rows=1) as tap:
        model(input_ids=ids, attention_mask=mask)
    attn = model.model.layers[1].self_attn
    loss = tap.q[1][0, 3].sum() + tap.k[1][0, 0].sum()  # query head 3 (KV group 1), KV head 0
    loss.backward()
    gq, gk = attn.q_proj.weight.grad, attn.k_proj.weight.grad
    assert gq[3 * 16 : 4 * 16].abs().sum() > 0 and gq[: 3 * 16].abs().sum() == 0
    assert gk[:16].abs().sum() > 0 and gk[16:].abs().sum() == 0


@pytest.mark.parametrize("rows", [None, 2, torch.tensor([[1, 6], [7, 0]])], ids=["all", "last", "per-row"])
@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward-after", "backward-inside"])
def test_tap_under_activation_checkpointing_gives_the_same_gradients(rows, backward_inside):
    """With activation checkpointing each layer runs again in the backward pass (without the tap once it has
    closed, with it inside the block): the checkpoint's check that both runs save the same tensors holds,
    and the gradients of a loss on the tapped q / k and the logits equal those without checkpointing."""
    ids, mask = random_batch(2, 8)
    grads = []
    for checkpointing in (False, True):
        model = tiny_model("llama")
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable()  # non-reentrant, transformers' default
        with tap_qk(model, layers=[0, 1], query_rows=rows) as tap:
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            loss = (
                logits.square().mean() + (tap.q[1] * tap.k[1].mean(2, keepdim=True).repeat(1, 2, 1, 1)).sum()
            )
            loss = loss + tap.q[0].square().sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    plain, checkpointed = grads
    assert plain.keys() == checkpointed.keys() and any("q_proj" in n for n in plain)
    for n in plain:
        torch.testing.assert_close(checkpointed[n], plain[n], rtol=1e-5, atol=1e-6, msg=n)


def test_bad_arguments_are_clear():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="not in 0..1"):
        tap_qk(model, layers=[2])
    # int() would turn these into layers nobody asked for (0.7 -> 0, True -> 1, "01" -> 0 and 1)
    for layers, message in [([0.7], "must be ints, got 0.7"), ([True], "must be ints, got True"),
                            ("01", "must be a list of layer indices"), (1, "must be a list of layer indices")]:  # fmt: skip
        with pytest.raises(TypeError, match=message):
            tap_qk(model, layers=layers)
    assert tap_qk(model, layers=[torch.tensor(1)]).layers == [1]
    with pytest.raises(ValueError, match="query_rows"):
        tap_qk(model, query_rows=0)
    ids, mask = random_batch(2, 5)
    with pytest.raises(ValueError, match="outside"), tap_qk(model, query_rows=torch.tensor([1, 5])):
        model(input_ids=ids, attention_mask=mask)
    eager = tiny_model("llama", attn="eager")
    with pytest.raises(ValueError, match="retmask attention"):
        tap_qk(eager)


@torch.no_grad()
def test_tap_on_a_hybrid_model_keys_layers_by_attention_layer():
    """LFM2 with convolution layers 0 and 2: tap layer 1 is the attention of decoder layer 3, and its q / k
    give eager attention's weights of that layer."""
    import transformers

    import retmask

    from .conftest import tiny_config, with_attn
    from .test_architectures import HYBRIDS

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("lfm2", **HYBRIDS["lfm2"])).eval()
    model = retmask.patch(model)
    ids, _ = random_batch(1, 9)
    with tap_qk(model, layers=[1]) as tap:
        model(input_ids=ids)
    assert sorted(tap.q) == [1]
    weights = with_attn(model, "eager")(input_ids=ids, output_attentions=True).attentions[1]  # [1, Hq, 9, 9]
    k = tap.k[1].repeat_interleave(tap.num_kv_groups, dim=1)
    logits = (tap.q[1] @ k.transpose(-1, -2)) * tap.scaling[1]
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(
        logits.masked_fill(~causal, float("-inf")).softmax(-1), weights, atol=1e-5, rtol=1e-4
    )


@torch.no_grad()
def test_switching_attention_inside_a_tap_is_refused_not_stale():
    """Moved to SDPA inside the tap, a forward call would leave the previous call's q / k in the tap: it is
    refused. A head mask on the same layer keeps its own guard after the tap ends."""
    import retmask
    from retmask.hf.layers import head_layout

    model = tiny_model("llama")
    ids, mask = random_batch(2, 10)
    layers = head_layout(model).layers
    with retmask.head_mask(model, [(1, 0)]):
        with tap_qk(model, layers=[0, 1]):
            model(input_ids=ids, attention_mask=mask)
            model.set_attn_implementation("sdpa")
            with pytest.raises(ValueError, match=r"^tap_qk is active on this model, .*'sdpa'"):
                model(input_ids=ids, attention_mask=mask)
            retmask.patch(model)
        assert not layers[0]._forward_pre_hooks and len(layers[1]._forward_pre_hooks) == 1
        model.set_attn_implementation("sdpa")
        with pytest.raises(ValueError, match=r"^a head mask is active"):
            model(input_ids=ids, attention_mask=mask)
        retmask.patch(model)
    assert not any(m._forward_pre_hooks for m in layers)
