"""Head masks: normalising user input, and exporting a checkpoint with masked heads zeroed.

Masking head h of layer l = zeroing columns ``[h*D, (h+1)*D)`` of that layer's ``o_proj.weight``
(``[hidden, Hq*D]``): the head then contributes nothing downstream. ``o_proj.bias`` (if any) is indexed
by the *output* dimension and is left alone (the reference script zeroes ``bias[h*D:(h+1)*D]``, which is
a different thing).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch

HeadSpec = torch.Tensor | Iterable  # bool [L, Hq] | bool [B, L, Hq] | [(layer, head), ...] | ["l-h", ...]


def _pair(item, index: int) -> tuple[int, int]:
    if isinstance(item, str):  # "layer-head", the key format of retrieval-score JSON files
        parts = item.split("-")
        if len(parts) == 2 and all(p.strip().lstrip("-").isdigit() for p in parts):
            return int(parts[0]), int(parts[1])
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        layer, head = item
        if isinstance(layer, torch.Tensor):
            layer = layer.item()
        if isinstance(head, torch.Tensor):
            head = head.item()
        if isinstance(layer, int) and isinstance(head, int) and not isinstance(layer, bool):
            return layer, head
    raise ValueError(
        f"head entry #{index} is {item!r}; expected a (layer, head) pair of ints or a 'layer-head' string"
    )


def normalize_head_mask(
    heads: HeadSpec, num_layers: int, num_heads: int, *, allow_per_row: bool = True
) -> torch.Tensor:
    """Turn a head selection into a CPU bool mask (True = head masked).

    Args:
        heads: list of (layer, head) pairs or "layer-head" strings; bool tensor [L, Hq]; or bool tensor
            [B, L, Hq] (one mask per batch row, if ``allow_per_row``).
        num_layers, num_heads: the model's [L, Hq].

    Returns:
        bool [L, Hq] or [B, L, Hq] on the CPU.
    """
    shape = f"[L, Hq] = [{num_layers}, {num_heads}]"
    if isinstance(heads, torch.Tensor):
        if heads.dtype != torch.bool:
            raise ValueError(
                f"head mask tensor must be bool (True = masked), got {heads.dtype}; use mask.bool() for 0/1 masks"
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
        layer, head = _pair(item, i)
        if not (0 <= layer < num_layers and 0 <= head < num_heads):
            raise ValueError(
                f"head (layer {layer}, head {head}) is out of range for this model: {shape}, so layers "
                f"0..{num_layers - 1} and query heads 0..{num_heads - 1}"
            )
        mask[layer, head] = True
    return mask


def zero_heads_(model: torch.nn.Module, heads: HeadSpec) -> torch.nn.Module:
    """Zero (in place) the o_proj columns of ``heads`` in ``model``; returns the model."""
    from .hf.layers import head_layout

    layout = head_layout(model)
    mask = normalize_head_mask(heads, *layout.shape, allow_per_row=False)
    D = layout.head_dim
    with torch.no_grad():
        for layer_idx, head in mask.nonzero().tolist():
            layout.layers[layer_idx].o_proj.weight[:, head * D : (head + 1) * D] = 0
    return model


def export_masked(
    model: torch.nn.Module, heads: HeadSpec, out_dir: str | os.PathLike, tokenizer=None
) -> Path:
    """Save a standard HF checkpoint of ``model`` with the o_proj columns of ``heads`` zeroed.

    ``model`` itself is not modified. The saved config names no retmask attention, so plain
    transformers loads it. Returns the output folder.
    """
    from .hf.layers import head_layout

    layout = head_layout(model)
    mask = normalize_head_mask(heads, *layout.shape, allow_per_row=False)
    D = layout.head_dim
    by_ptr = {m.o_proj.weight.data_ptr(): m for m in layout.layers}
    state = dict(model.state_dict())
    # state_dict() returns detached views: match o_proj weights by storage, then swap in zeroed copies.
    for key, tensor in list(state.items()):
        module = by_ptr.get(tensor.data_ptr()) if key.endswith("o_proj.weight") else None
        if module is None:
            continue
        cols = mask[module.layer_idx].nonzero().flatten().tolist()
        if cols:
            zeroed = tensor.detach().clone()
            for head in cols:
                zeroed[:, head * D : (head + 1) * D] = 0
            state[key] = zeroed
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    saved_impl = config._attn_implementation_internal
    try:
        # The checkpoint must load without retmask installed: do not record a custom attention name.
        config._attn_implementation_internal = None
        model.save_pretrained(out, state_dict=state)
    finally:
        config._attn_implementation_internal = saved_impl
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
