"""Verification passes of one shape whatever the cache holds, replayed from CUDA graphs on a GPU.

On a GPU a verification pass of a small model is host-bound: the Python of a 30-layer forward issues a few
hundred kernels one by one, so the pass costs as long as the host takes to issue them, whatever the GPU
does. A CUDA graph records those launches once and replays them in one call; it needs every tensor to
have the same shape and address at every replay, which a cache that grows and crops by the pass does not
give. Here the shapes are made fixed:

* the cache is a ``TailLayer`` cache (``retmask.hf.kv_cache``) of a fixed capacity C: a pass of M tokens
  writes its keys into the buffer's last M positions and attends over the whole buffer, the unused slots
  between the cached part and that tail masked out by a padding mask [1, C] (so the keys end with the
  queries, as the kernel places them); the accepted tokens' keys are then copied to the end of the cached
  part (``commit``), the rest is scratch;
* the positions (RoPE) are given explicitly, since a key's slot is no longer its position;
* a pass's tokens are padded to the next of ``BUCKETS`` rows: the padding rows come after the real ones,
  so causality keeps them from changing any real row, and their keys are never committed;
* C is rounded up to ``CAPACITY_STEP`` and only grows, so tests of different lengths replay the same
  graphs (a growth reallocates the buffers and the graphs are captured again).

Argmax indices are buffer slots: the cached part's slots are its positions, so an argmax into the needle
is the needle's position; one into the tail is a slot >= C - M, past every prompt position, as its
position is (the copy rule compares it with the needle span only). Ties between keys keep their order
(cached part before tail), so the smallest-index rule picks the same key.

Models with sliding-window layers are refused (``unsupported_reason``): a window is a distance in slots
here, not in positions.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from retmask.hf.kv_cache import TailLayer, cache_kwargs, growing_cache

BUCKETS = (2, 3, 5, 9, 17, 33, 65)  # rows per pass: the fed token + drafts of up to 1, 2, 4, ... 64 tokens
CAPACITY_STEP = 1024  # positions


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot run fixed-shape passes, or None if it can."""
    config = model.config.get_text_config(decoder=True)
    kinds = {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    if kinds != {DynamicLayer.__name__}:
        return (
            f"model '{config.model_type}' has cache layers of kind {sorted(kinds)}: fixed-shape verification "
            "passes need every layer to attend to every key (a sliding window is a distance in buffer slots "
            "there, not in positions)"
        )
    return None


def bucket(rows: int) -> int:
    """The fixed pass size for ``rows`` tokens."""
    for size in BUCKETS:
        if rows <= size:
            return size
    raise ValueError(
        f"a verification pass of {rows} tokens is longer than the largest bucket ({BUCKETS[-1]})"
    )


class StaticPasses:
    """Fixed-shape verification passes over one ``TailLayer`` cache (``new_cache``); replayed from CUDA
    graphs on a GPU (``graphs``), run eagerly on a CPU (same shapes, same results, nothing to gain there
    but the tests of the layout)."""

    def __init__(self, model) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason + "; use the default verification passes (static_passes=False)")
        self.model = model
        self.graphs = model.device.type == "cuda"  # the one rule: graphs wherever CUDA runs the model
        self.cache: DynamicCache | None = None
        self._captured: dict[tuple[int, bool], tuple] = {}  # (rows, argmax) -> graph and its tensors
        self._buffer = None  # the key buffer the graphs were captured over

    def new_cache(self) -> DynamicCache:
        self.cache = growing_cache(self.model, TailLayer)
        self._captured.clear()
        return self.cache

    @staticmethod
    def capacity_for(positions: int) -> int:
        """Buffer length for a test that may reach ``positions`` cached tokens: room for the largest tail
        twice past them (``TailLayer.begin_tail``), rounded up to ``CAPACITY_STEP``."""
        needed = positions + 2 * BUCKETS[-1]
        return -(-needed // CAPACITY_STEP) * CAPACITY_STEP

    def ensure_capacity(self, positions: int) -> None:
        """Call after the prefill: every layer's buffer holds at least ``capacity_for(positions)``."""
        capacity = self.capacity_for(positions)
        for layer in self.cache.layers:
            layer.ensure_capacity(capacity)

    def run(self, tokens: list[int], cap) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass over ``tokens`` (the fed token and the draft) at the cache's current length.
        Returns logits [n, V] and, with ``cap`` (an active ``capture_argmax(model, rows=None)``), argmax
        int64 [L, Hq, n] of buffer slots (n = len(tokens)). Follow it with :meth:`commit`."""
        n = len(tokens)
        rows = bucket(n)
        layers = self.cache.layers
        length = layers[0].get_seq_length()
        for layer in layers:
            layer.begin_tail(rows)
        device = self.model.device
        if self.graphs:
            graph, ids, positions, mask, logits, argmax = self._graph(rows, cap)
        else:
            ids = torch.empty(1, rows, dtype=torch.long, device=device)
            positions = torch.empty(1, rows, dtype=torch.long, device=device)
            mask = torch.empty(1, layers[0]._key_buffer.shape[-2], dtype=torch.bool, device=device)
        ids[0].copy_(torch.tensor(tokens + [tokens[-1]] * (rows - n)))
        torch.arange(length, length + rows, out=positions[0])
        mask.zero_()
        mask[:, :length] = True
        mask[:, -rows:] = True
        if self.graphs:
            graph.replay()
        else:
            logits = self._forward(ids, positions, mask)
            argmax = None if cap is None else cap.last[:, 0]
        if cap is not None:
            cap.calls.clear()
        return logits[0, :n], None if argmax is None else argmax[..., :n]

    def commit(self, keep: int) -> None:
        """Keep the first ``keep`` tokens of the last pass in the cache (the accepted ones)."""
        for layer in self.cache.layers:
            layer.commit_tail(keep)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids, position_ids=positions, attention_mask=mask, **cache_kwargs(self.model, self.cache),
            use_cache=True,
        )  # fmt: skip
        return out.logits

    def _graph(self, rows: int, cap) -> tuple:
        """The captured pass of ``rows`` tokens (captured now if the buffers changed or it is new): the
        graph, its input tensors (ids, positions, mask) and its outputs (logits, argmax or None)."""
        buffer = self.cache.layers[0]._key_buffer
        if buffer is not self._buffer:  # new or reallocated buffers: every graph read the old ones
            self._captured.clear()
            self._buffer = buffer
        key = (rows, cap is not None)
        if key not in self._captured:
            device = self.model.device
            ids = torch.zeros(1, rows, dtype=torch.long, device=device)
            positions = torch.zeros(1, rows, dtype=torch.long, device=device)
            mask = torch.ones(1, buffer.shape[-2], dtype=torch.bool, device=device)
            # Warm-up on a side stream (Triton compiles, cuBLAS picks its kernels), as CUDA graph capture
            # requires; it writes only the scratch tail.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(ids, positions, mask)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._forward(ids, positions, mask)
            argmax = None if cap is None else cap.last[:, 0]
            self._captured[key] = (graph, ids, positions, mask, logits, argmax)
        return self._captured[key]
