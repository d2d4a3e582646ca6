"""generate_copies: a prefill shared by stacked prompt copies gives generate's own tokens and logits."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import retmask
from retmask.hf.generation import generate_copies
from retmask.hf.layers import decoder_layers, head_layout
from retmask.hf.shared_prefill import shared_layers

from .conftest import random_batch, tiny_model
from .test_attention_features import feature_model

B = 3  # distinct prompts; the batch holds them twice (chosen rows, then rejected rows)


def _copies(seq: int = 9, left_pad: tuple[int, ...] = (0, 3, 5)) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = random_batch(B, seq, list(left_pad), seed=4)
    return torch.cat([ids, ids]), torch.cat([mask, mask])


def _rejected_mask(num_layers: int, num_heads: int, layer: int) -> torch.Tensor:
    """bool [2B, L, Hq]: rows B.. mask heads 0 and 2 of ``layer`` and head 1 of the top layer; every row
    masks head 3 of the bottom layer (the copies agree on it: it applies in the shared part too)."""
    mask = torch.zeros(2 * B, num_layers, num_heads, dtype=torch.bool)
    mask[:, 0, 3] = True
    mask[B:, layer, 0] = mask[B:, layer, 2] = True
    mask[B:, num_layers - 1, 1] = True
    return mask


def _config(new_tokens: int = 6) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=2,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip


def _rows_per_call(model: torch.nn.Module) -> tuple[list[int], list[int]]:
    """Records the batch size every call of the bottom and the top decoder layer sees."""
    blocks = decoder_layers(model)
    bottom, top = [], []
    blocks[0].register_forward_pre_hook(
        lambda m, a, k: bottom.append(_hidden(a, k).shape[0]), with_kwargs=True
    )
    blocks[-1].register_forward_pre_hook(lambda m, a, k: top.append(_hidden(a, k).shape[0]), with_kwargs=True)
    return bottom, top


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _no_hooks(model: torch.nn.Module, allowed: int) -> bool:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == allowed


CASES = [
    ("llama", 4, 2),
    ("llama", 4, 0),
    ("mistral", 2, 1),
    ("qwen2", 2, 1),
    ("gemma3_text", 2, 1),
    ("gpt_oss", 2, 1),
]


@pytest.mark.parametrize("arch, layers, masked_layer", CASES)
def test_shared_prefill_gives_generates_tokens_and_logits(arch, layers, masked_layer):
    if arch == "llama":
        model = tiny_model("llama", num_hidden_layers=layers)
    else:
        model = feature_model(arch)
    layout = head_layout(model)
    mask = _rejected_mask(layout.num_layers, layout.num_heads, masked_layer)
    ids, attn = _copies()
    with retmask.head_mask(model, mask), torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=attn, generation_config=_config())
    split = shared_layers(ids, mask, 2, layout.num_layers)
    assert split == min(masked_layer, layout.num_layers - 1)
    bottom, top = _rows_per_call(model)
    got = generate_copies(model, ids, attn, _config(), copies=2, head_mask=mask)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    if split:  # the prefill ran the bottom layer on the distinct prompts only, the top one on every row
        assert bottom[0] == B and top[0] == 2 * B
    assert set(bottom[1:]) == set(top[1:]) == {2 * B}  # decoding: every row
    assert _no_hooks(model, allowed=2)  # only the two recording hooks of this test are left
    assert all(m._retmask_skip is None and m._retmask_rows is None for m in layout.layers)  # mask restored


def test_shared_prefill_unchanged_without_sharing_and_with_sampling():
    model = tiny_model("llama", num_hidden_layers=4)
    layout = head_layout(model)
    mask = _rejected_mask(layout.num_layers, layout.num_heads, 2)
    ids, attn = _copies()
    sample = GenerationConfig(max_new_tokens=5, do_sample=True, top_k=0, pad_token_id=0, eos_token_id=2)
    outs = []
    for share in (True, False):
        torch.manual_seed(7)
        outs.append(generate_copies(model, ids, attn, sample, copies=2, head_mask=mask, share_prefill=share))
    assert torch.equal(outs[0], outs[1])


def test_shared_layers_rules():
    ids, _ = _copies()
    mask = _rejected_mask(5, 4, 3)
    assert shared_layers(ids, mask, 2, 5) == 3
    assert shared_layers(ids, None, 2, 5) == 4  # nothing differs: all but the top layer
    assert shared_layers(ids, mask[0], 2, 5) == 4  # one mask for every row
    same = mask.clone()
    same[:B] = same[B:]
    assert shared_layers(ids, same, 2, 5) == 4
    other = ids.clone()
    other[B + 1, -1] += 1  # one row is not a copy
    assert shared_layers(other, mask, 2, 5) == 0
    assert shared_layers(ids, mask, 1, 5) == 0  # not copies
    assert shared_layers(ids[:5], mask[:5], 2, 5) == 0  # 5 rows are not 2 copies
    _, attn = _copies()
    assert shared_layers(ids, mask, 2, 5, attn) == 3  # the copies' padding agrees too
    padded = attn.clone()
    padded[B, 0] = 0  # same ids, other padding: not copies
    assert shared_layers(ids, mask, 2, 5, padded) == 0
    first = mask.clone()
    first[B, 0, 1] = True
    assert shared_layers(ids, first, 2, 5) == 0  # they differ from the bottom layer on


def test_shared_prefill_error_leaves_no_hooks_and_restores_the_mask():
    model = tiny_model("llama", num_hidden_layers=4)
    layout = head_layout(model)
    mask = _rejected_mask(layout.num_layers, layout.num_heads, 2)
    ids, attn = _copies()

    def boom(*_):
        raise RuntimeError("boom")

    handle = decoder_layers(model)[3].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        generate_copies(model, ids, attn, _config(), copies=2, head_mask=mask)
    handle.remove()
    assert _no_hooks(model, allowed=0)
    assert all(m._retmask_skip is None and m._retmask_rows is None for m in layout.layers)
    got = generate_copies(model, ids, attn, _config(), copies=2, head_mask=mask)  # still works afterwards
    assert got.sequences.shape == (2 * B, ids.shape[1] + 6)


def test_decoder_layers_want_one_stack_in_layer_order():
    model = tiny_model("llama", num_hidden_layers=4)
    assert decoder_layers(model) == tuple(model.model.layers)
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[::-1])
    with pytest.raises(ValueError, match="not one ModuleList"):
        decoder_layers(model)


def test_a_model_without_a_plain_layer_stack_generates_without_sharing(monkeypatch):
    import retmask.hf.generation as generation

    model = tiny_model("llama", num_hidden_layers=4)
    layout = head_layout(model)
    mask = _rejected_mask(layout.num_layers, layout.num_heads, 2)
    ids, attn = _copies()
    with retmask.head_mask(model, mask), torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=attn, generation_config=_config())

    def no_stack(_model, _layout=None):
        raise ValueError("not one ModuleList")

    monkeypatch.setattr(generation, "decoder_layers", no_stack)
    bottom, _ = _rows_per_call(model)
    got = generate_copies(model, ids, attn, _config(), copies=2, head_mask=mask)
    assert torch.equal(got.sequences, want.sequences)
    assert bottom[0] == 2 * B  # the prefill ran on every row


def test_the_models_generation_defaults_do_not_shape_the_logits():
    """A model's generation_config may set a repetition penalty or ban repeated n-grams; generate would
    merge them into every field our config leaves unset. generate_copies decodes with our config only:
    its greedy tokens are the argmax of the model's logits, and the model's defaults are kept."""
    model = tiny_model("llama")
    model.generation_config.repetition_penalty = 50.0
    model.generation_config.no_repeat_ngram_size = 1
    ids, mask = random_batch(1, 9, [0], seed=4)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=2)
    with torch.no_grad():
        got = generate_copies(model, ids, mask, config)
        want = ids
        for _ in range(6):
            step = model(input_ids=want).logits[:, -1].argmax(-1, keepdim=True)
            want = torch.cat([want, step], dim=1)
            if step.item() == 2:
                break
        with_defaults = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert torch.equal(got, want)
    assert not torch.equal(with_defaults, want)  # the defaults would have changed the answer
    assert (
        model.generation_config.repetition_penalty == 50.0
        and model.generation_config.no_repeat_ngram_size == 1
    )


def test_an_argmax_capture_turns_the_shared_prefill_off():
    """A capture records every row of every layer; shared layers would record the first copies' rows only."""
    model = tiny_model("llama", num_hidden_layers=5)
    layout = head_layout(model)
    ids, attn = _copies()
    mask = _rejected_mask(layout.num_layers, layout.num_heads, 3)
    with retmask.capture_argmax(model, rows=1) as cap:
        out = generate_copies(model, ids, attn, _config(3), copies=2, head_mask=mask)
    assert out.sequences.shape[0] == 2 * B
    assert all(c.shape[1] == 2 * B for c in cap.calls)  # every call recorded every row


@pytest.mark.parametrize(
    "config, copies, error, message",
    [
        (None, 2, TypeError, r"config must be a transformers.GenerationConfig, got NoneType"),
        ({"max_new_tokens": 4}, 2, TypeError, r"config must be a transformers.GenerationConfig, got dict"),
        (
            _config(),
            0,
            ValueError,
            r"copies must be a whole number >= 1 that divides the batch \(6 rows.*got 0",
        ),
        (_config(), 4, ValueError, r"divides the batch \(6 rows.*got 4"),
        (_config(), 2.0, ValueError, r"copies must be a whole number.*got 2.0"),
    ],
)
def test_generate_copies_refuses_bad_arguments_by_name(config, copies, error, message):
    model = tiny_model("llama")
    ids, attn = _copies()
    assert ids.shape[0] == 6
    with pytest.raises(error, match=message):
        generate_copies(model, ids, attn, config, copies=copies)
