"""Fused prefill forward: online softmax that also carries each row's maximal logit and its key index.

Math. For one query row with scaled logits ``s_j`` (base 2: ``s_j = q.k_j * sm_scale * log2(e)``, so
that ``exp2`` replaces ``exp``), attention is ``o = sum_j 2^(s_j) v_j / sum_j 2^(s_j)``. Keys arrive in
blocks of BLOCK_N. Before a block we hold ``m`` (largest logit seen so far), ``l = sum 2^(s_j - m)`` and
``acc = sum 2^(s_j - m) v_j`` over the keys seen. A block with maximum ``b`` moves the reference point
to ``m' = max(m, b)``; the old sums are expressed relative to it by multiplying with
``alpha = 2^(m - m')`` and the block's terms are added with weights ``p_j = 2^(s_j - m')``. After the
last block ``o = acc / l`` and the log-sum-exp (natural log, what the backward needs) is
``(m + log2 l) * ln 2``. Subtracting the running maximum keeps every exponent <= 0: no overflow.

The argmax comes for free: ``m`` already *is* the running maximal logit, so we only add its position.
Inside a block ``tl.max(..., return_indices=True)`` returns the first maximal column; the running
index moves only when the block maximum is *strictly* greater than ``m``. Blocks are visited in
increasing key order, so among tied maxima the smallest key index wins, as with ``torch.argmax``.

Masking. Query row ``i`` sits at absolute position ``N - M + i``; causal rows see keys ``j <= N-M+i``;
``key_padding_mask`` (True = valid) removes keys for a whole batch row. Disallowed logits become -inf.
With a mask the key loop starts at the block of the batch row's first valid key (computed on the host
side by one small torch op): with left padding, leading padding blocks are never loaded, and query
tiles that lie entirely in the padding do no work at all.
The key loop is split in two: blocks below the first row's position (seen by every row of the tile,
never past N) need no causal or bounds mask; the remaining blocks up to the last row's position get
the full mask. A row that has no valid key keeps ``m = -inf, l = 0``: the kernel substitutes 0 for the
reference point so ``-inf - -inf`` never appears, writes ``o = 0``, argmax ``-1`` and ``lse = +inf``
(so ``exp(s - lse) = 0`` in the backward: zero gradients, no NaN).

Sliding window, soft-capping, sinks (the contract of ``reference.py``). With ``window`` row ``p`` sees
keys ``p - window < j <= p``: the key loop starts at the block holding the tile's first row's first key
(``max`` with the padding start), so a local layer costs O(M * (window + BLOCK_M)), not O(M * N). The
loop has three parts: blocks that straddle some row's lower window edge (masked), blocks inside every
row's window and below the first row's position (unmasked), the causal diagonal (masked). ``softcap``
caps the natural-scale logit before anything else sees it: ``s = softcap * tanh(sm_scale q.k / softcap)``,
computed as ``tanh(q.k * (sm_scale / softcap)) * (softcap * log2 e)`` (one exp2, one division and a
5-FMA polynomial per logit; ``_tanh`` is accurate in relative terms, so a huge cap, where every
``s / softcap`` is tiny, keeps every logit's order and the argmax; exact at +-inf, keeps NaN). A ``sink``
logit joins only the denominator, in the epilogue: the reference point moves to ``m' = max(m, sink)``,
``l' = l 2^(m - m') + 2^(sink - m')``, ``acc' = acc 2^(m - m')``; the argmax never sees it; the saved lse
is ``log(sum_j e^{s_j} + e^{sink})``, so the backward's ``P_j = exp(s_j - lse)`` is the probability of
the sink-extended softmax. A row with no valid key still gives 0 / -1 / +inf (the sink is not a key).

Sink tokens (``sink_tokens`` S, with a window; StreamingLLM's kept first keys, unlike the sink *logits*
above): row ``p`` also sees keys ``j < S``. The blocks holding sink tokens below the window's first block
get a key loop of their own before the window's (``_key_loops``, masked: keys ``>= S`` there lie below
every row's window), so the argmax still meets keys in increasing order; window-edge blocks keep a key
``j < S`` whatever the row's window. A tile visits O(BLOCK_M + window + S) keys.

Non-finite logits. ``l`` is a sum of terms in [0, 1], so it is NaN exactly when a NaN or +inf logit
reached the row among its allowed keys (``2^NaN``, or ``2^(inf - inf)`` once the running max is +inf;
every later rescale keeps the NaN) -- whatever ``max`` does with NaN on the GPU or in the interpreter.
The epilogue then writes NaN to the whole row, argmax -1 and lse NaN. -inf logits are masked keys.
In argmax tiles NaN logits are first turned into +inf (same poisoning, and a max-with-index over NaN
has no defined answer).

Head skipping. Default ("exact") grid: the second axis indexes an int32 list of the enabled (batch,
head) pairs built from ``skip_heads`` with ``program_id(1)`` (its length, read on the host, sizes the
grid), so work is proportional to the enabled heads, and the disabled heads' outputs are written with
torch (0 / -1 / +inf). Sync-free grid (while a CUDA graph is captured, or ``triton.common.FORCE_SYNC_FREE`` in tests):
one program per pair in natural order, each reading its pair's flag in ``skip_heads``; a disabled pair's
program runs empty key loops, so its epilogue writes 0 / -1 / +inf, with no host sync and no extra
kernel.

Argmax rows. Only the last T rows need an argmax. One launch covers every tile; a runtime branch sends
the tiles that hold none of them through key loops compiled without the argmax bookkeeping, so teacher
forcing (T ~ 50 of 50K rows) pays almost nothing for it. (Two launches would leave the few long
argmax tiles of the second one running alone after the first.)

K / V loads. A key block is a masked pointer load (any strides), pipelined through shared memory by
the compiler's asynchronous copies. (Loads through tensor descriptors were tried and dropped: see
docs/kernel_optimisation.md.)

Tile order. Program 0 takes the last row block: under a causal mask it has the most keys, and starting
with the longest tiles leaves the short ones to fill the tail of the launch.

Layout: q [B, Hq, M, D] with arbitrary strides; k, v [B, Hkv, N, D] with arbitrary strides (GQA: query
head h reads KV head ``h // (Hq // Hkv)``); D is padded to BLOCK_D (a power of two) with masked loads.
Batch and head offsets are int64; offsets inside one (batch, head) are int32, so ``M * stride_m`` and
``N * stride_n`` must stay below 2^31 (e.g. M < 524K rows for a Llama query view [B, M, 32 * 128]).
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
    device_guard,
    dot_precision,
    effective_pattern,
    fill_skipped,
    first_valid_keys,
    fwd_config,
    launch_fitting,
    new_float,
    new_index,
    with_blocks,
)
from .launch import launch_kernel


@triton.jit
def _tanh(x):
    """tanh in fp32 with a relative error of ~2 ulps everywhere (NaN in -> NaN out, +-inf -> +-1).

    ``|x| >= 0.625``: ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` from one exp2, sign restored; no
    inf / inf. Below, ``1 - e`` cancels: its absolute error of an ulp of 1 is a large relative error of a
    small tanh (at ``|x| = 1e-6``, 2 % -- a soft cap of 1e6 turned logits of ~1 into steps of 0.03 and lost
    their argmax), so there the odd minimax polynomial of Cephes' ``tanhf``
    (``x + x^3 P(x^2)``, 5 FMAs, < 1 ulp on ``|x| < 0.625``) is used instead. Both branches are computed
    (no divergence); a NaN fails the ``< 0.625`` test and takes the exp branch, which keeps it."""
    ax = tl.abs(x)
    e = tl.exp2(ax * -2.8853900817779268)  # exp(-2|x|) = 2^(-2 log2(e) |x|)
    t = tl.fdiv(1.0 - e, 1.0 + e)
    big = tl.where(x < 0, -t, t)
    z = tl.minimum(x * x, 0.390625)  # 0.625^2: the unused branch stays finite for huge |x| (no inf * 0)
    p = -5.70498872745e-3 * z + 2.06390887954e-2
    p = p * z - 5.37397155531e-2
    p = p * z + 1.33314422036e-1
    p = p * z - 3.33332819422e-1
    small = p * z * x + x
    return tl.where(ax < 0.625, small, big)


@triton.jit
def _logit_scales(sm_scale, softcap, SOFTCAP: tl.constexpr):
    """(qk_scale, cap2) of ``_scaled_logits``: ``sm_scale * log2(e)`` and 1 without a cap; with one,
    ``sm_scale / softcap`` and ``softcap * log2(e)``."""
    if SOFTCAP:
        qk_scale = sm_scale / softcap
        cap2 = softcap * 1.4426950408889634
    else:
        qk_scale = sm_scale * 1.4426950408889634
        cap2 = 1.0
    return qk_scale, cap2


@triton.jit
def _scaled_logits(q, k, qk_scale, cap2, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Base-2 logits [BM, BN] of q [BM, BD] against k [BN, BD].

    Without a cap ``qk_scale = sm_scale * log2(e)``. With one, the cap acts on the natural-scale logit:
    ``qk_scale = sm_scale / softcap`` gives ``x = s / softcap`` and ``cap2 = softcap * log2(e)`` turns
    ``tanh(x)`` into ``softcap * tanh(s / softcap) * log2(e)``."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:
        s = _tanh(s) * cap2
    return s


@triton.jit
def _load_rows(base, rows, rows_ok, stride_row, stride_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``rows`` of one (batch, head) of a [B, H, L, D] tensor (keys, values, queries or output
    gradients) as a [len(rows), BLOCK_D] tile; ``base`` points at the (batch, head). Rows past L
    (``rows_ok`` False) and lanes past HEAD_DIM read as 0."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = rows_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    tile = tl.load(base + rows[:, None] * stride_row + offs_d[None, :] * stride_d, mask=mask, other=0.0)
    return tile


@triton.jit
def _fwd_block(
    acc, l_i, m_i, idx_i, q, k_base, v_base, pad_base, start_n, pos, N, qk_scale, cap2, window,
    sink_tokens, stride_kn, stride_kd, stride_vn, stride_vd,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, TRACK_ARGMAX: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, SINK: tl.constexpr,
):  # fmt: skip
    """Fold keys [start_n, start_n + BLOCK_N) into (acc [BM, BD], l_i [BM], m_i [BM], idx_i [BM]).

    MASKED blocks apply the bounds, causal (CAUSAL) and sliding-window lower-edge (WINDOW; SINK: keys
    below ``sink_tokens`` pass it) masks; the caller passes unmasked only blocks that are in range and
    inside every row's window. k_base / v_base: the (batch, KV head)'s keys and values (``_load_rows``)."""
    cols = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = cols < N
    else:
        n_ok = cols >= 0  # all in range: the caller only passes full blocks below N
    k = _load_rows(k_base, cols, n_ok, stride_kn, stride_kd, HEAD_DIM, BLOCK_D)
    s = _scaled_logits(q, k, qk_scale, cap2, SOFTCAP, DOT_PRECISION)  # [BM, BN] fp32, base 2
    if MASKED or HAS_PAD:
        valid = n_ok[None, :]
        if MASKED and CAUSAL:
            valid = valid & (cols[None, :] <= pos[:, None])
        if MASKED and WINDOW:
            in_window = cols[None, :] > (pos - window)[:, None]
            if SINK:
                in_window = in_window | (cols[None, :] < sink_tokens)
            valid = valid & in_window
        if HAS_PAD:
            key_ok = tl.load(pad_base + cols, mask=cols < N, other=0) != 0
            valid = valid & key_ok[None, :]
        s = tl.where(valid, s, float("-inf"))
    if TRACK_ARGMAX:
        # NaN -> +inf: both poison the row the same way (see the epilogue), and a max-with-index over NaN
        # has no defined answer (the interpreter's nanargmax even raises on an all-NaN row).
        s = tl.where(s == s, s, float("inf"))
        blk_max, blk_arg = tl.max(s, 1, return_indices=True)
        # Strictly greater: an earlier (smaller) index keeps a tie.
        idx_i = tl.where(blk_max > m_i, blk_arg + start_n, idx_i)
    else:
        blk_max = tl.max(s, 1)
    m_new = tl.maximum(m_i, blk_max)
    # Rows with no valid key so far: use 0 as reference point (all their terms are exp2(-inf) = 0).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(v_base, cols, n_ok, stride_vn, stride_vd, HEAD_DIM, BLOCK_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new, idx_i


@triton.jit
def _key_loops(
    acc, l_i, m_i, idx_i, q, k_base, v_base, pad_base, sink_lo, sink_hi, lo, mid_lo, full_hi, hi,
    pos, N, qk_scale, cap2, window, sink_tokens, stride_kn, stride_kd, stride_vn, stride_vd,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr, TRACK_ARGMAX: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SINK: tl.constexpr,
):  # fmt: skip
    """All key blocks of one query tile in four runs: the sink tokens' blocks [sink_lo, sink_hi) below the
    window (masked, SINK only; sink_hi <= lo), window-edge blocks [lo, mid_lo) (masked, WINDOW only),
    blocks every row sees in full [mid_lo, full_hi) (unmasked), the rest up to ``hi`` (masked)."""
    if SINK:
        for start_n in range(sink_lo, sink_hi, BLOCK_N):
            acc, l_i, m_i, idx_i = _fwd_block(
                acc, l_i, m_i, idx_i, q, k_base, v_base, pad_base, start_n, pos, N, qk_scale, cap2, window,
                sink_tokens, stride_kn, stride_kd, stride_vn, stride_vd,
                HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL, HAS_PAD, TRACK_ARGMAX, WINDOW, SOFTCAP,
                DOT_PRECISION, SINK,
            )  # fmt: skip
    if WINDOW:
        for start_n in range(lo, tl.minimum(mid_lo, hi), BLOCK_N):
            acc, l_i, m_i, idx_i = _fwd_block(
                acc, l_i, m_i, idx_i, q, k_base, v_base, pad_base, start_n, pos, N, qk_scale, cap2, window,
                sink_tokens, stride_kn, stride_kd, stride_vn, stride_vd,
                HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL, HAS_PAD, TRACK_ARGMAX, WINDOW, SOFTCAP,
                DOT_PRECISION, SINK,
            )  # fmt: skip
    for start_n in range(mid_lo, full_hi, BLOCK_N):
        acc, l_i, m_i, idx_i = _fwd_block(
            acc, l_i, m_i, idx_i, q, k_base, v_base, pad_base, start_n, pos, N, qk_scale, cap2, window,
            sink_tokens, stride_kn, stride_kd, stride_vn, stride_vd,
            HEAD_DIM, BLOCK_N, BLOCK_D, False, CAUSAL, HAS_PAD, TRACK_ARGMAX, WINDOW, SOFTCAP, DOT_PRECISION,
            SINK,
        )  # fmt: skip
    for start_n in range(tl.maximum(mid_lo, full_hi), hi, BLOCK_N):
        acc, l_i, m_i, idx_i = _fwd_block(
            acc, l_i, m_i, idx_i, q, k_base, v_base, pad_base, start_n, pos, N, qk_scale, cap2, window,
            sink_tokens, stride_kn, stride_kd, stride_vn, stride_vd,
            HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL, HAS_PAD, TRACK_ARGMAX, WINDOW, SOFTCAP, DOT_PRECISION,
            SINK,
        )  # fmt: skip
    return acc, l_i, m_i, idx_i


@triton.jit
def _add_sink(acc, l_i, m_i, sink2):
    """Join a sink logit (base 2) to the softmax denominator only: move the reference point to
    ``max(m, sink)`` and add ``2^(sink - m')`` to ``l`` (a row without keys, m = -inf, gets l = 1 and
    keeps acc = 0). Overflow-free for any sink."""
    m_fin = tl.maximum(m_i, sink2)
    alpha = tl.exp2(m_i - m_fin)
    l_i = l_i * alpha + tl.exp2(sink2 - m_fin)
    return acc * alpha[:, None], l_i, m_fin


@triton.jit
def _fwd_kernel(
    Q, K, V, Out, Lse, Argmax, PadMask, KeyStart, Pairs, Disabled, Sinks,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    H_Q, GROUP, M, N, sm_scale, argmax_first_row, argmax_rows, last_m_block, window, softcap, sink_tokens,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, HAS_PAIRS: tl.constexpr, FLAGGED: tl.constexpr,
    TRACK_ARGMAX: tl.constexpr, WRITE_LSE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr, SINK: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M query rows of one enabled (batch, head) pair, all their keys."""
    # Longest tiles first: under a causal mask the last row block has the most keys; starting with it
    # leaves the short tiles to fill the tail of the launch.
    start_m = last_m_block - tl.program_id(0)
    if HAS_PAIRS:
        pair32 = tl.load(Pairs + tl.program_id(1))
    else:
        pair32 = tl.program_id(1)
    pair = pair32.to(tl.int64)
    b = (pair32 // H_Q).to(tl.int64)  # 32-bit division (B * Hq < 2^31), 64-bit offsets
    h = (pair32 % H_Q).to(tl.int64)
    kvh = (pair32 % H_Q // GROUP).to(tl.int64)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < M
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    pad_base = PadMask + b * N
    pos = offs_m + (N - M)  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    idx_i = tl.full([BLOCK_M], -1, dtype=tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale, cap2 = _logit_scales(sm_scale, softcap, SOFTCAP)

    # Keys in [mid_lo, full_hi) are in range and visible to every row of the tile: no mask at all.
    first_pos = start_m * BLOCK_M + (N - M)
    if CAUSAL:
        hi = tl.minimum(N, first_pos + BLOCK_M)
        full_hi = tl.minimum((first_pos + 1) // BLOCK_N, N // BLOCK_N) * BLOCK_N
    else:
        hi = N
        full_hi = (N // BLOCK_N) * BLOCK_N
    lo = 0
    if HAS_PAD:  # blocks before the first valid key hold only padding
        lo = (tl.load(KeyStart + b) // BLOCK_N) * BLOCK_N
    sink_lo = lo
    mid_lo = lo
    if WINDOW:
        # The tile's first row sees keys from first_pos - window + 1 on: earlier blocks are never loaded
        # (O(BLOCK_M + window) keys per tile). Keys >= first_pos + BLOCK_M - window are inside every
        # row's window; the blocks in between straddle some row's lower edge and get the mask.
        lo = tl.maximum(lo, (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N)
        inside = tl.maximum(first_pos + BLOCK_M - window, 0)
        mid_lo = tl.maximum(lo, tl.cdiv(inside, BLOCK_N) * BLOCK_N)
    sink_hi = 0
    if SINK:  # the sink tokens' blocks below the window's first block (from the first valid key's)
        sink_hi = tl.minimum(sink_tokens, lo)
    if FLAGGED:
        # Sync-free grids also hold programs for disabled pairs: empty key loops, so the epilogue writes
        # exactly a disabled head's outputs (0, argmax -1, lse +inf).
        enabled = tl.load(Disabled + pair32) == 0
        hi = tl.where(enabled, hi, 0)
        full_hi = tl.where(enabled, full_hi, 0)
        if SINK:
            sink_hi = tl.where(enabled, sink_hi, 0)
    if TRACK_ARGMAX and start_m * BLOCK_M + BLOCK_M > argmax_first_row:  # the tile holds argmax rows
        acc, l_i, m_i, idx_i = _key_loops(
            acc, l_i, m_i, idx_i, q, k_base, v_base, pad_base, sink_lo, sink_hi, lo, mid_lo, full_hi, hi, pos,
            N, qk_scale, cap2, window, sink_tokens, stride_kn, stride_kd, stride_vn, stride_vd,
            HEAD_DIM, BLOCK_N, BLOCK_D, CAUSAL, HAS_PAD, True, WINDOW, SOFTCAP, DOT_PRECISION, SINK,
        )  # fmt: skip
    else:
        acc, l_i, m_i, idx_i = _key_loops(
            acc, l_i, m_i, idx_i, q, k_base, v_base, pad_base, sink_lo, sink_hi, lo, mid_lo, full_hi, hi, pos,
            N, qk_scale, cap2, window, sink_tokens, stride_kn, stride_kd, stride_vn, stride_vd,
            HEAD_DIM, BLOCK_N, BLOCK_D, CAUSAL, HAS_PAD, False, WINDOW, SOFTCAP, DOT_PRECISION, SINK,
        )  # fmt: skip

    # l is a sum of terms in [0, 1]: it is NaN exactly when a NaN or +inf logit reached the row (its term
    # 2^(NaN) or 2^(inf - inf) is NaN, and NaN survives every later rescale). Such a row is NaN, -1.
    poisoned = l_i != l_i
    has_key = l_i > 0.0
    if HAS_SINKS:
        acc, l_i, m_i = _add_sink(acc, l_i, m_i, tl.load(Sinks + h) * 1.4426950408889634)
    l_safe = tl.where(has_key, l_i, 1.0)
    out = acc / l_safe[:, None]  # rows without keys: acc == 0 -> out 0
    out = tl.where(poisoned[:, None], float("nan"), out)
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(has_key, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("inf"))
        lse = tl.where(poisoned, float("nan"), lse)
        tl.store(Lse + pair * M + offs_m, lse, mask=m_ok)
    if TRACK_ARGMAX:
        t = offs_m - argmax_first_row
        idx = tl.where(poisoned, -1, idx_i)
        tl.store(Argmax + pair * argmax_rows + t, idx.to(tl.int64), mask=m_ok & (t >= 0))


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    argmax_rows: int,
    return_lse: bool,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    sink_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the prefill forward.

    q: [B, Hq, M, D] (any strides); k, v: [B, Hkv, N, D] (any strides); key_padding_mask: bool [B, N]
    contiguous or None; skip_heads: bool [B, Hq] contiguous or None; argmax_rows: T in [0, M];
    window: sliding window (causal only) or None; sink_tokens: with a window, the first keys every row
    also sees, or None; softcap: logit cap or None; sinks: fp32 [Hq]
    contiguous or None (the lse then includes the sink). block_m / block_n override the tile table
    (tests). Returns out [B, Hq, M, D] (q.dtype, contiguous),
    argmax int64 [B, Hq, T] or None, lse fp32 [B, Hq, M] or None.
    """
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    cfg = with_blocks(fwd_config(D, q.dtype), block_m, block_n)
    device = q.device
    out = new_float((B, Hq, M, D), q.dtype, device)
    argmax = new_index((B, Hq, argmax_rows), device) if argmax_rows else None
    lse = new_float((B, Hq, M), torch.float32, device) if return_lse else None
    plist = active_pairs(skip_heads, B, Hq)
    if plist.host_fill:
        fill_skipped(skip_heads, out, argmax, lse)
    if plist.grid == 0:
        return out, argmax, lse

    key_start = first_valid_keys(key_padding_mask)
    dummy = out  # stands in for pointers whose use is compiled out
    window, sink_tokens = effective_pattern(window, sink_tokens, N)

    def launch(cfg: TileConfig) -> None:
        n_blocks = cdiv(M, cfg.block_m)
        with device_guard(q):
            launch_kernel(
                _fwd_kernel, (n_blocks, plist.grid),
                q, k, v, out, lse if lse is not None else dummy, argmax if argmax is not None else dummy,
                key_padding_mask if key_padding_mask is not None else dummy,
                key_start if key_start is not None else dummy,
                plist.pairs if plist.pairs is not None else dummy,
                plist.disabled if plist.disabled is not None else dummy,
                sinks if sinks is not None else dummy,
                *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                Hq, Hq // Hkv, M, N, float(sm_scale), M - argmax_rows, argmax_rows, n_blocks - 1,
                window or 0, float(softcap or 1.0), sink_tokens or 0,
                HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d(D),
                CAUSAL=causal, HAS_PAD=key_padding_mask is not None, HAS_PAIRS=plist.pairs is not None,
                FLAGGED=plist.disabled is not None, TRACK_ARGMAX=argmax is not None, WRITE_LSE=return_lse, WINDOW=window is not None,
                SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None, DOT_PRECISION=dot_precision(q.dtype),
                SINK=sink_tokens is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip

    key = (
        "fwd",
        D,
        q.dtype,
        device,
        argmax is not None,
        window is not None,
        softcap is not None,
        sinks is not None,
        sink_tokens is not None,
    )
    launch_fitting(key, cfg, launch)
    return out, argmax, lse


__all__ = ["attention_forward"]
