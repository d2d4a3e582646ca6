"""The ``"retmask"`` attention implementation for transformers, and its mask function.

transformers calls ``retmask_attention(module, query, key, value, attention_mask, dropout=, scaling=, **kw)``
from every attention layer of a model loaded with ``attn_implementation="retmask"``; it forwards to
``retmask.kernels.attention``. Two per-layer attributes, set by ``retmask.set_head_mask`` and
``retmask.capture_argmax`` on the attention modules, switch on head skipping and argmax capture:

  ``module._retmask_skip``:    None or bool [Hq] / [B, Hq] (True = query head switched off)
  ``module._retmask_rows``:    None or B, the batch size a per-row head mask was set for
  ``module._retmask_capture``: None or an ``ArgmaxRecorder`` collecting the per-layer argmax
  ``module._retmask_tap``:     None or a ``retmask.hf.taps.QKTap`` recording the post-RoPE q / k (autograd kept)

The mask function hands the kernel the 2D ``[B, K]`` padding mask (flash-attention style) or None and
leaves causality and sliding windows to the kernel: a 4D mask would cost O(Q*K) memory per row. The
layer-specific parts of the attention come from the keyword arguments the model's attention modules pass
(transformers 5.x): ``sliding_window`` (Mistral, Qwen2, Gemma 2/3, Cohere 2, OLMo 3, gpt-oss local
layers), ``softcap`` (Gemma 2's ``attn_logit_softcapping``) and ``s_aux`` (gpt-oss attention sinks).
One more comes from the caller: ``model(..., sink_tokens=S)`` (transformers hands a model call's keyword
arguments down to every attention call) keeps the first S keys visible on the layers with a sliding window
(StreamingLLM's attention-sink tokens; a model without one takes ``sliding_window=W`` the same way); layers
without a window see every key already. S counts from the first key of the layer's cache, so a cache that
dropped its oldest keys (transformers' sliding-window cache layers) is refused: ``retmask.growing_cache``
keeps every key.

A layer of a head-sparse KV cache (``retmask.head_sparse_cache``) hands over only its full KV heads as
``key`` / ``value`` and the rest on the side (``key._retmask_sparse``, a ``retmask.hf.sparse_kv.layer.SparseKV``):
such a call goes to ``_head_sparse_attention``, which computes the full and the windowed KV heads in
separate calls (``retmask/hf/sparse_kv/attention.py``).

Packed sequences (padding-free batches: ``position_ids`` restarting at 0, or ``cu_seq_lens_q/k``) run as
a batch of one sequence per row (``retmask/hf/packed.py``), the outputs put back in their packed places.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
    flash_attention_mask,
)

from retmask.hf.packed import PackedLayout, packed_parts
from retmask.hf.sparse_kv.attention import sparse_attention
from retmask.hf.sparse_kv.layer import SparseKV
from retmask.kernels import attention as kernel_attention

NAME = "retmask"


class UnknownAttentionArgumentWarning(UserWarning):
    """A model passed a tensor argument to the attention function that retmask attention ignores."""


def _model_name(module_or_config: Any) -> str:
    config = getattr(module_or_config, "config", module_or_config)
    return getattr(config, "model_type", None) or type(module_or_config).__name__


def _unsupported(model: str, feature: str) -> NotImplementedError:
    return NotImplementedError(
        f"model '{model}' uses {feature}, which retmask attention does not support (the kernel computes causal "
        "or bidirectional softmax attention with a padding mask, an optional causal sliding window, logit "
        "soft-capping and attention sinks); load this model with attn_implementation='sdpa' or 'eager' "
        "instead, or pick a model without that feature"
    )


# Tensor arguments of transformers' attention calls that the kernel uses or that do not change attention
# (``seq_idx``: a packed token's sequence for the Mamba layers of hybrids; attention takes cu_seq_lens).
KNOWN_TENSOR_ARGS = frozenset(
    {"position_ids", "cache_position", "s_aux", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"}
)


# Keyword arguments whose value never calls for a warning or an error: the tensors above that the kernel
# uses or that do not change attention, and the plain values transformers passes to every call. A call
# with only these (every decode step of most models) skips the scan below.
ROUTINE_ARGS = (KNOWN_TENSOR_ARGS - {"cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"}) | {
    "use_cache", "sliding_window", "softcap", "is_causal", "sink_tokens",
}  # fmt: skip


# Config names of the attention-dropout probability: most models, GPT-2 / GPT-J / GPT-BigCode, others.
# ``retmask.load_model(..., attention_dropout=0.0)`` sets each one a config has.
ATTENTION_DROPOUT_SETTINGS = (
    "attention_dropout",
    "attn_pdrop",
    "attn_dropout",
    "attention_probs_dropout_prob",
)


def _dropout_setting(module: torch.nn.Module) -> str:
    """The config name of ``module``'s attention-dropout probability, for a message."""
    config = getattr(module, "config", None)
    for name in ATTENTION_DROPOUT_SETTINGS:
        if isinstance(getattr(config, name, None), (int, float)):
            return name
    return ATTENTION_DROPOUT_SETTINGS[0]


def _check_features(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    """Raise for anything the kernel would silently get wrong; warn about tensor arguments it does not
    know (a model may pass attention inputs under a new name, e.g. its sinks or a sparsity pattern).
    Runs on every attention call: the model's name is looked up only for a message."""
    if dropout and dropout > 0:
        setting = _dropout_setting(module)
        raise NotImplementedError(
            f"model '{_model_name(module)}' uses attention dropout ({dropout}) in training, which the retmask "
            f"kernel does not compute; turn it off by loading the model with {setting}=0.0 "
            f"(from_pretrained(..., {setting}=0.0)), or train this model with attn_implementation='sdpa'"
        )
    if kwargs.keys() <= ROUTINE_ARGS:
        return
    unknown = [k for k, v in kwargs.items() if k not in KNOWN_TENSOR_ARGS and isinstance(v, torch.Tensor)]
    if unknown:
        warnings.warn(
            f"model '{_model_name(module)}' passes {', '.join(sorted(unknown))} to its attention function, which "
            "retmask attention does "
            "not use: if they change attention, retmask's results differ from eager attention's (compare a "
            "forward with attn_implementation='eager' once)",
            UnknownAttentionArgumentWarning,
            stacklevel=3,
        )
    if kwargs.get("position_bias") is not None:
        raise _unsupported(_model_name(module), "an additive position bias")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise _unsupported(_model_name(module), "a paged KV cache (continuous batching)")
    if kwargs.get("output_attentions"):
        raise ValueError(
            f"model '{_model_name(module)}': retmask attention never materialises attention weights, so "
            "output_attentions=True is not available; use retmask.capture_argmax(model) for the per-head "
            "argmax, or attn_implementation='eager' for full weights"
        )


def _key_padding_mask(
    attention_mask: torch.Tensor | None,
    module: torch.nn.Module,
    batch: int,
    kv_len: int,
    device: torch.device,
) -> torch.Tensor | None:
    """The mask built by ``retmask_mask`` -> kernel ``key_padding_mask`` bool [B, N] (True = valid key)."""
    if attention_mask is None or getattr(attention_mask, "_retmask_all_valid", False):
        return None
    model = _model_name(module)
    if attention_mask.dim() != 2:
        raise ValueError(
            f"model '{model}': retmask attention takes a 2D padding mask [B, K], got a mask of shape "
            f"{list(attention_mask.shape)} (a custom 4D mask passed to forward?); pass a 2D attention_mask "
            "(1 = token, 0 = padding) instead"
        )
    if attention_mask.shape[1] != kv_len:
        raise ValueError(
            f"model '{model}': the attention_mask has {attention_mask.shape[1]} columns but attention sees "
            f"{kv_len} keys (the cached tokens and this call's); pass a mask with one column per token, cached "
            "ones included. A cache passed to generate() again still holds the earlier call's tokens: give each "
            "generate() call a new cache, or call cache.reset() first"
        )
    if attention_mask.shape[0] != batch:
        raise ValueError(
            f"model '{model}': the padding mask has batch size {attention_mask.shape[0]} but the input has {batch}"
        )
    mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    return mask.to(device)


def _check_window(attention_mask: torch.Tensor | None, window: int | None, module: torch.nn.Module) -> None:
    """Refuse a layer whose sliding-window mask (``retmask_mask``) and ``sliding_window`` argument differ:
    the kernel would attend to keys eager attention masks out (e.g. Qwen2-MoE and PhiMoE build sliding
    masks without passing the window)."""
    mask_window = getattr(attention_mask, "_retmask_window", None)
    if mask_window is not None and window != mask_window:
        passed = "no window" if window is None else f"a window of {window}"
        raise _unsupported(
            _model_name(module),
            f"a sliding-window mask of {mask_window} keys while its attention call passes {passed} (retmask takes "
            "the window from that argument, so it would attend differently from eager attention)",
        )


def _layer_state(module: torch.nn.Module, compiling: bool) -> tuple[Any, Any, Any, Any]:
    """The layer's ``_retmask_*`` attributes (skip, rows, tap, capture; None where never set). Read from
    the instance's ``__dict__`` (where ``nn.Module.__setattr__`` puts these plain values): ``getattr``
    with a default goes through ``nn.Module.__getattr__``, which raises and catches an AttributeError
    for every unset name. Under ``torch.compile`` (``compiling``) it stays ``getattr``: dynamo guards the
    attributes it reads that way (a head mask set after compiling recompiles the graph), not a read of
    ``__dict__``. A plain tuple: a named one would be one more Python call per attention call."""
    if compiling:
        return (
            getattr(module, "_retmask_skip", None), getattr(module, "_retmask_rows", None),
            getattr(module, "_retmask_tap", None), getattr(module, "_retmask_capture", None),
        )  # fmt: skip
    get = module.__dict__.get
    return get("_retmask_skip"), get("_retmask_rows"), get("_retmask_tap"), get("_retmask_capture")


def _skip_heads(
    module: torch.nn.Module, skip: torch.Tensor | None, rows: int | None, batch: int, device: torch.device
) -> torch.Tensor | None:
    if rows is not None and rows != batch:
        raise ValueError(
            f"model '{_model_name(module)}': the per-row head mask was set for batch size {rows} "
            f"but this forward call has {batch} rows; set a mask of shape [{batch}, L, Hq] (or a shared "
            "[L, Hq] mask) with retmask.set_head_mask. generate() expands the batch for beam search / "
            "num_return_sequences, k copies of each row next to each other: give it "
            "mask.repeat_interleave(k, dim=0), not mask.repeat(k, 1, 1)"
        )
    if skip is not None and skip.device != device:  # the model was moved after set_head_mask
        skip = skip.to(device)
        module._retmask_skip = skip
    return skip


def _autocast_inputs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under ``torch.autocast``, q, k, v in the autocast dtype, as SDPA gets them (it is on autocast's
    lower-precision list). Needed because they arrive mixed: Llama's rotary embedding multiplies the bf16
    q and k by float32 cos/sin, which promotes them to float32, while v stays bf16. Outside autocast the
    tensors pass unchanged (and mixed dtypes stay an error that names them)."""
    device_type = query.device.type
    if not torch.is_autocast_enabled(device_type):
        return query, key, value
    dtype = torch.get_autocast_dtype(device_type)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _one_head_dim(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [.., Dqk] and v [.., Dv] zero-padded to one head dim max(Dqk, Dv), which the kernel takes for
    all three (multi-head latent attention: DeepSeek-V2/V3 have Dqk = 192, Dv = 128). Exact: zero lanes add
    nothing to a q.k dot product, and the output's extra lanes are the weighted sum of zeros, cut off by
    the caller. The padded copy of v costs as much as the model's own expansion of its compressed cache
    into per-head keys and values, which it does on every call."""
    dim = max(query.shape[-1], value.shape[-1])
    pad = torch.nn.functional.pad
    if value.shape[-1] < dim:
        return query, key, pad(value, (0, dim - value.shape[-1]))
    return pad(query, (0, dim - query.shape[-1])), pad(key, (0, dim - key.shape[-1])), value


def retmask_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function.

    query: [B, Hq, S, D] (a non-contiguous view); key, value: [B, Hkv, N, D] (not repeated for GQA; N
    includes the KV cache); attention_mask: bool [B, N] padding mask or None (from ``retmask_mask``).
    Returns (out [B, S, Hq, D] contiguous, None).

    Written for its cost per call: a decode step of a small model spends as long in this Python as in
    the kernel, and between two layers the weights evict it from the caches, so every step below that a
    call does not need is skipped (each branch on None) rather than run as a no-op.
    """
    _check_features(module, dropout, kwargs)
    sparse = getattr(key, "_retmask_sparse", None)
    if sparse is not None and sparse.q_win.numel():  # a layer of a head-sparse KV cache with windowed heads
        return _head_sparse_attention(module, query, sparse, attention_mask, scaling, kwargs), None
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    # Per-layer attention features: None on layers (and models) without them.
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    # StreamingLLM sink tokens (a model call's keyword argument) extend a window; a layer without one sees
    # every past key, the sink tokens included, so they change nothing there.
    sink_tokens = kwargs.get("sink_tokens") if window is not None else None
    compiling = torch.compiler.is_compiling()
    skip, rows, tap, recorder = _layer_state(module, compiling)
    query, key, value = _autocast_inputs(query, key, value)
    value_dim = value.shape[-1]
    if value_dim != query.shape[-1]:  # multi-head latent attention (see _one_head_dim)
        if scaling is None:  # the default scale of the unpadded query
            scaling = query.shape[-1] ** -0.5
        query, key, value = _one_head_dim(query, key, value)
    B, _, S, _ = query.shape
    kpm = packed = None
    if attention_mask is not None:
        packed = getattr(attention_mask, "_retmask_packed", None)  # padding-free batches (see packed.py)
        _check_window(attention_mask, window, module)
        if sink_tokens is not None:
            _check_first_keys_kept(attention_mask, module)
        kv_end = getattr(attention_mask, "_retmask_kv_end", None)
        if kv_end is not None:  # a prefill into a static cache: the keys so far, ending with the queries
            key, value, attention_mask = key[:, :, :kv_end], value[:, :, :kv_end], attention_mask[:, :kv_end]
        kpm = _key_padding_mask(attention_mask, module, B, key.shape[2], query.device)
    if skip is not None or rows is not None:
        skip = _skip_heads(module, skip, rows, B, query.device)
    if "cu_seq_lens_q" in kwargs or "cu_seq_lens_k" in kwargs:  # flash-attention's varlen arguments
        packed = _varlen_layout(module, packed, kpm, kwargs, B, key.shape[2])
    if packed is not None:  # one sequence per batch row from here on; packed back at the end
        _check_packed_call(module, packed, tap, recorder)
        query, key, value = packed.unpack(query), packed.unpack(key), packed.unpack(value)
        kpm = packed.valid
        if skip is not None and skip.dim() == 2:  # a per-row head mask: each sequence takes its row's
            skip = skip.index_select(0, packed.segment_row)
    if tap is not None:  # the exact kernel inputs, not detached (MuDAF's loss trains through them)
        if sink_tokens is not None:
            raise ValueError(
                f"model '{_model_name(module)}': retmask.tap_qk records a layer's window, soft cap and sinks, "
                "not sink_tokens; tap a forward without sink_tokens"
            )
        tap.record(module.layer_idx, query, key, scaling, window=window, softcap=softcap, sinks=sinks)
    if recorder is not None and recorder.active:
        argmax_rows, select = recorder.rows_for_call(S, query.device)
        out, argmax = kernel_attention(
            query, key, value, causal=causal, sm_scale=scaling, key_padding_mask=kpm, skip_heads=skip,
            return_argmax=True, argmax_rows=argmax_rows, window=window, softcap=softcap, sinks=sinks,
            sink_tokens=sink_tokens, out_layout="bmhd",
        )  # fmt: skip
        if select is not None:
            argmax = argmax.index_select(2, select)
        recorder.record(module.layer_idx, argmax, kv_len=key.shape[2])
    else:
        out = kernel_attention(
            query, key, value, causal=causal, sm_scale=scaling, key_padding_mask=kpm, skip_heads=skip,
            window=window, softcap=softcap, sinks=sinks, sink_tokens=sink_tokens, out_layout="bmhd",
        )  # fmt: skip
    if packed is not None:
        out = packed.pack(out).transpose(1, 2)  # [B, Hq, N, D], a view of a contiguous [B, N, Hq, D]
    if out.shape[-1] != value_dim:  # drop the padded lanes (multi-head latent attention)
        out = out[..., :value_dim]
    # out is a view of a contiguous [B, S, Hq, D] tensor ("bmhd"): contiguous() copies nothing
    return out.transpose(1, 2).contiguous(), None


def _varlen_layout(
    module: torch.nn.Module,
    packed: PackedLayout | None,
    kpm: torch.Tensor | None,
    kwargs: dict,
    batch: int,
    kv_len: int,
) -> PackedLayout | None:
    """The packed layout of flash-attention's ``cu_seq_lens_q/k`` (int [S + 1]: 0, then each sequence's
    end in one packed row), as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` passes them.
    Checked and built at the forward's first layer, then kept on the tensor every layer gets (the checks
    read the device tensors: once, not per layer); checked against the layout of the mask when
    transformers found the packing in ``position_ids`` too. None for one sequence."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return packed
    layout = getattr(cu_q, "_retmask_packed", None)
    if layout is None:
        layout = _check_varlen(module, packed, kpm, cu_q, cu_k, batch, kv_len)
        cu_q._retmask_packed = layout
    return layout if layout.segments > 1 else packed


def _check_varlen(
    module: torch.nn.Module,
    packed: PackedLayout | None,
    kpm: torch.Tensor | None,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    batch: int,
    kv_len: int,
) -> PackedLayout:
    """The layout of ``cu_seq_lens_q`` after checking it against ``cu_seq_lens_k``, the row, the padding
    mask and the packing ``position_ids`` gave (``packed``); a ValueError naming the mismatch."""
    model = _model_name(module)
    if torch.compiler.is_compiling():  # the layout is built from a host read of the sequence ends
        raise _unsupported(model, "packed sequences (cu_seq_lens) under torch.compile; run them eagerly")
    if cu_q is None or cu_k is None or cu_q.shape != cu_k.shape or not torch.equal(cu_q, cu_k):
        raise ValueError(
            f"model '{model}': packed sequences take cu_seq_lens_q and cu_seq_lens_k with the same sequence "
            "ends (each query sees the keys of its own sequence); pass both, equal, or neither (position_ids "
            "that restart at 0 for each sequence also mark the packing)"
        )
    ends = cu_q.tolist()
    if batch != 1 or cu_q.dim() != 1 or ends[0] != 0 or ends[-1] != kv_len or ends != sorted(ends):
        raise ValueError(
            f"model '{model}': cu_seq_lens_q = {ends} does not describe a packed row of {kv_len} tokens "
            f"(batch size {batch}): it must start at 0, rise, and end at the row's length, with the "
            "sequences in one batch row and no KV cache"
        )
    if kpm is not None:
        raise ValueError(
            f"model '{model}': packed sequences (cu_seq_lens) with padding in the attention_mask; pack "
            "without padding, or pad without packing"
        )
    layout = PackedLayout.from_cumulative_lengths(cu_q, kv_len)
    if packed is not None and not packed.same_sequences(layout):
        raise ValueError(
            f"model '{model}': cu_seq_lens_q marks other sequences than position_ids do; pass position_ids "
            "that restart at 0 where each sequence of cu_seq_lens_q starts"
        )
    return layout


def _check_packed_call(module: torch.nn.Module, packed: PackedLayout, tap: Any, recorder: Any) -> None:
    """Refuse what a packed call cannot give: the per-layer records of retmask.tap_qk and
    retmask.capture_argmax are laid out per batch row (the last rows of a row, its keys), which a row of
    several sequences does not have."""
    model = _model_name(module)
    for what, state in (("retmask.tap_qk", tap), ("retmask.capture_argmax", recorder)):
        if state is not None and getattr(state, "active", True):
            raise ValueError(
                f"model '{model}': {what} records rows and keys per batch row, and this forward packs "
                f"{packed.segments} sequences into {packed.rows} row(s); give it a padded batch (one sequence "
                "per row, with an attention_mask) instead"
            )


def _head_sparse_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    sparse: SparseKV,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    kwargs: dict,
) -> torch.Tensor:
    """A layer of ``retmask.head_sparse_cache`` (``retmask/hf/sparse_kv``): the full KV heads' query heads
    over every key, the windowed ones over their sink + window keys, in separate calls (``sparse_attention``).
    query: [B, Hq, M, D]; attention_mask: bool [B, N] padding mask over every position, or None.
    Returns out [B, M, Hq, D] contiguous. Head masks and argmax capture work as on any layer."""
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if not causal or kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"model '{_model_name(module)}': layer {module.layer_idx} got a head-sparse KV cache layer but its "
            "attention is " + ("bidirectional" if not causal else "a sliding window") + "; the head-sparse "
            "cache prunes causal global layers only: build it with retmask.head_sparse_cache(model, ...)"
        )
    compiling = torch.compiler.is_compiling()
    skip, rows, tap, recorder = _layer_state(module, compiling)
    if tap is not None:
        raise ValueError(
            f"model '{_model_name(module)}': retmask.tap_qk records every key of a layer, and a head-sparse KV "
            "cache has freed most of them; tap a forward without the head-sparse cache"
        )
    B, _, M, _ = query.shape
    kpm = None
    if attention_mask is not None:
        _check_window(attention_mask, None, module)
        kpm = _key_padding_mask(attention_mask, module, B, sparse.length, query.device)
    if skip is not None or rows is not None:
        skip = _skip_heads(module, skip, rows, B, query.device)
    argmax_rows, select = 0, None
    if recorder is not None and recorder.active:
        argmax_rows, select = recorder.rows_for_call(M, query.device)
    out, argmax = sparse_attention(
        query, sparse, key_padding_mask=kpm, sm_scale=scaling, softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"), skip_heads=skip, argmax_rows=argmax_rows,
    )  # fmt: skip
    if argmax is not None:
        if select is not None:
            argmax = argmax.index_select(2, select)
        recorder.record(module.layer_idx, argmax, kv_len=sparse.length)  # absolute positions already
    return out


def _check_first_keys_kept(attention_mask: torch.Tensor, module: torch.nn.Module) -> None:
    """Refuse sink tokens on a layer whose cache dropped its oldest keys (``retmask_mask`` marks the mask
    with the number dropped): the kernel would take the oldest keys kept for the sequence's first ones."""
    dropped = getattr(attention_mask, "_retmask_kv_offset", 0)
    if dropped:
        raise ValueError(
            f"model '{_model_name(module)}': layer {module.layer_idx}'s KV cache has dropped its first {dropped} "
            "keys (a sliding-window cache layer), so sink_tokens cannot keep them; use a cache that keeps every "
            "key (retmask.growing_cache(model, ...))"
        )


def _sliding_window_of(mask_function: Any) -> int | None:
    """The window of transformers' sliding-window causal mask function
    (``and_masks(sliding_window_overlay(w), causal_mask_function)``, built by
    ``create_sliding_window_causal_mask``), or None for any other function.

    Recognised by structure, not by sampling it: an overlay on top (images, packed sequences, blocks) makes
    a different function, which is then refused rather than silently dropped.
    """
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    try:
        parts = inspect.getclosurevars(mask_function).nonlocals.get("mask_functions")
    except (TypeError, ValueError):
        return None
    if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not causal_mask_function:
        return None
    overlay = parts[0]
    if getattr(overlay, "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask":
        return None
    window = inspect.getclosurevars(overlay).nonlocals.get("sliding_window")
    return window if isinstance(window, int) and not isinstance(window, bool) else None


def retmask_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers mask function: bool [B, kv_length] padding mask (True = valid), or None if none.

    Accepted patterns: plain causal, bidirectional, and the causal sliding window of local layers (the
    window itself reaches the kernel through the attention module's ``sliding_window`` argument), each also
    over packed sequences (the mask then carries their ``PackedLayout``, see packed.py). Any other pattern
    (chunks, custom overlays) cannot be expressed by a padding mask: raise instead of silently ignoring it.
    """
    packed = None if torch.compiler.is_compiling() else packed_parts(mask_function)
    if packed is not None:  # padding-free batch: each sequence runs as a row of its own (see packed.py)
        segment_ids, mask_function = packed
        packed = PackedLayout.from_segment_ids(segment_ids.to(kwargs.get("device")))
    sliding = _sliding_window_of(mask_function)
    if mask_function not in (causal_mask_function, bidirectional_mask_function) and sliding is None:
        model = _model_name(kwargs.get("config"))
        feature = (
            "an attention pattern other than causal, bidirectional or a causal sliding window (chunked "
            "attention, a custom mask overlay, or packing combined with one of them)"
        )
        if attention_mask is None:
            # Under torch.compile / torch.export transformers cannot test whether position_ids pack several
            # sequences (data-dependent), so without an attention_mask and a KV cache it always wraps the
            # mask function for packing, even after a graph break (the test ran in the traced part).
            feature += (
                "; under torch.compile / torch.export this includes every call without an attention_mask and "
                "without a KV cache (transformers cannot rule out packed position_ids while tracing): pass "
                "attention_mask (e.g. torch.ones_like(input_ids)) or use_cache=True to a batch that is not "
                "packed, and run a packed one (position_ids restarting at 0 per sequence) eagerly"
            )
        raise _unsupported(model, feature)
    causal = mask_function is not bidirectional_mask_function
    if causal and kv_offset == 0 and (isinstance(q_offset, torch.Tensor) or kv_length > q_offset + q_length):
        # A static cache layer: a buffer longer than the sequence so far (its length a tensor once filled).
        # Not for bidirectional attention: there more keys than queries means other keys (an encoder's).
        return _static_cache_mask(batch_size, q_length, kv_length, q_offset, sliding, attention_mask, kwargs)
    if kv_offset + kv_length != q_offset + q_length:
        # The kernel places query row i at key position kv_length - q_length + i: the keys must end with the
        # queries. Dynamic caches (full, or sliding layers that keep the last window - 1 keys) do.
        raise _unsupported(
            _model_name(kwargs.get("config")),
            f"a KV cache whose keys do not end with the queries (q_offset={q_offset}, q_length={q_length}, "
            f"kv_length={kv_length}, kv_offset={kv_offset}); use the default DynamicCache, a StaticCache, or "
            "retmask.growing_cache(model)",
        )
    if attention_mask is not None and (
        torch.compiler.is_compiling() or (attention_mask.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        # flash_attention_mask drops an all-valid mask after a data-dependent `mask.all()` (a graph break
        # under torch.compile, a device->host read that CUDA graph capture forbids); the kernel gives the
        # same output with the all-valid mask kept.
        return attention_mask[:, -kv_length:]
    mask = flash_attention_mask(
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs
    )
    if sliding is not None and not torch.compiler.is_compiling():
        # The kernel takes the window from the attention call's ``sliding_window`` argument, which some
        # models never pass (they build the sliding mask only): the mask carries its window, and the
        # attention function refuses a call whose window differs (see ``_check_window``).
        if mask is None:  # every key valid: an all-valid mask, marked so that no padding work is done
            mask = torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device"))
            mask._retmask_all_valid = True
        mask._retmask_window = sliding
        mask._retmask_kv_offset = kv_offset  # keys this layer's cache dropped (sink tokens need them)
    if packed is not None:
        if mask is None:
            mask = torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device"))
            mask._retmask_all_valid = True
        mask._retmask_packed = packed
    return mask


def _static_cache_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor,
    sliding: int | None,
    attention_mask: torch.Tensor | None,
    kwargs: dict,
) -> torch.Tensor:
    """The padding mask of a static cache layer: bool [B, kv_length] over its whole buffer, True = a key
    of this sequence (filled, not padding), i.e. position < q_offset + q_length and valid in
    ``attention_mask``.

    A static cache (``cache_implementation="static"``, transformers' ``StaticCache``) keeps keys in a buffer
    of fixed length, so a compiled decode step has the same shapes at every position (what CUDA graphs
    need); ``q_offset`` is a 0-d tensor there once the buffer exists (no host read of it here). The kernel
    places query row i at key position kv_length - q_length + i, so one query row (a decode step) over the
    whole buffer with the unfilled slots masked out is exact; several rows (a prefill) need the keys cut at
    q_offset + q_length, which the attention function does from ``mask._retmask_kv_end`` (eager only: the cut
    is a host read of q_offset, and under torch.compile a shape that changes with it). A static
    sliding-window layer comes here only while its buffer is not full (its keys are then positions 0.. in
    order, all within the window); once full it hands over keys that end with the queries, as a dynamic
    cache does."""
    device = kwargs.get("device")
    if isinstance(q_offset, torch.Tensor):
        q_offset = q_offset.to(device)
    filled = torch.arange(kv_length, device=device) < q_offset + q_length  # bool [kv_length]
    mask = filled.expand(batch_size, kv_length)
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[1] > kv_length:
            raise ValueError(
                f"model '{_model_name(kwargs.get('config'))}': retmask attention takes a 2D padding mask [B, K] "
                f"with K <= the static cache's length ({kv_length}), got a mask of shape "
                f"{list(attention_mask.shape)}; pass the 2D attention_mask of the tokens so far (1 = token, "
                "0 = padding)"
            )
        given = attention_mask.to(device=device, dtype=torch.bool)
        mask = mask & torch.nn.functional.pad(given, (0, kv_length - given.shape[1]), value=False)
    if torch.compiler.is_compiling():
        if q_length > 1:
            raise _unsupported(
                _model_name(kwargs.get("config")),
                f"a static cache under torch.compile with {q_length} new tokens in one call (a compiled call "
                "over a static cache takes one token, as generate's decode steps do; run the prefill "
                "uncompiled, as generate does)",
            )
        return mask
    if q_length > 1:
        mask._retmask_kv_end = int(q_offset) + q_length
    if sliding is not None:
        mask._retmask_window = sliding  # checked against the attention call's window (``_check_window``)
    return mask


def register() -> None:
    """Register ``"retmask"`` class-wide with transformers (idempotent). Runs at ``import retmask``."""
    AttentionInterface.register(NAME, retmask_attention)
    AttentionMaskInterface.register(NAME, retmask_mask)


register()
