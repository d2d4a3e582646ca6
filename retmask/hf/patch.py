"""``retmask.patch(model)``: switch a loaded model to retmask attention, after checking it can work."""

from __future__ import annotations

import torch

from retmask.heads.layout import attention_layer_ids
from retmask.hf.interface import NAME
from retmask.hf.layers import head_layout

TESTED = (
    "Llama, SmolLM2, Qwen2 and Mistral (with and without a sliding window), Qwen3, OLMo-2, OLMo-3, Gemma 2 "
    "(soft-capping), Gemma 3 (local/global layers, head dim 256), Gemma 3n, Cohere 2, gpt-oss (sinks), GPT-2, GPT-NeoX, "
    "GPT-J, CodeGen, OPT, Phi, Phi-3, StarCoder 1/2, Persimmon, Gemma, Granite, Mixtral, Qwen2/3-MoE, OLMoE, "
    "SmolLM3, GLM-4, Nemotron, EXAONE 4, Helium; the attention layers of hybrid models: LFM2, Qwen3.5 (dense, MoE), "
    "Qwen3-Next, Granite 4.0-H, Nemotron-H, OLMo hybrid, Kimi Linear; multi-head latent attention: DeepSeek-V2/V3, "
    "MiniCPM3"
)

# Model types whose attention modules call the attention function registered under the model's
# ``attn_implementation`` (through ``ALL_ATTENTION_FUNCTIONS``) although their class does not declare it with
# ``_supports_attention_backend``: each is tested against eager attention in tests/hf/test_architectures.py.
ROUTED_WITHOUT_FLAG = frozenset(
    {
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_text",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "olmo_hybrid",
        "nemotron_h",
        "kimi_linear",
    }
)

# Hybrid models whose attention layers run on retmask attention but whose other layers break what retmask
# builds on them: model type -> why.
REFUSED_HYBRIDS = {
    "jamba": "its Mamba layers give other logits when a prompt is fed in chunks after a cache (transformers' "
    "PyTorch path), and detection prefills in chunks",
    "bamba": "its Mamba-2 layers give other logits when tokens follow a cached prompt (transformers' PyTorch "
    "path)",
    "minimax": "its linear-attention layers report attention weights too, so eager attention's "
    "output_attentions (the reference that detection is checked against) does not list its heads alone",
}


def _fail(model_type: str, why: str) -> ValueError:
    return ValueError(
        f"model '{model_type}' cannot use retmask attention: {why}. Supported: decoder LMs whose attention goes "
        f"through transformers' AttentionInterface with full or sliding-window causal attention (tested: {TESTED})"
    )


def check_supported(model: torch.nn.Module) -> None:
    """Raise a ValueError naming the problem if ``model`` cannot run on the retmask kernel."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    if model_type in REFUSED_HYBRIDS:
        raise _fail(model_type, REFUSED_HYBRIDS[model_type])
    compatible = getattr(type(model), "is_backend_compatible", None)
    routed = compatible is not None and compatible()
    if not routed and model_type not in ROUTED_WITHOUT_FLAG:
        raise _fail(
            model_type,
            f"{type(model).__name__} does not declare that its attention goes through AttentionInterface "
            "(_supports_attention_backend is False) and is not a model retmask has tested that way",
        )
    for sub in (config, getattr(config, "text_config", None)):
        if sub is not None and getattr(sub, "num_hidden_layers", None) is not None:
            try:
                attention_layer_ids(sub)  # refuses layer kinds the kernel does not compute exactly
            except ValueError as err:
                raise _fail(model_type, str(err)) from None
    try:
        head_layout(model)
    except ValueError as err:
        raise _fail(model_type, str(err)) from None


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
