"""Decode forward (M == 1): the keys are split across programs, then the partial results are merged.

Why. With one query row per (batch, head) the prefill grid has only B * Hq programs, far fewer than a
GPU can run at once, and each would stream all N keys alone. Splitting the keys into S contiguous
ranges gives B * Hq * S programs that read K/V in parallel (the split-K / "flash-decoding" scheme).

Math. Program (split s, pair) runs the online softmax of ``triton_fwd`` over its key range only and
writes a partial state: ``m_s`` (largest base-2 logit in the range, -inf if the range has no valid
key), ``i_s`` (its smallest key index), ``l_s = sum 2^(s_j - m_s)`` and ``a_s = sum 2^(s_j - m_s) v_j``.
With ``m = max_s m_s`` the exact result is ``o = sum_s 2^(m_s - m) a_s / sum_s 2^(m_s - m) l_s`` and
``lse = (m + log2 sum_s 2^(m_s - m) l_s) * ln 2``. The global argmax is the index of a split whose
``m_s == m``; taking the smallest such ``i_s`` keeps the smallest index among tied maxima (splits are
ordered ranges, and each ``i_s`` is already the smallest within its range). Splits without a valid key
(``m_s = -inf``) get weight 0; if every split is empty the row is empty: out 0, argmax -1, lse +inf.

With one query row a tensor-core ``tl.dot`` does not apply (its operands need >= 16 rows): logits are an
elementwise product reduced over D, and the value update a broadcast product reduced over keys, in fp32.
Causality is trivially satisfied (the single row sits at position N - 1 and sees every key); padding
still applies. Only enabled (batch, head) pairs are launched, as in the prefill kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import (
    active_pairs,
    block_d,
    decode_config,
    device_guard,
    fill_skipped,
    interpreting,
    new_float,
    new_index,
    num_sms,
)


@triton.jit
def _decode_partial_kernel(
    Q, K, V, PadMask, Pairs, PartM, PartIdx, PartL, PartAcc,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    H_Q, GROUP, N, keys_per_split, num_splits, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_PAD: tl.constexpr, HAS_PAIRS: tl.constexpr,
):  # fmt: skip
    """Program (split, slot): partial (m, idx, l, acc) of keys [split * kps, (split + 1) * kps)."""
    split = tl.program_id(0)
    slot = tl.program_id(1)
    if HAS_PAIRS:
        pair = tl.load(Pairs + slot).to(tl.int64)
    else:
        pair = slot.to(tl.int64)
    b = pair // H_Q
    h = pair % H_Q
    kvh = h // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d * stride_qd, mask=d_ok, other=0.0).to(tl.float32)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    qk_scale = sm_scale * 1.4426950408889634

    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, N)
    m_i = tl.full([1], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([1], dtype=tl.float32)
    idx_i = tl.full([1], -1, dtype=tl.int32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        n_ok = cols < hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], 1) * qk_scale  # [BLOCK_N]
        valid = n_ok
        if HAS_PAD:
            valid = valid & (tl.load(PadMask + b * N + cols, mask=n_ok, other=0) != 0)
        s = tl.where(valid, s, float("-inf"))
        blk_max, blk_arg = tl.max(s, 0, return_indices=True)
        idx_i = tl.where(blk_max > m_i, blk_arg + start_n, idx_i)  # strict: earlier index keeps ties
        m_new = tl.maximum(m_i, blk_max)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref)  # [BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new

    part = slot * num_splits + split
    zero = tl.arange(0, 1)
    tl.store(PartM + part + zero, m_i)
    tl.store(PartIdx + part + zero, idx_i)
    tl.store(PartL + part + zero, l_i)
    tl.store(PartAcc + part * BLOCK_D + offs_d, acc)


@triton.jit
def _decode_merge_kernel(
    Pairs, PartM, PartIdx, PartL, PartAcc, Out, Lse, Argmax,
    stride_ob, stride_oh, stride_od,
    H_Q, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
    HAS_PAIRS: tl.constexpr, WRITE_ARGMAX: tl.constexpr, WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """Program (slot): combine the num_splits partial states of one enabled pair (SPLITS = padded)."""
    slot = tl.program_id(0)
    if HAS_PAIRS:
        pair = tl.load(Pairs + slot).to(tl.int64)
    else:
        pair = slot.to(tl.int64)
    b = pair // H_Q
    h = pair % H_Q
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    base = slot * num_splits
    m_s = tl.load(PartM + base + offs_s, mask=s_ok, other=float("-inf"))
    i_s = tl.load(PartIdx + base + offs_s, mask=s_ok, other=2147483647)
    l_s = tl.load(PartL + base + offs_s, mask=s_ok, other=0.0)
    a_s = tl.load(
        PartAcc + (base + offs_s[:, None]) * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0
    )

    m = tl.max(m_s, 0)
    empty = m == float("-inf")
    # Smallest index among the splits that reach the maximum (all of them when the row is empty).
    idx = tl.min(tl.where(m_s == m, i_s, 2147483647), 0)
    idx = tl.where(empty, -1, idx)
    m_ref = tl.where(empty, 0.0, m)
    w = tl.exp2(m_s - m_ref)  # empty splits: exp2(-inf) = 0
    l_tot = tl.sum(l_s * w, 0)
    l_safe = tl.where(empty, 1.0, l_tot)
    out = tl.sum(a_s * w[:, None], 0) / l_safe
    d_ok = offs_d < HEAD_DIM
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d * stride_od, out.to(Out.dtype.element_ty), mask=d_ok
    )
    zero = tl.arange(0, 1)
    if WRITE_LSE:
        lse = tl.where(empty, float("inf"), (m + tl.log2(l_safe)) * 0.6931471805599453)
        tl.store(Lse + pair + zero, tl.zeros([1], dtype=tl.float32) + lse)
    if WRITE_ARGMAX:
        tl.store(Argmax + pair + zero, tl.zeros([1], dtype=tl.int64) + idx.to(tl.int64))


def default_num_splits(n_active: int, kv_len: int, block_n: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about twice, each with at least 4 key blocks to amortise its
    partial write (tune on GPU); at most 4 splits in the interpreter, where programs run serially."""
    max_splits = max(1, triton.cdiv(kv_len, 4 * block_n))
    if interpreting():
        return min(4, triton.cdiv(kv_len, block_n))
    want = triton.cdiv(2 * num_sms(device), max(1, n_active))
    return max(1, min(want, max_splits))


def decode_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    sm_scale: float,
    argmax_rows: int,
    return_lse: bool,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the split-key decode forward.

    q: [B, Hq, 1, D] (any strides); k, v: [B, Hkv, N, D] (any strides); key_padding_mask: bool [B, N]
    contiguous or None; skip_heads: bool [B, Hq] contiguous or None; argmax_rows: 0 or 1.
    num_splits / block_n override the heuristics (tests). ``causal`` has no effect (accepted so every
    launcher takes the same arguments): the single row sits at position N - 1 and sees every key.
    Returns out [B, Hq, 1, D] (q.dtype), argmax int64 [B, Hq, 1] or None, lse fp32 [B, Hq, 1] or None.
    """
    B, Hq, M, D = q.shape
    if M != 1:
        raise ValueError(f"decode_forward needs exactly one query row, got q of shape {list(q.shape)}")
    Hkv, N = k.shape[1], k.shape[2]
    cfg = decode_config(D, q.dtype)
    bn = block_n or cfg.block_n
    device = q.device
    out = new_float((B, Hq, 1, D), q.dtype, device)
    argmax = new_index((B, Hq, 1), device) if argmax_rows else None
    lse = new_float((B, Hq, 1), torch.float32, device) if return_lse else None
    pairs, n_active = active_pairs(skip_heads, B, Hq)
    fill_skipped(skip_heads, out, argmax, lse)
    if n_active == 0:
        return out, argmax, lse

    splits = num_splits or default_num_splits(n_active, N, bn, device)
    splits = max(1, min(splits, triton.cdiv(N, bn)))
    keys_per_split = triton.cdiv(triton.cdiv(N, splits), bn) * bn  # whole key blocks per split
    splits = triton.cdiv(N, keys_per_split)  # drop splits that rounding left empty
    bd = block_d(D)
    # Partial states: written for every (slot, split) by the partial kernel, so plain empty buffers.
    part_m = torch.empty(n_active * splits, dtype=torch.float32, device=device)
    part_idx = torch.empty(n_active * splits, dtype=torch.int32, device=device)
    part_l = torch.empty(n_active * splits, dtype=torch.float32, device=device)
    part_acc = torch.empty(n_active * splits * bd, dtype=torch.float32, device=device)
    dummy = out
    pairs_arg = pairs if pairs is not None else dummy
    q2 = q[:, :, 0]  # [B, Hq, D] view
    with device_guard(q):
        _decode_partial_kernel[(splits, n_active)](
            q2, k, v, key_padding_mask if key_padding_mask is not None else dummy, pairs_arg,
            part_m, part_idx, part_l, part_acc,
            *q2.stride(), *k.stride(), *v.stride(),
            Hq, Hq // Hkv, N, keys_per_split, splits, float(sm_scale),
            HEAD_DIM=D, BLOCK_N=bn, BLOCK_D=bd,
            HAS_PAD=key_padding_mask is not None, HAS_PAIRS=pairs is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        o2 = out[:, :, 0]
        _decode_merge_kernel[(n_active,)](
            pairs_arg, part_m, part_idx, part_l, part_acc, o2,
            lse if lse is not None else dummy, argmax if argmax is not None else dummy,
            *o2.stride(), Hq, splits,
            HEAD_DIM=D, BLOCK_D=bd, SPLITS=max(2, triton.next_power_of_2(splits)),
            HAS_PAIRS=pairs is not None, WRITE_ARGMAX=argmax is not None, WRITE_LSE=lse is not None,
            num_warps=4,
        )  # fmt: skip
    return out, argmax, lse


__all__ = ["decode_forward", "default_num_splits"]
