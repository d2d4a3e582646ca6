"""Head selections as masks: ``[(layer, head), ...]`` / ``["layer-head", ...]`` → bool ``[L, Hq]``.

True = head masked (switched off). A per-row mask ``[B, L, Hq]`` gives every batch row its own heads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from retmask.heads.keys import Head, parse_head_pair

# bool [L, Hq] | bool [B, L, Hq] | int [K, 2] pairs (tensor or NumPy array) | [(layer, head), ...] | ["l-h", ...]
HeadSpec = torch.Tensor | Iterable


def normalize_head_mask(
    heads: HeadSpec, num_layers: int, num_heads: int, *, allow_per_row: bool = True
) -> torch.Tensor:
    """Turn a head selection into a CPU bool mask (True = head masked).

    Args:
        heads: list of (layer, head) pairs or "layer-head" strings; an integer tensor or NumPy array
            [K, 2] of pairs (``mask.nonzero()``, ``np.argwhere(mask)``); bool tensor (or NumPy bool array)
            [L, Hq]; or [B, L, Hq] (one mask per batch row, if ``allow_per_row``).
        num_layers, num_heads: the model's [L, Hq].

    Returns:
        bool [L, Hq] or [B, L, Hq] on the CPU.
    """
    shape = f"[L, Hq] = [{num_layers}, {num_heads}]"
    if isinstance(heads, Mapping):
        raise TypeError(
            f"heads is a dict ({len(heads)} keys, e.g. {next(iter(heads), None)!r}), and a dict's keys are not a "
            "choice of heads: for retrieval scores ({'layer-head': score}) choose the heads first "
            "(retmask.heads.select_top_k(retmask.heads.mean_scores(scores), k) or select_threshold), for a "
            "heads file pass its list (data['heads'], or retmask.heads.read_heads(path).heads)"
        )
    if isinstance(heads, np.ndarray):  # numbers: the same mask or pair list as a tensor; strings: a list
        heads = torch.from_numpy(heads) if heads.dtype.kind in "biuf" else heads.tolist()
    if isinstance(heads, torch.Tensor) and heads.is_meta:
        raise ValueError(
            "head mask tensor is on the meta device (a shape without values); build it on the CPU, e.g. "
            "torch.zeros(L, Hq, dtype=torch.bool)"
        )
    if isinstance(heads, torch.Tensor) and _is_pair_list(heads, num_layers, num_heads):
        heads = heads.tolist()
    if isinstance(heads, torch.Tensor):
        if heads.dtype != torch.bool and tuple(heads.shape) == (num_layers, 2) == (num_layers, num_heads):
            raise ValueError(
                f"an integer head tensor of shape [{num_layers}, 2] is ambiguous for this model ({shape}): a 0/1 "
                "mask or a list of (layer, head) pairs; pass mask.bool() for a mask, or heads.tolist() for pairs"
            )
        if heads.dtype != torch.bool:
            raise ValueError(
                f"head mask tensor must be bool (True = masked), got {heads.dtype} of shape {list(heads.shape)}; "
                "use mask.bool() for a 0/1 mask, or pass an integer [K, 2] tensor of (layer, head) pairs"
            )
        per_row = heads.dim() == 3
        if (
            heads.shape[-2:] != (num_layers, num_heads)
            or heads.dim() not in (2, 3)
            or (per_row and not allow_per_row)
        ):
            expected = f"{shape}" + (" or [B, L, Hq]" if allow_per_row else "")
            raise ValueError(f"head mask must have shape {expected} for this model, got {list(heads.shape)}")
        return heads.detach().to("cpu", copy=True)
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Iterable):
        raise TypeError(
            f"heads must be a list of (layer, head) pairs or a bool tensor {shape}, got {type(heads).__name__}"
        )
    mask = torch.zeros(num_layers, num_heads, dtype=torch.bool)
    for i, item in enumerate(heads):
        layer, head = parse_head_pair(item, f"head entry #{i}")
        if not (0 <= layer < num_layers and 0 <= head < num_heads):
            raise ValueError(
                f"head (layer {layer}, head {head}) is out of range for this model: {shape}, so layers "
                f"0..{num_layers - 1} and query heads 0..{num_heads - 1}"
            )
        mask[layer, head] = True
    return mask


def _is_pair_list(heads: torch.Tensor, num_layers: int, num_heads: int) -> bool:
    """An integer tensor [K, 2] lists (layer, head) pairs, as ``mask.nonzero()`` gives them, unless the
    model's own [L, Hq] is [K, 2] (a 0/1 mask of that model has the same shape: refused as not bool)."""
    integer = not (heads.dtype.is_floating_point or heads.dtype.is_complex or heads.dtype == torch.bool)
    return (
        integer and heads.dim() == 2 and heads.shape[1] == 2 and tuple(heads.shape) != (num_layers, num_heads)
    )


def heads_to_mask(heads: Sequence[Head], shape: Sequence[int], *, rows: int | None = None) -> torch.Tensor:
    """bool ``[L, Hq]`` (or ``[rows, L, Hq]``, the same heads in every row), True at ``heads``.

    A head outside ``shape`` is an error naming it (the heads were probably chosen for another model).
    """
    mask = normalize_head_mask(list(heads), int(shape[0]), int(shape[1]), allow_per_row=False)
    return mask if rows is None else mask.expand(rows, -1, -1).clone()
