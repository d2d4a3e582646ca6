"""Drop-in attention for Hugging Face models: everything that touches a transformers model.

Importing this package registers ``attn_implementation="retmask"`` (attention + mask function) with
transformers.

interface.py  the attention function and its mask function (registration)
patch.py      ``patch(model)``: switch a loaded model to retmask attention after checking it can work
layers.py     the attention modules of a model and its head geometry (``head_layout``)
model_report.py  can a model run on retmask attention, and its layout, from its config (``retmask env --model``)
heads.py      runtime head masks (``set_head_mask``, ``head_mask``; per batch row too)
capture.py    argmax capture (``capture_argmax``)
taps.py       post-RoPE q/k taps with autograd (``tap_qk``)
loading.py    ``load_model``: hub id, local folder, GGUF (converted once and cached), embedded default
linears.py    ``patch_linears``: float32 CPU linears on torch's BLAS or oneDNN, whichever is measured faster
export.py     ``export_masked``: a checkpoint with the masked heads' output-projection (o_proj) inputs zeroed
sparse_kv/    ``head_sparse_cache``: every key for retrieval KV heads, sink + window keys for the others

    model, tok = retmask.load_model()                       # embedded SmolLM2, attn "retmask"
    with retmask.capture_argmax(model, rows=1) as cap:      # argmax of the last row of every call
        model.generate(**batch, max_new_tokens=8)           # cap.calls: [L, B, Hq, 1] per step
    with retmask.head_mask(model, [(3, 1), (7, 4)]):        # (layer, query head), skipped by the kernel
        model.generate(**batch)                             # = the o_proj-zeroed checkpoint's output
    retmask.export_masked(model, [(3, 1), (7, 4)], "out/")  # that checkpoint, for plain transformers

Packed (padding-free) batches run in eager mode, one sequence per kernel row (``packed.py``).

Limits (each raises a clear error instead of computing something else): chunked attention, attention
dropout in training, custom 4D masks, packed sequences under torch.compile or with ``capture_argmax`` /
``tap_qk``, paged caches, a compiled multi-token call into a static KV cache (generate compiles decode steps only), ``output_attentions=True`` (use ``capture_argmax``),
a zeroed-head export of a model that normalises its heads' joint output before the output projection
(BitNet), transformers releases older than the range retmask declares (``retmask/requirements.py``).
"""

from __future__ import annotations

import transformers

from retmask.hf.capture import ArgmaxCapture, capture_argmax
from retmask.hf.heads import clear_head_mask, head_mask, set_head_mask
from retmask.hf.interface import NAME, register, retmask_attention, retmask_mask
from retmask.hf.layers import HeadLayout, head_layout
from retmask.hf.patch import check_supported, patch
from retmask.requirements import check_release, declared_range

# Older releases import fine and fail at the first forward (the mask function's arguments): stop here.
check_release("transformers", transformers.__version__, declared_range("transformers"))

__all__ = [
    "NAME",
    "ArgmaxCapture",
    "HeadLayout",
    "capture_argmax",
    "check_supported",
    "clear_head_mask",
    "head_layout",
    "head_mask",
    "patch",
    "register",
    "retmask_attention",
    "retmask_mask",
    "set_head_mask",
]
