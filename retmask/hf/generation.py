"""``generate`` for a batch of stacked prompt copies: the in-place KV cache, and a prefill shared by the copies.

RetMask's contrast batches hold every prompt ``copies`` times (chosen rows, then rejected rows) under a
per-row head mask. :func:`generate_copies` calls transformers' ``generate`` with two changes that leave the
tokens as they are (up to GEMM rounding of other row counts):

* a ``GrowingLayer`` cache (``retmask.hf.kv_cache``) reserved for prompt + new tokens, so a decoding step
  appends its keys in place instead of copying the whole cache with ``torch.cat``;
* where the copies of a prompt agree on the layers below the first one they mask differently, those
  layers run once per prompt in generate's prefill call (``retmask.hf.shared_prefill``).

Only ``config`` (and ``logits_processor``) shape the logits: the model's own generation defaults (a
``generation_config.json`` may set a repetition penalty, suppressed tokens, a minimum length, ...), which
``generate`` would otherwise merge into every field ``config`` leaves unset, are set aside for the call,
so a sample is drawn from the model's distribution and a greedy answer is its argmax.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList

from retmask.hf.heads import head_mask as masked_heads
from retmask.hf.kv_cache import growing_cache, reserve
from retmask.hf.layers import decoder_layers
from retmask.hf.shared_prefill import share_next_prefill, shared_layers


@torch.no_grad()
def generate_copies(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    config: GenerationConfig,
    *,
    copies: int = 1,
    head_mask: torch.Tensor | None = None,
    logits_processor: LogitsProcessorList | None = None,
    share_prefill: bool = True,
) -> torch.Tensor:
    """``model.generate`` on a left-padded batch; returns the sequences [R, T + new] as generate does.

    input_ids, attention_mask: [R, T] on the model's device; rows ``c * R / copies + i`` may be copies of
    rows ``i`` (checked: a batch that is not is generated without sharing). config: ``max_new_tokens`` must
    be set. head_mask: None, a per-row bool [R, L, Hq] or a shared [L, Hq] (needs
    ``attn_implementation="retmask"``), applied for the call. share_prefill: False always prefills every row (for comparisons).
    """
    if not isinstance(config, GenerationConfig):
        raise TypeError(
            f"generate_copies config must be a transformers.GenerationConfig, got {type(config).__name__}; "
            "e.g. GenerationConfig(max_new_tokens=64, do_sample=False)"
        )
    if config.max_new_tokens is None:
        raise ValueError("generate_copies needs config.max_new_tokens (the cache is reserved for it)")
    rows = input_ids.shape[0]
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1 or rows % copies:
        raise ValueError(
            f"generate_copies copies must be a whole number >= 1 that divides the batch ({rows} rows: copy c "
            f"of row i is row c * {rows} / copies + i), got {copies!r}"
        )
    cache = growing_cache(model)
    reserve(cache, input_ids.shape[1] + config.max_new_tokens)
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "generation_config": config,
    }
    if logits_processor is not None:
        kwargs["logits_processor"] = logits_processor
    split = 0
    one_prefill_call = getattr(config, "prefill_chunk_size", None) is None  # not a chunked prefill
    # an argmax capture records every row of every layer: the shared layers would record b rows, not R
    capturing = any(getattr(m, "_retmask_capture", None) is not None for m in model.modules())
    if share_prefill and copies > 1 and one_prefill_call and not capturing:
        split = shared_layers(input_ids, head_mask, copies, _stacked_layers(model), attention_mask)
    with contextlib.ExitStack() as scope:
        scope.enter_context(_only_config(model))
        if head_mask is not None:
            scope.enter_context(masked_heads(model, head_mask))
        if split:
            scope.enter_context(
                share_next_prefill(model, input_ids.shape[0], copies, split, head_mask, cache)
            )
        return model.generate(**kwargs, cache=cache)


@contextlib.contextmanager
def _only_config(model: Any):
    """Within: ``model.generation_config`` holds the model's special-token ids only (generate fills the
    caller's unset fields from it)."""
    saved = model.generation_config
    tokens = {k: getattr(saved, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    model.generation_config = GenerationConfig(**tokens)
    try:
        yield
    finally:
        model.generation_config = saved


def _stacked_layers(model: Any) -> int:
    """L where the model's decoder layers are a plain stack the shared prefill can hook (one
    ``ModuleList`` in layer order), else 0: such models generate without sharing."""
    try:
        return len(decoder_layers(model))
    except ValueError:
        return 0
