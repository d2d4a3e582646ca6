"""The in-place KV cache (``GrowingLayer``) computes exactly what transformers' DynamicCache does."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from retmask.hf.kv_cache import GrowingLayer, growing_cache, reserve
from tests.tiny import tiny_llama


def _poison_spare_capacity(cache) -> None:
    """NaN in every buffer slot past the filled length: a read of an unwritten slot shows in the output."""
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        layer._key_buffer[..., layer._length :, :] = float("nan")
        layer._value_buffer[..., layer._length :, :] = float("nan")


@pytest.mark.parametrize("impl", ["retmask", "sdpa", "eager"])
def test_growing_cache_equals_dynamic_cache(impl):
    model = tiny_llama(vocab=50)
    model.set_attn_implementation(impl)
    ids = torch.randint(3, 50, (1, 700), generator=torch.Generator().manual_seed(1)).to(model.device)
    ref, ours = DynamicCache(config=model.config), growing_cache(model)
    assert all(isinstance(layer, GrowingLayer) for layer in ours.layers)
    # chunked prefill across several capacity doublings (256 -> 512 -> 1024), then passes with crops
    steps = [(0, 200), (200, 301), (301, 600), (600, 609), (-5, 0), (609, 612), (-2, 0), (612, 700)]
    with torch.no_grad():
        for a, b in steps:
            if a < 0:  # crop: drop -a positions
                ref.crop(a)
                ours.crop(a)
                assert ours.get_seq_length() == ref.get_seq_length()
                continue
            x = ids[:, a:b]
            want = model(input_ids=x, cache=ref, use_cache=True).logits
            _poison_spare_capacity(ours)
            got = model(input_ids=x, cache=ours, use_cache=True).logits
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert ours.get_seq_length() == ref.get_seq_length()
    for lr, lo in zip(ref.layers, ours.layers, strict=True):
        torch.testing.assert_close(lo.keys, lr.keys, rtol=0, atol=0)
        torch.testing.assert_close(lo.values, lr.values, rtol=0, atol=0)


def test_growing_layer_views_crop_and_reset():
    layer = GrowingLayer()
    k = torch.randn(1, 2, 300, 4)
    keys, values = layer.update(k, -k)
    assert layer.get_seq_length() == 300 and layer._key_buffer.shape[-2] == 300  # max(256, needed)
    assert keys.data_ptr() == layer._key_buffer.data_ptr()  # a view, no copy
    torch.testing.assert_close(values, -k, rtol=0, atol=0)
    layer.crop(-100)
    assert layer.get_seq_length() == 200 and layer.keys.shape[-2] == 200
    k2 = torch.randn(1, 2, 150, 4)
    keys, _ = layer.update(k2, k2)
    assert layer._key_buffer.shape[-2] == 600  # doubled, old content moved
    torch.testing.assert_close(keys, torch.cat([k[..., :200, :], k2], dim=-2), rtol=0, atol=0)
    with pytest.raises(ValueError, match="negative"):
        layer.crop(5)
    layer.crop(-1000)
    assert layer.get_seq_length() == 0
    layer.reset()
    assert layer.get_seq_length() == 0 and not layer.is_initialized


def test_another_batch_is_refused_before_the_cache_is_written():
    """A cache reused for a smaller batch used to broadcast the new keys into every row of its buffer."""
    layer = GrowingLayer()
    k = torch.randn(2, 2, 5, 4)
    layer.update(k, -k)
    with pytest.raises(
        ValueError, match=r"holds keys of \[batch, kv heads\] = \[2, 2\] but the call brings \[1, 2\]"
    ):
        layer.update(k[:1, :, :1], k[:1, :, :1])
    assert layer.get_seq_length() == 5
    torch.testing.assert_close(layer.keys, k, rtol=0, atol=0)  # untouched


def test_reserve_allocates_exactly_the_hint_and_never_doubles():
    cache = growing_cache(tiny_llama(vocab=50))
    reserve(cache, 1000)
    layer = cache.layers[0]
    k = torch.randn(1, 2, 300, 16)
    layer.update(k, k)
    assert layer._key_buffer.shape[-2] == 1000
    more = torch.randn(1, 2, 700, 16)
    layer.update(more, more)  # fills it exactly: no new buffer
    assert layer._key_buffer.shape[-2] == 1000 and layer.get_seq_length() == 1000
    reserve(cache, 1500)
    layer.update(k[..., :1, :], k[..., :1, :])  # past the old capacity: the new hint, not 2 x 1000
    assert layer._key_buffer.shape[-2] == 1500


@pytest.mark.parametrize(
    "op", ["tile_batch", "batch_select_indices", "batch_repeat_interleave", "reorder_cache"]
)
def test_batch_reshuffles_rebuild_the_buffers(op):
    """After a reshuffle the layer appends in place to the new rows, like a DynamicLayer does by cat."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 5, 4, generator=g), torch.randn(3, 2, 5, 4, generator=g)
    ours, ref = GrowingLayer(), DynamicLayer()
    ours.capacity_hint = 16
    ours.update(k, v)
    ref.update(k, v)
    arg = {"tile_batch": 2, "batch_select_indices": torch.tensor([2, 0]), "batch_repeat_interleave": 2,
           "reorder_cache": torch.tensor([1, 1, 0])}[op]  # fmt: skip
    getattr(ours, op)(arg)
    if op == "tile_batch":
        ref.keys, ref.values = torch.cat([ref.keys] * 2), torch.cat([ref.values] * 2)
    else:
        getattr(ref, op)(arg)
    rows = ref.keys.shape[0]
    assert ours._key_buffer.shape == (rows, 2, 16, 4)  # the reserved capacity is kept
    more = torch.randn(rows, 2, 3, 4, generator=g)
    got, want = ours.update(more, -more), ref.update(more, -more)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got[0].data_ptr() == ours._key_buffer.data_ptr()


def test_beam_search_on_the_growing_cache_equals_the_dynamic_cache():
    model = tiny_llama(vocab=50)
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=2)
    with torch.no_grad():
        want = model.generate(input_ids=ids, **kw)
        got = model.generate(input_ids=ids, **kw, cache=growing_cache(model))
    assert torch.equal(got, want)


def test_growth_past_the_capacity_hint_doubles():
    """Past a too-small hint the buffer doubles (amortised O(1) appends), not one allocation per token."""
    layer = GrowingLayer()
    layer.capacity_hint = 8
    k = torch.randn(1, 1, 8, 4)
    layer.update(k, k)
    assert layer._key_buffer.shape[-2] == 8  # the hint, exactly
    allocations = set()
    for _ in range(20):
        one = torch.randn(1, 1, 1, 4)
        layer.update(one, one)
        allocations.add(layer._key_buffer.data_ptr())
    assert layer._key_buffer.shape[-2] >= 28 and len(allocations) <= 3


def test_cache_layers_are_described_in_words_not_transformers_classes():
    """Refusals (head-sparse cache, fixed-shape passes) name what a layer keeps, with runs of layers."""
    import types

    from retmask.hf.kv_cache import FULL, SLIDING, cache_layer_kinds, describe_layers
    from tests.hf.conftest import tiny_config
    from tests.hf.test_architectures import ARCHITECTURES

    def kinds(name: str, **overrides) -> dict[str, list[int]]:
        config = tiny_config(name, **{**ARCHITECTURES[name], **overrides})
        return cache_layer_kinds(types.SimpleNamespace(config=config))

    assert kinds("gemma3n_text") == {
        SLIDING: [0],
        FULL: [1],
        "nothing (such a layer reuses another layer's cache or needs none)": [2, 3],
    }
    nemotron_h = kinds("nemotron_h")  # layer 2 is an MLP-only layer: no cache at all
    assert describe_layers(nemotron_h) == (
        "layer 0 holds a recurrent state (linear attention or a state-space layer); layers 1, 3 hold keys "
        "and values of full attention; layer 2 holds nothing (such a layer reuses another layer's cache or "
        "needs none)"
    )
    assert kinds("gpt2", num_hidden_layers=5) == {FULL: [0, 1, 2, 3, 4]}
    assert describe_layers({SLIDING: [0, 1, 2, 4, 5, 7], FULL: [3, 6]}) == (
        "layers 0-2, 4-5, 7 hold keys and values of sliding-window attention; layers 3, 6 hold keys and "
        "values of full attention"
    )
