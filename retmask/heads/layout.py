"""``[L, Hq]`` of a model: the number of layers and of query heads per layer, from its config alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from retmask.heads.keys import Head, SelectionError

# Layer kinds (a config's ``layer_types``) whose layers hold softmax attention heads, and those whose
# layers hold none (the convolution, linear-attention / Mamba and feed-forward-only layers of hybrid models).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
HEADLESS_LAYER_TYPES = frozenset({"conv", "linear_attention", "mlp", "moe"})


def layer_kinds(config: Any) -> list[str]:
    """A (text) config's kind of each layer (``layer_types``, or ``layers_block_type`` in some hybrid
    models); [] when it lists none (every layer is full attention)."""
    return list(getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or [])


def attention_layer_ids(config: Any) -> tuple[int, ...]:
    """The decoder layers of a (text) config that hold attention heads: all ``num_hidden_layers`` of them,
    or in a hybrid model those whose ``layer_types`` (or ``layers_block_type``) entry is an attention
    kind. Raises ValueError for a layer kind that is neither known attention nor known to have no heads."""
    num_layers = int(config.num_hidden_layers)
    kinds = layer_kinds(config)
    if not kinds:
        return tuple(range(num_layers))
    unknown = sorted(set(kinds) - ATTENTION_LAYER_TYPES - HEADLESS_LAYER_TYPES)
    if unknown:
        raise ValueError(
            f"its layers use {unknown} attention; retmask computes full and sliding-window causal "
            f"attention ({', '.join(sorted(ATTENTION_LAYER_TYPES))}) beside layers of kinds "
            f"{sorted(HEADLESS_LAYER_TYPES)}"
        )
    return tuple(i for i, kind in enumerate(kinds[:num_layers]) if kind in ATTENTION_LAYER_TYPES)


def model_shape(model_or_config: Any) -> tuple[int, int]:
    """``(num_layers, num_query_heads)`` of an HF model or config (multimodal configs: the text config):
    num_layers counts the layers with attention heads (in a hybrid model, not its other layers)."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    try:
        return len(attention_layer_ids(config)), int(config.num_attention_heads)
    except AttributeError as err:
        raise ValueError(
            f"{type(model_or_config).__name__} has no num_hidden_layers / num_attention_heads in its config; "
            "retmask needs a decoder language model"
        ) from err


def check_shape(shape: Sequence[int]) -> tuple[int, int]:
    """Validate ``[num_layers, num_query_heads]`` (positive ints)."""
    if len(shape) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shape):
        raise SelectionError(f"model shape must be [num_layers, num_query_heads] > 0, got {list(shape)}")
    return int(shape[0]), int(shape[1])


def check_heads(heads: Sequence[Head], shape: Sequence[int], *, source: str = "heads") -> None:
    """Raise if any head is outside a model with ``[L, Hq]`` = ``shape``."""
    n_layers, n_heads = check_shape(shape)
    for layer, head in heads:
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise SelectionError(
                f"{source}: head [{layer}, {head}] does not exist in a model with [L, Hq] = "
                f"[{n_layers}, {n_heads}]; the file was probably made for another model"
            )
