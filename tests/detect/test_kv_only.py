"""``kv_only``: the cache it leaves equals a full forward's bit for bit, the skipped work is
really skipped (the last layer's heads and MLP, the LM head), and masks, MLPs and the head are restored
afterwards."""

from __future__ import annotations

import pytest
import torch

import retmask
from retmask.detect.kv_only import kv_only
from retmask.hf.kv_cache import growing_cache, reserve
from retmask.hf.layers import head_layout
from tests.detect.test_fast_equals_oracle import tiny_local_global
from tests.hf.test_attention_features import feature_model
from tests.tiny import tiny_llama


def _chunked_prefill(model, ids: torch.Tensor, chunk: int, skip: bool):
    """Fill a fresh cache with ``ids`` [1, N] in calls of ``chunk`` tokens; return it and the last logits."""
    ids = ids.to(model.device)
    cache = growing_cache(model)
    reserve(cache, ids.shape[1])
    logits = None
    with torch.no_grad():
        for a in range(0, ids.shape[1], chunk):
            if skip:
                with kv_only(model):
                    logits = model(input_ids=ids[:, a : a + chunk], cache=cache, use_cache=True).logits
            else:
                logits = model(input_ids=ids[:, a : a + chunk], cache=cache, use_cache=True).logits
    return cache, logits


MODELS = {
    "llama": lambda: tiny_llama(vocab=50, layers=3),
    "gemma3-local-global": lambda: tiny_local_global(window=24),
    # a mixture of experts named GptOssMLP that returns (hidden_states, router_scores): it must run
    "gpt-oss": lambda: feature_model("gpt_oss"),
}


@pytest.mark.parametrize(
    "name, impl",
    [(name, impl) for name in ("llama", "gemma3-local-global") for impl in ("retmask", "sdpa")]
    + [("gpt-oss", "retmask"), ("gpt-oss", "eager")],  # transformers has no SDPA path for gpt-oss
)
def test_cache_is_bit_identical_to_a_full_forward(name, impl):
    model = MODELS[name]()
    model.set_attn_implementation(impl)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, 203), generator=torch.Generator().manual_seed(2))
    want, want_logits = _chunked_prefill(model, ids, 64, skip=False)
    got, got_logits = _chunked_prefill(model, ids, 64, skip=True)
    for layer_want, layer_got in zip(want.layers, got.layers, strict=True):
        assert torch.isfinite(layer_got.keys).all()
        torch.testing.assert_close(layer_got.keys, layer_want.keys, rtol=0, atol=0)
        torch.testing.assert_close(layer_got.values, layer_want.values, rtol=0, atol=0)
    # The outputs are what was skipped: they differ (else the test would not show that anything was skipped).
    assert not torch.allclose(got_logits, want_logits)


def test_last_layer_mlp_heads_and_lm_head_are_skipped_and_restored():
    model = tiny_llama(vocab=50, layers=3)
    calls = {i: 0 for i in range(3)}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate_proj.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    attention = head_layout(model).layers[-1]
    ids = torch.randint(3, 50, (1, 20), generator=torch.Generator().manual_seed(0)).to(model.device)
    with torch.no_grad(), kv_only(model):
        assert attention._retmask_skip.tolist() == [True] * 4
        logits = model(input_ids=ids).logits
    assert calls == {0: 1, 1: 1, 2: 0}  # the last layer's MLP did not run
    # the LM head returned zeros of the logits' shape and dtype (its random weights give no exact zeros)
    assert logits.shape == (1, 20, 50) and logits.dtype == model.dtype and not logits.any()
    assert "forward" not in vars(model.model.layers[-1].mlp) and attention._retmask_skip is None
    assert "forward" not in vars(model.lm_head)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert calls == {0: 2, 1: 2, 2: 1}  # and runs again afterwards
    assert logits.any()


def test_an_existing_shared_head_mask_is_restored():
    model = tiny_llama(vocab=50, layers=3)
    retmask.set_head_mask(model, [(2, 1), (0, 3)])
    first, last = head_layout(model).layers[0], head_layout(model).layers[-1]
    before_first, before_last = first._retmask_skip.clone(), last._retmask_skip.clone()
    with torch.no_grad(), kv_only(model):
        assert last._retmask_skip.tolist() == [True] * 4
        torch.testing.assert_close(
            first._retmask_skip, before_first, rtol=0, atol=0
        )  # other layers untouched
        model(
            input_ids=torch.randint(3, 50, (1, 16), generator=torch.Generator().manual_seed(0)).to(
                model.device
            )
        )
    torch.testing.assert_close(last._retmask_skip, before_last, rtol=0, atol=0)


def test_a_per_row_head_mask_keeps_its_batch_check_and_is_restored():
    model = tiny_llama(vocab=50, layers=3)
    heads = torch.zeros(2, 3, 4, dtype=torch.bool)
    heads[1, 2, 0] = True
    retmask.set_head_mask(model, heads)
    last = head_layout(model).layers[-1]
    before = last._retmask_skip.clone()
    ids = torch.randint(3, 50, (2, 16), generator=torch.Generator().manual_seed(0)).to(model.device)
    with torch.no_grad(), kv_only(model):
        assert last._retmask_skip.shape == (2, 4) and bool(last._retmask_skip.all())
        model(input_ids=ids)
        with pytest.raises(ValueError, match="per-row head mask was set for batch size 2"):
            model(input_ids=ids[:1])
    torch.testing.assert_close(last._retmask_skip, before, rtol=0, atol=0)


def test_an_instance_forward_of_the_head_and_mlp_is_restored():
    """A module whose forward is already an instance attribute (accelerate's hooks wrap modules that way)
    gets that forward back after the block, not the class's."""
    model = tiny_llama(vocab=50, layers=3)
    wrapped = []
    for module in (model.lm_head, model.model.layers[-1].mlp):
        inner = module.forward

        def forward(*args, _inner=inner, _module=module, **kwargs):
            wrapped.append(type(_module).__name__)
            return _inner(*args, **kwargs)

        module.forward = forward
    ids = torch.randint(3, 50, (1, 12), generator=torch.Generator().manual_seed(0)).to(model.device)
    with torch.no_grad(), kv_only(model):
        model(input_ids=ids)
    assert wrapped == []  # inside the block neither wrapper ran: the zeros did
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert sorted(wrapped) == ["Linear", "LlamaMLP"] and logits.any()


def test_only_dense_mlps_are_replaced():
    """A dense MLP's linear layers (GPT-2's Conv1D included) hold all its parameters; gpt-oss's ``GptOssMLP``
    holds a router and stacked experts and returns a tuple, so it is left to run."""
    from retmask.detect.kv_only import _dense_mlp
    from tests.hf.conftest import tiny_model

    for model in (tiny_llama(vocab=50), tiny_model("gpt2")):
        layer = model.model.layers[-1] if hasattr(model, "model") else model.transformer.h[-1]
        assert _dense_mlp(layer) is layer.mlp
    gpt_oss = feature_model("gpt_oss")
    assert _dense_mlp(gpt_oss.model.layers[-1]) is None
