"""Fused attention kernels with per-row argmax of the logits and head skipping.

``retmask.kernels.attention`` is the function (the entry point lives in ``dispatch.py``); which code
path a call takes is the rule of ``paths.py`` (``describe()`` lists it for this machine, as ``retmask
env`` prints it); the operators ``torch.ops.retmask.attention_fwd`` / ``attention_bwd`` are registered in
``ops.py`` on import; ``reference.py`` is the plain-torch oracle.
"""

from .dispatch import BACKENDS, attention, available_backends, resolve_backend
from .paths import check_settings, describe
from .reference import reference_attention, reference_logits

__all__ = [
    "BACKENDS",
    "attention",
    "available_backends",
    "check_settings",
    "describe",
    "reference_attention",
    "reference_logits",
    "resolve_backend",
]
