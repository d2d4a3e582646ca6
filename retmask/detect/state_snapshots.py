"""Rewinding the cache of a hybrid model to an earlier position.

A hybrid model's cache holds, besides the keys and values of its attention layers, the running state of
its other layers: the last few inputs of a convolution, the recurrent state of a linear-attention (gated
DeltaNet, delta rule) or Mamba-2 layer. Keys and values are cut back by dropping positions; a running state
is a summary of every position so far and cannot be. Detection rewinds its cache between tests (to reuse
the prompt prefix two tests share), so for a hybrid it keeps copies of those states at the positions it
may rewind to (the chunk boundaries of the prefill) and puts one back when it rewinds there.

A state at position p (``take``) is a clone of every non-attention layer's tensors after the first p
tokens, with the layer's token count where it keeps one (transformers 5.25 on: ``cumulative_length_linear``,
which ``get_seq_length`` reports and the next call's positions start from): about 20 MB for a model with
18 gated-DeltaNet layers of 16 value heads of 128 x 128 (float32).
Detection keeps at most ``core.MAX_KEPT_STATES`` of them per prompt.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

# per layer of the cache: None for an attention layer or a layer that caches nothing (a feed-forward-only
# layer), else (conv states, recurrent states) by state index and the layer's token count (None where the
# transformers release keeps none)
LayerStates = tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], torch.Tensor | None] | None
# The attribute of a non-attention layer's token count (transformers 5.25 on)
TOKEN_COUNT = "cumulative_length_linear"


def take(cache) -> list[LayerStates]:
    """Copies of the running states of ``cache``'s non-attention layers (a ``DynamicCache``)."""

    def copies(states: dict[int, torch.Tensor | None]) -> dict[int, torch.Tensor]:
        return {i: t.clone() for i, t in states.items() if t is not None}

    def count(layer) -> torch.Tensor | None:
        tokens = getattr(layer, TOKEN_COUNT, None)
        return tokens.clone() if isinstance(tokens, torch.Tensor) else None

    return [
        (copies(layer.conv_states), copies(layer.recurrent_states), count(layer))
        if isinstance(layer, LinearAttentionCacheLayerMixin)
        else None
        for layer in cache.layers
    ]


def nbytes(states: list[LayerStates]) -> int:
    """Bytes held by ``states`` (from ``take``): every copied conv and recurrent state and token count."""
    return sum(
        sum(t.nbytes for t in (*conv.values(), *recurrent.values()))
        + (tokens.nbytes if tokens is not None else 0)
        for conv, recurrent, tokens in filter(None, states)
    )


def rewind(cache, length: int, states: list[LayerStates]) -> None:
    """Bring ``cache`` back to its first ``length`` positions: its attention layers drop the later keys
    and values, its other layers get ``states`` (taken at ``length``) copied back into their tensors (which
    the layers update in place), token count included, so ``states`` can be put back again."""
    for layer, saved in zip(cache.layers, states, strict=True):
        if saved is None:
            if isinstance(layer, CacheLayerMixin):  # keys and values
                remove = layer.get_seq_length() - length
                if remove > 0:
                    layer.crop(-remove)
            continue
        conv, recurrent, tokens = saved
        for i, t in conv.items():
            layer.conv_states[i].copy_(t)
        for i, t in recurrent.items():
            layer.recurrent_states[i].copy_(t)
        if tokens is not None:
            getattr(layer, TOKEN_COUNT).copy_(tokens)


__all__ = ["LayerStates", "nbytes", "rewind", "take"]
