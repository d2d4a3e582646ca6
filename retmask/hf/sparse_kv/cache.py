"""``retmask.head_sparse_cache(model, ...)``: a KV cache that keeps every key only for retrieval heads.

    cache = retmask.head_sparse_cache(model, scores="scores.json", budget=0.25, window=1024, sink_tokens=4)
    model.generate(**batch, cache=cache, max_new_tokens=64)             # a new cache for every call
    cache.memory_bytes(), cache.full_cache_bytes()                      # held vs a DynamicCache's

Layers: each global (full-attention) layer gets a ``HeadSparseLayer`` (``layer.py``): the full KV heads
chosen by the policy (``policy.py``) keep every key, the others the first ``sink_tokens`` positions plus
the last ``window``. Local sliding-window layers (Gemma 2/3, Cohere 2, OLMo 3, ...) keep transformers' own
sliding-window cache (their last ``window - 1`` keys, every head): they are bounded already, and the policy
applies to the global layers only. The model must run on retmask attention, which computes the two kinds
of KV heads of a layer separately (``attention.py``).

Left padding: positions are columns of the padded batch, so a row's sinks are the first ``sink_tokens``
columns, which for a row with ``pad`` padding tokens hold ``max(0, sink_tokens - pad)`` real tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from retmask.hf.kv_cache import FULL, SLIDING, cache_layer_kinds, describe_layers
from retmask.hf.layers import head_layout
from retmask.hf.patch import require_retmask
from retmask.hf.sparse_kv.layer import HeadSparseLayer
from retmask.hf.sparse_kv.policy import KVHead, KVLayout, full_kv_heads

PREFILL_MODES = ("windowed", "full")


class HeadSparseCache(Cache):
    """A transformers ``Cache`` of ``HeadSparseLayer`` s (global layers) and sliding-window layers (local).

    Attributes:
        full_heads: the (layer, kv_head) pairs kept whole, sorted.
        window, sink_tokens: W and S of the windowed heads.
        prefill: "windowed" or "full" (``head_sparse_cache``).
    """

    def __init__(
        self,
        layers: list[Any],
        full_heads: list[KVHead],
        window: int,
        sink_tokens: int,
        prefill: str = "windowed",
    ):
        super().__init__(layers=layers)
        self.full_heads = list(full_heads)
        self.window, self.sink_tokens, self.prefill = window, sink_tokens, prefill

    def reserve(self, positions: int) -> None:
        """The full heads' buffers are allocated at exactly ``positions`` tokens (prompt + new tokens)
        instead of growing by doubling; call before the first forward."""
        for layer in self.layers:
            if isinstance(layer, HeadSparseLayer):
                layer.reserve(positions)

    def layer_memory_bytes(self) -> list[int]:
        """Bytes held per layer: allocated K/V buffers (and slot positions) of every layer."""
        return [_held(layer) for layer in self.layers]

    def memory_bytes(self) -> int:
        """Bytes the cache holds in all (``layer_memory_bytes`` summed)."""
        return sum(self.layer_memory_bytes())

    def full_cache_bytes(self) -> int:
        """What transformers' ``DynamicCache`` would hold for the same tokens: K and V [B, Hkv, N, D] in every
        global layer, the same sliding-window keys in every local layer."""
        return sum(
            layer.full_cache_bytes() if isinstance(layer, HeadSparseLayer) else _held(layer)
            for layer in self.layers
        )


def _held(layer: Any) -> int:
    if isinstance(layer, HeadSparseLayer):
        return layer.memory_bytes()
    if not getattr(layer, "is_initialized", False) or layer.keys is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))


def _check_int(name: str, value: Any, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: {fix}")
    return value


def head_sparse_cache(
    model: torch.nn.Module,
    scores: str | Path | Mapping[Any, Any] | None = None,
    *,
    budget: int | float | None = None,
    tau: float | None = None,
    full_heads: Iterable[Any] | None = None,
    window: int,
    sink_tokens: int = 4,
    max_length: int | None = None,
    prefill: str = "windowed",
) -> HeadSparseCache:
    """A head-sparse KV cache for ``model`` (on retmask attention), for ``model.generate(..., cache=cache)``
    or forward calls. Make a new one for every ``generate`` call (or ``cache.reset()`` it first).

    Args:
        scores: a scores file (``retmask detect``'s JSON) or mapping, for ``budget`` / ``tau``.
        budget: the top KV heads kept whole, ranked by their best query head's score: a fraction in (0, 1]
            of the global layers' KV heads (rounded up) or an int count.
        tau: every KV head with a query head scoring >= tau is kept whole (0.1: retrieval heads).
        full_heads: an explicit list of (layer, kv_head) pairs instead (baselines; ``[]`` = StreamingLLM).
        window: W >= 1, the recent tokens every other KV head keeps (a query at p sees p - W < j <= p).
        sink_tokens: S >= 0, the first tokens (columns of the padded batch) every KV head keeps.
        max_length: positions the cache may reach (prompt + max_new_tokens): the full heads' buffers are then
            allocated once at that size; without it they hold the prefill exactly and then grow by 1/8.
        prefill: "windowed" (default): the windowed heads attend over their sink + window keys from the first
            token on, so the prompt costs O(S + W) keys per row in them; "full": the first forward call (the
            prompt, as ``generate`` sends it) attends over every key in every head, then the cache drops what
            the windowed heads do not keep, so only the decoded tokens see the pattern (prefill memory and work
            are the full cache's; what is held afterwards is the same).

    See ``retmask.hf.sparse_kv.policy`` for why a KV head counts as full when its best query head does.
    """
    require_retmask(model, "head_sparse_cache")
    window = _check_int(
        "window", window, 1, "the window must be a whole number of tokens >= 1 (e.g. window=1024)"
    )
    sink_tokens = _check_int(
        "sink_tokens", sink_tokens, 0, "pass a whole number of sink tokens >= 0 (e.g. 4)"
    )
    if prefill not in PREFILL_MODES:
        raise ValueError(f"prefill={prefill!r}: pass one of {', '.join(map(repr, PREFILL_MODES))}")
    if max_length is not None:
        _check_int("max_length", max_length, 1, "pass prompt length + max_new_tokens, or None")
    config = model.config.get_text_config(decoder=True)
    template = DynamicCache(config=config).layers
    odd = {kind: layers for kind, layers in cache_layer_kinds(model).items() if kind not in (FULL, SLIDING)}
    if odd:
        raise ValueError(
            f"model '{config.model_type}' has layers whose cache is not attention keys and values: "
            f"{describe_layers(odd)}; the head-sparse cache handles full and sliding-window attention layers only"
        )
    global_layers = tuple(i for i, layer in enumerate(template) if type(layer) is DynamicLayer)
    if not global_layers:
        raise ValueError(
            f"every layer of model '{config.model_type}' is a sliding-window layer (window "
            f"{getattr(config, 'sliding_window', None)}): its cache is bounded already, so there is nothing for "
            "a head-sparse cache to prune; use the model's default cache"
        )
    heads = head_layout(model)
    if heads.latent_kv:
        raise ValueError(
            f"model '{config.model_type}' uses multi-head latent attention: its cache holds one compressed "
            "latent per token, shared by all heads, so there are no KV heads to keep or drop"
        )
    num_q, num_kv = heads.num_heads, heads.kv_heads
    layout = KVLayout(int(config.num_hidden_layers), num_q, num_kv, global_layers)
    chosen = full_kv_heads(layout, scores=scores, budget=budget, tau=tau, full_heads=full_heads)
    per_layer: dict[int, list[int]] = {i: [] for i in global_layers}
    for layer, kv in chosen:
        per_layer[layer].append(kv)
    layers: list[Any] = [
        HeadSparseLayer(per_layer[i], num_kv, layout.groups, window, sink_tokens, prefill == "full")
        if i in per_layer
        else layer  # a local layer: transformers' sliding-window cache, as the model's default cache
        for i, layer in enumerate(template)
    ]
    cache = HeadSparseCache(layers, chosen, window, sink_tokens, prefill)
    if max_length is not None:
        cache.reserve(max_length)
    return cache
