"""Prefill calls whose outputs nobody reads: the last decoder layer only has to write its K/V, and no
logits are needed.

A prefill call exists to fill the KV cache. Layer l's keys and values are computed from the output of
layer l - 1, so every layer but the last must run in full; of the last layer only the K/V projections
(and whatever the attention module does before its cache update: norms, rotary embedding) are needed. Its
attention output, its output projection's input and its MLP feed only the call's hidden states and logits,
which the caller throws away, and so does the LM head. :func:`kv_only` skips that work for the duration of a
``with`` block:

* every query head of the last layer is switched off (the retmask kernel skips switched-off heads: no
  work, output 0; other attention implementations ignore the switch and compute as usual), and
* the last layer's MLP returns zeros instead of running, when it is a dense MLP (a module whose class
  name ends in ``MLP`` and whose parameters all belong to linear layers; it returns one tensor: Llama,
  Gemma, Qwen, Mistral, Phi). Mixture-of-experts blocks may return router outputs too and are left alone,
  even one named ``...MLP`` (gpt-oss's returns ``(hidden_states, router_scores)``);
* the LM head (the model's output embedding, when it is a linear layer) returns zeros of the logits'
  shape instead of multiplying. Even one position's logits cost a pass over the whole output matrix: with
  Gemma-3-270M's 262,144-token vocabulary that was 6% of a 256-token-chunked fp32 prefill on 2 CPU cores
  and 9% in bf16.

In a hybrid model whose last decoder layer is not an attention layer, the last attention layer's output
feeds the layers after it, whose states the cache keeps: there the block skips the LM head only.

The cache it leaves is bit-identical to a full forward's (the K/V of every layer come from the same
operations on the same inputs); only the call's returned hidden states and logits differ. For a model of
L layers this saves about 1/L of the prefill (SmolLM2-135M, 30 layers: 2.9% of a 3,000-token chunked
prefill on 2 CPU cores).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from retmask.hf.layers import head_layout, is_transposed_linear


def _decoder_layer_of(model: torch.nn.Module, attention: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose ``self_attn`` is ``attention`` (the decoder layer), or None."""
    for module in model.modules():
        if getattr(module, "self_attn", None) is attention:
            return module
    return None


def _dense_mlp(layer: torch.nn.Module | None) -> torch.nn.Module | None:
    """The decoder layer's ``mlp`` when it is dense, else None. Dense: its class name ends in ``MLP`` and every
    submodule that holds parameters is a linear layer (``nn.Linear`` or its subclasses, GPT-2's ``Conv1D``),
    so it maps hidden states [..., hidden] to one tensor of that shape. The name alone does not say it: a
    mixture of experts holds a router and stacked expert weights, and gpt-oss's ``GptOssMLP`` is one that
    returns ``(hidden_states, router_scores)``, which its decoder layer unpacks (zeros in its place broke
    every prefill)."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, torch.nn.Module) or not type(mlp).__name__.endswith("MLP"):
        return None
    holders = [m for m in mlp.modules() if next(m.parameters(recurse=False), None) is not None]
    linear = all(isinstance(m, torch.nn.Linear) or is_transposed_linear(m) for m in holders)
    return mlp if linear else None


def _zeros_like_input(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return torch.zeros_like(hidden_states)


def _linear_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's LM head when it is a plain linear layer (``get_output_embeddings``), else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, torch.nn.Linear) else None


def _zero_logits(vocab: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward for the LM head: zeros of the logits' shape ``[..., vocab]``, in the hidden states' dtype."""

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.new_zeros(*hidden_states.shape[:-1], vocab)

    return forward


@contextmanager
def _forward_replaced(
    module: torch.nn.Module | None, forward: Callable[..., torch.Tensor] | None
) -> Iterator[None]:
    """``module`` (None: nothing) runs ``forward`` inside the block: an instance attribute shadows the class's
    forward. On exit the module's own instance ``forward`` is back, if it had one (accelerate's hooks wrap a
    module that way), or the class's."""
    if module is None:
        yield
        return
    own = vars(module).get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


@contextmanager
def kv_only(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, forward calls of ``model`` compute only the K/V of its last decoder layer and no
    logits (see the module docstring): use it only around calls whose hidden states and logits are
    discarded. Any runtime head mask (shared or per batch row) is restored on exit, as are the MLP and the
    LM head."""
    head = _linear_head(model)
    zero_logits = _zero_logits(head.out_features) if head is not None else None
    with _forward_replaced(head, zero_logits), _last_layer_kv_only(model):
        yield


@contextmanager
def _last_layer_kv_only(model: torch.nn.Module) -> Iterator[None]:
    """The last decoder layer's part of :func:`kv_only`: its query heads switched off and its dense MLP
    returning zeros, restored on exit; nothing in a hybrid whose later layers read that layer's output."""
    layout = head_layout(model)
    if layout.layer_ids[-1] != layout.total_layers - 1:  # a hybrid's later layers read its output
        yield
        return
    attention, heads = layout.layers[-1], layout.num_heads
    old_skip = getattr(attention, "_retmask_skip", None)
    rows = getattr(attention, "_retmask_rows", None)
    device = layout.projections[-1].weight.device
    shape = (rows, heads) if rows is not None else (heads,)  # a per-row mask keeps its batch check
    mlp = _dense_mlp(_decoder_layer_of(model, attention))
    attention._retmask_skip = torch.ones(shape, dtype=torch.bool, device=device)
    try:
        with _forward_replaced(mlp, _zeros_like_input):
            yield
    finally:
        attention._retmask_skip = old_skip
