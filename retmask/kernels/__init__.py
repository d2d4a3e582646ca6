"""Fused attention kernels with per-row argmax of the logits and head skipping."""

from .attention import BACKENDS, attention, available_backends, resolve_backend
from .reference import reference_attention, reference_logits

__all__ = [
    "BACKENDS",
    "attention",
    "available_backends",
    "reference_attention",
    "reference_logits",
    "resolve_backend",
]
