"""FA2-style backward of the fused attention: gradients from the saved log-sum-exp, nothing materialised.

Math. For one row, ``P_j = exp(s_j - lse)`` with ``s_j = sm_scale * q.k_j`` (the forward saved ``lse``,
so P is recomputed blockwise without another softmax pass) and ``o = sum_j P_j v_j``. With upstream
gradient ``dO``:

* ``dV_j = sum_rows P_j dO``                         (o is linear in v)
* ``dP_j = dO . v_j``
* ``dS_j = P_j (dP_j - delta)``, ``delta = sum_j P_j dP_j = dO . o``   (softmax Jacobian; the second form
  needs only the forward output, computed once per row by the *preprocess* kernel)
* ``dQ = sm_scale * sum_j dS_j k_j``,  ``dK_j = sm_scale * sum_rows dS_j q``.

Soft-capping: ``s = c tanh(x / c)`` with ``x = sm_scale * q.k``, so ``dS_x = dS_s * (1 - tanh^2)`` (the
tanh is recomputed with the logits). Sinks: the forward's lse includes the sink, so ``P_j`` above is
already the probability of the sink-extended softmax and ``delta = dO . o`` is unchanged (the sink has no
value); ``dsink_h = -sum_{b, rows} exp(sink_h - lse) * delta``, summed per row block by the preprocess
kernel and over blocks and batch on the host (deterministic, no atomics).

Two kernels avoid atomics: the dK/dV kernel owns a block of keys of one KV head and loops over the
query rows (and over every query head of its GQA group, so a KV head receives the sum of its group's
contributions); the dQ kernel owns a block of query rows and loops over the keys. Both recompute
``P`` in base 2: ``exp2(s * log2 e - lse * log2 e)``.

Masking reproduces the forward exactly: disallowed keys (causal ``j > N - M + i``, padding, beyond N)
and rows beyond M get ``P = 0``. A row with no valid key has ``lse = +inf``, so its ``P`` is 0 and its
gradients are 0 with no NaN. Disabled heads contribute nothing: the dQ and preprocess grids enumerate
enabled (batch, head) pairs, the dK/dV kernel skips disabled heads of its group, and KV heads whose
whole group is disabled do no work. Their zero dQ / dK / dV are written with torch (exact grid mode)
or by programs with empty loops (sync-free mode, see ``triton.fwd``).

Loops start where they can contribute. Keys before a batch row's first valid key are padding: the dQ
loop starts at that key's block, and dK/dV programs wholly before it only store zeros. Causal: key
block ``[n0, n0 + BLOCK_N)`` is seen only by rows with ``N - M + i >= n0``, and row block
``[m0, m0 + BLOCK_M)`` sees keys up to ``N - M + m0 + BLOCK_M - 1``. Sliding window: key block
``[n0, n0 + BLOCK_N)`` is seen only by rows at positions ``<= n0 + BLOCK_N - 2 + window`` (the dK/dV row
loop stops there), and the dQ loop of a row block starts at the block of ``N - M + m0 - window + 1``:
both cost O(window) per block. Sink tokens (``sink_tokens`` S, with a window: row p also sees keys
``j < S``): a key block holding one is seen by every row from its causal start on (the dK/dV row loop
runs to M), and the dQ kernel first loops over the sink tokens' blocks below its window's first block;
window masks keep keys ``j < S``. O(window + S) per block.

Loads. The tiles a loop walks over (Q and dO in the dK/dV kernel, K and V in the dQ kernel) are masked
pointer loads (``triton.fwd._load_rows``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    TileConfig,
    active_pairs,
    block_d,
    bwd_config,
    cdiv,
    device_guard,
    dot_precision,
    effective_pattern,
    first_valid_keys,
    launch_fitting,
    new_float,
    with_blocks,
)
from .fwd import _load_rows, _logit_scales, _tanh
from .launch import launch_kernel


@triton.jit
def _bwd_preprocess_kernel(
    Out, DO, Delta, Pairs, Lse, Sinks, DSinkPart,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_db, stride_dh, stride_dm, stride_dd,
    H_Q, M,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HAS_PAIRS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """delta[pair, i] = sum_d dO[i, d] * O[i, d] in fp32 for BLOCK_M rows of one enabled pair; with
    sinks also this block's share of dsinks[h], ``-sum_i exp(sink_h - lse_i) * delta_i``, written to
    DSinkPart[pair, program_id(0)] (summed on the host: deterministic, no atomics)."""
    if HAS_PAIRS:
        pair32 = tl.load(Pairs + tl.program_id(1))
    else:
        pair32 = tl.program_id(1)
    # 32-bit division (B * Hq < 2^31): the 64-bit one is a subroutine call whose saved registers spilled.
    pair = pair32.to(tl.int64)
    b = (pair32 // H_Q).to(tl.int64)
    h = (pair32 % H_Q).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < M)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(
        Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
        mask=mask,
        other=0.0,
    )
    do = tl.load(
        DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :] * stride_dd,
        mask=mask,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + pair * M + offs_m, delta, mask=offs_m < M)
    if HAS_SINKS:
        # P_sink = exp(sink - lse) (the lse includes the sink); rows past M and keyless rows have
        # lse = +inf, so P_sink = 0 there.
        lse = tl.load(Lse + pair * M + offs_m, mask=offs_m < M, other=float("inf"))
        p_sink = tl.exp2((tl.load(Sinks + h) - lse) * 1.4426950408889634)
        part = -tl.sum(p_sink * delta, 0)
        tl.store(DSinkPart + pair * tl.num_programs(0) + tl.program_id(0), part)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, PadMask, KeyStart, Skip, KvPairs, KvDisabled,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_db, stride_dh, stride_dm, stride_dd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H_Q, H_KV, GROUP, M, N, sm_scale, window, softcap, sink_tokens,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_PAIRS: tl.constexpr,
    FLAGGED: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SINK: tl.constexpr,
):  # fmt: skip
    """Program (key block, enabled KV pair): dK, dV of BLOCK_N keys, summed over the group's heads."""
    start_n = tl.program_id(0) * BLOCK_N
    if HAS_PAIRS:
        kv_pair = tl.load(KvPairs + tl.program_id(1))
    else:
        kv_pair = tl.program_id(1)
    b = (kv_pair // H_KV).to(tl.int64)  # 32-bit division (B * Hkv < 2^31), 64-bit offsets
    kvh = (kv_pair % H_KV).to(tl.int64)
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = cols < N
    d_ok = offs_d < HEAD_DIM
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(
        K + b * stride_kb + kvh * stride_kh + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V + b * stride_vb + kvh * stride_vh + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
        mask=kv_mask,
        other=0.0,
    )
    key_ok = n_ok
    if HAS_PAD:
        key_ok = key_ok & (tl.load(PadMask + b * N + cols, mask=n_ok, other=0) != 0)
    qk_scale, cap2 = _logit_scales(sm_scale, softcap, SOFTCAP)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Rows i with N - M + i >= start_n are the first that can see this key block.
    if CAUSAL:
        m_lo = (tl.maximum(start_n - (N - M), 0) // BLOCK_M) * BLOCK_M
    else:
        m_lo = 0
    m_hi = M
    if WINDOW:  # the last row that sees key j sits at position j + window - 1
        m_hi = tl.minimum(M, start_n + BLOCK_N - 1 + window - (N - M))
        if SINK:  # ... unless j is a sink token: every later row sees it
            m_hi = tl.where(start_n < sink_tokens, M, m_hi)
    if HAS_PAD:  # a block wholly before the first valid key holds only padding: dK = dV = 0
        m_lo = tl.where(start_n + BLOCK_N > tl.load(KeyStart + b), m_lo, M)
    if FLAGGED:  # sync-free grid: a fully disabled group's programs visit no rows: dK = dV = 0
        m_lo = tl.where(tl.load(KvDisabled + kv_pair) == 0, m_lo, M)
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        enabled = True
        if HAS_SKIP:
            enabled = tl.load(Skip + b * H_Q + h) == 0
        if enabled:
            pair = b * H_Q + h
            q_base = Q + b * stride_qb + h * stride_qh
            do_base = DO + b * stride_db + h * stride_dh
            for start_m in range(m_lo, m_hi, BLOCK_M):
                rows = start_m + tl.arange(0, BLOCK_M)
                m_ok = rows < M
                q = _load_rows(q_base, rows, m_ok, stride_qm, stride_qd, HEAD_DIM, BLOCK_D)
                do = _load_rows(do_base, rows, m_ok, stride_dm, stride_dd, HEAD_DIM, BLOCK_D)
                # lse = +inf beyond M (and for keyless rows): P = exp2(s - inf) = 0.
                lse2 = tl.load(Lse + pair * M + rows, mask=m_ok, other=float("inf")) * 1.4426950408889634
                delta = tl.load(Delta + pair * M + rows, mask=m_ok, other=0.0)
                s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # [BN, BM]
                if SOFTCAP:
                    t_t = _tanh(s_t)
                    s_t = t_t * cap2
                valid = key_ok[:, None] & m_ok[None, :]
                if CAUSAL:
                    valid = valid & (cols[:, None] <= (rows + (N - M))[None, :])
                if WINDOW:
                    in_window = cols[:, None] > (rows + (N - M - window))[None, :]
                    if SINK:
                        in_window = in_window | (cols[:, None] < sink_tokens)
                    valid = valid & in_window
                p_t = tl.where(valid, tl.exp2(s_t - lse2[None, :]), 0.0)
                dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
                dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BN, BM]
                ds_t = p_t * (dp_t - delta[None, :])
                if SOFTCAP:  # through the cap: d(c tanh(s / c)) / ds = 1 - tanh^2
                    ds_t = ds_t * (1.0 - t_t * t_t)
                dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    dk = dk * sm_scale
    tl.store(
        DK + b * stride_dkb + kvh * stride_dkh + cols[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
        dk.to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + b * stride_dvb + kvh * stride_dvh + cols[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.jit
def _dq_block(
    dq, q, do, lse2, delta, k_base, v_base, pad_base, start_n, pos, m_ok, N, qk_scale, cap2,
    window, sink_tokens, stride_kn, stride_kd, stride_vn, stride_vd,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SINK: tl.constexpr,
):  # fmt: skip
    """dq [BM, BD] plus the keys [start_n, start_n + BLOCK_N)'s share of dS K (unscaled). k_base / v_base:
    the (batch, KV head)'s keys and values (``_load_rows``)."""
    cols = start_n + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    k = _load_rows(k_base, cols, n_ok, stride_kn, stride_kd, HEAD_DIM, BLOCK_D)
    v = _load_rows(v_base, cols, n_ok, stride_vn, stride_vd, HEAD_DIM, BLOCK_D)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BM, BN]
    if SOFTCAP:
        t = _tanh(s)
        s = t * cap2
    valid = m_ok[:, None] & n_ok[None, :]
    if CAUSAL:
        valid = valid & (cols[None, :] <= pos[:, None])
    if WINDOW:
        in_window = cols[None, :] > (pos - window)[:, None]
        if SINK:
            in_window = in_window | (cols[None, :] < sink_tokens)
        valid = valid & in_window
    if HAS_PAD:
        key_ok = tl.load(pad_base + cols, mask=n_ok, other=0) != 0
        valid = valid & key_ok[None, :]
    p = tl.where(valid, tl.exp2(s - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [BM, BN]
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, PadMask, KeyStart, Pairs, Disabled,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_db, stride_dh, stride_dm, stride_dd,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H_Q, GROUP, M, N, sm_scale, window, softcap, sink_tokens,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, HAS_PAIRS: tl.constexpr, FLAGGED: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, SINK: tl.constexpr,
):  # fmt: skip
    """Program (row block, enabled pair): dQ of BLOCK_M rows, looping over the visible keys."""
    start_m = tl.program_id(0) * BLOCK_M
    if HAS_PAIRS:
        pair32 = tl.load(Pairs + tl.program_id(1))
    else:
        pair32 = tl.program_id(1)
    pair = pair32.to(tl.int64)
    b = (pair32 // H_Q).to(tl.int64)  # 32-bit division (B * Hq < 2^31), 64-bit offsets
    h = (pair32 % H_Q).to(tl.int64)
    kvh = (pair32 % H_Q // GROUP).to(tl.int64)
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = rows < M
    d_ok = offs_d < HEAD_DIM
    row_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=row_mask,
        other=0.0,
    )
    do = tl.load(
        DO + b * stride_db + h * stride_dh + rows[:, None] * stride_dm + offs_d[None, :] * stride_dd,
        mask=row_mask,
        other=0.0,
    )
    lse2 = tl.load(Lse + pair * M + rows, mask=m_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(Delta + pair * M + rows, mask=m_ok, other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    pos = rows + (N - M)
    qk_scale, cap2 = _logit_scales(sm_scale, softcap, SOFTCAP)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum(N, start_m + BLOCK_M + (N - M))
    else:
        hi = N
    lo = 0
    if HAS_PAD:  # blocks before the first valid key hold only padding
        lo = (tl.load(KeyStart + b) // BLOCK_N) * BLOCK_N
    sink_lo = lo
    if WINDOW:  # the block's first row sees keys from its position - window + 1 on
        lo = tl.maximum(lo, (tl.maximum(start_m + (N - M) - window + 1, 0) // BLOCK_N) * BLOCK_N)
    sink_hi = 0
    if SINK:  # the sink tokens' blocks below the window's first block
        sink_hi = tl.minimum(sink_tokens, lo)
    if FLAGGED:  # sync-free grid: a disabled head's programs visit no keys: dQ = 0
        head_on = tl.load(Disabled + pair32) == 0
        hi = tl.where(head_on, hi, 0)
        if SINK:
            sink_hi = tl.where(head_on, sink_hi, 0)
    pad_base = PadMask + b * N
    if SINK:
        for start_n in range(sink_lo, sink_hi, BLOCK_N):
            dq = _dq_block(
                dq, q, do, lse2, delta, k_base, v_base, pad_base, start_n, pos, m_ok, N, qk_scale,
                cap2, window, sink_tokens, stride_kn, stride_kd, stride_vn, stride_vd,
                BLOCK_N, BLOCK_D, HEAD_DIM, CAUSAL, HAS_PAD, WINDOW, SOFTCAP, DOT_PRECISION, SINK,
            )  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        dq = _dq_block(
            dq, q, do, lse2, delta, k_base, v_base, pad_base, start_n, pos, m_ok, N, qk_scale,
            cap2, window, sink_tokens, stride_kn, stride_kd, stride_vn, stride_vd,
            BLOCK_N, BLOCK_D, HEAD_DIM, CAUSAL, HAS_PAD, WINDOW, SOFTCAP, DOT_PRECISION, SINK,
        )  # fmt: skip
    dq = dq * sm_scale
    tl.store(
        DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
        dq.to(DQ.dtype.element_ty),
        mask=row_mask,
    )


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    sink_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of the fused forward.

    grad_out, q, out: [B, Hq, M, D] (any strides); k, v: [B, Hkv, N, D] (any strides); lse: fp32
    [B, Hq, M] contiguous from the forward (+inf for keyless rows; with sinks it includes the sink);
    key_padding_mask: bool [B, N] contiguous or None; skip_heads: bool [B, Hq] contiguous or None;
    window / sink_tokens / softcap as in the forward; sinks: fp32 [Hq] contiguous or None. block_m / block_n
    override the tile table (tests). Returns dq [B, Hq, M, D], dk, dv [B, Hkv, N, D], contiguous, in
    the inputs' dtypes (disabled heads give dq = 0 and no contribution to dk, dv), and dsinks fp32 [Hq]
    (None without sinks).
    """
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    group = Hq // Hkv
    cfg = with_blocks(bwd_config(D, q.dtype), block_m, block_n)
    bd = block_d(D)
    device = q.device
    dq = new_float((B, Hq, M, D), q.dtype, device)
    dk = new_float((B, Hkv, N, D), k.dtype, device)
    dv = new_float((B, Hkv, N, D), v.dtype, device)
    plist = active_pairs(skip_heads, B, Hq)
    kv_skip = None if skip_heads is None else skip_heads.view(B, Hkv, group).all(-1)
    kv_plist = active_pairs(kv_skip, B, Hkv)  # KV heads with at least one enabled query head
    if plist.host_fill:  # masked_fill_, not boolean-index assignment (a host sync each, see fill_skipped)
        dq.masked_fill_(skip_heads[:, :, None, None], 0)
        dk.masked_fill_(kv_skip[:, :, None, None], 0)
        dv.masked_fill_(kv_skip[:, :, None, None], 0)
    if plist.grid == 0:
        return dq, dk, dv, None if sinks is None else torch.zeros(Hq, dtype=torch.float32, device=device)

    window, sink_tokens = effective_pattern(window, sink_tokens, N)
    delta = torch.empty((B, Hq, M), dtype=torch.float32, device=device)  # only enabled rows are read
    dummy = dq
    pad_arg = key_padding_mask if key_padding_mask is not None else dummy
    key_start = first_valid_keys(key_padding_mask)
    start_arg = key_start if key_start is not None else dummy
    precision = dot_precision(q.dtype)
    feats = dict(WINDOW=window is not None, SOFTCAP=softcap is not None, SINK=sink_tokens is not None)
    feat_args = (window or 0, float(softcap or 1.0), sink_tokens or 0)
    pairs = plist.pairs if plist.pairs is not None else dummy
    disabled = plist.disabled if plist.disabled is not None else dummy
    kv_pairs = kv_plist.pairs if kv_plist.pairs is not None else dummy
    kv_disabled = kv_plist.disabled if kv_plist.disabled is not None else dummy

    def launch(cfg: TileConfig) -> torch.Tensor | None:
        """The three kernels with tile ``cfg``; returns the dsinks partial sums [B * Hq, row blocks]."""
        bm, bn = cfg.block_m, cfg.block_n
        m_blocks = cdiv(M, bm)
        # dsinks partial sums per (pair, row block); pairs without a program (disabled, exact grid) stay 0.
        dsink_part = (
            None if sinks is None else torch.zeros((B * Hq, m_blocks), dtype=torch.float32, device=device)
        )
        common = dict(HEAD_DIM=D, BLOCK_D=bd, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        with device_guard(q):
            launch_kernel(
                _bwd_preprocess_kernel, (m_blocks, plist.grid),
                out, grad_out, delta, pairs, lse, sinks if sinks is not None else dummy,
                dsink_part if dsink_part is not None else dummy,
                *out.stride(), *grad_out.stride(), Hq, M,
                BLOCK_M=bm, HAS_PAIRS=plist.pairs is not None, HAS_SINKS=sinks is not None, **common,
            )  # fmt: skip
            launch_kernel(
                _bwd_dkdv_kernel, (cdiv(N, bn), kv_plist.grid),
                q, k, v, grad_out, lse, delta, dk, dv, pad_arg, start_arg,
                skip_heads if skip_heads is not None else dummy, kv_pairs, kv_disabled,
                *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(),
                Hq, Hkv, group, M, N, float(sm_scale), *feat_args,
                BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, HAS_PAD=key_padding_mask is not None,
                HAS_SKIP=skip_heads is not None, HAS_PAIRS=kv_plist.pairs is not None,
                FLAGGED=kv_plist.disabled is not None, DOT_PRECISION=precision,
                **feats, **common,
            )  # fmt: skip
            launch_kernel(
                _bwd_dq_kernel, (m_blocks, plist.grid),
                q, k, v, grad_out, lse, delta, dq, pad_arg, start_arg, pairs, disabled,
                *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dq.stride(),
                Hq, group, M, N, float(sm_scale), *feat_args,
                BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, HAS_PAD=key_padding_mask is not None,
                HAS_PAIRS=plist.pairs is not None, FLAGGED=plist.disabled is not None, DOT_PRECISION=precision,
                **feats, **common,
            )  # fmt: skip
        return dsink_part

    # A retry after a refused launch reruns every kernel: each writes (not adds to) its outputs.
    key = (
        "bwd",
        D,
        q.dtype,
        device,
        window is not None,
        softcap is not None,
        sinks is not None,
        sink_tokens is not None,
    )
    dsink_part = launch_fitting(key, cfg, launch)
    dsinks = None if dsink_part is None else dsink_part.view(B, Hq, -1).sum((0, 2))
    return dq, dk, dv, dsinks


__all__ = ["attention_backward"]
