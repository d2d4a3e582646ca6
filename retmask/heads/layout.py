"""``[L, Hq]`` of a model: the number of layers and of query heads per layer, from its config alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from retmask.heads.keys import Head, SelectionError


def model_shape(model_or_config: Any) -> tuple[int, int]:
    """``(num_layers, num_query_heads)`` of an HF model or config (multimodal configs: the text config)."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    try:
        return int(config.num_hidden_layers), int(config.num_attention_heads)
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
