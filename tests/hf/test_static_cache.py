"""Static KV caches (``cache_implementation="static"``): the same tokens as a dynamic cache, eager and compiled.

A static cache keeps every layer's keys in a fixed-length buffer, so a compiled decode step has one shape
at every position (what CUDA graphs need). The mask function turns the unfilled slots into padding (one
query row over the whole buffer), and an eager prefill cuts the keys at the tokens so far.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch._dynamo.utils import counters
from transformers import CompileConfig

import retmask
from retmask.hf.interface import retmask_mask

from .conftest import random_batch, tiny_model, with_attn
from .test_attention_features import FEATURE_ARCHS, feature_model

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def _generate(model, ids, mask, new: int, **kw) -> torch.Tensor:
    """Greedy generate; eager unless ``compile_config`` is given (on a GPU transformers would otherwise
    compile the decode steps of a static cache by itself)."""
    kw.setdefault("disable_compile", "compile_config" not in kw)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, **GREEDY, **kw)


def _compile_config() -> CompileConfig:
    """generate's own compilation of its decode steps, on any device (transformers compiles on GPUs only
    unless told), with a backend that needs no C++ compiler: the graph is what is tested here."""
    config = CompileConfig(backend="aot_eager", mode=None, fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    return config


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_cache_generates_the_dynamic_cache_tokens(arch):
    model = tiny_model(arch)
    ids, mask = random_batch(2, 7, left_pad=[0, 3], seed=1)
    dynamic = _generate(model, ids, mask, 12)
    static = _generate(model, ids, mask, 12, cache_implementation="static")
    sdpa = _generate(with_attn(model, "sdpa"), ids, mask, 12, cache_implementation="static")
    assert torch.equal(static, dynamic) and torch.equal(static, sdpa)


@pytest.mark.parametrize("arch", sorted(FEATURE_ARCHS))
def test_static_cache_with_sliding_window_and_layer_features(arch):
    # A 3-token prompt under a 5-key window: the static sliding layers are first part-filled buffers
    # (the padding-mask path), then full rolling ones whose keys end with the queries.
    model = feature_model(arch)
    ids, mask = random_batch(2, 3, left_pad=[0, 1], seed=2)
    eager = _generate(feature_model(arch, attn="eager"), ids, mask, 9, cache_implementation="static")
    assert torch.equal(_generate(model, ids, mask, 9, cache_implementation="static"), eager)
    assert torch.equal(_generate(model, ids, mask, 9), eager)


def test_static_cache_logits_of_a_prefill_and_decode_step_equal_sdpa():
    model = tiny_model("llama")
    sdpa = with_attn(model, "sdpa")
    ids, mask = random_batch(2, 9, left_pad=[2, 0], seed=3)
    logits = []
    for m in (model, sdpa):
        cache = transformers.StaticCache(config=m.config, max_cache_len=16)
        with torch.no_grad():
            first = m(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits
            step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            step = m(input_ids=ids[:, -1:], attention_mask=step_mask, cache=cache, use_cache=True)
        logits.append((first, step.logits))
    for got, want in zip(logits[0], logits[1], strict=True):
        valid = mask.bool() if got.shape[1] > 1 else torch.ones_like(got[..., 0], dtype=torch.bool)
        torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)


def test_static_cache_with_per_row_head_masks_and_argmax_capture():
    model = tiny_model("llama")
    ids, mask = random_batch(2, 7, left_pad=[0, 2], seed=4)
    heads = torch.zeros(2, 2, 4, dtype=torch.bool)
    heads[0, 0, 1] = heads[1, 1, 2] = True
    outputs = {}
    for kind in ("dynamic", "static"):
        kw = {"cache_implementation": "static"} if kind == "static" else {}
        with retmask.head_mask(model, heads), retmask.capture_argmax(model, rows=1) as cap:
            tokens = _generate(model, ids, mask, 8, **kw)
        outputs[kind] = tokens, torch.stack([c[..., -1] for c in cap.calls])  # [steps, L, B, Hq]
    assert torch.equal(outputs["static"][0], outputs["dynamic"][0])
    assert torch.equal(outputs["static"][1], outputs["dynamic"][1])
    assert (outputs["static"][1][:, 0, 0, 1] == -1).all() and (outputs["static"][1][:, 1, 1, 2] == -1).all()


def test_compiled_generate_with_a_static_cache_is_one_graph_for_every_step():
    model = tiny_model("llama")
    ids, mask = random_batch(2, 7, left_pad=[0, 3], seed=5)
    dynamic = _generate(model, ids, mask, 10)
    torch._dynamo.reset()
    counters.clear()
    compiled = _generate(
        model, ids, mask, 10, cache_implementation="static", compile_config=_compile_config()
    )
    assert torch.equal(compiled, dynamic)
    # The prefill runs eagerly; the 9 decode steps are one graph, traced once (no recompile per position).
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_compiled_decode_step_builds_its_static_mask_in_the_graph():
    """A user's own compiled decode loop (no attention_mask): the mask comes from the cache's tensor length
    inside the graph; the logits equal an eager dynamic-cache decode."""
    model = tiny_model("llama")
    ids, _ = random_batch(1, 6, seed=6)
    torch._dynamo.reset()
    step = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
    static = transformers.StaticCache(config=model.config, max_cache_len=16)
    dynamic = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        x = model(input_ids=ids, cache=static, use_cache=True).logits[:, -1:].argmax(-1)
        model(input_ids=ids, cache=dynamic, use_cache=True)
        counters.clear()
        for _ in range(5):
            got = step(input_ids=x, cache=static, use_cache=True).logits
            want = model(input_ids=x, cache=dynamic, use_cache=True).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            x = want[:, -1:].argmax(-1)
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_prefill_into_a_static_cache_is_refused_with_the_fix():
    model = tiny_model("llama")
    ids, mask = random_batch(1, 6, seed=7)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with pytest.raises(Exception, match="run the prefill uncompiled"), torch.no_grad():
        compiled(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)


def test_static_cache_mask_longer_than_the_buffer_is_refused():
    too_long = torch.ones(1, 9, dtype=torch.bool)
    with pytest.raises(
        ValueError, match=r"K <= the static cache's length \(8\), got a mask of shape \[1, 9\]"
    ):
        retmask_mask(1, 1, 8, q_offset=torch.tensor(3), attention_mask=too_long)


def test_bidirectional_attention_over_more_keys_is_not_taken_for_a_static_cache():
    """More keys than queries in bidirectional attention (e.g. an encoder's) is refused as before, not
    masked as a static cache's unfilled slots."""
    from transformers.masking_utils import bidirectional_mask_function

    with pytest.raises(NotImplementedError, match="keys do not end with the queries"):
        retmask_mask(1, 3, 8, q_offset=0, mask_function=bidirectional_mask_function)
