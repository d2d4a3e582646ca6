"""The head-sparse KV cache (``retmask.head_sparse_cache``) computes exactly eager attention under the
equivalent per-head mask: a full KV head's query heads see every causal key, a windowed one's see key j
from query position p iff j < S or p - W < j (and j <= p). The reference below is an attention function
registered with transformers that builds that mask explicitly ([B, Hq, M, N], fine at these sizes) over a
normal ``DynamicCache``; same weights, so logits agree to fp32 rounding and greedy tokens exactly.

Sizes: S = 2 sinks, W = 5 window, prompts of 20 tokens (> S + W: eviction happens in prefill and every
decode step), batch 2 with left padding (3 tokens) unless said otherwise.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

import retmask
from retmask.heads.keys import SelectionError
from retmask.hf.interface import retmask_mask
from retmask.hf.sparse_kv import attention as sparse_attention_module
from retmask.hf.sparse_kv.layer import HeadSparseLayer
from retmask.hf.sparse_kv.policy import KVLayout, full_kv_heads
from retmask.hf.sparse_kv.sink_window import sink_window_attention

from ..device import TEST_DEVICE
from .conftest import random_batch, tiny_config

S, W = 2, 5
REF = "retmask_test_head_pattern"

# Gemma 3: layer 0 local (window 4, its own sliding cache), layer 1 global (the policy's)
ARCHS = {
    "qwen2": {},
    "mistral": {},
    "gemma3_text": dict(
        sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16
    ),
    # the KV heads as the attention has them, not as the config says (2): GPT-2 has one per query head
    # (4), GPT-BigCode one in all (multi-query)
    "gpt2": {},
    "gpt_bigcode": {},
}
# some full, some windowed
MIXED = {
    "qwen2": [(0, 1)],
    "mistral": [(1, 0)],
    "gemma3_text": [(1, 1)],
    "gpt2": [(0, 3), (1, 1)],
    "gpt_bigcode": [(0, 0)],
}


# -- the reference: eager attention under an explicit per-head mask ----------------------------------
class Pattern:
    """What the reference attention masks: ``full`` (layer, kv_head) pairs, ``layers`` the pruned layers,
    ``sinks`` S and ``window`` W of the windowed heads."""

    full: set[tuple[int, int]] = set()
    layers: set[int] = set()
    sinks, window = S, W
    full_prefill = False  # the first call (M == N keys) unmasked: head_sparse_cache(prefill="full")
    argmax: dict[int, torch.Tensor] = {}  # layer -> [B, Hq] argmax of the last row (absolute positions)


def reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query: [B, Hq, M, D]; key, value: [B, Hkv, N, D] (a DynamicCache: keys end with the queries)."""
    B, Hq, M, D = query.shape
    Hkv, N = key.shape[1], key.shape[2]
    g = Hq // Hkv
    layer = module.layer_idx
    # positions: a global layer's cache holds every token from 0; a local one the last keys (relative is
    # enough there, its window is relative)
    kpos = torch.arange(N, device=query.device)
    qpos = kpos[N - M :]
    allowed = kpos[None] <= qpos[:, None]  # [M, N]
    if kwargs.get("sliding_window") is not None:
        allowed &= kpos[None] > qpos[:, None] - kwargs["sliding_window"]
    allowed = allowed[None, None].expand(B, Hq, M, N).clone()
    if layer in Pattern.layers and not (Pattern.full_prefill and M == N):
        windowed = (kpos[None] < Pattern.sinks) | (kpos[None] > qpos[:, None] - Pattern.window)
        for h in range(Hq):
            if (layer, h // g) not in Pattern.full:
                allowed[:, h] &= windowed
    if attention_mask is not None and not getattr(attention_mask, "_retmask_all_valid", False):
        allowed &= attention_mask.bool()[:, None, None, :]
    k = key.repeat_interleave(g, 1).float()
    v = value.repeat_interleave(g, 1).float()
    logits = (query.float() @ k.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(logits, -1).nan_to_num(0.0)  # a row without a key: 0, as the kernel
    out = weights @ v
    skip = getattr(module, "_retmask_skip", None)
    if skip is not None:
        out = out.masked_fill(skip.reshape(-1, Hq)[:, :, None, None].to(out.device), 0.0)
    Pattern.argmax[layer] = logits[:, :, -1].argmax(-1)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


AttentionInterface.register(REF, reference_attention)
AttentionMaskInterface.register(REF, retmask_mask)


def tiny(arch: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = tiny_config(arch, **ARCHS[arch])
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    return retmask.patch(model.to(TEST_DEVICE).eval())


def reference_of(model, full: list[tuple[int, int]], sinks: int = S) -> transformers.PreTrainedModel:
    """A copy of ``model`` on the reference attention, masking like a head-sparse cache with ``full``."""
    other = copy.deepcopy(model)
    other.set_attn_implementation(REF)
    config = model.config.get_text_config(decoder=True)
    Pattern.full, Pattern.sinks, Pattern.window = set(full), sinks, W
    Pattern.full_prefill = False
    Pattern.layers = {
        i
        for i, kind in enumerate(getattr(config, "layer_types", None) or ["full_attention"] * 2)
        if kind == "full_attention"
    }
    return other


def step(model, ids, mask, cache):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=True, cache=cache).logits


def run_steps(model, cache, ids, mask, chunks: list[int], decode: int) -> list[torch.Tensor]:
    """Prefill ``ids`` in chunks of the given sizes, then ``decode`` greedy steps; the logits of each call."""
    out, a = [], 0
    for n in chunks:
        out.append(step(model, ids[:, a : a + n], mask[:, : a + n], cache))
        a += n
    tokens = ids
    for _ in range(decode):
        nxt = out[-1][:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], 1)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        out.append(step(model, nxt, mask, cache))
    return out


def assert_logits_equal(got: list[torch.Tensor], want: list[torch.Tensor], valid: torch.Tensor) -> None:
    first = True
    for g, w in zip(got, want, strict=True):
        if first:  # padding rows of the prompt have no defined output
            g, w = g[valid[:, : g.shape[1]]], w[valid[:, : w.shape[1]]]
            first = False
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


# -- exactness --------------------------------------------------------------------------------------
@pytest.mark.parametrize("blocked", [False, True], ids=["kernel-band", "blocked"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_equal_masked_eager(arch, blocked, monkeypatch):
    """Prefill in one call (the kernel's band where it can, or the blocked path) and in two chunks (the
    second sees the first's compact buffer), then decode steps: logits = the masked eager reference."""
    if blocked:
        monkeypatch.setattr(sparse_attention_module, "KERNEL_SINK_TOKENS", False)
    model = tiny(arch)
    ref = reference_of(model, MIXED[arch])
    ids, mask = random_batch(2, 20, left_pad=[0, 3])
    for chunks in ([20], [12, 8]):
        cache = retmask.head_sparse_cache(model, full_heads=MIXED[arch], window=W, sink_tokens=S)
        got = run_steps(model, cache, ids, mask, chunks, decode=4)
        want = run_steps(ref, DynamicCache(config=ref.config), ids, mask, chunks, decode=4)
        valid = mask.bool()
        assert_logits_equal([torch.cat(got[: len(chunks)], 1), *got[len(chunks) :]],
                            [torch.cat(want[: len(chunks)], 1), *want[len(chunks) :]], valid)  # fmt: skip
    # the pattern matters: a full cache gives other logits once keys leave the window
    full = run_steps(model, DynamicCache(config=model.config), ids, mask, [20], decode=4)
    assert (full[-1] - got[-1]).abs().max() > 1e-2


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_full_prefill_sees_every_key_then_decodes_the_pattern(arch):
    """prefill="full": the first call is the full cache's attention (every head, every key); the cache then
    holds what the windowed prefill would, so decode steps (and a second prefill chunk) see the pattern."""
    model = tiny(arch)
    ref = reference_of(model, MIXED[arch])
    Pattern.full_prefill = True
    ids, mask = random_batch(2, 20, left_pad=[0, 3])
    valid = mask.bool()
    for chunks in ([20], [12, 8]):
        cache = retmask.head_sparse_cache(
            model, full_heads=MIXED[arch], window=W, sink_tokens=S, prefill="full"
        )
        got = run_steps(model, cache, ids, mask, chunks, decode=4)
        want = run_steps(ref, DynamicCache(config=ref.config), ids, mask, chunks, decode=4)
        assert_logits_equal([torch.cat(got[: len(chunks)], 1), *got[len(chunks) :]],
                            [torch.cat(want[: len(chunks)], 1), *want[len(chunks) :]], valid)  # fmt: skip
        windowed = retmask.head_sparse_cache(model, full_heads=MIXED[arch], window=W, sink_tokens=S)
        run_steps(model, windowed, ids, mask, chunks, decode=4)
        assert cache.memory_bytes() == windowed.memory_bytes()
    full = run_steps(model, DynamicCache(config=model.config), ids, mask, [20], decode=4)
    got = run_steps(
        model, retmask.head_sparse_cache(model, full_heads=MIXED[arch], window=W, sink_tokens=S, prefill="full"),
        ids, mask, [20], decode=4,
    )  # fmt: skip
    torch.testing.assert_close(got[0][valid], full[0][valid], atol=1e-5, rtol=1e-5)  # the prompt: unpruned
    assert (full[-1] - got[-1]).abs().max() > 1e-2  # decode: pruned
    with pytest.raises(ValueError, match="prefill='all': pass one of 'windowed', 'full'"):
        retmask.head_sparse_cache(model, full_heads=[], window=W, prefill="all")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_generate_equals_masked_eager(arch):
    """Greedy generate, batch 2 with left padding, 8 new tokens: token for token the reference's."""
    model = tiny(arch)
    ref = reference_of(model, MIXED[arch])
    ids, mask = random_batch(2, 20, left_pad=[0, 3], seed=1)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    cache = retmask.head_sparse_cache(model, full_heads=MIXED[arch], window=W, sink_tokens=S)
    with torch.no_grad():
        got = model.generate(**kw, cache=cache)
        want = ref.generate(**kw)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == 27  # 20 + 8 - 1 (the last token is never fed back)


def test_a_reused_cache_names_the_fix_and_reset_makes_it_new():
    """A cache given to a second generate() still holds the first call's tokens: the error says to reset it,
    and after ``cache.reset()`` the second call generates the same tokens as the first."""
    model = tiny("qwen2")
    ids, mask = random_batch(2, 20, left_pad=[0, 3], seed=1)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    cache = retmask.head_sparse_cache(model, full_heads=MIXED["qwen2"], window=W, sink_tokens=S)
    with torch.no_grad():
        first = model.generate(**kw, cache=cache)
        with pytest.raises(ValueError, match=r"call cache\.reset\(\) first"):
            model.generate(**kw, cache=cache)
        cache.reset()
        again = model.generate(**kw, cache=cache)
    assert torch.equal(first, again)


def test_sampling_and_beams_equal_masked_eager():
    """Sampling (same seed) and beam search (reorders the cache's batch rows) give the reference's tokens."""
    model = tiny("qwen2")
    ref = reference_of(model, MIXED["qwen2"])
    ids, mask = random_batch(2, 20, left_pad=[0, 3], seed=2)
    for extra in (dict(do_sample=True, top_k=0), dict(num_beams=2, do_sample=False)):
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, **extra)
        cache = retmask.head_sparse_cache(model, full_heads=MIXED["qwen2"], window=W, sink_tokens=S)
        with torch.no_grad():
            torch.manual_seed(5)
            got = model.generate(**kw, cache=cache)
            torch.manual_seed(5)
            want = ref.generate(**kw)
        assert torch.equal(got, want), extra


def test_argmax_capture_and_head_masks_equal_masked_eager():
    """capture_argmax gives absolute positions (the windowed heads' slots mapped back), and masked heads
    (one reading a full KV head, one a windowed one) are 0 / -1 in both."""
    model = tiny("qwen2")
    ref = reference_of(model, MIXED["qwen2"])
    ids, mask = random_batch(2, 20, left_pad=[0, 3])
    heads = [(0, 0), (0, 3), (1, 2)]
    cache = retmask.head_sparse_cache(model, full_heads=MIXED["qwen2"], window=W, sink_tokens=S)
    ref_cache = DynamicCache(config=ref.config)
    with retmask.head_mask(model, heads) as skip, retmask.capture_argmax(model, rows=1) as cap:
        for layer, module in enumerate(retmask.hf.head_layout(ref).layers):  # the reference reads it directly
            module._retmask_skip = skip[layer]
        x = ids
        for _ in range(4):  # prefill, then 3 decode steps
            got, want = step(model, x, mask, cache), step(ref, x, mask, ref_cache)
            torch.testing.assert_close(got[:, -1], want[:, -1], atol=1e-4, rtol=1e-4)
            argmax = torch.stack([Pattern.argmax[i] for i in range(2)])  # [L, B, Hq]
            for layer, head in heads:
                argmax[layer, :, head] = -1
            assert torch.equal(cap.last[..., 0], argmax)
            x = got[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(x)], 1)


# -- memory -------------------------------------------------------------------------------------------
def test_memory_held_matches_formula_and_is_below_full_cache():
    model = tiny("gemma3_text")  # local layer 0 (window 4) + global layer 1
    ids, mask = random_batch(2, 20, left_pad=[0, 3])
    total = 20 + 5
    cache = retmask.head_sparse_cache(model, full_heads=[(1, 1)], window=W, sink_tokens=S, max_length=total)
    run_steps(model, cache, ids, mask, [20], decode=5)
    B, D, e = 2, 16, 4
    held = cache.layer_memory_bytes()
    local = cache.layers[0]
    assert held[0] == 2 * local.keys.numel() * e and local.keys.shape[2] == 3  # its own window - 1 keys
    # global layer: 1 full KV head x all 25 positions + 1 windowed head x (S + W) slots, K and V, + positions
    assert held[1] == 2 * B * D * e * (1 * total + 1 * (S + W)) + 8 * (S + W)
    full = DynamicCache(config=model.config)
    run_steps(model, full, ids, mask, [20], decode=5)
    dynamic = sum(2 * layer.keys.numel() * e for layer in full.layers)
    assert cache.full_cache_bytes() == dynamic
    assert cache.memory_bytes() < dynamic


def test_memory_without_a_length_hint_grows_by_an_eighth():
    model = tiny("qwen2")
    ids, mask = random_batch(1, 20)
    cache = retmask.head_sparse_cache(model, full_heads=[(0, 0)], window=W, sink_tokens=S)
    run_steps(model, cache, ids, mask, [20], decode=2)
    layer = cache.layers[0]
    assert layer._full._key_buffer.shape[2] == 21 + 64  # exact prefill (20), then + max(64, n / 8) at 21


# -- limits: every head full, no head full --------------------------------------------------------------
def test_every_kv_head_full_is_the_normal_cache():
    model = tiny("qwen2")
    ids, mask = random_batch(2, 20, left_pad=[0, 3])
    every = [(layer, kv) for layer in range(2) for kv in range(2)]
    cache = retmask.head_sparse_cache(model, full_heads=every, window=W, sink_tokens=S)
    got = run_steps(model, cache, ids, mask, [20], decode=3)
    want = run_steps(model, DynamicCache(config=model.config), ids, mask, [20], decode=3)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_no_kv_head_full_is_streaming_llm():
    """StreamingLLM on every head (full_heads=[]): the reference with every head windowed; the cache holds
    only sink + window keys."""
    model = tiny("mistral")
    ref = reference_of(model, [])
    ids, mask = random_batch(2, 20, left_pad=[0, 3])
    cache = retmask.head_sparse_cache(model, full_heads=[], window=W, sink_tokens=S)
    got = run_steps(model, cache, ids, mask, [20], decode=3)
    want = run_steps(ref, DynamicCache(config=ref.config), ids, mask, [20], decode=3)
    assert_logits_equal(got, want, mask.bool())
    # 2 layers x 2 KV heads x (S + W) slots, K and V (B 2, D 16, fp32), + the slot positions
    assert cache.memory_bytes() == 2 * (2 * 2 * 2 * 16 * 4 * (S + W) + 8 * (S + W))


def _reachable_tensor_bytes(root: object) -> int:
    """Bytes of every tensor storage reachable from ``root`` through Python references (attributes, lists,
    a tensor's own attributes), each storage counted once."""
    import gc
    import types

    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType, str, bytes)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def test_the_cache_keeps_only_what_it_holds_after_a_prefill():
    """After a prefill (and after each decode step) the cache references no tensor beyond the buffers it
    counts: the prompt's windowed keys handed to the attention are not kept alive by any layer (they were,
    on the tensor the layer stored, until its next call: a whole full cache of keys at the end of a prefill)."""
    model = tiny("mistral")
    ids, mask = random_batch(2, 20, left_pad=[0, 3])
    for full in ([], MIXED["mistral"]):
        for steps in (0, 2):
            cache = retmask.head_sparse_cache(model, full_heads=full, window=W, sink_tokens=S)
            run_steps(model, cache, ids, mask, [20], decode=steps)
            index_bytes = sum(
                t.numel() * t.element_size()
                for layer in cache.layers
                for t in (layer._kv_full, layer._kv_win, layer._q_full, layer._q_win)
            )
            assert _reachable_tensor_bytes(cache) <= cache.memory_bytes() + index_bytes, (full, steps)


def test_no_sinks_window_only():
    """S = 0: a plain sliding window on the windowed heads (the kernel's band in prefill)."""
    model = tiny("qwen2")
    ids, mask = random_batch(2, 20, left_pad=[0, 3])
    ref = reference_of(model, MIXED["qwen2"], sinks=0)
    cache = retmask.head_sparse_cache(model, full_heads=MIXED["qwen2"], window=W, sink_tokens=0)
    got = run_steps(model, cache, ids, mask, [20], decode=3)
    want = run_steps(ref, DynamicCache(config=ref.config), ids, mask, [20], decode=3)
    assert_logits_equal(got, want, mask.bool())


# -- the blocked sink + window attention against a brute-force oracle ------------------------------------
def test_sink_window_attention_matches_brute_force():
    """Unordered key slots with empty ones, padding, soft-capping, sinks, a skipped head and argmax."""
    torch.manual_seed(0)
    B, Hkv, g, M, D = 2, 2, 2, 9, 8
    start, sink, window = 11, 3, 4
    positions = torch.tensor([0, 1, 2, -1, 17, 18, 19, 20, 12, 13, 14, 15, 16, 11, 10, 9, 3])
    perm = torch.randperm(positions.numel())
    positions = positions[perm]
    K = positions.numel()
    q = torch.randn(B, Hkv * g, M, D)
    k, v = torch.randn(B, Hkv, K, D), torch.randn(B, Hkv, K, D)
    kpm = torch.ones(B, K, dtype=torch.bool)
    kpm[1, (positions == 1) | (positions == 12)] = False
    sinks, skip = torch.randn(Hkv * g), torch.tensor([False, False, True, False])
    out, argmax = sink_window_attention(
        q, k, v, positions, start=start, sink_tokens=sink, window=window, sm_scale=0.3,
        key_padding_mask=kpm, softcap=2.0, sinks=sinks, skip_heads=skip, argmax_rows=4,
    )  # fmt: skip
    qpos = torch.arange(start, start + M)[:, None]
    allowed = (positions >= 0) & (positions <= qpos) & ((positions < sink) | (positions > qpos - window))
    allowed = allowed[None, None] & kpm[:, None, None]  # [B, 1, M, K]
    logits = 2.0 * torch.tanh(q @ k.repeat_interleave(g, 1).transpose(-1, -2) * 0.3 / 2.0)
    logits = logits.masked_fill(~allowed, float("-inf"))
    full = torch.cat([logits, sinks[None, :, None, None].expand(B, -1, M, 1)], -1)
    want = torch.softmax(full, -1)[..., :K] @ v.repeat_interleave(g, 1)
    want[:, 2] = 0
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    want_argmax = positions[logits[:, :, -4:].argmax(-1)]  # no ties in random logits
    want_argmax[:, 2] = -1
    assert torch.equal(argmax, want_argmax)


# -- policy ---------------------------------------------------------------------------------------------
LAYOUT = KVLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, global_layers=(0, 1))
SCORES = {
    "0-0": [0.0],
    "0-1": [0.3],
    "0-2": [0.05],
    "0-3": [0.0],
    "1-0": [0.08],
    "1-1": [0.0],
    "1-2": [0.0],
    "1-3": [0.2],
}


def test_policy_ranks_kv_heads_by_their_best_query_head():
    # KV head (l, kv) holds query heads 2kv, 2kv + 1: best scores (0,0) 0.3, (0,1) 0.05, (1,0) 0.08, (1,1) 0.2
    assert full_kv_heads(LAYOUT, scores=SCORES, tau=0.1) == [(0, 0), (1, 1)]
    assert full_kv_heads(LAYOUT, scores=SCORES, tau=0.06) == [(0, 0), (1, 0), (1, 1)]
    assert full_kv_heads(LAYOUT, scores=SCORES, budget=1) == [(0, 0)]
    assert full_kv_heads(LAYOUT, scores=SCORES, budget=0.5) == [(0, 0), (1, 1)]
    assert full_kv_heads(LAYOUT, scores=SCORES, budget=0.6) == [(0, 0), (1, 0), (1, 1)]  # 2.4 -> 3
    assert full_kv_heads(LAYOUT, scores=SCORES, budget=1.0) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert full_kv_heads(LAYOUT, full_heads=[[1, 1], "0-1"]) == [(0, 1), (1, 1)]
    local = KVLayout(2, 4, 2, global_layers=(1,))  # a local layer 0 is not a candidate
    assert full_kv_heads(local, scores=SCORES, budget=1) == [(1, 1)]


def test_scores_file_and_budget_through_the_public_api(tmp_path):
    model = tiny("qwen2")
    path = tmp_path / "scores.json"
    path.write_text(json.dumps(SCORES))
    cache = retmask.head_sparse_cache(model, str(path), budget=0.5, window=W)
    assert cache.full_heads == [(0, 0), (1, 1)] and cache.sink_tokens == 4
    assert [layer.full_kv for layer in cache.layers] == [[0], [1]]


def test_bad_input_errors_name_the_fix(tmp_path):
    model = tiny("qwen2")
    make = retmask.head_sparse_cache
    with pytest.raises(ValueError, match=r"window=0: the window must be a whole number of tokens >= 1"):
        make(model, full_heads=[], window=0)
    with pytest.raises(ValueError, match=r"sink_tokens=-1: pass a whole number"):
        make(model, full_heads=[], window=4, sink_tokens=-1)
    for bad in (0, 0.0, 1.5, -0.2, 5, True):
        with pytest.raises(
            SelectionError, match=r"budget.*pass budget as a fraction in \(0, 1\] or a count from 1 to 4"
        ):
            make(model, SCORES, budget=bad, window=4)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({f"{ly}-{h}": [0.1] for ly in range(3) for h in range(4)}))
    with pytest.raises(SelectionError, match=r"head \[2, 0\] does not exist.*made for another model"):
        make(model, str(other), budget=0.5, window=4)
    fewer = tmp_path / "fewer.json"
    fewer.write_text(json.dumps({f"0-{h}": [0.1] for h in range(4)}))
    with pytest.raises(
        SelectionError, match=r"scores for 4 heads, but the model has .* 8 query heads.*for this model"
    ):
        make(model, str(fewer), tau=0.1, window=4)
    with pytest.raises(SelectionError, match=r"no KV head has a query head with score >= tau=0.9.*lower tau"):
        make(model, SCORES, tau=0.9, window=4)
    with pytest.raises(SelectionError, match="pass exactly one of budget="):
        make(model, SCORES, budget=0.5, tau=0.1, window=4)
    with pytest.raises(SelectionError, match="pass scores="):
        make(model, budget=0.5, window=4)
    with pytest.raises(SelectionError, match=r"full_heads\[0\] = \(0, 2\) does not exist.*not query heads"):
        make(model, full_heads=[(0, 2)], window=4)
    with pytest.raises(SelectionError, match=r"sliding-window layer.*global layers \[1\]"):
        make(tiny("gemma3_text"), full_heads=[(0, 0)], window=4)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with pytest.raises(ValueError, match=r"head_sparse_cache needs the model on retmask attention"):
        make(eager, full_heads=[], window=4)
    torch.manual_seed(0)
    sliding = transformers.AutoModelForCausalLM.from_config(
        tiny_config("mistral", sliding_window=5), attn_implementation="retmask"
    )
    with pytest.raises(
        ValueError, match=r"every layer .* is a sliding-window layer .* nothing for a head-sparse"
    ):
        make(sliding, full_heads=[], window=4)
    cache = make(model, full_heads=[], window=W, sink_tokens=S)
    ids, mask = random_batch(1, 10)
    step(model, ids, mask, cache)
    with pytest.raises(NotImplementedError, match="cannot be rolled back"):
        cache.crop(-2)
    assert isinstance(cache.layers[0], HeadSparseLayer) and not cache.is_croppable


def test_hybrid_and_latent_attention_models_are_refused_by_name():
    """A hybrid's convolution / recurrent layers keep states, not KV heads; multi-head latent attention
    caches one compressed latent per token for all heads: no KV head to keep or drop in either."""
    from tests.hf.test_architectures import HYBRIDS, LATENT

    torch.manual_seed(0)
    lfm2 = transformers.AutoModelForCausalLM.from_config(
        tiny_config("lfm2", **HYBRIDS["lfm2"]), attn_implementation="retmask"
    )
    with pytest.raises(
        ValueError,
        match=r"'lfm2' has layers whose cache is not attention keys and values: layers 0, 2 hold a recurrent "
        r"state \(linear attention or a state-space layer\); the head-sparse cache handles full and",
    ):
        retmask.head_sparse_cache(lfm2, full_heads=[(0, 0)], window=4)
    deepseek = transformers.AutoModelForCausalLM.from_config(
        tiny_config("deepseek_v2", **LATENT["deepseek_v2"]), attn_implementation="retmask"
    )
    with pytest.raises(ValueError, match=r"'deepseek_v2' uses multi-head latent attention.*no KV heads"):
        retmask.head_sparse_cache(deepseek, full_heads=[(0, 0)], window=4)
