"""The in-place KV cache (``GrowingLayer``) computes exactly what transformers' DynamicCache does."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from retmask.detect.kv_cache import GrowingLayer, growing_cache, reserve
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
    ids = torch.randint(3, 50, (1, 700), generator=torch.Generator().manual_seed(1))
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
            want = model(input_ids=x, past_key_values=ref, use_cache=True).logits
            _poison_spare_capacity(ours)
            got = model(input_ids=x, past_key_values=ours, use_cache=True).logits
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


def test_fast_detector_cache_holds_no_more_than_the_longest_test_needs():
    from retmask.detect import FastDetector

    from .test_fast_equals_oracle import tiny_prompts

    model = tiny_llama()
    fast = FastDetector(model, {2}, max_new_tokens=30, chunk=64)
    longest = 0
    for prompt, span in tiny_prompts():
        fast.run(prompt, span)
        longest = max(longest, len(prompt) + 30)
        for layer in fast.cache.layers:
            assert layer._key_buffer.shape[-2] <= longest
