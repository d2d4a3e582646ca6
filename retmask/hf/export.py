"""Exporting a checkpoint with heads zeroed, for plain transformers.

Masking head h of layer l = zeroing input features ``[h*D, (h+1)*D)`` of that layer's output projection
(``o_proj.weight[:, h*D:(h+1)*D]``, ``[hidden, Hq*D]``; the rows of a GPT-2 ``Conv1D``, whose weight is
``[Hq*D, hidden]``): the head then contributes nothing downstream. The projection's bias (if any) is
indexed by the *output* dimension and is left alone (zeroing ``bias[h*D:(h+1)*D]``, as one published
script does, is a different thing).

The folder says what it is, readable without retmask: ``config.json`` carries ``retmask_masked_heads``
(``[[layer, head], ...]``, 0-based) and ``retmask_masking`` (base model, how the heads were chosen, the
scores file, the retmask version), and ``README.md`` is a model card with the same facts.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from retmask.heads.mask import HeadSpec, normalize_head_mask
from retmask.hf.layers import HeadLayout, head_inputs, head_layout, output_norms
from retmask.hf.loading import auto_class_name
from retmask.model_files import copy_processor_files
from retmask.runfiles import atomic_folder, io_failure, output_error


def check_zeroing_is_masking(layout: HeadLayout) -> None:
    """Raise a ValueError naming the module when zeroing a head's output-projection inputs is not the same
    as switching the head off at run time: the model normalises the heads' joint output before its output
    projection (``output_norms``)."""
    norms = output_norms(layout.layers[0])
    if norms:
        raise ValueError(
            f"model '{layout.model_type}': its attention normalises the heads' joint output "
            f"({', '.join(norms)}) before {layout.projection_name}, so a checkpoint with a head's "
            f"{layout.projection_name} inputs zeroed is not the model with that head switched off; mask the "
            "heads at run time instead (retmask.head_mask, or --mask-file on the commands that take one)"
        )


def zero_heads_(model: torch.nn.Module, heads: HeadSpec) -> torch.nn.Module:
    """Zero (in place) the output-projection inputs of ``heads`` in ``model``; returns the model."""
    layout = head_layout(model)
    check_zeroing_is_masking(layout)
    mask = normalize_head_mask(heads, *layout.shape, allow_per_row=False)
    D = layout.head_dim
    with torch.no_grad():
        for layer_idx, head in mask.nonzero().tolist():
            head_inputs(layout.projections[layer_idx])[head * D : (head + 1) * D] = 0
    return model


def export_masked(
    model: torch.nn.Module,
    heads: HeadSpec,
    out_dir: str | os.PathLike,
    tokenizer=None,
    *,
    provenance: dict[str, Any] | None = None,
) -> Path:
    """Save a standard HF checkpoint of ``model`` with the output-projection inputs of ``heads`` zeroed.

    ``model`` itself is not modified. The saved config names no retmask attention, so plain
    transformers loads it; it records the heads (``retmask_masked_heads``) and ``provenance``
    (``retmask_masking``: e.g. ``base_model``, ``selection`` = the heads JSON's dict,
    ``HeadSelection.to_json()``, or a sentence saying how the heads were chosen, ``scores_file``), also written
    as a model card (``README.md``). Returns the output folder.
    """
    layout = head_layout(model)
    check_zeroing_is_masking(layout)
    mask = normalize_head_mask(heads, *layout.shape, allow_per_row=False)
    if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(
            f"tokenizer must be a tokenizer or processor object (with save_pretrained), got "
            f"{type(tokenizer).__name__}; load one with transformers.AutoTokenizer.from_pretrained(path)"
        )
    provenance = _plain_provenance(provenance)
    D = layout.head_dim
    by_ptr = {proj.weight.data_ptr(): (layer_idx, proj) for layer_idx, proj in enumerate(layout.projections)}
    state = dict(model.state_dict())
    # state_dict() returns detached views: match the projections' weights by storage (and name, as a tied
    # weight shares its storage), then swap in zeroed copies.
    for key, tensor in list(state.items()):
        found = by_ptr.get(tensor.data_ptr()) if key.endswith(f"{layout.projection_name}.weight") else None
        if found is None:
            continue
        layer_idx, proj = found
        cols = mask[layer_idx].nonzero().flatten().tolist()
        if cols:
            zeroed = tensor.detach().clone()
            for head in cols:
                head_inputs(proj, zeroed)[head * D : (head + 1) * D] = 0
            state[key] = zeroed
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        # errno and file name set: the commands print it as one line naming the folder
        what = "is a file, not a folder" if not out.is_dir() else "already exists and is not empty"
        raise FileExistsError(errno.EEXIST, f"export folder {out} {what}; pick a new folder", str(out))
    masked = [[int(a), int(b)] for a, b in mask.nonzero().tolist()]
    masking = masking_record(model, masked, provenance, projection=layout.projection_name)
    # Written into a hidden sibling folder and renamed into place at the end: an interrupted export
    # (Ctrl-C, a full disk) leaves no half-written checkpoint that would load as if it were complete, and a
    # failed write is ``cannot write OUT: REASON`` (an OutputWriteError) with nothing left behind.

    with atomic_folder(out) as partial:
        try:
            _save_checkpoint(model, state, masked, masking, partial)
            if tokenizer is not None:
                tokenizer.save_pretrained(partial)
            copy_processor_files(model, partial)
            (partial / "README.md").write_text(
                model_card(masked, masking, layout.shape, layout.projection_name, auto_class_name(model)),
                encoding="utf-8",
            )
        except OSError:
            raise  # atomic_folder names ``out``
        except Exception as err:
            cause = io_failure(err)  # a full disk under safetensors is a SafetensorError, not an OSError
            if cause is None:
                raise
            raise output_error(out, cause) from None
    return out


def _save_checkpoint(
    model: torch.nn.Module, state: dict, masked: list[list[int]], masking: dict, folder: Path
) -> None:
    """``save_pretrained`` with ``state`` and the masking metadata in the config. transformers does not write
    the attention implementation into config.json, so the checkpoint loads without retmask installed
    (``tests/hf/test_export.py`` checks it)."""
    config = model.config
    try:
        config.retmask_masked_heads = masked
        config.retmask_masking = masking
        model.save_pretrained(folder, state_dict=state)
    finally:
        for name in ("retmask_masked_heads", "retmask_masking"):
            if name in config.__dict__:
                delattr(config, name)


def _plain_provenance(provenance: Any) -> dict[str, Any] | None:
    """``provenance`` as plain JSON values (it goes into config.json and the model card): paths become
    strings, NumPy / torch scalars and arrays numbers and lists; anything else is a TypeError naming it."""
    if provenance is None:
        return None
    if not isinstance(provenance, Mapping):
        raise TypeError(
            f"provenance must be a dict (e.g. {{'selection': 'top 5 heads by retrieval score', 'scores_file': "
            f"'scores.json'}}), got {type(provenance).__name__}"
        )

    def plain(value: Any) -> Any:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if hasattr(value, "tolist"):  # NumPy / torch scalars and arrays
            return value.tolist()
        raise TypeError(
            f"provenance holds a {type(value).__name__} ({value!r:.60}), which a config file cannot store; "
            "pass strings, numbers, lists and dicts"
        )

    return json.loads(json.dumps(dict(provenance), default=plain))


def masking_record(
    model: torch.nn.Module, masked: list[list[int]], provenance: dict | None, projection: str = "o_proj"
) -> dict:
    """What ``config.retmask_masking`` records: the edit (on the output projection named ``projection``),
    the base model, the retmask version and the caller's ``provenance`` (how the heads were chosen, from
    which scores)."""
    from retmask import __version__

    record: dict[str, Any] = {
        "edit": f"{projection} input features of each masked head set to 0 (the head contributes nothing)",
        "num_masked_heads": len(masked),
        "base_model": getattr(model.config, "name_or_path", None) or None,
        "retmask_version": __version__,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    record.update({k: v for k, v in (provenance or {}).items() if v is not None})
    return record


def _rule(selection: dict) -> str:
    """How the heads were chosen, in words, from a heads-JSON dict (``HeadSelection.to_json()``)."""
    if selection.get("method") == "mudaf-sample":
        rule = (
            f"{len(selection.get('heads') or [])} heads sampled with P(h) ~ exp(score / "
            f"{selection.get('temperature')}) (seed {selection.get('seed')})"
        )
    elif selection.get("top_k") is not None:
        rule = f"the {selection['top_k']} heads with the highest mean retrieval score"
    elif selection.get("threshold") is not None:
        rule = f"heads with mean retrieval score >= {selection['threshold']:g}"
    else:
        rule = f"method {selection.get('method', '?')}"
    if selection.get("baseline"):
        n = len(selection.get("retrieval_heads") or [])
        pool = "none of them retrieval heads" if selection["baseline"] == "non-retrieval" else "any heads"
        rule = f"{selection['baseline']} baseline: as many random heads ({pool}; seed {selection.get('seed')}) as the {n} {rule}"
    return rule


def model_card(
    masked: list[list[int]],
    masking: dict,
    shape: tuple[int, int],
    projection: str = "o_proj",
    auto_class: str = "AutoModelForCausalLM",
) -> str:
    """``README.md`` of an exported folder: what was done to which model (``projection``: the name of the
    output projection edited; ``auto_class``: the transformers class that loads it), readable without
    retmask."""
    base = masking.get("base_model") or "unknown"
    selection = masking.get("selection") or {}
    heads = ", ".join(f"{a}-{b}" for a, b in masked) or "none"
    rows = [
        ("base model", f"`{base}`"),
        (
            "heads zeroed",
            f"{len(masked)} of {shape[0] * shape[1]} ({shape[0]} layers x {shape[1]} query heads)",
        ),
        ("which (layer-head, 0-based)", heads),
    ]
    if selection:
        rows.append(("chosen as", selection if isinstance(selection, str) else _rule(selection)))
    if masking.get("scores_file"):
        digest = masking.get("scores_sha256")
        rows.append(
            ("scores file", f"`{masking['scores_file']}`" + (f" (sha256 {digest[:16]}...)" if digest else ""))
        )
    if masking.get("heads_file"):
        rows.append(("heads file", f"`{masking['heads_file']}`"))
    rows += [
        ("retmask version", str(masking.get("retmask_version"))),
        ("created", str(masking.get("created"))),
    ]
    front = ["---", "tags:", "- retmask", "- attention-heads-masked"]
    if "/" in base and not base.startswith((".", "/", "~")) and base.count("/") == 1:
        front.append(f"base_model: {base}")  # a hub id
    front.append("---")
    table = ["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]
    return "\n".join(
        [
            *front,
            "",
            f"# {Path(base).name or base} with {len(masked)} attention heads switched off",
            "",
            "A standard Hugging Face checkpoint written by `retmask mask --export` (retmask's `export_masked`): "
            f"the base model with the output projection's (`{projection}`) input features of the heads below set "
            f"to zero, so those heads contribute nothing. Everything else is unchanged; `{projection}.bias`, if "
            "any, is kept.",
            "",
            *table,
            "",
            "Load it with plain transformers (no retmask needed): "
            f"`{auto_class}.from_pretrained(folder)`. `config.json` carries the same facts: "
            "`retmask_masked_heads` (`[[layer, head], ...]`) and `retmask_masking`.",
            "",
        ]
    )
