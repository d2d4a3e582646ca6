"""Fixed-shape verification passes (``FastDetector(static_passes=True)``): the cache's scratch tail, buffer
growth and refusals. Their equality with the step-by-step oracle is proven with the other fast-path
variants in ``test_fast_equals_oracle.py``. On a CPU they run eagerly; with RETMASK_TEST_DEVICE=cuda the
same tests replay them from CUDA graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retmask.detect import FastDetector, oracle_detect
from retmask.detect.static_passes import BUCKETS, CAPACITY_STEP, StaticPasses, bucket
from retmask.hf.kv_cache import TailLayer, growing_cache
from tests.tiny import tiny_llama

from .test_fast_equals_oracle import tiny_local_global, tiny_prompts


def test_tiny_static_passes_after_the_buffer_grows():
    """A test longer than the buffer so far reallocates it (graphs captured again on a GPU)."""
    model = tiny_llama()
    rng = np.random.default_rng(5)
    needle = rng.integers(3, 16, size=10)
    fast = FastDetector(model, {2}, max_new_tokens=20, chunk=64, static_passes=True)
    for length in (200, CAPACITY_STEP + 300, 150):
        hay = rng.integers(3, 16, size=length)
        prompt = np.concatenate([[1], hay[: length // 2], needle, hay[length // 2 :], [4, 5]]).astype(
            np.int64
        )
        span = (1 + length // 2, 1 + length // 2 + 10)
        want = oracle_detect(model, prompt, span, {2}, max_new_tokens=20, prefill_impl="retmask")
        got = fast.run(prompt, span)
        assert got.tokens == want.tokens
        np.testing.assert_array_equal(got.copies, want.copies)
    assert fast.cache.layers[0]._key_buffer.shape[-2] == 2 * CAPACITY_STEP


def test_tail_layer_appends_writes_its_tail_and_commits():
    model = tiny_llama()
    cache = growing_cache(model, TailLayer)
    layer = cache.layers[0]
    gen = torch.Generator().manual_seed(0)
    first, tail = (torch.randn(1, 2, n, 16, generator=gen) for n in (5, 3))
    layer.capacity_hint = 16
    layer.update(first, first + 1)
    layer.begin_tail(3)
    assert layer.get_seq_length() == 13  # capacity - tail: the keys end with the tail's queries
    keys, values = layer.update(tail, tail + 1)
    assert (
        keys.shape[-2] == 16
        and torch.equal(keys[..., -3:, :], tail)
        and torch.equal(values[..., :5, :], first + 1)
    )
    layer.copy_tail(torch.tensor([5, 6, 15]))  # keep two: to slots 5, 6; the third stays where it is
    layer.end_tail(2)
    assert layer.get_seq_length() == 7
    assert torch.equal(layer.keys, torch.cat([first, tail[..., :2, :]], -2))
    assert torch.equal(layer.values, torch.cat([first, tail[..., :2, :]], -2) + 1)
    with pytest.raises(ValueError, match="too few for a tail of 5 \\(needs 17\\)"):
        layer.begin_tail(5)
    layer.begin_tail(4)
    with pytest.raises(ValueError, match="a tail of 4 positions got 3 new keys"):
        layer.update(tail, tail)


def test_buckets_and_refusals():
    assert [bucket(n) for n in (1, 2, 3, 4, 9, 10, 65)] == [2, 2, 3, 5, 9, 17, 65]
    with pytest.raises(ValueError, match="longer than the largest bucket"):
        bucket(BUCKETS[-1] + 1)
    with pytest.raises(ValueError, match="max_draft <= 64"):
        FastDetector(tiny_llama(), {2}, max_draft=65, static_passes=True)
    with pytest.raises(
        ValueError,
        match=r"'gemma3_text' is not full attention throughout \(layers 0-1 hold keys and values of "
        r"sliding-window attention\): .*static_passes=False; retmask detect: drop --static-passes",
    ):
        StaticPasses(tiny_local_global())
    import transformers

    import retmask
    from tests.hf.conftest import tiny_config
    from tests.hf.test_architectures import HYBRIDS

    lfm2 = transformers.AutoModelForCausalLM.from_config(tiny_config("lfm2", **HYBRIDS["lfm2"]))
    with pytest.raises(ValueError, match="'lfm2' is a hybrid model .*leave it off"):
        FastDetector(retmask.patch(lfm2.eval()), {2}, static_passes=True)


def test_static_passes_do_not_read_uninitialised_slots(monkeypatch):
    """The unused slots between the cached part and the tail are masked keys, but a kernel's block product
    still multiplies their values by a zero weight: NaN there would poison the row. New buffers come out
    of memory holding anything, NaN here, so the cache must zero them."""
    model = tiny_llama()
    prompt, span = tiny_prompts()[2]
    want = oracle_detect(model, prompt, span, {2}, max_new_tokens=30, prefill_impl="retmask")
    new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(
        torch.Tensor, "new_empty", lambda t, *a, **k: new_empty(t, *a, **k).fill_(float("nan"))
    )
    got = FastDetector(model, {2}, max_new_tokens=30, chunk=64, static_passes=True).run(prompt, span)
    assert got.tokens == want.tokens
    np.testing.assert_array_equal(got.copies, want.copies)
