"""Argument checking and normalisation for ``retmask.kernels.attention``.

Every error names the argument, the shape (or dtype/device) received and what was expected, so a user
can fix the call without reading kernel code.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MAX_HEAD_DIM = 256


class AttentionShape(NamedTuple):
    """Sizes of one attention call (a named tuple: built on every call, where a frozen dataclass's
    ``__init__`` costs several times as much).

    batch: B; q_heads: Hq; kv_heads: Hkv; q_len: M (query rows); kv_len: N (keys); head_dim: D.
    Query row ``i`` sits at absolute position ``N - M + i`` (prefill: M == N; decode: M == 1).
    """

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = MHA, Hq = MQA)."""
        return self.q_heads // self.kv_heads


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttentionShape:
    """Validate ``q: [B, Hq, M, D]``, ``k, v: [B, Hkv, N, D]`` and return their sizes."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            expected = "[B, Hq, M, D]" if name == "q" else "[B, Hkv, N, D]"
            raise ValueError(f"{name} must have 4 dimensions {expected}, got shape {_shape(t)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{name} has dtype {t.dtype}; supported dtypes are float32, float16, bfloat16 "
                "(and float64 for the reference backend)"
            )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}; cast them first"
        )
    # is_cpu first: reading .device builds a torch.device object per access, on every call
    if not (q.is_cpu and k.is_cpu and v.is_cpu) and (k.device != q.device or v.device != q.device):
        raise ValueError(
            f"q, k, v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}"
        )
    B, Hq, M, D = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape [B, Hkv, N, D], got k {_shape(k)} and v {_shape(v)}"
        )
    Bk, Hkv, N, Dk = k.shape
    if Bk != B:
        raise ValueError(f"k has batch size {Bk} but q has {B}: expected k of shape [{B}, Hkv, N, {D}]")
    if Dk != D:
        raise ValueError(f"k has head dim {Dk} but q has {D}: expected k of shape [{B}, Hkv, N, {D}]")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"q has {Hq} heads and k/v have {Hkv}: the number of query heads must be a multiple of the "
            "number of key/value heads (MHA, GQA or MQA)"
        )
    if M > N:
        raise ValueError(
            f"q has {M} query rows but k/v have only {N} keys: with a KV cache the keys include the "
            "queries' own positions, so M <= N is required (query row i sits at position N - M + i)"
        )
    if D == 0 or D > MAX_HEAD_DIM:
        raise ValueError(f"head dim {D} is not supported: expected 1 <= D <= {MAX_HEAD_DIM}")
    return AttentionShape(B, Hq, Hkv, M, N, D)


def check_key_padding_mask(
    mask: torch.Tensor | None, shape: AttentionShape, device: torch.device
) -> torch.Tensor | None:
    """Return ``key_padding_mask`` as a contiguous ``bool [B, N]`` (True = valid key), or None."""
    if mask is None:
        return None
    # The expected shape is formatted only inside the error branches: formatting it eagerly would make
    # torch.compile specialise on B and N (a recompile per batch size and per decode step).
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        got = _shape(mask) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"key_padding_mask must be a bool tensor of shape [B, N] = [{shape.batch}, {shape.kv_len}], got {got}"
        )
    if tuple(mask.shape) != (shape.batch, shape.kv_len):
        raise ValueError(
            f"key_padding_mask must have shape [B, N] = [{shape.batch}, {shape.kv_len}], got {_shape(mask)}"
        )
    if mask.device != device:
        raise ValueError(f"key_padding_mask is on {mask.device} but q is on {device}")
    if mask.dtype != torch.bool:
        raise ValueError(
            f"key_padding_mask must be bool (True = valid key), got {mask.dtype}; use mask.bool() "
            "if 1 marks valid tokens"
        )
    return mask.contiguous()


def check_skip_heads(
    skip: torch.Tensor | None, shape: AttentionShape, device: torch.device
) -> torch.Tensor | None:
    """Return ``skip_heads`` as a contiguous ``bool [B, Hq]`` (True = head disabled), or None if no head
    is disabled anywhere."""
    if skip is None:
        return None
    B, Hq = shape.batch, shape.q_heads
    if not isinstance(skip, torch.Tensor) or skip.dim() not in (1, 2):
        got = _shape(skip) if isinstance(skip, torch.Tensor) else type(skip).__name__
        raise ValueError(
            f"skip_heads must be a bool tensor of shape [Hq] = [{Hq}] or [B, Hq] = [{B}, {Hq}], got {got}"
        )
    if skip.dtype != torch.bool:
        raise ValueError(f"skip_heads must be bool (True = head disabled), got {skip.dtype}")
    if skip.device != device:
        raise ValueError(f"skip_heads is on {skip.device} but q is on {device}")
    if skip.dim() == 1:
        if skip.shape[0] != Hq:
            raise ValueError(
                f"skip_heads must have shape [Hq] = [{Hq}] or [B, Hq] = [{B}, {Hq}], got {_shape(skip)}"
            )
        skip = skip.unsqueeze(0).expand(B, Hq)
    elif tuple(skip.shape) != (B, Hq):
        raise ValueError(
            f"skip_heads must have shape [Hq] = [{Hq}] or [B, Hq] = [{B}, {Hq}], got {_shape(skip)}"
        )
    return skip.contiguous()


def _whole_number(x: Any) -> int | None:
    """``x`` as an int when it is an integer of another type (a NumPy integer), else None. bool is an int
    subclass but no count: True would silently mean 1, so it is refused (None), as NumPy bools are (not
    ``numbers.Integral``)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        return None
    return int(x)


def check_argmax_rows(argmax_rows: int | None, return_argmax: bool, shape: AttentionShape) -> int:
    """Number of trailing query rows that get an argmax (0 = no argmax requested)."""
    if not return_argmax:
        if argmax_rows is not None:
            raise ValueError("argmax_rows was given but return_argmax=False; pass return_argmax=True")
        return 0
    if argmax_rows is None:
        return shape.q_len
    rows = argmax_rows if type(argmax_rows) is int else _whole_number(argmax_rows)
    if rows is None or not 1 <= rows <= shape.q_len:
        raise ValueError(
            f"argmax_rows must be an int in [1, M] = [1, {shape.q_len}] (the last rows of q), got {argmax_rows!r}"
        )
    return rows


# Parameter ranges (issue 47: backends disagreed on extreme finite parameters). Every backend computes
# the logits in float32, but folds the parameters in at different points: the reference multiplies
# q.k by sm_scale and then divides by softcap; the Triton kernels multiply q.k once by sm_scale * log2(e)
# or by sm_scale / softcap and softcap * log2(e); the C++ kernel keeps its own order. Near the ends of the
# float32 range those orders decide between finite, inf and 0 (sm_scale = 1e300 is inf in float32: NaN on
# one backend, partly NaN on another, finite on a third), and GPUs flush subnormal results to zero where
# CPUs keep them. Inside these ranges every such product of parameters is a normal float32 number
# (sm_scale * log2(e), sm_scale / softcap in [1e-16, 1e10], softcap * log2(e)), so the backends see the
# same logits and the non-finite contract (reference.py) is decided by the inputs alone.
#
# sm_scale: models use 1 / sqrt(D) (at most 1; 0.0625 at D = 256) or 1 ("no scaling"); [1e-6, 1e4] leaves
# four orders of magnitude of temperature on either side. fp16 inputs give |q.k| <= 256 * 65504^2 ~ 1.1e12,
# so no fp16 call can overflow a logit; fp32 / bf16 inputs can overflow q.k itself whatever the scale --
# an inf logit, which the non-finite contract covers the same way on every backend.
SM_SCALE_RANGE = (1e-6, 1e4)
# softcap: models use 30-50 (Gemma 2, Grok). Above 1e10 the cap changes no logit that matters: for
# |s| <= 1e3 (larger logit gaps already give a one-hot softmax) c * tanh(s / c) differs from s by
# s^3 / (3 c^2), a relative 3e-15, far below float32's 6e-8 -- pass None instead; and s / softcap stays a
# normal float32 number (no flush to zero on a GPU) for |s| >= 1e-28. Below 1e-6 every capped logit lies
# within +-1e-6, whose softmax weights e^s float32 resolves to only ~25 levels around 1.
SOFTCAP_RANGE = (1e-6, 1e10)


def _range_text(bounds: tuple[float, float]) -> str:
    return f"[{bounds[0]:g}, {bounds[1]:g}]"


def check_sm_scale(sm_scale: float | None, head_dim: int) -> float:
    """The logit scale as a float in ``SM_SCALE_RANGE`` (default ``head_dim ** -0.5``); ValueError naming
    the value and the range otherwise (see the comment above ``SM_SCALE_RANGE`` for why it is bounded)."""
    if sm_scale is None:
        return float(head_dim**-0.5)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise ValueError(f"sm_scale must be a finite float, got {type(sm_scale).__name__} {sm_scale!r}")
    lo, hi = SM_SCALE_RANGE
    if lo <= sm_scale <= hi:  # (False for NaN) the messages below are built only for a bad value
        return float(sm_scale)
    default = f"leave it None for the default 1/sqrt(head_dim) = {head_dim**-0.5:.6g}"
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be finite, got {sm_scale}; {default}")
    raise ValueError(
        f"sm_scale must be in {_range_text(SM_SCALE_RANGE)}, got {sm_scale:g}: outside it the float32 "
        f"logits (sm_scale * q.k, sm_scale * log2(e)) of different backends overflow or flush to zero "
        f"differently; {default}"
    )


OUT_LAYOUTS = ("bhmd", "bmhd")


def check_out_layout(out_layout: str) -> bool:
    """Whether ``out_layout`` asks for the [B, M, Hq, D] memory layout ("bmhd"); ValueError for anything
    other than "bhmd" / "bmhd"."""
    if out_layout not in OUT_LAYOUTS:
        raise ValueError(
            f"out_layout must be 'bhmd' (out contiguous as [B, Hq, M, D]) or 'bmhd' (out a view of a "
            f"contiguous [B, M, Hq, D] tensor, as transformers' attention functions return), got {out_layout!r}"
        )
    return out_layout == "bmhd"


def check_window(window: int | None, causal: bool) -> int | None:
    """A sliding-window size: row at position p sees keys j with p - window < j <= p. None = no window."""
    if window is None:
        return None
    given, window = window, window if type(window) is int else _whole_number(window)
    if window is None:
        raise ValueError(f"window must be a positive int (keys per sliding window) or None, got {given!r}")
    if window <= 0:
        raise ValueError(
            f"window must be >= 1 (a query at position p sees keys p - window < j <= p), got {window}; "
            "pass window=None for full attention"
        )
    if not causal:
        raise ValueError(
            f"window={window} needs causal=True: the sliding window bounds keys from below in causal "
            "attention (transformers' sliding_window); bidirectional windows are not supported"
        )
    return window


def check_sink_tokens(sink_tokens: int | None, window: int | None) -> int | None:
    """Sink tokens S (StreamingLLM's attention sinks): with a sliding window, the row at position p also
    sees the first S keys, i.e. keys j <= p with p - window < j or j < S. None = none.

    These are kept *keys*, unlike ``sinks`` (learned per-head logits that join only the softmax
    denominator). ``window`` must be the checked window (so causal is already required)."""
    if sink_tokens is None:
        return None
    given, sink_tokens = sink_tokens, sink_tokens if type(sink_tokens) is int else _whole_number(sink_tokens)
    if sink_tokens is None:
        raise ValueError(
            f"sink_tokens must be a positive int (the first keys every row keeps seeing besides its sliding "
            f"window) or None, got {given!r}"
        )
    if sink_tokens <= 0:
        raise ValueError(
            f"sink_tokens must be >= 1 (the row at position p sees keys j <= p with p - window < j or "
            f"j < sink_tokens), got {sink_tokens}; pass sink_tokens=None for a plain sliding window"
        )
    if window is None:
        raise ValueError(
            f"sink_tokens={sink_tokens} needs a sliding window (window=W): the sink tokens are the first keys "
            "kept visible beyond the window (StreamingLLM); without a window every past key is visible already. "
            "(Learned per-head sink logits, as gpt-oss uses, are the separate argument sinks=.)"
        )
    return sink_tokens


def check_softcap(softcap: float | None) -> float | None:
    """A logit soft cap (logits <- softcap * tanh(logits / softcap)) in ``SOFTCAP_RANGE``, or None."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise ValueError(f"softcap must be a positive float or None, got {softcap!r}")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(
            f"softcap must be a finite float > 0 (logits <- softcap * tanh(logits / softcap)), got {softcap}; "
            "pass softcap=None for no capping"
        )
    lo, hi = SOFTCAP_RANGE
    if not lo <= softcap <= hi:
        hint = (
            "a larger cap changes no logit in float32: pass softcap=None"
            if softcap > hi
            else "a smaller cap leaves logits float32 cannot tell apart in the softmax"
        )
        raise ValueError(f"softcap must be in {_range_text(SOFTCAP_RANGE)}, got {softcap:g}; {hint}")
    return float(softcap)


def check_sinks(
    sinks: torch.Tensor | None, shape: AttentionShape, device: torch.device
) -> torch.Tensor | None:
    """Attention-sink logits ``float [Hq]`` (one per query head, in the softmax denominator only), or None."""
    if sinks is None:
        return None
    Hq = shape.q_heads
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(
            f"sinks must be a float tensor of shape [Hq] = [{Hq}] or None, got {type(sinks).__name__}"
        )
    if tuple(sinks.shape) != (Hq,):
        raise ValueError(
            f"sinks must have shape [Hq] = [{Hq}] (one logit per query head), got {_shape(sinks)}"
        )
    if not sinks.is_floating_point():
        raise ValueError(
            f"sinks must be a floating-point tensor (one logit per query head), got {sinks.dtype}"
        )
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {device}; move it with sinks.to(q.device)")
    return sinks
