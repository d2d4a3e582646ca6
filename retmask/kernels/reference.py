"""Plain-torch attention with argmax: the test oracle.

It materialises the full ``[B, Hq, M, N]`` logit matrix, so it is only for tests and small inputs.
Computation happens in float64 for float64 inputs and in float32 otherwise; the result is cast back.
It is differentiable (autograd through plain torch ops).
"""

from __future__ import annotations

import torch


def allowed_keys(
    q_len: int, kv_len: int, causal: bool, key_padding_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """Which keys each query row may attend to: ``bool [B or 1, 1, M, N]``.

    Query row ``i`` sits at absolute position ``N - M + i``; causal rows see keys ``j <= N - M + i``.
    """
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
    cols = torch.arange(kv_len, device=device).unsqueeze(0)
    allowed = cols <= rows if causal else torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]
    return allowed


def reference_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled logits ``float [B, Hq, M, N]`` with disallowed keys at -inf (compute dtype: fp64 for fp64
    inputs, else fp32)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    scale = D**-0.5 if sm_scale is None else sm_scale
    k_rep = k.to(compute).repeat_interleave(Hq // Hkv, dim=1)
    logits = torch.matmul(q.to(compute), k_rep.transpose(-1, -2)) * scale
    allowed = allowed_keys(M, N, causal, key_padding_mask, q.device)
    return logits.masked_fill(~allowed, float("-inf"))


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    skip_heads: torch.Tensor | None = None,
    argmax_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Materialised attention.

    q: [B, Hq, M, D]; k, v: [B, Hkv, N, D]; key_padding_mask: bool [B, N] (True = valid);
    skip_heads: bool [B, Hq] (True = disabled); argmax_rows: last rows that get an argmax (0 = none).
    Returns out [B, Hq, M, D] (q.dtype) and argmax int64 [B, Hq, argmax_rows] or None.
    Rows without any valid key give output 0 and argmax -1; skipped heads give 0 and -1.
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    Hq, Hkv = q.shape[1], k.shape[1]
    logits = reference_logits(q, k, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask)
    has_key = torch.isfinite(logits).any(dim=-1, keepdim=True)  # [B, Hq, M, 1]
    # Rows with no valid key: softmax over all -inf is NaN; replace by zeros (and keep grads finite).
    safe_logits = torch.where(has_key, logits, torch.zeros_like(logits))
    probs = torch.softmax(safe_logits, dim=-1) * has_key
    v_rep = v.to(compute).repeat_interleave(Hq // Hkv, dim=1)
    out = torch.matmul(probs, v_rep)
    if skip_heads is not None:
        out = out * (~skip_heads)[:, :, None, None].to(compute)
    argmax = None
    if argmax_rows:
        tail = logits[:, :, -argmax_rows:]
        argmax = torch.argmax(tail, dim=-1)  # ties -> first (smallest) index, like the kernels
        invalid = ~has_key[:, :, -argmax_rows:, 0]
        if skip_heads is not None:
            invalid = invalid | skip_heads[:, :, None]
        argmax = argmax.masked_fill(invalid, -1)
    return out.to(q.dtype), argmax
