"""Locate the attention modules of a transformers model and its head geometry."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retmask.heads.layout import attention_layer_ids

# Names of the projection that maps an attention layer's concatenated head outputs back to the hidden
# size, in the order they are looked for: Llama-like models, GPT-NeoX / Phi, OPT / GPT-J, GPT-2.
OUTPUT_PROJECTIONS = ("o_proj", "dense", "out_proj", "c_proj")


def is_transposed_linear(module: torch.nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's linear layers): weight [in, out], the transpose of ``nn.Linear``'s."""
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor)


def output_projection_name(attention: torch.nn.Module) -> str | None:
    """The attribute name of the attention module's output projection (an ``nn.Linear`` or a ``Conv1D``),
    or None."""
    for name in OUTPUT_PROJECTIONS:
        module = getattr(attention, name, None)
        if isinstance(module, torch.nn.Linear) or (module is not None and is_transposed_linear(module)):
            return name
    return None


def projection_inputs(projection: torch.nn.Module) -> int:
    """The input features of an output projection: Hq * D."""
    weight = projection.weight
    return int(weight.shape[0] if is_transposed_linear(projection) else weight.shape[1])


def head_inputs(projection: torch.nn.Module, weight: torch.Tensor | None = None) -> torch.Tensor:
    """A view of ``weight`` (default: the projection's own) with the input features first: [Hq * D, hidden].
    Zeroing rows ``[h*D, (h+1)*D)`` of it removes head h's contribution."""
    weight = projection.weight if weight is None else weight
    return weight if is_transposed_linear(projection) else weight.t()


def output_norms(attention: torch.nn.Module) -> tuple[str, ...]:
    """Names of the normalisation modules ``attention`` holds besides its query, key and value norms
    (``q_norm``, ``k_layernorm``, ``query_layernorm``, ``v_norm``, ...): a norm over the heads' joint output
    before the output projection, as BitNet's ``attn_sub_norm``. Through such a norm a zeroed head still
    changes the others' scale, so zeroing its projection inputs is not the same edit as switching it off."""
    return tuple(
        name
        for name, _ in attention.named_children()
        if "norm" in name.lower() and not name.lower().startswith(("q", "k", "v"))
    )


def is_latent_attention(attention: torch.nn.Module) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3): the cache holds one compressed latent per
    token, which ``kv_b_proj`` expands into every query head's own key and value on each call; query / key
    heads are wider than value heads (``qk_head_dim`` 192 against ``v_head_dim`` 128 in DeepSeek-V3)."""
    return isinstance(getattr(attention, "kv_b_proj", None), torch.nn.Module)


@dataclass(frozen=True)
class HeadLayout:
    """Head geometry of a model: ``layers[l]`` is its l-th softmax-attention module, in layer order, and
    ``projections[l]`` that module's output projection (``o_proj``, or its other names:
    ``OUTPUT_PROJECTIONS``). ``layer_ids[l]`` is the decoder layer it sits in (its ``layer_idx``): l itself
    in a model whose every layer is attention; in a hybrid model (convolution, linear-attention or Mamba
    layers besides the attention layers) only the attention layers are counted, and every [L, Hq] array of
    retmask is indexed by attention layer.

    num_layers: L (attention layers); num_heads: Hq (query heads per layer); kv_heads: Hkv (key / value
    heads per layer; in multi-head latent attention one per query head, as the attention sees them);
    head_dim: D (output-projection inputs per head: the value head dim).
    """

    layers: tuple[torch.nn.Module, ...]
    layer_ids: tuple[int, ...]
    projections: tuple[torch.nn.Module, ...]
    projection_name: str  # the projections' attribute name, e.g. "o_proj"
    num_heads: int
    kv_heads: int
    head_dim: int
    model_type: str
    total_layers: int  # decoder layers, attention or not
    latent_kv: bool = False  # multi-head latent attention: the cache holds a compressed latent, not KV heads

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def shape(self) -> tuple[int, int]:
        """[L, Hq]"""
        return (self.num_layers, self.num_heads)

    @property
    def hybrid(self) -> bool:
        """True if the model has layers other than these attention layers (its cache then holds states
        that cannot be rewound to an earlier position)."""
        return self.num_layers != self.total_layers

    def positions(self) -> dict[int, int]:
        """``layer_idx`` of each attention module -> its attention-layer index l."""
        return {layer_idx: i for i, layer_idx in enumerate(self.layer_ids)}


def _is_attention(module: torch.nn.Module) -> bool:
    """A softmax-attention module of transformers: a ``layer_idx``, an output projection, and the
    ``is_causal`` flag the attention functions read. Convolution, linear-attention and Mamba mixers of hybrid
    models have the first two but not the flag."""
    return (
        isinstance(getattr(module, "layer_idx", None), int)
        and isinstance(getattr(module, "is_causal", None), bool)
        and output_projection_name(module) is not None
    )


def head_layout(model: torch.nn.Module) -> HeadLayout:
    """Attention modules ordered by layer, with Hq and D; raises if the model has no recognisable layout."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    found = [m for m in model.modules() if _is_attention(m)]
    if not found:
        raise ValueError(
            f"model '{model_type}' ({type(model).__name__}) has no attention modules with a layer_idx and an "
            f"output projection ({' / '.join(OUTPUT_PROJECTIONS)}); retmask supports decoder LMs whose "
            "attention modules are built that way (Llama, Qwen, Mistral, Gemma, Phi, GPT-2, GPT-NeoX, OPT, ...)"
        )
    kinds = sorted({type(m).__name__ for m in found})
    if len(kinds) > 1:
        raise ValueError(
            f"model '{model_type}': its layers hold attention modules of different kinds ({', '.join(kinds)}), "
            "e.g. linear and softmax attention; retmask needs the same softmax attention in every layer"
        )
    # a vision-language model (Gemma 3 from 4B, ...) keeps the language model's geometry in its text config
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    by_layer = {m.layer_idx: m for m in found}
    layer_ids = attention_layer_ids(text_config)
    if sorted(by_layer) != list(layer_ids) or len(by_layer) != len(found):
        raise ValueError(
            f"model '{model_type}': its attention modules sit in layers {sorted(m.layer_idx for m in found)}, "
            f"but its config puts attention in layers {list(layer_ids)}; head masks cannot be mapped to layers"
        )
    num_heads = getattr(text_config, "num_attention_heads", None)
    name = output_projection_name(found[0])
    inputs = projection_inputs(getattr(found[0], name))
    # GPT-NeoX names it head_size; a module without either splits the projection's inputs evenly
    head_dim = getattr(found[0], "head_dim", None) or getattr(found[0], "head_size", None)
    if head_dim is None and num_heads:
        head_dim = inputs // num_heads
    if num_heads is None or inputs != num_heads * head_dim:
        raise ValueError(
            f"model '{model_type}': the output projection has {inputs} input features, expected "
            f"num_attention_heads ({num_heads}) x head_dim ({head_dim})"
        )
    # Hkv as the attention computes it: transformers' attention functions repeat each KV head
    # num_key_value_groups times, and a module without that attribute has one KV head per query head. The
    # config can disagree: GPT-BigCode's multi_query is not reflected in num_key_value_heads.
    # Multi-head latent attention expands its keys and values to one head per query head on every call.
    latent = is_latent_attention(found[0])
    groups = 1 if latent else getattr(found[0], "num_key_value_groups", 1)
    if not isinstance(groups, int) or groups < 1 or num_heads % groups:
        raise ValueError(
            f"model '{model_type}': num_key_value_groups = {groups!r} does not divide its {num_heads} query heads"
        )
    layers = tuple(by_layer[i] for i in layer_ids)
    return HeadLayout(
        layers=layers,
        layer_ids=layer_ids,
        projections=tuple(getattr(m, name) for m in layers),
        projection_name=name,
        num_heads=int(num_heads),
        kv_heads=int(num_heads) // groups,
        head_dim=int(head_dim),
        model_type=model_type,
        total_layers=int(text_config.num_hidden_layers),
        latent_kv=latent,
    )


def decoder_layers(model: torch.nn.Module, layout: HeadLayout | None = None) -> tuple[torch.nn.Module, ...]:
    """The block around each attention module (``model.model.layers[l]`` in Llama-like models): the module
    that holds ``layout.layers[l]`` as a direct child, where these blocks are the L entries of one
    ``nn.ModuleList`` in layer order. Raises ValueError for a model built otherwise, and for a hybrid model
    (its attention blocks are not its whole stack)."""
    layout = layout or head_layout(model)
    if layout.hybrid:
        raise ValueError(
            f"model '{layout.model_type}': its decoder layers {list(layout.layer_ids)} hold attention and its "
            "other layers do not; it is not a stack of attention blocks"
        )
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
