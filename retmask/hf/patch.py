"""``retmask.patch(model)``: switch a loaded model to retmask attention, after checking it can work."""

from __future__ import annotations

import torch

from retmask.hf.interface import NAME
from retmask.hf.layers import head_layout

TESTED = "Llama, Qwen2, Qwen3, Mistral (sliding_window=None), OLMo-2, SmolLM2"


def _fail(model_type: str, why: str) -> ValueError:
    return ValueError(
        f"model '{model_type}' cannot use retmask attention: {why}. Supported: decoder LMs whose attention goes "
        f"through transformers' AttentionInterface with full causal attention (tested: {TESTED})"
    )


def check_supported(model: torch.nn.Module) -> None:
    """Raise a ValueError naming the problem if ``model`` cannot run on the retmask kernel."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    compatible = getattr(type(model), "is_backend_compatible", None)
    if compatible is None or not compatible():
        raise _fail(
            model_type,
            f"{type(model).__name__} does not route attention through AttentionInterface "
            "(_supports_attention_backend is False)",
        )
    try:
        layout = head_layout(model)
    except ValueError as err:
        raise _fail(model_type, str(err)) from None
    for sub in (config, getattr(config, "text_config", None)):
        if sub is None:
            continue
        for attr in ("attn_logit_softcapping", "attention_logit_softcapping"):
            if getattr(sub, attr, None) is not None:
                raise _fail(
                    model_type, f"attention logit soft-capping is active ({attr}={getattr(sub, attr)})"
                )
        kinds = set(getattr(sub, "layer_types", None) or [])
        if kinds - {"full_attention"}:
            raise _fail(model_type, f"its layers use {sorted(kinds - {'full_attention'})} attention")
        if getattr(sub, "sliding_window", None) is not None and getattr(sub, "use_sliding_window", True):
            raise _fail(
                model_type, f"sliding-window attention is active (sliding_window={sub.sliding_window})"
            )
    if any(hasattr(m, "sinks") for m in layout.layers):
        raise _fail(model_type, "its attention layers have attention sinks")


def patch(model: torch.nn.Module) -> torch.nn.Module:
    """Check ``model`` and switch it (in place) to ``attn_implementation="retmask"``; returns it."""
    check_supported(model)
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        raise _fail(model.config.model_type, "set_attn_implementation did not take effect")
    return model


def uses_retmask(model: torch.nn.Module) -> bool:
    """True if ``model`` currently dispatches attention to retmask."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME


def require_retmask(model: torch.nn.Module, what: str) -> None:
    """Raise if ``model`` is not on retmask attention: ``what`` would otherwise be silently ignored."""
    if not uses_retmask(model):
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        raise ValueError(
            f"{what} needs the model on retmask attention, but it uses attn_implementation={impl!r}; call "
            "retmask.patch(model) first or load it with attn_implementation='retmask'"
        )
