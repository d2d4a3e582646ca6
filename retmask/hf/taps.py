"""``retmask.hf.taps.tap_qk``: the post-RoPE query and key states of chosen layers, with autograd.

Inside ``with tap_qk(model, layers) as tap:`` every forward call of the model records, for each chosen
layer, the tensors handed to the retmask kernel by transformers' attention function:

  ``tap.q[l]``: query states [B, Hq, M', D] (RoPE applied; M' = the selected rows, below)
  ``tap.k[l]``: key states   [B, Hkv, N, D] (RoPE applied, KV cache included, not repeated for GQA)
  ``tap.scaling[l]``: the softmax scale the layer passed (1/sqrt(D) for Llama-like models)
  ``tap.features[l]``: the layer's attention features, ``{"window", "softcap", "sinks"}`` (each None on
  layers without it): a sliding window of ``window`` keys, logits capped as ``softcap * tanh(s / softcap)``,
  per-head sink logits [Hq] that join the softmax denominator. Whoever rebuilds attention weights from
  ``q`` / ``k`` must apply them (a local layer of Gemma 3 sees only the last ``window`` keys).

Nothing is detached: a loss computed from ``tap.q`` / ``tap.k`` back-propagates into q_proj / k_proj (and
everything below them), which is what MuDAF's contrastive loss needs. With ``query_rows`` the query is
reduced right in the attention call (a copy that keeps the graph), so the full [B, Hq, S, D] query of
every layer is not kept alive for scoring passes run under ``torch.no_grad()``.

Cost when no tap is active: one ``getattr`` per attention call (``module._retmask_tap`` is None).
Each forward call overwrites the previous call's tensors; only the newest call is kept.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch

from retmask.hf.guard import sync_guard
from retmask.hf.layers import head_layout
from retmask.hf.patch import require_retmask


def _layer_index(x: Any) -> int:
    """A layer index: an int (numpy and 0-d integer tensors too), never a bool or a float (``int(0.7)`` and
    ``int(True)`` would tap layers nobody asked for)."""
    if not isinstance(x, bool):
        try:
            return operator.index(x)
        except TypeError:
            pass
    raise TypeError(f"tap_qk: layers must be ints, got {x!r}")


class QKTap:
    """Context manager returned by :func:`tap_qk`.

    Attributes:
        layers: the tapped layer indices (sorted).
        q: layer -> query [B, Hq, M', D] of the newest forward call.
        k: layer -> key [B, Hkv, N, D] of the newest forward call.
        scaling: layer -> softmax scale (float) used by that layer.
        features: layer -> {"window": int | None, "softcap": float | None, "sinks": [Hq] tensor | None}.
        num_kv_groups: Hq // Hkv (query head h reads KV head h // num_kv_groups).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        layers: Iterable[int] | None = None,
        query_rows: int | torch.Tensor | None = None,
    ):
        require_retmask(model, "tap_qk")
        self.model = model
        self.layout = head_layout(model)
        num_layers = self.layout.num_layers
        if layers is not None and (isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable)):
            raise TypeError(
                f"tap_qk: layers must be a list of layer indices (or None for all), got {layers!r}"
            )
        chosen = list(range(num_layers)) if layers is None else sorted({_layer_index(x) for x in layers})
        bad = [x for x in chosen if not 0 <= x < num_layers]
        if bad or not chosen:
            raise ValueError(
                f"tap_qk: layers {bad or '[]'} are not in 0..{num_layers - 1}; pass layer indices of this "
                f"{num_layers}-layer model (or None for all layers)"
            )
        self.layers = chosen
        self._position = self.layout.positions()  # module.layer_idx -> attention layer l
        self.query_rows = _check_rows(query_rows)
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.scaling: dict[int, float] = {}
        self.features: dict[int, dict[str, Any]] = {}
        self.num_kv_groups = 1

    # -- called from retmask_attention -------------------------------------------------------------
    def record(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        scaling: float | None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """The tensors of the attention module with ``layer_idx``, kept under its attention layer l.
        query: [B, Hq, S, D] (a view); key: [B, Hkv, N, D]; kept with their autograd graph.
        window / softcap / sinks ([Hq]): the layer's attention features as passed to the kernel, or None."""
        rows = self.query_rows
        if rows is not None:
            # Under activation checkpointing the layer runs again in the backward pass, after the tap has
            # closed; the checkpoint requires that run to save the same tensors for backward as the first, so
            # what the row selection saves (its indices) is kept here, out of the checkpoint's count.
            with torch.autograd.graph.saved_tensors_hooks(_same, _same):
                if isinstance(rows, int):
                    query = query[:, :, -min(rows, query.shape[2]) :].clone()
                else:
                    query = _gather_rows(query, rows)
        layer = self._position[layer_idx]
        self.q[layer] = query
        self.k[layer] = key
        self.scaling[layer] = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
        self.features[layer] = {"window": window, "softcap": softcap, "sinks": sinks}
        self.num_kv_groups = query.shape[1] // key.shape[1]

    def clear(self) -> None:
        """Drop the recorded tensors (and the graphs they hold)."""
        self.q.clear()
        self.k.clear()
        self.features.clear()

    def __enter__(self) -> QKTap:
        mods = [self.layout.layers[i] for i in self.layers]
        if any(getattr(m, "_retmask_tap", None) is not None for m in mods):
            raise RuntimeError("tap_qk is already active on these layers; nested taps are not supported")
        for m in mods:
            m._retmask_tap = self
            sync_guard(m)
        return self

    def __exit__(self, *exc) -> None:
        for i in self.layers:
            self.layout.layers[i]._retmask_tap = None
            sync_guard(self.layout.layers[i])


def _check_rows(rows: int | torch.Tensor | None) -> int | torch.Tensor | None:
    if rows is None:
        return None
    if isinstance(rows, torch.Tensor):
        if rows.dtype not in (torch.int64, torch.int32) or rows.dim() not in (1, 2):
            raise TypeError(
                "tap_qk query_rows tensor must be int64 [B] (one query row per batch row) or [B, T] "
                f"(T rows per batch row), got {rows.dtype} of shape {list(rows.shape)}"
            )
        return rows.long()
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"tap_qk query_rows must be None, an int >= 1 or an int64 tensor, got {rows!r}")
    return rows


def _gather_rows(query: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """query [B, Hq, S, D], rows int64 [B] or [B, T] -> [B, Hq, T, D] (T = 1 for [B]); differentiable."""
    B, S = query.shape[0], query.shape[2]
    idx = rows if rows.dim() == 2 else rows[:, None]
    if idx.shape[0] != B:
        raise ValueError(f"tap_qk query_rows has {idx.shape[0]} batch rows but this forward call has {B}")
    if bool((idx < 0).any()) or bool((idx >= S).any()):
        raise ValueError(
            f"tap_qk query_rows {idx.tolist()} fall outside this call's {S} query rows (decode steps with a KV "
            "cache have one row; tap the prefill call)"
        )
    idx = idx.to(query.device)
    # one index_select per batch row: its backward keeps only the indices (gather would keep the whole query)
    return torch.stack([query[b].index_select(1, idx[b]) for b in range(B)])


def _same(tensor: torch.Tensor) -> torch.Tensor:
    """A saved tensor kept as it is (pack and unpack hook)."""
    return tensor


def tap_qk(
    model: torch.nn.Module,
    layers: Iterable[int] | None = None,
    query_rows: int | torch.Tensor | None = None,
) -> QKTap:
    """Record post-RoPE query/key states of ``layers`` (None = all) as they enter the retmask kernel.

    Args:
        model: a model on retmask attention.
        layers: layer indices to tap; other layers pay nothing.
        query_rows: None = all query rows (``tap.q[l]`` is the kernel's input view); int T = the last T
            rows of each call; int64 [B] = one row per batch row (e.g. each row's last prompt token under
            right padding) -> q [B, Hq, 1, D]; int64 [B, T] -> [B, Hq, T, D].

    ``with tap_qk(model, [5, 7], query_rows=last) as tap: out = model(ids)`` then ``tap.q[5]``,
    ``tap.k[5]``. Gradients flow from anything computed on them.
    """
    return QKTap(model, layers, query_rows)
