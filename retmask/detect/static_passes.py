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

from typing import NamedTuple

import torch
from transformers import DynamicCache

from retmask.hf.kv_cache import FULL, TailLayer, cache_layer_kinds, describe_layers, growing_cache

BUCKETS = (2, 3, 5, 9, 17, 33, 65)  # rows per pass: the fed token + drafts of up to 1, 2, 4, ... 64 tokens
CAPACITY_STEP = 1024  # positions


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot run fixed-shape passes, or None if it can."""
    odd = {kind: layers for kind, layers in cache_layer_kinds(model).items() if kind != FULL}
    if odd:
        return (
            f"model '{model.config.model_type}' is not full attention throughout ({describe_layers(odd)}): "
            "fixed-shape verification passes need every layer to attend to every key (a sliding window is a "
            "distance in buffer slots there, not in positions)"
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
    graphs on a GPU (``graphs``), run eagerly on a CPU (same code, same results; nothing to gain there but
    the tests of the layout).

    A pass and its commit are two functions of small integer inputs: the pass of ``header`` (int64
    [M + 1]: the M token ids, then the cache length) builds its positions and mask and runs the model; the
    commit of ``slots`` (int64 [M]: where each tail position goes) copies the kept keys. On a GPU each is
    captured once per bucket (and buffer), so a pass costs the host two small copies to the device and two
    graph replays instead of the few hundred kernel launches of a forward."""

    def __init__(self, model) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(
                reason + "; use the default verification passes (static_passes=False; retmask detect: drop "
                "--static-passes)"
            )
        self.model = model
        self.graphs = model.device.type == "cuda"  # the one rule: graphs wherever CUDA runs the model
        self.cache: DynamicCache | None = None
        self._captured: dict[tuple, _Captured] = {}  # (kind, rows, argmax) -> graph, inputs, outputs
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
        """Every layer's buffer holds at least ``capacity_for(positions)`` (a layer that holds nothing yet
        allocates that much on its first call)."""
        capacity = self.capacity_for(positions)
        for layer in self.cache.layers:
            layer.ensure_capacity(capacity)

    def run(self, tokens: list[int], cap) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass over ``tokens`` (the fed token and the draft) at the cache's current length.
        Returns logits [n, V] and, with ``cap`` (an active ``capture_argmax(model, rows=None)``), argmax
        int64 [L, Hq, n] of buffer slots (n = len(tokens)); the caller clears ``cap.calls`` after reading
        it. Follow it with :meth:`commit`."""
        n = len(tokens)
        rows = bucket(n)
        length = self.cache.layers[0].get_seq_length()
        for layer in self.cache.layers:
            layer.begin_tail(rows)
        header = tokens + [tokens[-1]] * (rows - n) + [length]  # padded ids, then the cache length
        logits, argmax = self._call("pass", rows, cap, header)
        return logits[0, :n], None if argmax is None else argmax[:, 0, :, :n]

    def commit(self, keep: int) -> None:
        """Keep the first ``keep`` tokens of the last pass in the cache (the accepted ones)."""
        first = self.cache.layers[0]  # in tail mode: its length is the cached part's until end_tail
        rows, length, capacity = first.tail, first._length, first._key_buffer.shape[-2]
        # kept positions go to the end of the cached part, the others onto themselves
        slots = [length + i if i < keep else capacity - rows + i for i in range(rows)]
        self._call("commit", rows, None, slots)
        for layer in self.cache.layers:
            layer.end_tail(keep)

    # -- the two functions, eager or replayed ------------------------------------------------------------
    def _pass(self, header: torch.Tensor) -> tuple[torch.Tensor, None]:
        """header: int64 [M + 1] -> (logits [1, M, V], None); argmax lands in the active capture."""
        rows = header.shape[0] - 1
        capacity = self.cache.layers[0]._key_buffer.shape[-2]
        length = header[rows]
        positions = (length + torch.arange(rows, device=header.device))[None]
        slots = torch.arange(capacity, device=header.device)
        mask = ((slots < length) | (slots >= capacity - rows))[None]  # cached part and tail: bool [1, C]
        out = self.model(
            input_ids=header[None, :rows], position_ids=positions, attention_mask=mask,
            cache=self.cache, use_cache=True,
        )  # fmt: skip
        return out.logits, None

    def _commit(self, slots: torch.Tensor) -> tuple[None, None]:
        for layer in self.cache.layers:
            layer.copy_tail(slots)
        return None, None

    def _call(self, kind: str, rows: int, cap, values: list[int]) -> tuple:
        """Run ``_pass`` / ``_commit`` on ``values``: eagerly, or by replaying its graph (captured first if
        new for this bucket, capture and buffer). Returns (logits, argmax or None) for a pass."""
        fn = self._pass if kind == "pass" else self._commit
        device = self.model.device
        if not self.graphs:
            result = fn(torch.tensor(values, dtype=torch.long, device=device))
            return result[0], (None if cap is None or kind != "pass" else cap.last)
        buffer = self.cache.layers[0]._key_buffer
        if buffer is not self._buffer:  # new or reallocated buffers: every graph read the old ones
            self._captured.clear()
            self._buffer = buffer
        key = (kind, rows, cap is not None)
        if key not in self._captured:
            self._captured[key] = _capture(
                fn, torch.tensor(values, dtype=torch.long, device=device), cap, kind
            )
        captured = self._captured[key]
        captured.inputs.copy_(torch.tensor(values, dtype=torch.long))
        captured.graph.replay()
        return captured.logits, captured.argmax


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # int64, the function's argument: filled before each replay
    logits: torch.Tensor | None
    argmax: torch.Tensor | None  # [L, B, Hq, M] of the capture's recording


def _capture(fn, inputs: torch.Tensor, cap, kind: str) -> _Captured:
    """``fn(inputs)`` captured in a CUDA graph, after a warm-up on a side stream (Triton compiles, cuBLAS
    picks its kernels) as capture requires. The warm-up runs ``fn`` on the real inputs; both functions
    can run twice with the same inputs (a pass rewrites the tail, a commit copies the same keys again)."""
    device = inputs.device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits, _ = fn(inputs)
    argmax = cap.last if cap is not None and kind == "pass" else None
    return _Captured(graph, inputs, logits, argmax)
