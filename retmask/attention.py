"""Drop-in attention for Hugging Face models (public facade of ``retmask.hf``).

Importing this module registers ``attn_implementation="retmask"`` (attention + mask function) with
transformers. See ``retmask.hf.interface`` for the attention function, ``retmask.hf.heads`` for runtime
head masks, ``retmask.hf.capture`` for argmax capture and ``retmask.hf.patch`` for ``patch``.
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
