"""The C++ CPU attention backward: ``attention_bwd`` of ``retmask._C`` (csrc/attention_bwd_cpu_kernel.h).

The gradients of attention without soft-capping or sinks (causal or not, key padding, skipped heads,
GQA, a sliding window with or without sink tokens: O(M x (window + sink tokens)) work) in one pass per block of whole query rows: the logits are recomputed and the five
products of the backward (Q K^T, dO V^T, P^T dO, dS^T Q, dS K) run on the kernel's FMA micro-kernels with
the causal triangle skipped, everything in fp32. fp16 / bf16 inputs are converted exactly on load and
each gradient is rounded once when stored, as autocast's own fp32 backward would; no [B, H, M, N] tensor
is ever built (scratch: two [rows, N] blocks per thread, ~512 KB, and one fp32 dK / dV pair per kv
head).

``ops.recompute_grads`` uses it where ``paths.cpu_backward_path`` says so: eager CPU calls without
soft-capping or sinks.
"""

from __future__ import annotations

import torch

from . import backend as cpu


def _pattern(window: int | None, sink_tokens: int | None, kv_len: int) -> dict[str, int]:
    """The binding's window / sink_tokens keyword arguments, capped at N keys (the kernel's own rule:
    a window of N or more keys, or sink_tokens + window >= N, is plain causal attention; sink tokens
    without a window are refused there)."""
    cap = max(1, kv_len)
    pattern = {}
    if window is not None:
        pattern["window"] = min(int(window), cap)
    if sink_tokens is not None:
        pattern["sink_tokens"] = min(int(sink_tokens), cap)
    return pattern


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    window: int | None = None,
    sink_tokens: int | None = None,
    block_m: int = 0,
    isa: str | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of attention at (q, k, v) for the output gradient ``grad_out``.

    grad_out, q: [B, Hq, M, D]; k, v: [B, Hkv, N, D]; one float dtype, any strides, M <= N (the queries
    are the last M positions when causal); key_padding_mask: bool [B, N] (True = valid key) or None;
    skip_heads: bool [B, Hq] (True = skipped) or None; window: int >= 1 (needs causal: row i at position
    p = N - M + i sees keys p - window < j <= p) or None; sink_tokens: int >= 1 (needs a window: the row
    also sees keys j < sink_tokens) or None. Returns contiguous gradients in the inputs' dtype:
    dq [B, Hq, M, D] (0 for skipped heads and rows without a valid key), dk, dv [B, Hkv, N, D].
    ``out`` = (dq, dk, dv) to write into (any strides; tests pre-fill them to prove every element is
    written); ``block_m``: query rows per block (0: sized for the cache); ``isa``: the build to run (see
    ``cpu.selected_isa``). Raises ValueError (from the binding, naming the argument) for inconsistent
    tensors, RuntimeError when the extension is not built.
    """
    lib = cpu._library()
    if lib is None:
        raise RuntimeError("retmask._C is not built; see the warning above")
    codes = lib.codes
    if out is None:
        out = (
            torch.empty(q.shape, dtype=q.dtype),
            torch.empty(k.shape, dtype=k.dtype),
            torch.empty(v.shape, dtype=v.dtype),
        )
    dq, dk, dv = out
    kpm = key_padding_mask.contiguous() if key_padding_mask is not None else None
    skip = skip_heads.contiguous() if skip_heads is not None else None
    arg = cpu.tensor_arg
    lib.module.attention_bwd(
        arg("grad_out", grad_out, codes), arg("q", q, codes), arg("k", k, codes), arg("v", v, codes),
        arg("dq", dq, codes), arg("dk", dk, codes), arg("dv", dv, codes),
        arg("key_padding_mask", kpm, codes) if kpm is not None else None,
        arg("skip_heads", skip, codes) if skip is not None else None,
        bool(causal), float(sm_scale), int(block_m), torch.get_num_threads(), cpu.selected_isa(isa),
        **_pattern(window, sink_tokens, k.shape[2]),
    )  # fmt: skip
    return dq, dk, dv
