"""Split-key forward for calls with few query rows: keys split across programs, one program per KV head,
split and row block, then a merge. Any M works; ``paths.triton_forward_kernel`` decides which calls
come here (decode; verification passes of 2-64 rows once a GPU has timed them).

Why. With few query rows per (batch, head) the prefill grid has only B * Hq programs, far fewer than a
GPU can run at once; each holds a BLOCK_M-row tile that is mostly padding and streams all N keys alone.
Splitting the keys into S contiguous ranges gives S times more programs that read K/V in parallel (the
split-K / "flash-decoding" scheme). Such a call is memory-bound (about M * G FLOPs per byte for small M),
so the program also takes all G = Hq / Hkv query heads that share one KV head (GQA): the tile's rows are
the M * G pairs (query row, head), row r being query row r // G of head r % G of the group, padded to a
power of two >= 16 and cut into row blocks of at most ``block_m`` rows. Each K/V element is then read from
HBM once per split and row block instead of once per query head, and the logits are a tensor-core
``tl.dot`` (the padding rows cost compute, which these calls have to spare).

Math. Program (split s, KV pair, row block) runs the online softmax of ``triton.fwd`` (the same
``_key_loops``) over its key range and writes, for every row, a partial state: ``m_s`` (largest base-2
logit in the range, -inf if the range has no valid key), ``i_s`` (its smallest key index), ``l_s = sum 2^(s_j - m_s)``
and ``a_s = sum 2^(s_j - m_s) v_j``. With ``m = max_s m_s`` the exact result is
``o = sum_s 2^(m_s - m) a_s / sum_s 2^(m_s - m) l_s`` and ``lse = (m + log2 sum_s 2^(m_s - m) l_s) ln 2``.
The global argmax is the index of a split whose ``m_s == m``; taking the smallest such ``i_s`` keeps
the smallest index among tied maxima (splits are ordered ranges, and each ``i_s`` is already the
smallest within its range). Splits without a valid key (``m_s = -inf``) get weight 0; if every split is
empty the row is empty: out 0, argmax -1, lse +inf.

Query row i sits at position N - M + i and, causally, sees keys j <= N - M + i (one row, M == 1, sees
every key: the causal mask is compiled out); padding applies to all. Within a split the key loop is
the prefill's (``_key_loops``): blocks that every row of the tile sees in full run unmasked, the causal
diagonal (past the tile's first row's position) masked, and nothing past its last row's position is
read. A sliding window limits row p to keys p - window < j <= p: only the blocks from the one holding the
first row's first key are split over the programs; blocks below the last row's first key straddle some
row's window edge and get the mask. Sink tokens (``sink_tokens`` S, with a window: every row also sees
keys ``j < S``) below that first block are visited by split 0 alone, in a key loop of its own before its
window keys; the merge's smallest-index rule keeps the argmax independent of which split holds them.
Soft-capping is applied per logit as in the prefill (``_fwd_block``); a sink joins the merge's
denominator (``m_ref = max(m, sink)``, ``l += 2^(sink - m_ref)``). A split that met a NaN / +inf logit has
a NaN ``l_s``, which survives the merge's weighting (NaN * 0 = NaN): the row becomes NaN with argmax -1.

Head skipping: only KV heads with at least one enabled query head do work. The grid is always the
sync-free one (``triton.common.sync_free``), with no host sync: a fully disabled group's programs get no
keys, never read its K/V and only write their fixed partial states; disabled heads inside a working group
ride along in the tile for free, and the merge (one program per KV head and tile row) stores
0 / -1 / +inf for every row of a disabled head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    TileConfig,
    active_pairs,
    block_d,
    cdiv,
    decode_config,
    device_guard,
    dot_precision,
    effective_pattern,
    first_valid_keys,
    interpreting,
    launch_fitting,
    new_float,
    new_index,
    next_power_of_2,
    num_sms,
    with_blocks,
)
from .fwd import _key_loops, _logit_scales
from .launch import launch_kernel


@triton.jit
def _decode_partial_kernel(
    Q, K, V, PadMask, KeyStart, KvPairs, KvDisabled, PartM, PartIdx, PartL, PartAcc,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    H_KV, GROUP, M, N, key_lo, keys_per_split, num_splits, num_row_blocks, sm_scale, window, softcap,
    sink_tokens,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, HAS_PAIRS: tl.constexpr, FLAGGED: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, SINK: tl.constexpr,
):  # fmt: skip
    """Program (split, KV slot, row block): partial (m, idx, l, acc) of BLOCK_G rows of the group's
    M * GROUP (query row, head) pairs over keys [key_lo + split * kps, min(key_lo + (split + 1) * kps, N));
    key_lo and kps are multiples of BLOCK_N (key_lo: the block holding the first row's first window key,
    else 0). SINK: split 0 also takes the sink tokens below key_lo."""
    split = tl.program_id(0)
    slot = tl.program_id(1)
    row_block = tl.program_id(2)
    if HAS_PAIRS:
        kv_pair = tl.load(KvPairs + slot)
    else:
        kv_pair = slot
    b = (kv_pair // H_KV).to(tl.int64)  # 32-bit division (B * Hkv < 2^31), 64-bit offsets
    kvh = (kv_pair % H_KV).to(tl.int64)
    # Tile row r is the pair (query row r // GROUP, head r % GROUP of the group): the group's heads of
    # one query row are neighbours, so a tile reads each K/V block once for all of them.
    offs_r = row_block * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_r // GROUP
    heads = kvh * GROUP + offs_r % GROUP
    q_mask = (offs_r < M * GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=q_mask, other=0.0,
    )  # fmt: skip
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    pad_base = PadMask + b * N
    pos = rows + (N - M)  # each row's absolute position (padding rows past M: masked at the store)
    first_pos = row_block * BLOCK_G // GROUP + (N - M)
    last_pos = tl.minimum((row_block * BLOCK_G + BLOCK_G - 1) // GROUP, M - 1) + (N - M)
    qk_scale, cap2 = _logit_scales(sm_scale, softcap, SOFTCAP)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    idx_i = tl.full([BLOCK_G], -1, dtype=tl.int32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    lo = key_lo + split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, N)
    if CAUSAL:  # no row of the tile sees keys past its last row's position
        hi = tl.minimum(hi, last_pos + 1)
    sink_lo = 0
    if HAS_PAD:  # blocks before the first valid key hold only padding (splits there do no work)
        sink_lo = (tl.load(KeyStart + b) // BLOCK_N) * BLOCK_N
        lo = tl.maximum(lo, sink_lo)
    sink_hi = 0
    if SINK:  # split 0: the sink tokens' blocks below the window's first block
        sink_hi = tl.where(split == 0, tl.minimum(sink_tokens, key_lo), 0)
    if FLAGGED:  # sync-free grid: a fully disabled group's programs get no keys
        group_on = tl.load(KvDisabled + kv_pair) == 0
        hi = tl.where(group_on, hi, lo)
        if SINK:
            sink_hi = tl.where(group_on, sink_hi, 0)
    mid_lo = lo
    if WINDOW:
        # Blocks from the one holding the last row's first key (last_pos - window + 1) on are inside
        # every row's window; the blocks below straddle some row's lower edge and get the mask.
        mid_lo = tl.maximum(lo, tl.cdiv(last_pos + 1 - window, BLOCK_N) * BLOCK_N)
    # Whole blocks that every row sees (in range, and causal: up to the first row's position) need no mask.
    full_hi = (hi // BLOCK_N) * BLOCK_N
    if CAUSAL:
        full_hi = tl.minimum(full_hi, (first_pos + 1) // BLOCK_N * BLOCK_N)
    full_hi = tl.maximum(mid_lo, full_hi)
    # The prefill's key loops, argmax always tracked.
    acc, l_i, m_i, idx_i = _key_loops(
        acc, l_i, m_i, idx_i, q, k_base, v_base, pad_base, sink_lo, sink_hi, lo, mid_lo, full_hi, hi,
        pos, N, qk_scale, cap2, window, sink_tokens, stride_kn, stride_kd, stride_vn, stride_vd,
        HEAD_DIM, BLOCK_N, BLOCK_D, CAUSAL, HAS_PAD, True, WINDOW, SOFTCAP, DOT_PRECISION, SINK,
    )  # fmt: skip

    # [BLOCK_G] partial-state rows of this (slot, row block, split)
    part = ((slot * num_row_blocks + row_block) * num_splits + split) * BLOCK_G + tl.arange(0, BLOCK_G)
    tl.store(PartM + part, m_i)
    tl.store(PartIdx + part, idx_i)
    tl.store(PartL + part, l_i)
    tl.store(PartAcc + part[:, None] * BLOCK_D + offs_d[None, :], acc)


@triton.jit
def _decode_merge_kernel(
    KvPairs, Skip, Sinks, PartM, PartIdx, PartL, PartAcc, Out, Lse, Argmax,
    stride_ob, stride_oh, stride_om, stride_od,
    H_Q, H_KV, GROUP, M, argmax_rows, num_splits, num_row_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
    HAS_PAIRS: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_SINKS: tl.constexpr, WRITE_ARGMAX: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """Program (KV slot, r): combine the num_splits partial states of the group's tile row r, i.e. query
    row r // GROUP of head kvh * GROUP + r % GROUP (SPLITS = num_splits padded to a power of two). A
    disabled head stores 0 / -1 / +inf; the argmax is stored for the last ``argmax_rows`` query rows."""
    slot = tl.program_id(0)
    r = tl.program_id(1)
    if HAS_PAIRS:
        kv_pair = tl.load(KvPairs + slot)
    else:
        kv_pair = slot
    b = (kv_pair // H_KV).to(tl.int64)  # 32-bit division (B * Hkv < 2^31), 64-bit offsets
    h = (kv_pair % H_KV).to(tl.int64) * GROUP + r % GROUP
    row = r // GROUP
    pair = b * H_Q + h
    enabled = tl.full([1], 1, dtype=tl.int1)
    if HAS_SKIP:
        enabled = tl.load(Skip + pair + tl.arange(0, 1)) == 0
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    part = ((slot * num_row_blocks + r // BLOCK_G) * num_splits + offs_s) * BLOCK_G + r % BLOCK_G
    m_s = tl.load(PartM + part, mask=s_ok, other=float("-inf"))
    i_s = tl.load(PartIdx + part, mask=s_ok, other=2147483647)
    l_s = tl.load(PartL + part, mask=s_ok, other=0.0)
    a_s = tl.load(PartAcc + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)

    m = tl.max(m_s, 0)
    empty = m == float("-inf")
    # Smallest index among the splits that reach the maximum (all of them when the row is empty).
    idx = tl.min(tl.where(m_s == m, i_s, 2147483647), 0)
    if HAS_SINKS:
        # The sink joins the denominator only; max(m, sink) keeps every exponent <= 0 (empty row: sink).
        sink2 = tl.load(Sinks + h) * 1.4426950408889634
        m_ref = tl.maximum(m, sink2)
    else:
        m_ref = tl.where(empty, 0.0, m)
    w = tl.exp2(m_s - m_ref)  # empty splits: exp2(-inf) = 0
    l_tot = tl.sum(l_s * w, 0)
    if HAS_SINKS:
        l_tot += tl.exp2(sink2 - m_ref)
    # A split that met a NaN / +inf logit has l_s = NaN (see fwd.py); NaN survives the weighting
    # (NaN * 0 = NaN), so the row is poisoned: NaN out, argmax -1.
    poisoned = l_tot != l_tot
    idx = tl.where(empty | poisoned, -1, idx)
    l_safe = tl.where(empty, 1.0, l_tot)
    out = tl.sum(a_s * w[:, None], 0) / l_safe
    out = tl.where(poisoned, float("nan"), out)
    d_ok = offs_d < HEAD_DIM
    o_ptrs = Out + b * stride_ob + h * stride_oh + row * stride_om + offs_d * stride_od
    out = tl.where(enabled, out, 0.0)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=d_ok)
    zero = tl.arange(0, 1)
    if WRITE_LSE:
        lse = tl.where(empty, float("inf"), (m_ref + tl.log2(l_safe)) * 0.6931471805599453)
        lse = tl.where(poisoned, float("nan"), lse)
        tl.store(Lse + pair * M + row + zero, tl.where(enabled, lse, float("inf")))
    if WRITE_ARGMAX:
        t = row - (M - argmax_rows) + zero  # argmax slot of this query row (stored where t >= 0)
        tl.store(Argmax + pair * argmax_rows + t, tl.where(enabled, idx.to(tl.int64), -1), mask=t >= 0)


def default_num_splits(n_programs: int, kv_len: int, block_n: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about twice, each with at least 4 key blocks to amortise its
    partial write (tune on GPU); at most 4 splits in the interpreter, where programs run serially.
    n_programs: programs per split (enabled KV heads over the batch)."""
    max_splits = max(1, cdiv(kv_len, 4 * block_n))
    if interpreting():
        return min(4, cdiv(kv_len, block_n))
    want = cdiv(2 * num_sms(device), max(1, n_programs))
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
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    block_rows: int | None = None,
    sink_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the split-key forward (decode and other calls with few query rows).

    q: [B, Hq, M, D] (any strides); k, v: [B, Hkv, N, D] (any strides), M <= N; key_padding_mask: bool
    [B, N] contiguous or None; skip_heads: bool [B, Hq] (any strides) or None; argmax_rows: T in [0, M];
    window: sliding window (causal only) or None (only the keys from the first row's first window key on
    are distributed over the splits); sink_tokens: with a window, the first keys every row also sees
    (split 0 takes them), or None; softcap: logit cap or None; sinks: fp32 [Hq] contiguous or None.
    num_splits / block_n / block_rows (tile rows, a power of two >= 16) override the heuristics (tests).
    Returns out [B, Hq, M, D] (q.dtype), argmax int64 [B, Hq, T] or None, lse fp32 [B, Hq, M] or None.
    """
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    group = Hq // Hkv
    cfg = with_blocks(decode_config(D, q.dtype), block_rows, block_n)
    device = q.device
    out = new_float((B, Hq, M, D), q.dtype, device)
    argmax = new_index((B, Hq, argmax_rows), device) if argmax_rows else None
    lse = new_float((B, Hq, M), torch.float32, device) if return_lse else None
    if skip_heads is not None:
        skip_heads = skip_heads.contiguous()  # the merge reads it flat (a no-op for attention()'s calls)
    kv_skip = None if skip_heads is None else skip_heads.view(B, Hkv, group).all(-1)
    # Always the sync-free grid: a decode call is a few programs whose GPU time is microseconds, so the
    # exact grid's device->host sync (and its pair list and fill ops) would cost far more than the
    # disabled programs it saves, which only write their fixed outputs.
    plist = active_pairs(kv_skip, B, Hkv, always_sync_free=True)  # one program per KV head, never host_fill
    n_kv = plist.grid

    window, sink_tokens = effective_pattern(window, sink_tokens, N)
    # One row sees every key: the causal mask is compiled out.
    causal = causal and M > 1
    bd = block_d(D)
    tile_rows = M * group  # (query row, head) pairs per KV head
    key_start = first_valid_keys(key_padding_mask)
    dummy = out
    pairs_arg = plist.pairs if plist.pairs is not None else dummy
    disabled_arg = plist.disabled if plist.disabled is not None else dummy

    def launch(cfg: TileConfig) -> None:
        bn = cfg.block_n
        bg = min(cfg.block_m, max(16, next_power_of_2(tile_rows)))  # tile rows (>= 16 for tl.dot)
        row_blocks = cdiv(tile_rows, bg)
        # The first row sees keys from N - M + 1 - window on: the splits share the blocks from the one
        # holding that key.
        key_lo = max(0, N - M + 1 - window) // bn * bn if window is not None else 0
        span = N - key_lo
        splits = num_splits or default_num_splits(n_kv * row_blocks, span, bn, device)
        splits = max(1, min(splits, cdiv(span, bn)))
        keys_per_split = max(bn, cdiv(cdiv(span, splits), bn) * bn)  # whole key blocks per split
        splits = max(1, cdiv(span, keys_per_split))  # drop splits that rounding left empty
        # Partial states: every (slot, row block, split, row) is written by the partial kernel, so plain
        # empty memory, in one allocation (each one costs host time on a GPU): m, l, the argmax (int32,
        # the same 4 bytes) and acc; rows is a multiple of 16, so every part stays 16-byte aligned.
        rows = n_kv * row_blocks * splits * bg
        part = torch.empty(rows * (3 + bd), dtype=torch.float32, device=device)
        part_m, part_l, part_idx, part_acc = part.split_with_sizes([rows, rows, rows, rows * bd])
        part_idx = part_idx.view(torch.int32)
        with device_guard(q):
            launch_kernel(
                _decode_partial_kernel, (splits, n_kv, row_blocks),
                q, k, v, key_padding_mask if key_padding_mask is not None else dummy,
                key_start if key_start is not None else dummy, pairs_arg, disabled_arg,
                part_m, part_idx, part_l, part_acc,
                *q.stride(), *k.stride(), *v.stride(),
                Hkv, group, M, N, key_lo, keys_per_split, splits, row_blocks, float(sm_scale), window or 0,
                float(softcap or 1.0), sink_tokens or 0,
                HEAD_DIM=D, BLOCK_G=bg, BLOCK_N=bn, BLOCK_D=bd, CAUSAL=causal,
                HAS_PAD=key_padding_mask is not None, HAS_PAIRS=plist.pairs is not None,
                FLAGGED=plist.disabled is not None, WINDOW=window is not None, SOFTCAP=softcap is not None,
                DOT_PRECISION=dot_precision(q.dtype), SINK=sink_tokens is not None,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip
            launch_kernel(
                _decode_merge_kernel, (n_kv, tile_rows),
                pairs_arg, skip_heads if skip_heads is not None else dummy,
                sinks if sinks is not None else dummy,
                part_m, part_idx, part_l, part_acc, out,
                lse if lse is not None else dummy, argmax if argmax is not None else dummy,
                *out.stride(), Hq, Hkv, group, M, argmax_rows, splits, row_blocks,
                HEAD_DIM=D, BLOCK_G=bg, BLOCK_D=bd, SPLITS=max(2, next_power_of_2(splits)),
                HAS_PAIRS=plist.pairs is not None, HAS_SKIP=skip_heads is not None,
                HAS_SINKS=sinks is not None, WRITE_ARGMAX=argmax is not None, WRITE_LSE=lse is not None,
                num_warps=4,
            )  # fmt: skip

    key = ("decode", D, q.dtype, device, window is not None, softcap is not None, sink_tokens is not None)
    launch_fitting(key, cfg, launch)
    return out, argmax, lse


__all__ = ["decode_forward", "default_num_splits"]
