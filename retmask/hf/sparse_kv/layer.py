"""One global layer of a head-sparse KV cache: every key for the full KV heads, sink + window for the rest.

Storage (B = batch, D = head dim, N = tokens so far, S = sink tokens, W = window):

* full KV heads (Hf of them): a ``FullHeadsLayer`` (in-place appends into ``[B, Hf, capacity, D]``; the
  capacity is the cache's ``max_length`` hint when given, else the prefill's length, then + 1/8 per growth);
* windowed KV heads (Hw): a compact buffer ``[B, Hw, S + W, D]`` for K and for V. Slots ``0 .. S-1`` hold
  positions ``0 .. S-1`` (the sinks); slots ``S .. S+W-1`` are a ring over the later positions (position
  ``p >= S`` lives in slot ``S + (p - S) % W``). Writing position p overwrites position ``p - W``, exactly
  the key that leaves the window of the query at p, so after a decode step's write the buffer holds the
  keys that query sees and nothing else. ``positions`` (int64 [S + W], -1 = empty slot) names each slot.

Prefill: the windowed heads' query rows see only their pattern, so the keys they never see are skipped
(``full_prefill=False``, the default: memory and work bounded from the first token), or, with
``full_prefill=True``, the first forward call attends over every key in every head, as a normal cache would,
and only then drops what the windowed heads do not keep (compression after the prompt: decode steps see the
pattern, the prompt's own rows do not). A later multi-token call (a second prefill chunk) sees the pattern
either way: the keys it would need are gone.

Positions are columns of the padded batch (shared by every row): with left padding a row's sinks are the
first S columns, i.e. ``max(0, S - pad)`` real tokens for a row with ``pad`` padding tokens (its window is
unaffected: padding sits only before the real tokens).

``update`` returns the full heads' keys and values ``[B, Hf, N, D]`` like any cache layer, with a
``SparseKV`` attached to the returned key tensor (``key._retmask_sparse``; an alias that the cache does not
keep, so the call's windowed keys die with the call): the retmask attention function reads it and computes
the windowed heads from their compact keys (``attention.py``). Another attention implementation would see
only the full heads, so ``head_sparse_cache`` refuses models not on retmask attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from retmask.hf.kv_cache import GrowingLayer

SLACK = 8  # without a capacity hint, the full heads' buffer grows to needed + needed / SLACK
SLACK_MIN = 64  # tokens, at least


class FullHeadsLayer(GrowingLayer):
    """The full KV heads' keys: a ``GrowingLayer`` (in-place appends) that, without a capacity hint,
    allocates exactly the prefill's tokens and then grows by 1/8 (at least 64 tokens), not by doubling: a
    cache whose point is memory should not hold twice the prompt after its first decode step. The copies
    stay amortised O(1) per token (one every N/8 tokens at length N)."""

    def _reserve(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        capacity = 0 if self._key_buffer is None else self._key_buffer.shape[-2]
        if needed <= capacity or (self.capacity_hint and needed <= self.capacity_hint):
            super()._reserve(needed, key_states, value_states)
            return
        hint = self.capacity_hint
        # GrowingLayer allocates exactly its hint when the hint suffices: hand it the size chosen here
        self.capacity_hint = needed if capacity == 0 else needed + max(SLACK_MIN, needed // SLACK)
        try:
            super()._reserve(needed, key_states, value_states)
        finally:
            self.capacity_hint = hint


@dataclass(eq=False)
class SparseKV:
    """What one ``HeadSparseLayer.update`` hands the attention function.

    q_full, q_win: int64 [Hq_f], [Hq_w], the query heads reading full / windowed KV heads (KV-head major,
        so ``q_win`` reshapes to [Hw, g]); keys_full, values_full: [B, Hf, N, D] (all positions);
    keys_win, values_win: [B, Hw, Nw, D], the windowed heads' keys this call may need (see ``mode``);
    positions_win: int64 [Nw], the absolute position of each (-1 = empty slot);
    mode: "visible"  one query row (decode); every non-empty key in keys_win is visible to it;
          "ordered"  keys_win holds positions 0 .. N-1 in order and every query row sees every earlier key:
                     no key has left the pattern yet (N <= S + W), or a first prefill with
                     ``full_prefill``; plain causal attention;
          "pattern"  anything else (a prefill longer than S + W, or a chunk after earlier calls): row p
                     sees key j iff 0 <= j <= p and (j < S or p - W < j).
    length: N, positions in the sequence after this update (the padding mask's width);
    start: position of the first query row; window: W; sink_tokens: S.
    """

    q_full: torch.Tensor
    q_win: torch.Tensor
    keys_full: torch.Tensor
    values_full: torch.Tensor
    keys_win: torch.Tensor
    values_win: torch.Tensor
    positions_win: torch.Tensor
    mode: str
    length: int
    start: int
    window: int
    sink_tokens: int


class HeadSparseLayer(CacheLayerMixin):
    """A layer cache keeping all keys of ``full_kv`` KV heads and sink + window keys of the others."""

    is_sliding = False  # its padding mask covers every position (get_mask_sizes), like a full layer
    is_croppable = False  # evicted keys cannot come back
    supports_early_init = False

    def __init__(
        self,
        full_kv: list[int],
        num_kv_heads: int,
        groups: int,
        window: int,
        sink_tokens: int,
        full_prefill: bool = False,
    ):
        super().__init__()
        self.full_prefill = full_prefill
        self.full_kv = sorted(full_kv)
        self.win_kv = [h for h in range(num_kv_heads) if h not in set(full_kv)]
        self.num_kv_heads, self.groups = num_kv_heads, groups
        self.window, self.sink_tokens = window, sink_tokens
        self._full = FullHeadsLayer()
        self.capacity_hint = 0
        self._length = 0
        self._keys_win: torch.Tensor | None = None  # [B, Hw, S + W, D]
        self._values_win: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None  # int64 [S + W]

    # -- set-up --------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device

        def index(heads: list[int]) -> torch.Tensor:
            return torch.tensor(heads, dtype=torch.int64, device=self.device)

        g = self.groups
        self._kv_full, self._kv_win = index(self.full_kv), index(self.win_kv)
        self._q_full = index([kv * g + i for kv in self.full_kv for i in range(g)])
        self._q_win = index([kv * g + i for kv in self.win_kv for i in range(g)])
        self.is_initialized = True

    def reserve(self, positions: int) -> None:
        """The full heads' buffer is allocated at ``positions`` tokens (prompt + new tokens) when it is first
        needed, instead of growing (``FullHeadsLayer``)."""
        self.capacity_hint = self._full.capacity_hint = positions

    def _split(self, states: torch.Tensor, heads: torch.Tensor, count: int) -> torch.Tensor:
        """states[:, heads] without a copy when the heads are all of them."""
        return states if count == self.num_kv_heads else states.index_select(1, heads)

    # -- the update the attention layers call --------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [B, Hkv, n, D] (positions N .. N + n - 1) -> the full heads' keys and
        values [B, Hf, N + n, D]; ``keys._retmask_sparse`` is the ``SparseKV`` of this call."""
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                "a head-sparse KV cache hands the attention function its windowed keys on the side, which "
                "torch.compile cannot trace; run the model eagerly with it"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        start, end = self._length, self._length + n
        B, _, _, D = key_states.shape
        if self.full_kv:
            keys, values = self._full.update(
                self._split(key_states, self._kv_full, len(self.full_kv)),
                self._split(value_states, self._kv_full, len(self.full_kv)),
            )
        else:  # no full head: an empty [B, 0, N, D] carries the length
            keys = key_states.new_empty(B, 0, end, D)
            values = value_states.new_empty(B, 0, end, D)
        self.keys, self.values = keys, values
        if self.win_kv:
            k_new = self._split(key_states, self._kv_win, len(self.win_kv))
            v_new = self._split(value_states, self._kv_win, len(self.win_kv))
            if n == 1 and self._keys_win is not None:
                keys_win, values_win, positions, mode = self._write_one(k_new, v_new, start)
            else:
                keys_win, values_win, positions, mode = self._write_chunk(k_new, v_new, start, end)
        else:
            keys_win = values_win = key_states.new_empty(B, 0, 0, D)
            positions, mode = torch.empty(0, dtype=torch.int64, device=self.device), "visible"
        self._length = end
        # The SparseKV rides on an alias of the keys, never on a tensor the cache keeps (self.keys, the full
        # heads' buffer view): it holds this call's windowed keys, for a prefill every prompt key of the
        # windowed heads, and would keep them alive in every layer until that layer's next call.
        handed = keys.view(keys.shape)
        handed._retmask_sparse = SparseKV(
            q_full=self._q_full, q_win=self._q_win, keys_full=keys, values_full=values, keys_win=keys_win,
            values_win=values_win, positions_win=positions, mode=mode, length=end, start=start,
            window=self.window, sink_tokens=self.sink_tokens,
        )  # fmt: skip
        return handed, values

    def _slot(self, position: int) -> int:
        S = self.sink_tokens
        return position if position < S else S + (position - S) % self.window

    def _write_one(
        self, k_new: torch.Tensor, v_new: torch.Tensor, position: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
        """Decode: write in place (overwriting position - W, which the query at ``position`` no longer
        sees); the attention reads the whole buffer."""
        slot = self._slot(position)
        self._keys_win[:, :, slot] = k_new[:, :, 0]
        self._values_win[:, :, slot] = v_new[:, :, 0]
        self._positions[slot] = position
        return self._keys_win, self._values_win, self._positions, "visible"

    def _write_chunk(
        self, k_new: torch.Tensor, v_new: torch.Tensor, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
        """A chunk of n tokens (prefill): the attention gets the old buffer + the chunk (the chunk's first
        rows may need keys the chunk evicts), the cache a new buffer with the chunk's kept keys written."""
        S, W = self.sink_tokens, self.window
        old_k, old_v, old_pos = self._keys_win, self._values_win, self._positions
        B, Hw, n, D = k_new.shape
        chunk_pos = torch.arange(start, end, dtype=torch.int64, device=self.device)
        if end <= S + W:  # nothing evicted yet: slot i holds position i, so old[:start] + chunk is in order
            keys_win = k_new if start == 0 else torch.cat([old_k[:, :, :start], k_new], dim=2)
            values_win = v_new if start == 0 else torch.cat([old_v[:, :, :start], v_new], dim=2)
            positions = torch.arange(end, dtype=torch.int64, device=self.device)
            mode = "ordered" if n > 1 else "visible"
        elif old_k is None:  # a first prefill: the pattern, or with full_prefill every key (kept: S + W)
            keys_win, values_win, positions = k_new, v_new, chunk_pos
            mode = "ordered" if self.full_prefill else "pattern"
        else:
            keys_win, values_win = torch.cat([old_k, k_new], dim=2), torch.cat([old_v, v_new], dim=2)
            positions, mode = torch.cat([old_pos, chunk_pos]), "pattern"
        # The new buffer: zeros, not empty (an empty slot's garbage could be NaN, and 0 * NaN = NaN in a
        # product over masked keys), then the chunk's keys that stay: sinks and the last W positions.
        if old_k is None:
            new_k = k_new.new_zeros(B, Hw, S + W, D)
            new_v = v_new.new_zeros(B, Hw, S + W, D)
            new_pos = torch.full((S + W,), -1, dtype=torch.int64, device=self.device)
        else:
            new_k, new_v, new_pos = old_k.clone(), old_v.clone(), old_pos.clone()
        keep = (chunk_pos < S) | (chunk_pos > end - 1 - W)
        slots = torch.where(chunk_pos < S, chunk_pos, S + (chunk_pos - S) % W)[keep]
        new_k.index_copy_(2, slots, k_new[:, :, keep])
        new_v.index_copy_(2, slots, v_new[:, :, keep])
        new_pos.index_copy_(0, slots, chunk_pos[keep])
        self._keys_win, self._values_win, self._positions = new_k, new_v, new_pos
        return keys_win, values_win, positions, mode

    # -- what the Cache API asks -----------------------------------------------------------------------
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset): the padding mask covers every position (the windowed heads pick their
        columns from it by position)."""
        return self._length + query_length, 0

    def get_seq_length(self) -> int:
        return self._length

    def get_max_length(self) -> int:
        return -1

    def memory_bytes(self) -> int:
        """Bytes this layer holds: the full heads' K/V buffers (their allocated capacity), the windowed
        heads' K/V buffers and the slot positions."""
        held = [self._full._key_buffer, self._full._value_buffer] if self._full.is_initialized else []
        held += [self._keys_win, self._values_win, self._positions]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def full_cache_bytes(self) -> int:
        """What a ``DynamicCache`` layer holds for the same tokens: K and V [B, Hkv, N, D]."""
        if not self.is_initialized or self._length == 0:
            return 0
        B, D = self.keys.shape[0], self.keys.shape[-1]
        return 2 * B * self.num_kv_heads * self._length * D * torch.empty(0, dtype=self.dtype).element_size()

    def reset(self) -> None:
        self._full = FullHeadsLayer()
        self._full.capacity_hint = self.capacity_hint
        self._keys_win = self._values_win = self._positions = None
        self._length = 0
        self.keys = self.values = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError(
                "a head-sparse KV cache has freed the keys it evicted, so it cannot be rolled back (crop): "
                "assisted / speculative decoding and prompt-cache reuse need a full cache "
                "(transformers' DynamicCache or retmask.growing_cache)"
            )

    # -- batch reshuffles (beam search, num_return_sequences, contrastive search) -----------------------
    def _map_batch(self, fn) -> None:
        if self._full.is_initialized and self._full.get_seq_length() > 0:
            self._full._replace(fn(self._full.keys), fn(self._full.values))
            self.keys, self.values = self._full.keys, self._full.values
        if self._keys_win is not None:
            self._keys_win, self._values_win = fn(self._keys_win), fn(self._values_win)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if torch.is_tensor(indices):
            indices = indices.to(self.device)
        self._map_batch(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, 0))
