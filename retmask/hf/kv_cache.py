"""A KV cache that appends in place, for detection's verification passes and for generation.

transformers' ``DynamicLayer.update`` appends with ``torch.cat``, which copies the whole cache on every
forward call: at 5K tokens of SmolLM2 that is 2 x 30 x 3 x 5000 x 64 x 4 B = 230 MB read and written per
pass, as much memory traffic as the pass's own weights; a generation step of one token pays it per token. ``GrowingLayer`` keeps the keys and values in a
buffer with spare capacity and hands out views of the filled part; ``crop`` only moves the end. The
fused kernel takes any row stride, so the views cost no copy there either.

Capacity: when the caller knows how long the cache can get (``reserve``: prompt length + max new tokens,
set by the detector before each test and by ``retmask generate`` before each batch), a buffer is allocated at exactly that size, so the cache never holds
more than the longest test needs (a 50K-token detection must not pay for doubling). Without a hint it
doubles when full, so appends cost amortised O(new tokens). Batch reshuffles (beam search's reorder,
``batch_repeat_interleave``, ``batch_select_indices``, :meth:`GrowingLayer.tile_batch`) build new buffers
of the same capacity from the filled part.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

MIN_CAPACITY = 256  # tokens; the first allocation of a layer's buffer

# What a transformers cache layer holds, in words, matched by class name on the layer's class and its bases
# (first match wins: a linear-attention layer that also keeps attention keys is named by its state).
# By name, so that a transformers release without one of these classes still imports.
FULL = "keys and values of full attention"
SLIDING = "keys and values of sliding-window attention"
_LAYER_KINDS = (
    ("DummyLayer", "nothing (such a layer reuses another layer's cache or needs none)"),
    ("LinearAttentionLayer", "a recurrent state (linear attention or a state-space layer)"),
    ("DynamicIndexedLayer", "an indexer cache for sparse attention"),
    ("BaseQuantizedLayer", "quantized keys and values"),
    ("DynamicSlidingWindowLayer", SLIDING),
    ("DynamicLayer", FULL),
)


def cache_layer_kinds(model) -> dict[str, list[int]]:
    """The layers of ``model``'s default cache grouped by what they hold, in words (``FULL``, ``SLIDING``
    and the other phrases of ``_LAYER_KINDS``; a class none matches by its own name), e.g.
    ``{SLIDING: [0, 1, 2], FULL: [3]}``: for messages that name the layers a feature cannot handle
    without naming transformers' classes."""
    kinds: dict[str, list[int]] = {}
    for index, layer in enumerate(DynamicCache(config=model.config.get_text_config(decoder=True)).layers):
        bases = {cls.__name__ for cls in type(layer).__mro__}
        kind = next((words for name, words in _LAYER_KINDS if name in bases), type(layer).__name__)
        kinds.setdefault(kind, []).append(index)
    return kinds


def describe_layers(kinds: dict[str, list[int]]) -> str:
    """``{SLIDING: [0, 1, 2, 4], FULL: [3]}`` -> "layers 0-2, 4 hold keys and values of sliding-window
    attention; layer 3 holds keys and values of full attention"."""
    return "; ".join(
        f"{_layer_list(layers)} {'holds' if len(layers) == 1 else 'hold'} {words}"
        for words, layers in kinds.items()
    )


def _layer_list(layers: list[int]) -> str:
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    text = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return ("layer " if len(layers) == 1 else "layers ") + text


class GrowingLayer(DynamicLayer):
    """One layer's keys and values: ``keys``/``values`` are views ``[B, Hkv, length, D]`` of buffers
    ``[B, Hkv, capacity, D]``."""

    capacity_hint: int = 0  # positions the cache may reach (0 = unknown: grow by doubling)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]
        self.is_initialized = True

    def _reserve(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        capacity = 0 if self._key_buffer is None else self._key_buffer.shape[-2]
        if needed <= capacity:
            return
        # the hint when it suffices; past it (or without one) double, so appends stay amortised O(1)
        fits = self.capacity_hint and needed <= self.capacity_hint
        capacity = self.capacity_hint if fits else max(MIN_CAPACITY, 2 * capacity, needed)
        key_buffer = key_states.new_empty(*key_states.shape[:-2], capacity, key_states.shape[-1])
        value_buffer = value_states.new_empty(*value_states.shape[:-2], capacity, value_states.shape[-1])
        if self._length:
            key_buffer[..., : self._length, :] = self._key_buffer[..., : self._length, :]
            value_buffer[..., : self._length, :] = self._value_buffer[..., : self._length, :]
        self._key_buffer, self._value_buffer = key_buffer, value_buffer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [B, Hkv, n, D] -> views [B, Hkv, length + n, D] of the whole cache."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._key_buffer is not None and key_states.shape[:-2] != self._key_buffer.shape[:-2]:
            # before any write: a smaller batch would broadcast into every row and spoil the cache
            raise ValueError(
                f"this cache holds keys of [batch, kv heads] = {list(self._key_buffer.shape[:-2])} but the call "
                f"brings {list(key_states.shape[:-2])}; use a new retmask.growing_cache(model) for another "
                "batch (or call its reset())"
            )
        end = self._length + key_states.shape[-2]
        self._reserve(end, key_states, value_states)
        self._key_buffer[..., self._length : end, :] = key_states
        self._value_buffer[..., self._length : end, :] = value_states
        self._length = end
        self.keys = self._key_buffer[..., :end, :]
        self.values = self._value_buffer[..., :end, :]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (the transformers 5 sign convention)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._length = max(0, self._length + tokens_to_remove)
        self.keys = self._key_buffer[..., : self._length, :]
        self.values = self._value_buffer[..., : self._length, :]

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        self._length = 0
        super().reset()

    def _replace(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make ``keys`` / ``values`` ([B', Hkv, length, D]) the whole content, in buffers of the old capacity."""
        capacity = self._key_buffer.shape[-2]
        self._key_buffer = self._value_buffer = None
        self._length = 0
        self._reserve(max(capacity, keys.shape[-2]), keys, values)
        self.update(keys, values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows ``beam_idx`` of the batch, in that order (beam search)."""
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (a LongTensor or a bool / slice index of the batch dimension)."""
        if self.get_seq_length() > 0:
            if torch.is_tensor(indices):
                indices = indices.to(self.keys.device)
            self._replace(self.keys[indices], self.values[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times in a row: rows [a, b] -> [a, a, b, b]."""
        if self.get_seq_length() > 0:
            self._replace(self.keys.repeat_interleave(repeats, 0), self.values.repeat_interleave(repeats, 0))

    def tile_batch(self, copies: int) -> None:
        """The whole batch ``copies`` times over: rows [a, b] -> [a, b, a, b] (``torch.cat`` order)."""
        if self.get_seq_length() > 0:
            self._replace(torch.cat([self.keys] * copies), torch.cat([self.values] * copies))


class TailLayer(GrowingLayer):
    """A ``GrowingLayer`` that can also take a forward call's keys in a scratch tail at the end of its
    buffer, for forward calls of one shape whatever the cache holds (CUDA graphs).

    While ``tail`` is 0 it appends in place like its parent. With ``tail = M`` (``begin_tail``) a call of
    M tokens writes its keys at the buffer's last M positions and gets the whole buffer back: the cached
    positions [0, length), unused slots, then its own M keys, so the keys end with the queries as the
    kernel expects and every call of M tokens has the same shapes and addresses. The caller masks the
    unused slots out (a padding mask over the whole buffer), gives the positions (RoPE) explicitly, and
    keeps the first r of the M keys by copying them to the end of the cached part (``copy_tail``) and
    counting them (``end_tail(r)``).
    ``get_seq_length`` reports capacity - M while a tail is set, which is what makes the mask sizes and
    the query offset transformers derives from it match that layout."""

    tail: int = 0

    def begin_tail(self, rows: int) -> None:
        capacity = self._key_buffer.shape[-2]
        # the cached part and the keys it may keep stay clear of the tail
        if self._length + 2 * rows > capacity:
            raise ValueError(
                f"the KV buffer holds {capacity} positions, {self._length} used: too few for a tail of {rows} "
                f"(needs {self._length + 2 * rows}); reserve more capacity before the call"
            )
        self.tail = rows

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [B, Hkv, n, D] -> [B, Hkv, length + n, D] views (append), or with a
        tail of n: the whole buffers [B, Hkv, capacity, D], the new keys in their last n positions."""
        if not self.tail:
            return super().update(key_states, value_states)
        if key_states.shape[-2] != self.tail:
            raise ValueError(f"a tail of {self.tail} positions got {key_states.shape[-2]} new keys")
        self._key_buffer[..., -self.tail :, :] = key_states
        self._value_buffer[..., -self.tail :, :] = value_states
        return self._key_buffer, self._value_buffer

    def get_seq_length(self) -> int:
        if self.tail:
            return self._key_buffer.shape[-2] - self.tail
        return super().get_seq_length()

    def copy_tail(self, slots: torch.Tensor) -> None:
        """Copy the tail's M positions to the buffer slots ``slots`` (int64 [M] on the buffer's device: a
        fixed shape, so a CUDA graph can hold the copy), e.g. the accepted ones to the end of the cached
        part and the rest onto themselves; ``end_tail`` then counts them."""
        tail_keys = self._key_buffer[:, :, -self.tail :].clone()  # the copy may write where it reads
        tail_values = self._value_buffer[:, :, -self.tail :].clone()
        self._key_buffer.index_copy_(2, slots, tail_keys)
        self._value_buffer.index_copy_(2, slots, tail_values)

    def end_tail(self, keep: int) -> None:
        """Leave tail mode with ``keep`` more cached positions (put there by ``copy_tail``)."""
        self._length += keep
        self.tail = 0
        self.keys = self._key_buffer[..., : self._length, :]
        self.values = self._value_buffer[..., : self._length, :]

    def _reserve(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """As the parent, with the new buffers' unused part zeroed: a tail call sees the whole buffer
        (masked slots included), and uninitialised memory may hold NaN, which a masked key's zero weight
        does not cancel in the kernel's block products (0 * NaN = NaN)."""
        old = self._key_buffer
        super()._reserve(needed, key_states, value_states)
        if self._key_buffer is not old:
            self._key_buffer[..., self._length :, :].zero_()
            self._value_buffer[..., self._length :, :].zero_()

    def ensure_capacity(self, positions: int) -> None:
        """Buffers of at least ``positions`` positions (an existing filled part is copied over; a layer
        that holds nothing yet allocates that many on its first call)."""
        self.capacity_hint = max(self.capacity_hint, positions)
        if self.is_initialized and self._key_buffer is not None:
            self._reserve(positions, self._key_buffer, self._value_buffer)


def reserve(cache: DynamicCache, positions: int) -> None:
    """Tell ``cache``'s growing layers that it may reach ``positions`` tokens: the next buffer they
    allocate has exactly that capacity (an existing larger buffer is kept)."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.capacity_hint = positions


def growing_cache(model, layer: type[GrowingLayer] = GrowingLayer) -> DynamicCache:
    """A ``DynamicCache`` for ``model`` whose layers append in place (``layer``: ``GrowingLayer``, or
    ``TailLayer`` for detection's fixed-shape verification passes).

    Sliding-window layers get one too and so keep every key, not only the last ``window - 1``: detection
    crops the cache back to the prompt after each test, which a cache that dropped keys cannot do. The
    window is applied by the kernel (``sliding_window`` reaches it from the attention module), which visits
    only the key blocks inside it, so the extra keys cost memory (a few MB per 1K tokens), not time.
    """
    cache = DynamicCache(config=model.config)
    cache.layers = [
        layer() if type(old) in (DynamicLayer, DynamicSlidingWindowLayer) else old for old in cache.layers
    ]
    return cache
