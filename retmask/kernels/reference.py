"""Plain-torch attention with argmax: the test oracle.

It materialises the full ``[B, Hq, M, N]`` logit matrix, so it is only for tests and small inputs.
Computation happens in float64 for float64 inputs and in float32 otherwise; the result is cast back.
It is differentiable (autograd through plain torch ops), also with respect to ``sinks``.

The contract every backend follows (and this file defines):

* Row ``i`` of ``q`` sits at absolute position ``p = N - M + i``. It may attend to key ``j`` when the key
  is valid in ``key_padding_mask``, ``j <= p`` (causal) and ``j > p - window`` (sliding window, the
  semantics of transformers' ``sliding_window``) or, with ``sink_tokens`` S, ``j < S``: "first S + last
  window" keys, StreamingLLM's attention sinks (kept keys; not the ``sinks`` logits below).
* Logits are ``s_j = sm_scale * q . k_j``, then ``softcap * tanh(s_j / softcap)`` when ``softcap`` is set.
* ``sinks`` ([Hq], one logit per query head) joins the softmax denominator only:
  ``out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink})``; it has no value and is never an argmax.
* ``argmax`` is the smallest index among the maximal (capped) logits of the allowed keys.
* A row with no allowed key (all padding, or a window that misses every valid key) gives output 0 and
  argmax -1; so does a skipped head. Logits of ``-inf`` count as disallowed keys.
* Non-finite inputs: a row with a NaN or ``+inf`` logit among its allowed keys (a NaN / inf in its query
  or in a key it sees) gives output NaN and argmax -1. A NaN / inf in ``v`` makes the output of the rows
  that see that key NaN (other rows may be NaN too: a zero weight times NaN is NaN, as in eager
  attention) and leaves the argmax alone.
* Gradients of non-finite inputs (this file's autograd, the C++ CPU backward, the chunked and SDPA
  recomputes, Triton; ``tests/kernels/test_extremes.py``). A *group* is one batch row's KV head with its
  query heads: its dq, dk, dv are computed from its own inputs only.

  - Isolation: a group without a non-finite input (a skipped head's query aside) gets dk, dv exactly as
    if no input anywhere were non-finite, bit for bit; so does dq of a row whose query is finite in a
    group whose k and v are finite (a query reaches no other row's dq).
  - Poisoning: a row whose output is NaN by the rules above has dq NaN in every element, and so has dk
    of every key it sees; when a logit caused it (a non-finite query or key), dv of those keys too.
  - Fixed rows: a skipped head gets dq = 0 and its query reaches no gradient; a row without an allowed
    key gets dq = 0 while its group's k and v are finite (its own query may be NaN).
  - Everything else in a group holding a non-finite input is unspecified: NaN on one backend, finite on
    another, where blocking decides whether a zero weight meets a NaN (0 * NaN = NaN). E.g. a NaN key
    that no row may see changes no output, but can make its group's dq NaN. ``dsinks`` sums over the
    batch: isolation does not cover it.

``sm_scale`` and ``softcap`` are bounded (``validation.SM_SCALE_RANGE`` / ``SOFTCAP_RANGE``), so that
only inputs, never parameters, overflow the float32 logits.
"""

from __future__ import annotations

import torch


def allowed_keys(
    q_len: int,
    kv_len: int,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    device: torch.device,
    window: int | None = None,
    sink_tokens: int | None = None,
) -> torch.Tensor:
    """Which keys each query row may attend to: ``bool [B or 1, 1, M, N]``.

    Query row ``i`` sits at absolute position ``p = N - M + i``; causal rows see keys ``j <= p``; with a
    sliding ``window`` only keys ``j > p - window`` as well, or with ``sink_tokens`` S also ``j < S``.
    """
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
    cols = torch.arange(kv_len, device=device).unsqueeze(0)
    allowed = cols <= rows if causal else torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if window is not None:
        in_window = cols > rows - window
        if sink_tokens is not None:
            in_window = in_window | (cols < sink_tokens)
        allowed = allowed & in_window
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
    window: int | None = None,
    softcap: float | None = None,
    skip_heads: torch.Tensor | None = None,
    sink_tokens: int | None = None,
) -> torch.Tensor:
    """Scaled (and soft-capped) logits ``float [B, Hq, M, N]`` with disallowed keys at -inf (compute dtype:
    fp64 for fp64 inputs, else fp32). ``skip_heads`` (bool [B, Hq], True = skipped): every key of a skipped
    head is disallowed, and its q and (repeated) k are zeroed first, so that neither a NaN in them nor
    the zero gradient that masking hands back (0 * NaN = NaN in the matmul's backward) reaches any
    gradient: skipped heads contribute exactly nothing, as in the kernels, which never load them."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    scale = D**-0.5 if sm_scale is None else sm_scale
    q_c = q.to(compute)
    k_rep = k.to(compute).repeat_interleave(Hq // Hkv, dim=1)
    allowed = allowed_keys(M, N, causal, key_padding_mask, q.device, window, sink_tokens)
    if skip_heads is not None:
        skipped = skip_heads[:, :, None, None]
        q_c = q_c.masked_fill(skipped, 0.0)
        k_rep = k_rep.masked_fill(skipped, 0.0)
        allowed = allowed & ~skipped
    logits = torch.matmul(q_c, k_rep.transpose(-1, -2)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
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
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    sink_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Materialised attention.

    q: [B, Hq, M, D]; k, v: [B, Hkv, N, D]; key_padding_mask: bool [B, N] (True = valid);
    skip_heads: bool [B, Hq] (True = disabled); argmax_rows: last rows that get an argmax (0 = none);
    window: sliding-window size or None; softcap: logit cap or None; sinks: float [Hq] or None;
    sink_tokens: with a window, the first keys every row also sees (kept keys), or None.
    Returns out [B, Hq, M, D] (q.dtype) and argmax int64 [B, Hq, argmax_rows] or None.
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    Hq, Hkv = q.shape[1], k.shape[1]
    logits = reference_logits(
        q, k, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask, window=window,
        softcap=softcap, skip_heads=skip_heads, sink_tokens=sink_tokens,
    )  # fmt: skip
    neg_inf = float("-inf")
    has_key = (logits != neg_inf).any(dim=-1, keepdim=True)  # [B, Hq, M, 1]; NaN counts as a key
    poisoned = (torch.isnan(logits) | (logits == float("inf"))).any(dim=-1, keepdim=True)
    # Rows with no valid key: softmax over all -inf is NaN; replace by zeros (and keep grads finite).
    safe_logits = torch.where(has_key, logits, torch.zeros_like(logits))
    if sinks is not None:
        sink = sinks.to(compute)[None, :, None, None].expand(*logits.shape[:3], 1)
        probs = torch.softmax(torch.cat([safe_logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(safe_logits, dim=-1)
    probs = probs * has_key
    v_rep = v.to(compute).repeat_interleave(Hq // Hkv, dim=1)
    if skip_heads is not None:  # zero weights times a NaN value would still be NaN (see reference_logits)
        v_rep = v_rep.masked_fill(skip_heads[:, :, None, None], 0.0)
    out = torch.matmul(probs, v_rep)
    argmax = None
    if argmax_rows:
        tail = logits[:, :, -argmax_rows:]
        argmax = torch.argmax(tail, dim=-1)  # ties -> first (smallest) index, like the kernels
        invalid = ~has_key[:, :, -argmax_rows:, 0] | poisoned[:, :, -argmax_rows:, 0]
        if skip_heads is not None:
            invalid = invalid | skip_heads[:, :, None]
        argmax = argmax.masked_fill(invalid, -1)
    return out.to(q.dtype), argmax
