"""What retmask sees in a model, from its config alone: can it run on retmask attention, and its head layout.

The model is built on the meta device (``torch.device("meta")``): modules with shapes but no storage, so no
weights are read or allocated and a 70B model's report takes a fraction of a second. The checks are those
``retmask.patch`` runs on a loaded model (``check_supported``), so the answer is the one a real load gives.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from transformers import AutoConfig

from retmask.heads.layout import layer_kinds
from retmask.hf.export import check_zeroing_is_masking
from retmask.hf.layers import head_layout
from retmask.hf.loading import ModelLoadError, max_context, model_class_for, resolve_source
from retmask.hf.patch import check_supported


def model_report(spec: str | None, gguf_file: str | None = None) -> dict[str, Any]:
    """The report of the model ``load_model(spec, gguf_file=...)`` would load (None: the embedded model).

    Returns a JSON-ready dict: ``model``, ``model_type``, ``class``, ``supported`` (bool) and ``problem``
    (why not, or None); when supported also ``layers`` (L), ``query_heads`` (Hq), ``kv_heads`` (Hkv),
    ``head_dim`` (D), ``output_projection``, ``layer_kinds`` (kind -> count), ``sliding_window``,
    ``softcap``, ``sinks``, ``max_context`` and ``zeroed_head_export`` ("exact", or why it is refused).
    """
    source = resolve_source(spec, gguf_file)
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=False)
        model_class = model_class_for(source)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"could not read the config of model {source!r}: {err}. Hub downloads may be unavailable here: "
            "pass a local folder or a .gguf file"
        ) from None
    with torch.device("meta"):
        model = model_class.from_config(config, attn_implementation="eager")
    report: dict[str, Any] = {
        "model": spec or "embedded SmolLM2-135M-Instruct",
        "model_type": config.model_type,
        "class": type(model).__name__,
    }
    try:
        check_supported(model)
    except ValueError as err:
        return {**report, "supported": False, "problem": str(err)}
    layout = head_layout(model)
    text = config.get_text_config(decoder=True)
    kinds = Counter(layer_kinds(text) or ["full_attention"] * layout.num_layers)
    try:
        check_zeroing_is_masking(layout)
        export = "exact"
    except ValueError as err:
        export = f"refused: {err}"
    return {
        **report,
        "supported": True,
        "problem": None,
        "layers": layout.num_layers,
        # a hybrid model's heads sit in some of its layers only: their decoder layer numbers
        "attention_layers": list(layout.layer_ids) if layout.hybrid else None,
        "query_heads": layout.num_heads,
        "kv_heads": layout.kv_heads,
        "head_dim": layout.head_dim,
        "output_projection": layout.projection_name,
        "layer_kinds": dict(kinds),
        "sliding_window": getattr(text, "sliding_window", None),
        "softcap": getattr(text, "attn_logit_softcapping", None),
        "sinks": hasattr(layout.layers[0], "sinks"),
        "latent_attention": layout.latent_kv,
        "max_context": max_context(model),
        "zeroed_head_export": export,
    }


def report_lines(report: dict[str, Any]) -> list[str]:
    """The report as the indented lines ``retmask env --model`` prints."""
    lines = [
        "model:",
        f"  {'name':18} {report['model']} ({report['model_type']}, {report['class']})",
    ]
    if not report["supported"]:
        return [*lines, f"  {'retmask attention':18} not supported: {report['problem']}"]
    kinds = ", ".join(f"{n} {kind}" for kind, n in report["layer_kinds"].items())
    window = f" (window {report['sliding_window']})" if "sliding_attention" in report["layer_kinds"] else ""
    features = [f"logit soft-capping {report['softcap']}"] * (report["softcap"] is not None)
    features += ["attention sinks"] * report["sinks"]
    features += ["multi-head latent attention (one compressed latent per token in the cache)"] * report[
        "latent_attention"
    ]
    hybrid = report["attention_layers"] is not None
    layers = f"{report['layers']} {'attention ' * hybrid}layers"
    placed = [
        f"  {'attention layers':18} {report['attention_layers']} (score rows l = 0..{report['layers'] - 1})"
    ]
    return [
        *lines,
        f"  {'retmask attention':18} supported",
        f"  {'heads':18} {layers} x {report['query_heads']} query heads, {report['kv_heads']} KV "
        f"heads, head dim {report['head_dim']} (output projection {report['output_projection']})",
        f"  {'layer kinds':18} {kinds}{window}",
        *placed * hybrid,
        f"  {'features':18} {', '.join(features) or 'none beyond causal attention'}",
        f"  {'context':18} {report['max_context']} tokens",
        f"  {'zeroed-head export':18} {report['zeroed_head_export']}",
    ]


__all__ = ["model_report", "report_lines"]
