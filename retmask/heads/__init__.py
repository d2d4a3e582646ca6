"""Attention heads as data: names, the ``[L, Hq]`` of a model, masks, scores files and selection policies.

Nothing here touches model weights or attention code: ``retmask.hf`` and everything above it import from
here, never the other way round. The mask helpers (``HeadSpec``, ``heads_to_mask``,
``normalize_head_mask``) build torch tensors; they load on first use, so reading heads and scores files
(``retmask mask``, every command's ``--help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from retmask.heads.keys import Head, SelectionError, head_key, parse_head_key, parse_head_pair
from retmask.heads.layout import check_heads, check_shape, model_shape
from retmask.heads.selection import (
    BASELINES,
    METHODS,
    HeadSelection,
    complete_scores,
    heads_from_json,
    load_scores,
    mean_scores,
    mudaf_selection,
    parse_heads_arg,
    ranked,
    read_heads,
    sample_non_retrieval,
    sample_random,
    sample_softmax_heads,
    select_heads,
    select_threshold,
    select_top_k,
    write_heads,
)

if TYPE_CHECKING:
    from retmask.heads.mask import HeadSpec, heads_to_mask, normalize_head_mask

_TORCH_NAMES = ("HeadSpec", "heads_to_mask", "normalize_head_mask")  # defined in retmask.heads.mask


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module("retmask.heads.mask"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BASELINES",
    "METHODS",
    "Head",
    "HeadSelection",
    "HeadSpec",
    "SelectionError",
    "check_heads",
    "check_shape",
    "complete_scores",
    "head_key",
    "heads_from_json",
    "heads_to_mask",
    "load_scores",
    "mean_scores",
    "model_shape",
    "mudaf_selection",
    "normalize_head_mask",
    "parse_head_key",
    "parse_head_pair",
    "parse_heads_arg",
    "ranked",
    "read_heads",
    "sample_non_retrieval",
    "sample_random",
    "sample_softmax_heads",
    "select_heads",
    "select_threshold",
    "select_top_k",
    "write_heads",
]
