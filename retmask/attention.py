"""Drop-in attention for Hugging Face models (public facade of ``retmask.hf``).

Importing this module registers ``attn_implementation="retmask"`` (attention + mask function) with
transformers. See ``retmask.hf.interface`` for the attention function, ``retmask.hf.heads`` for runtime
head masks, ``retmask.hf.capture`` for argmax capture and ``retmask.hf.patch`` for ``patch``.

    model, tok = retmask.load_model()                       # embedded SmolLM2, attn "retmask"
    with retmask.capture_argmax(model, rows=1) as cap:      # argmax of the last row of every call
        model.generate(**batch, max_new_tokens=8)           # cap.calls: [L, B, Hq, 1] per step
    with retmask.head_mask(model, [(3, 1), (7, 4)]):        # (layer, query head), skipped by the kernel
        model.generate(**batch)                             # = the o_proj-zeroed checkpoint's output
    retmask.export_masked(model, [(3, 1), (7, 4)], "out/")  # that checkpoint, for plain transformers

Limits (each raises a clear error instead of computing something else): sliding-window / chunked
attention, logit soft-capping, attention sinks, attention dropout in training, static KV caches, custom
4D masks, packed sequences, ``output_attentions=True`` (use ``capture_argmax``).
"""

from __future__ import annotations

from .hf.capture import ArgmaxCapture, capture_argmax
from .hf.heads import clear_head_mask, head_mask, set_head_mask
from .hf.interface import NAME, register, retmask_attention, retmask_mask
from .hf.layers import HeadLayout, head_layout
from .hf.patch import check_supported, patch

__all__ = [
    "NAME",
    "ArgmaxCapture",
    "HeadLayout",
    "capture_argmax",
    "check_supported",
    "clear_head_mask",
    "head_layout",
    "head_mask",
    "patch",
    "register",
    "retmask_attention",
    "retmask_mask",
    "set_head_mask",
]
