"""Fused attention kernels with per-row argmax of the logits and head skipping.

``retmask.kernels.attention`` is the function (the entry point lives in ``dispatch.py``); the operators
``torch.ops.retmask.attention_fwd`` / ``attention_bwd`` are registered in ``ops.py`` on import.
"""

from .dispatch import BACKENDS, attention, available_backends, resolve_backend
from .reference import reference_attention, reference_logits

__all__ = [
    "BACKENDS",
    "attention",
    "available_backends",
    "reference_attention",
    "reference_logits",
    "resolve_backend",
]
