"""Packed sequences (padding-free batches): several sequences laid end to end in one batch row.

Padding-free training (transformers' ``DataCollatorWithFlattening``, TRL's ``padding_free=True``) packs
sequences into one row and restarts ``position_ids`` at 0 for each; transformers then builds a mask in
which a token sees only the earlier tokens of its own sequence (or passes ``cu_seq_lens_q/k``, the
sequences' cumulative lengths, as flash-attention's variable-length kernels take them). The retmask kernel
takes a padding mask, not a block-diagonal one, so a packed call runs as a batch: every sequence becomes
a row of its own, right-padded to the longest (``PackedLayout.unpack``), one kernel call covers them all,
and the outputs go back to their packed places (``PackedLayout.pack``). Both moves are index selects, so
gradients flow through them; a padded slot's key is masked out and its query's output is dropped, so it
adds exactly zero to any gradient. The padding costs the difference between the longest sequence and the
others in kernel work; the layout is built once per forward (it rides on the mask every layer shares).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers.masking_utils import (
    and_masks,
    packed_sequence_mask_function,
    remap_positions_for_packed_sequence,
)

_AND = and_masks(lambda *a: True).__qualname__
_PACKED = packed_sequence_mask_function(torch.zeros(1, 1)).__qualname__
_REMAP = remap_positions_for_packed_sequence(lambda *a: True, torch.zeros(1, 1)).__qualname__


@dataclass(frozen=True)
class PackedLayout:
    """Where each packed token goes in a batch of one sequence per row.

    rows, length: the packed input's batch size B and length N; segments S, longest sequence L.
    source: int64 [S * L], the packed token (index into B * N) of each slot (padded slots: token 0).
    slot: int64 [B * N], the slot of each packed token (index into S * L).
    valid: bool [S, L], True = a token (False = right padding).
    segment_row: int64 [S], the packed row each sequence came from (for per-row head masks).
    """

    rows: int
    length: int
    longest: int
    source: torch.Tensor
    slot: torch.Tensor
    valid: torch.Tensor
    segment_row: torch.Tensor

    @classmethod
    def from_segment_ids(cls, segment_ids: torch.Tensor) -> PackedLayout:
        """segment_ids: int [B, N], equal within a sequence, changing where the next one starts (as
        transformers' ``find_packed_sequence_indices`` numbers them). One host read (the longest length)."""
        rows, length = segment_ids.shape
        flat = segment_ids.reshape(-1)
        starts_here = torch.ones_like(flat, dtype=torch.bool)
        starts_here[1:] = flat[1:] != flat[:-1]
        starts_here[::length] = True  # a sequence never continues into the next packed row
        starts = starts_here.nonzero().squeeze(1)  # [S]
        lengths = torch.diff(starts, append=starts.new_tensor([flat.numel()]))
        longest = int(lengths.max())
        segment = starts_here.cumsum(0) - 1  # [B * N] the sequence of each token
        token = torch.arange(flat.numel(), device=flat.device)
        slot = segment * longest + (token - starts[segment])
        source = torch.zeros(starts.numel() * longest, dtype=torch.long, device=flat.device)
        source[slot] = token
        valid = torch.zeros(starts.numel() * longest, dtype=torch.bool, device=flat.device)
        valid[slot] = True
        return cls(rows, length, longest, source, slot, valid.view(-1, longest), starts // length)

    @classmethod
    def from_cumulative_lengths(cls, cu_seq_lens: torch.Tensor, length: int) -> PackedLayout:
        """cu_seq_lens: int [S + 1], 0, then the end of each sequence in the one packed row of ``length``
        tokens (flash-attention's varlen convention)."""
        ends = cu_seq_lens[1:].to(torch.long)
        token = torch.arange(length, device=cu_seq_lens.device)
        segment_ids = torch.searchsorted(ends, token, right=True)
        return cls.from_segment_ids(segment_ids[None])

    @property
    def segments(self) -> int:
        return self.valid.shape[0]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, H, N, D] packed -> [S, H, L, D], one sequence per row (a view of a [S, L, H, D] copy)."""
        heads, dim = x.shape[1], x.shape[3]
        tokens = x.transpose(1, 2).reshape(self.rows * self.length, heads, dim)
        return (
            tokens.index_select(0, self.source).view(self.segments, self.longest, heads, dim).transpose(1, 2)
        )

    def pack(self, out: torch.Tensor) -> torch.Tensor:
        """out: [S, H, L, D] (any layout) -> contiguous [B, N, H, D], each token's row back in its place."""
        heads, dim = out.shape[1], out.shape[3]
        slots = out.transpose(1, 2).reshape(self.segments * self.longest, heads, dim)
        return slots.index_select(0, self.slot).view(self.rows, self.length, heads, dim)

    def same_sequences(self, other: PackedLayout) -> bool:
        return (self.rows, self.length, self.longest) == (other.rows, other.length, other.longest) and bool(
            torch.equal(self.slot, other.slot)
        )


def packed_parts(mask_function) -> tuple[torch.Tensor, object] | None:
    """(segment ids [B, N], the per-sequence mask function) when ``mask_function`` is transformers'
    packed-sequence mask, ``and_masks(remap_positions_for_packed_sequence(inner, position_ids),
    packed_sequence_mask_function(segment_ids))``, else None. Recognised by structure, as the sliding
    window is (``interface._sliding_window_of``): any other wrapper is not a packed mask."""
    if getattr(mask_function, "__qualname__", "") != _AND:
        return None
    parts = _closure(mask_function, "mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    remapped, packed = parts
    if getattr(remapped, "__qualname__", "") != _REMAP or getattr(packed, "__qualname__", "") != _PACKED:
        return None
    segment_ids = _closure(packed, "packed_sequence_mask")
    inner = _closure(remapped, "mask_function")
    if not isinstance(segment_ids, torch.Tensor) or segment_ids.dim() != 2 or inner is None:
        return None
    return segment_ids, inner


def _closure(function, name: str):
    try:
        return inspect.getclosurevars(function).nonlocals.get(name)
    except (TypeError, ValueError):
        return None
