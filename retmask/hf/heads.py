"""Runtime head masks on query heads: ``set_head_mask``, ``clear_head_mask``, ``head_mask``.

A masked head is skipped by the kernel (``skip_heads``): its output is exactly 0 and it costs no work,
which gives the same logits as a checkpoint with that head's output-projection inputs (``o_proj``
columns) zeroed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from retmask.heads.mask import HeadSpec, normalize_head_mask
from retmask.hf.guard import sync_guard
from retmask.hf.layers import HeadLayout, head_layout
from retmask.hf.patch import require_retmask


def set_head_mask(model: torch.nn.Module, heads: HeadSpec) -> torch.Tensor:
    """Mask query heads at run time (replaces any previous mask).

    Args:
        heads: list of (layer, head) pairs (or "layer-head" strings), bool [L, Hq], or bool [B, L, Hq]
            = one mask per batch row (every forward call must then have exactly B rows; for a
            ``generate()`` that expands each row to k rows, beams or ``num_return_sequences``, pass
            ``mask.repeat_interleave(k, dim=0)``: the k copies of a row sit next to each other).

    Returns:
        the normalised CPU mask, bool [L, Hq] or [B, L, Hq].

    With gradient checkpointing, keep the mask of a forward call set until its ``backward()``: the
    recomputation reads the mask that is set then, so a mask changed in between gives the gradients of
    the other mask (or a ``CheckpointError`` when the saved tensors no longer match).
    """
    require_retmask(model, "set_head_mask")
    layout = head_layout(model)
    mask = normalize_head_mask(heads, *layout.shape)
    _apply(layout, [layer_state(mask, layer_idx) for layer_idx in range(layout.num_layers)])
    return mask


LayerState = tuple[torch.Tensor | None, int | None]  # (skip [Hq] / [B, Hq] or None, rows of a per-row mask)


def layer_state(mask: torch.Tensor, layer_idx: int) -> LayerState:
    """What one attention module holds for a normalised mask (bool [L, Hq] or [B, L, Hq])."""
    per_row = mask.dim() == 3
    skip = mask[:, layer_idx] if per_row else mask[layer_idx]  # [B, Hq] or [Hq]
    # None for a layer without masked heads keeps the kernel on its fast path; decided once, here. The batch
    # size of a per-row mask is checked against every call, even in layers without masked heads.
    return (skip if bool(skip.any()) else None), (mask.shape[0] if per_row else None)


def _apply(layout: HeadLayout, states: list[LayerState]) -> None:
    for module, proj, (skip, rows) in zip(layout.layers, layout.projections, states, strict=True):
        module._retmask_skip = None if skip is None else skip.to(proj.weight.device)
        module._retmask_rows = rows
        sync_guard(module)


@contextmanager
def layer_states(model: torch.nn.Module, states: list[LayerState]) -> Iterator[None]:
    """Inside the block, attention module ``l`` holds ``states[l]`` (layers may differ in batch size: see
    ``retmask.hf.shared_prefill``); the previous masks come back on exit."""
    layout = head_layout(model)
    saved = _current(model)
    try:
        _apply(layout, states)
        yield
    finally:
        _apply(layout, saved)


def clear_head_mask(model: torch.nn.Module) -> None:
    """Remove any runtime head mask."""
    for module in head_layout(model).layers:
        module._retmask_skip = None
        module._retmask_rows = None
        sync_guard(module)


def _current(model: torch.nn.Module) -> list[LayerState]:
    return [
        (getattr(m, "_retmask_skip", None), getattr(m, "_retmask_rows", None))
        for m in head_layout(model).layers
    ]


@contextmanager
def head_mask(model: torch.nn.Module, heads: HeadSpec) -> Iterator[torch.Tensor]:
    """``with retmask.head_mask(model, heads): ...`` masks ``heads`` inside the block, then restores the
    previous mask (if any). Yields the normalised mask."""
    saved = _current(model)
    try:
        yield set_head_mask(model, heads)
    finally:
        _apply(head_layout(model), saved)
