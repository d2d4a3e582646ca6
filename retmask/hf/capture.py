"""``retmask.capture_argmax``: per-layer, per-head argmax of the attention logits, from the kernel.

Each forward call of the model inside the context appends one int64 tensor ``[L, B, Hq, T']`` to
``cap.calls``: for the selected query rows of that call, the absolute key position (in the KV sequence,
cache and left padding included; on sliding-window layers whose cache keeps only the last keys, the
kernel's index in the kept keys is shifted back to the absolute position) with the largest attention logit; -1 for a masked head, a row
without any valid key, or (per-batch-row selections) a slot beyond that batch row's selected rows. The kernel computes it alongside the output (``return_argmax=True,
argmax_rows=T``); attention is never materialised and nothing is copied to the host.
"""

from __future__ import annotations

import numbers

import torch

from retmask.hf.layers import head_layout
from retmask.hf.patch import require_retmask


class ArgmaxCapture:
    """Context manager returned by ``capture_argmax``.

    Attributes:
        calls: one int64 tensor [L, B, Hq, T'] per forward call, on the model's device.
        last: the newest entry of ``calls``.
    """

    def __init__(self, model: torch.nn.Module, rows: int | torch.Tensor | None = 1):
        require_retmask(model, "capture_argmax")
        self.model = model
        self.layout = head_layout(model)
        self._position = self.layout.positions()  # module.layer_idx -> attention layer l
        self.calls: list[torch.Tensor] = []
        self.active = False  # True only between the model's forward pre-hook and post-hook
        self._rows, self._mask_first, self._mask_select, self._mask_len = _parse_rows(rows)
        # Per-batch-row selection (bool [B, S]): the kernel computes rows [first, S) of every batch row and
        # ``record`` gathers each batch row's own rows from them (int64 [B, T'], padded slots flagged).
        self._row_index: torch.Tensor | None = None
        self._row_pad: torch.Tensor | None = None
        if self._mask_select is not None and self._mask_select.dim() == 2:
            self._row_index, self._row_pad = self._mask_select, self._mask_select < 0
            self._row_index = self._row_index.clamp_min(0)
        self._current: list[torch.Tensor | None] = []
        self._hooks: list = []
        # Tokens in the sequence up to the end of the current call (cache + input): a layer given N keys
        # holds positions [end - N, end) (sliding-window caches drop the oldest keys).
        self._sequence_end: int | None = None

    @property
    def last(self) -> torch.Tensor:
        if not self.calls:
            raise RuntimeError(
                "capture_argmax recorded no forward call yet: run the model inside the `with` block (the model "
                "given to capture_argmax itself: calling a submodule such as model.model records nothing)"
            )
        return self.calls[-1]

    # -- called from the attention function ---------------------------------------------------------
    def rows_for_call(self, q_len: int, device: torch.device) -> tuple[int, torch.Tensor | None]:
        """Kernel ``argmax_rows`` for a call with ``q_len`` query rows, and the rows to keep among them
        (int64 on ``device``, copied there once)."""
        if self._mask_select is None:
            return (q_len if self._rows is None else min(self._rows, q_len)), None
        if self._mask_len != q_len:
            raise ValueError(
                f"capture_argmax rows mask has {self._mask_len} entries but this forward call has "
                f"{q_len} query rows: a bool mask fits calls of exactly its length, so it cannot follow "
                "generate() (a prefill, then one row per decode step); capture such runs with rows=<int> (the "
                f"last rows of each call), and forward calls of {q_len} rows with a mask of that length"
            )
        if self._row_index is not None:  # per-batch-row selection: gathered in ``record``
            return q_len - self._mask_first, None
        if self._mask_select.device != device:
            self._mask_select = self._mask_select.to(device)
        return q_len - self._mask_first, self._mask_select

    def record(self, layer_idx: int, argmax: torch.Tensor, kv_len: int | None = None) -> None:
        """argmax: int64 [B, Hq, T'] of the attention module with ``layer_idx`` for the current call (for a
        per-batch-row selection: [B, Hq, S - first], from which each batch row's own rows are gathered
        here), as indices into the ``kv_len`` keys the layer saw."""
        if kv_len is not None and self._sequence_end is not None and self._sequence_end > kv_len:
            # A sliding-window cache gave this layer only the last kv_len keys of the sequence.
            argmax = torch.where(argmax >= 0, argmax + (self._sequence_end - kv_len), argmax)
        if self._row_index is not None:
            batch, heads = argmax.shape[0], argmax.shape[1]
            if batch != self._row_index.shape[0]:
                raise ValueError(
                    f"capture_argmax rows mask is per batch row for batch size {self._row_index.shape[0]} but "
                    f"this forward call has {batch} rows; pass a bool mask [{batch}, S] or a shared mask [S]"
                )
            if self._row_index.device != argmax.device:
                self._row_index = self._row_index.to(argmax.device)
                self._row_pad = self._row_pad.to(argmax.device)
            index = self._row_index[:, None, :].expand(batch, heads, -1)  # [B, Hq, T']
            argmax = argmax.gather(2, index).masked_fill(self._row_pad[:, None, :], -1)
        self._current[self._position[layer_idx]] = argmax

    # -- hooks on the model ------------------------------------------------------------------------
    def _start(self, module, args, kwargs):
        self._current = [None] * self.layout.num_layers
        self._sequence_end = _sequence_end(args, kwargs)
        self.active = True

    def _finish(self, module, args, output):
        self.active = False
        missing = [i for i, a in enumerate(self._current) if a is None]
        if missing:
            raise RuntimeError(
                f"capture_argmax: layers {missing} did not run through retmask attention in this forward call "
                "(was the attention implementation changed inside the `with` block?)"
            )
        self.calls.append(torch.stack(self._current))  # [L, B, Hq, T']
        self._current = []

    def __enter__(self) -> ArgmaxCapture:
        for layer in self.layout.layers:
            if getattr(layer, "_retmask_capture", None) is not None:
                raise RuntimeError(
                    "capture_argmax is already active on this model; nested captures are not supported"
                )
        for layer in self.layout.layers:
            layer._retmask_capture = self
        self._hooks = [
            self.model.register_forward_pre_hook(self._start, with_kwargs=True),
            self.model.register_forward_hook(self._finish),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for layer in self.layout.layers:
            layer._retmask_capture = None
        self.active = False


def _sequence_end(args: tuple, kwargs: dict) -> int | None:
    """Cached tokens + input tokens of a forward call, from its arguments (None if it cannot be told)."""
    inputs = kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    if inputs is None and args and isinstance(args[0], torch.Tensor):
        inputs = args[0]
    if inputs is None or inputs.dim() < 2:
        return None
    cache = kwargs.get("cache")
    if cache is None:  # the older keyword, which transformers still takes
        cache = kwargs.get("past_key_values")
    past = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0
    return past + int(inputs.shape[1])


def _parse_row_mask_per_batch(rows: torch.Tensor) -> tuple[None, int, torch.Tensor, int]:
    """rows: bool [B, S] -> (None, first selected row over the batch, int64 [B, T'] selected rows of each
    batch row relative to that first row, -1 in the slots past a row's count, S)."""
    rows = rows.detach().cpu()
    counts = rows.sum(1)
    if bool((counts == 0).any()):
        empty = (counts == 0).nonzero().flatten().tolist()
        raise ValueError(
            f"capture_argmax rows mask selects no row for batch rows {empty}; every batch row needs at least "
            "one True entry"
        )
    first = int(rows.any(0).nonzero()[0])
    width = int(counts.max())
    index = torch.full((rows.shape[0], width), -1, dtype=torch.int64)
    for b in range(rows.shape[0]):  # set-up time only, one host pass
        sel = rows[b].nonzero().flatten() - first
        index[b, : sel.numel()] = sel
    return None, first, index, rows.shape[1]


def _parse_rows(rows) -> tuple[int | None, int, torch.Tensor | None, int]:
    """-> (last-rows count or None = all rows, first selected row of a mask, selected rows of a mask
    relative to that first row (int64 [T'] shared, or [B, T'] per batch row), mask length)."""
    if rows is None:
        return None, 0, None, 0
    if isinstance(rows, torch.Tensor) and rows.dtype == torch.bool:
        if rows.dim() == 2:
            return _parse_row_mask_per_batch(rows)
        if rows.dim() != 1:
            raise ValueError(
                f"capture_argmax rows mask must be bool [S] (one entry per query row of each call) or "
                f"[B, S] (its own rows for every batch row), got shape {list(rows.shape)}"
            )
        select = rows.detach().cpu().nonzero().flatten()  # one host read, at set-up time
        if select.numel() == 0:
            raise ValueError("capture_argmax rows mask selects no row; set at least one entry to True")
        first = int(select[0])
        return None, first, select - first, rows.shape[0]
    if isinstance(rows, numbers.Integral) and not isinstance(rows, bool):
        rows = int(rows)  # NumPy integers too (NumPy bools are not Integral)
    if isinstance(rows, torch.Tensor):
        raise TypeError(
            f"capture_argmax rows as a tensor must be a bool mask [S] or [B, S] (True = a row to capture), got "
            f"{rows.dtype} of shape {list(rows.shape)}; use rows.bool() for a 0/1 mask, or an int for the last "
            "rows of each call"
        )
    if not isinstance(rows, int) or isinstance(rows, bool):
        raise TypeError(
            f"capture_argmax rows must be an int (the last T query rows of each call), a bool tensor [S] or "
            f"[B, S], or None (all rows), got {type(rows).__name__}"
        )
    if rows < 1:
        raise ValueError(f"capture_argmax rows must be >= 1 (the last T query rows of each call), got {rows}")
    return rows, 0, None, 0


def capture_argmax(model: torch.nn.Module, rows: int | torch.Tensor | None = 1) -> ArgmaxCapture:
    """Record the attention argmax of every layer and query head during forward calls.

    Args:
        model: a model on retmask attention (``retmask.patch`` / ``attn_implementation="retmask"``).
        rows: int T = the last T query rows of each call (T' = min(T, rows of that call)); a bool
            tensor [S] = those rows (every call must then have S query rows); a bool tensor [B, S] = each
            batch row its own rows (T' = the largest count; shorter rows are padded with -1, so with right
            padding ``rows = attention_mask.bool()`` captures exactly the real tokens); None = all rows.

    Use as ``with retmask.capture_argmax(model, rows=T) as cap: model(...)``; then ``cap.calls`` holds
    one int64 tensor [L, B, Hq, T'] per forward call (``cap.last`` = newest), absolute key positions.
    """
    return ArgmaxCapture(model, rows)
