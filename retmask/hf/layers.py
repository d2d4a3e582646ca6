"""Locate the attention modules of a transformers model and its head geometry."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadLayout:
    """Head geometry of a model: ``layers[l]`` is the attention module with ``layer_idx == l``.

    num_layers: L; num_heads: Hq (query heads per layer); head_dim: D (o_proj columns per head).
    """

    layers: tuple[torch.nn.Module, ...]
    num_heads: int
    head_dim: int
    model_type: str

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def shape(self) -> tuple[int, int]:
        """[L, Hq]"""
        return (self.num_layers, self.num_heads)


def _is_attention(module: torch.nn.Module) -> bool:
    return (
        isinstance(getattr(module, "layer_idx", None), int)
        and isinstance(getattr(module, "o_proj", None), torch.nn.Linear)
        and hasattr(module, "head_dim")
    )


def head_layout(model: torch.nn.Module) -> HeadLayout:
    """Attention modules ordered by layer, with Hq and D; raises if the model has no recognisable layout."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    found = [m for m in model.modules() if _is_attention(m)]
    if not found:
        raise ValueError(
            f"model '{model_type}' ({type(model).__name__}) has no attention modules with o_proj / layer_idx / "
            "head_dim; retmask supports decoder LMs built like Llama (Llama, Qwen2, Qwen3, Mistral, OLMo-2, ...)"
        )
    by_layer = {m.layer_idx: m for m in found}
    if sorted(by_layer) != list(range(len(found))):
        raise ValueError(
            f"model '{model_type}': attention layer indices {sorted(m.layer_idx for m in found)} are not "
            "0..L-1 with one module each; head masks cannot be mapped to layers"
        )
    num_heads = getattr(config, "num_attention_heads", None)
    head_dim = found[0].head_dim
    if num_heads is None or found[0].o_proj.in_features != num_heads * head_dim:
        raise ValueError(
            f"model '{model_type}': o_proj has {found[0].o_proj.in_features} input features, expected "
            f"num_attention_heads ({num_heads}) x head_dim ({head_dim})"
        )
    layers = tuple(by_layer[i] for i in range(len(found)))
    return HeadLayout(layers=layers, num_heads=int(num_heads), head_dim=int(head_dim), model_type=model_type)


def decoder_layers(model: torch.nn.Module, layout: HeadLayout | None = None) -> tuple[torch.nn.Module, ...]:
    """The block around each attention module (``model.model.layers[l]`` in Llama-like models): the module
    that holds ``layout.layers[l]`` as a direct child, where these blocks are the L entries of one
    ``nn.ModuleList`` in layer order. Raises ValueError for a model built otherwise."""
    layout = layout or head_layout(model)
    parent_of = {id(child): module for module in model.modules() for child in module.children()}
    missing = [i for i, attn in enumerate(layout.layers) if id(attn) not in parent_of]
    if missing:
        raise ValueError(f"model '{layout.model_type}': no module holds the attention of layers {missing}")
    blocks = tuple(parent_of[id(attn)] for attn in layout.layers)
    stack = parent_of.get(id(blocks[0]))
    if not isinstance(stack, torch.nn.ModuleList) or tuple(stack) != blocks:
        raise ValueError(
            f"model '{layout.model_type}': the blocks around its attention modules are not one ModuleList of "
            f"{layout.num_layers} decoder layers in layer order"
        )
    return blocks
