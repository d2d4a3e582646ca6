"""Prefill a batch made of copies of the same prompts once below the first layer where the copies differ.

RetMask generates a chosen and a rejected response for every instruction in one batch of R = copies * b
rows: rows ``i, b + i, 2b + i, ...`` hold the same prompt, and a per-row head mask switches heads off in
some of them. Below the first layer ``split`` in which the copies of a prompt mask different heads, their
hidden states are identical, and so are the prompt's keys and values there. :func:`share_next_prefill`
makes the next forward call of the model (``generate``'s prefill) run those layers on the ``b`` distinct
prompts only:

* forward pre-hooks on the decoder layers below ``split`` keep the first ``b`` rows of every batch-sized
  argument (tensors of two or more dimensions whose first one is R: hidden states, padding mask, position
  ids, rotary cos / sin), and the attention modules there hold the head mask of those rows (the copies
  agree on it);
* a pre-hook on decoder layer ``split`` stacks ``copies`` copies of the hidden states: the layers above
  run on the full batch, with their own masks, and the logits come out for every row;
* when the call returns, the cache layers below ``split`` are tiled to the full batch
  (``GrowingLayer.tile_batch``), the hooks are removed and the masks restored: decoding runs as usual.

The prefill stays one forward call over the whole prompt, so every position takes the kernels it would
take anyway; only the row count of the lower layers' GEMMs changes. For SmolLM2 with its detected
retrieval heads masked (first masked layer 17 of 30) a chosen + rejected prefill does (30 + 13) / 60 =
0.72 of the layer work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from retmask.hf.heads import layer_state, layer_states
from retmask.hf.kv_cache import GrowingLayer
from retmask.hf.layers import decoder_layers, head_layout


def shared_layers(
    input_ids: torch.Tensor,
    head_mask: torch.Tensor | None,
    copies: int,
    num_layers: int,
    attention_mask: torch.Tensor | None = None,
) -> int:
    """How many layers from the bottom a prefill of ``copies`` stacked copies can share (0 = none).

    input_ids, attention_mask: [R, T]; 0 unless R = copies * b and the rows are ``copies`` copies of the
    first b, padding included (the shared rows run with the first b rows' mask).
    head_mask: None, bool [L, Hq] (the same for every row) or [R, L, Hq]: the first layer in which a copy
    masks other heads than the first b rows, at most L - 1 (the top layer always runs on every row).
    """
    rows = input_ids.shape[0]
    if copies < 2 or rows % copies or num_layers < 2:
        return 0
    b = rows // copies
    for rows_of in (input_ids, attention_mask):
        if rows_of is not None and not all(
            torch.equal(rows_of[:b], rows_of[c * b : (c + 1) * b]) for c in range(1, copies)
        ):
            return 0
    if head_mask is None or head_mask.dim() == 2:
        return num_layers - 1
    first = head_mask[:b]
    differs = torch.zeros(head_mask.shape[1], dtype=torch.bool)
    for c in range(1, copies):
        differs |= (head_mask[c * b : (c + 1) * b] != first).any(-1).any(0)  # [L]
    split = int(differs.nonzero()[0]) if bool(differs.any()) else num_layers
    return min(split, num_layers - 1)


def _map_batch(x: Any, rows: int, fn: Any) -> Any:
    """``x`` with ``fn`` applied to every tensor of >= 2 dims whose first dim is ``rows`` (in tuples, lists
    and dicts too)."""
    if isinstance(x, torch.Tensor):
        return fn(x) if x.dim() >= 2 and x.shape[0] == rows else x
    if isinstance(x, tuple):
        return tuple(_map_batch(y, rows, fn) for y in x)
    if isinstance(x, list):
        return [_map_batch(y, rows, fn) for y in x]
    if isinstance(x, dict):
        return {k: _map_batch(v, rows, fn) for k, v in x.items()}
    return x


@contextlib.contextmanager
def share_next_prefill(
    model: torch.nn.Module,
    rows: int,
    copies: int,
    split: int,
    head_mask: torch.Tensor | None,
    cache: Any,
) -> Iterator[None]:
    """Inside the block, the next forward call of ``model`` with ``rows`` rows shares layers [0, split).

    rows: R = copies * b, the batch of that call (its rows ``c * b + i`` must be copies of row i, see
    :func:`shared_layers`); split: 1 <= split < L; head_mask: None or the per-row bool [R, L, Hq] the
    model holds (``retmask.head_mask``) for the call; cache: the ``DynamicCache`` of ``GrowingLayer``s
    (``retmask.hf.kv_cache.growing_cache``) the call fills. Calls after the first run as usual; leaving
    the block undoes whatever the first call did not.
    """
    layout = head_layout(model)
    blocks = decoder_layers(model, layout)
    b = rows // copies
    if not (1 <= split < layout.num_layers) or rows != b * copies or copies < 2:
        raise ValueError(
            f"share_next_prefill: {rows} rows as {copies} copies, split {split} of {layout.num_layers}"
        )
    if not all(isinstance(layer, GrowingLayer) for layer in cache.layers):
        raise ValueError(
            "share_next_prefill needs a cache of GrowingLayer's (retmask.hf.kv_cache.growing_cache)"
        )

    def first_rows(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        keep = lambda t: t[:b]  # noqa: E731
        return _map_batch(args, rows, keep), _map_batch(kwargs, rows, keep)

    def every_row(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        stack = lambda t: torch.cat([t] * copies)  # noqa: E731
        return _map_batch(args, b, stack), _map_batch(kwargs, b, stack)

    states = None
    if head_mask is not None and head_mask.dim() == 3:
        mask = head_mask.cpu()
        states = [layer_state(mask[:b] if i < split else mask, i) for i in range(layout.num_layers)]
    hooks: list[Any] = []
    masks = contextlib.ExitStack()

    def finish() -> None:
        for hook in hooks:
            hook.remove()
        hooks.clear()
        masks.close()

    def after_prefill(_module: torch.nn.Module, _args: tuple, _kwargs: dict, _out: Any) -> None:
        finish()
        for i in range(split):
            cache.layers[i].tile_batch(copies)

    def before_call(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or ids.shape[0] != rows:
            finish()  # not the prefill this was set up for: run it, and the rest, as usual
            return
        if states is not None:
            masks.enter_context(layer_states(model, states))
        # prepend: other hooks on these layers (users', the argmax recorder's) see the shapes the layer runs on
        hooks.extend(
            blocks[i].register_forward_pre_hook(first_rows, with_kwargs=True, prepend=True)
            for i in range(split)
        )
        hooks.append(blocks[split].register_forward_pre_hook(every_row, with_kwargs=True, prepend=True))
        hooks.append(model.register_forward_hook(after_prefill, with_kwargs=True))
        hooks.remove(start)
        start.remove()

    start = model.register_forward_pre_hook(before_call, with_kwargs=True)
    hooks.append(start)
    try:
        yield
    finally:
        finish()
