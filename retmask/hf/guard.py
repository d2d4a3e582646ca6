"""Refuse a forward call that would silently bypass what retmask holds on an attention layer.

A head mask (``_retmask_skip``) and a ``tap_qk`` (``_retmask_tap``) live on the attention modules and act
only inside retmask's attention function. If the model is switched to another ``attn_implementation``
while one is set, that function is no longer called: a masked head would run, a tap would keep the
previous call's tensors, both silently. While a layer holds either it carries a forward pre-hook that
refuses such a call by name (one Python call per forward call of that layer); a layer holding neither
carries no hook and pays nothing. ``sync_guard``
is called wherever they are set or cleared. (``capture_argmax`` needs no hook: it checks after every
forward call that each layer reported, and a capture runs on every layer of detection's decode steps.)
"""

from __future__ import annotations

import torch

from retmask.hf.interface import NAME

_STATE = {"_retmask_skip": "a head mask", "_retmask_tap": "tap_qk"}
_HANDLE = "_retmask_guard"


def sync_guard(module: torch.nn.Module) -> None:
    """Give ``module`` the guard hook while it holds retmask state, and take it away once it holds none."""
    handle = module.__dict__.get(_HANDLE)
    active = any(module.__dict__.get(name) is not None for name in _STATE)
    if active and handle is None:
        module._retmask_guard = module.register_forward_pre_hook(_refuse_other_attention)
    elif not active and handle is not None:
        handle.remove()
        module._retmask_guard = None


def _refuse_other_attention(module: torch.nn.Module, args: tuple) -> None:
    impl = getattr(getattr(module, "config", None), "_attn_implementation", NAME)  # no config: cannot tell
    if impl == NAME:
        return
    held = " and ".join(what for name, what in _STATE.items() if module.__dict__.get(name) is not None)
    raise ValueError(
        f"{held} is active on this model, but it now uses attn_implementation={impl!r}, which ignores it; "
        "switch back with retmask.patch(model), or end it first (clear_head_mask, or leave the `with` block)"
    )
