"""The "first S + last W" key pattern: ``sink_tokens`` (StreamingLLM's attention-sink tokens) with a window.

The row at position p sees key j iff j <= p and (p - W < j or j < S): kept *keys*, unlike ``sinks`` (learned
per-head logits in the denominator). The oracle (``reference.py``) is first checked against a per-row
float64 loop written from that definition; then every backend is compared with the oracle on fresh random
inputs: the fused C++ kernel (every build this CPU runs, both tile layouts, split decode, bf16 dot
products), the blocked CPU path (query-row chunks, ``chunked.py``), the SDPA path (a boolean mask),
Triton (prefill, decode, backward; the interpreter on CPU-only machines, so tiny shapes) and their
backwards. Kernel outputs are poisoned first (NaN / -12345) so an unwritten element fails; keys no row may
see are poisoned with NaN where a test checks that they are never loaded.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from retmask.kernels import attention, chunked, ops, paths, reference_attention
from retmask.kernels.cpu import backend as cpu
from retmask.kernels.cpu import backward as cpu_backward
from retmask.kernels.reference import allowed_keys
from retmask.kernels.sdpa import sdpa_attention

from ..device import on_test_device
from .helpers import POISON_FLOAT, POISON_INDEX, assert_argmax_matches, left_padding_mask, make_qkv

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
OUT_TOL = {torch.float32: dict(atol=3e-5, rtol=3e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}
ARGMAX_ATOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def loop_attention(q, k, v, *, window, sink_tokens, key_padding_mask=None):
    """The definition, one row at a time in float64: row i at p = N - M + i sees key j iff j <= p,
    (p - window < j or j < sink_tokens) and j is valid. Returns (out, argmax) over all rows."""
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    out = torch.zeros(B, Hq, M, D, dtype=torch.float64)
    argmax = torch.full((B, Hq, M), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            for i in range(M):
                p = N - M + i
                keys = [
                    j for j in range(N)
                    if j <= p and (j > p - window or j < sink_tokens)
                    and (key_padding_mask is None or bool(key_padding_mask[b, j]))
                ]  # fmt: skip
                if not keys:
                    continue
                s = torch.stack([q[b, h, i].double() @ k[b, kh, j].double() for j in keys]) * D**-0.5
                top = s.max()
                argmax[b, h, i] = keys[int((s == top).nonzero()[0])]
                w = torch.exp(s - top)
                out[b, h, i] = sum(w[n] * v[b, kh, j].double() for n, j in enumerate(keys)) / w.sum()
    return out, argmax


# -- the oracle and the arguments --------------------------------------------------------------------


@pytest.mark.parametrize(
    "M,N,window,sink",
    [(9, 9, 3, 2), (5, 12, 4, 1), (1, 12, 3, 5), (12, 12, 2, 6), (7, 11, 4, 7), (6, 10, 1, 3)],
)
def test_reference_matches_the_definition(M, N, window, sink):
    q, k, v = make_qkv(2, 4, 2, M, N, 8, dtype=torch.float64, seed=M * N + sink)
    pad = left_padding_mask(2, N, [0, 2])
    want_out, want_am = loop_attention(q, k, v, window=window, sink_tokens=sink, key_padding_mask=pad)
    out, am = reference_attention(
        q, k, v, key_padding_mask=pad, argmax_rows=M, window=window, sink_tokens=sink
    )  # fmt: skip
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    assert torch.equal(am, want_am)


def test_allowed_keys_pattern():
    """Bottom-right aligned (row i at N - M + i, as the window): 3 rows against 10 keys, window 2, S = 2."""
    got = allowed_keys(3, 10, True, None, torch.device("cpu"), window=2, sink_tokens=2)[0, 0]
    want = torch.tensor(
        [[1, 1, 0, 0, 0, 0, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0, 0, 1, 1]]
    ).bool()
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sink_tokens=4), "needs a sliding window"),
        (dict(window=8, sink_tokens=0), ">= 1"),
        (dict(window=8, sink_tokens=-2), ">= 1"),
        (dict(window=8, sink_tokens=True), "positive int"),
        (dict(window=8, sink_tokens=2.0), "positive int"),
        (dict(window=8, sink_tokens="4"), "positive int"),
    ],
)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_bad_sink_tokens_are_refused(kwargs, match, backend):
    q, k, v = make_qkv(1, 2, 1, 4, 6, 8)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, backend=backend, **kwargs)


def test_message_tells_sink_tokens_from_sink_logits():
    q, k, v = make_qkv(1, 2, 1, 4, 6, 8)
    with pytest.raises(ValueError, match="sinks="):
        attention(q, k, v, sink_tokens=2)


# -- the fused C++ kernel: forward --------------------------------------------------------------------

# (B, Hq, Hkv, M, N, D, window, sink, pads, skip rows)
CPU_CASES = [
    (1, 2, 1, 70, 70, 16, 5, 1, None, None),  # prefill, S = 1, N off the 64-key block
    (2, 4, 2, 33, 150, 32, 20, 4, [0, 7], [[False, True, False, False], [False, False, False, True]]),
    (1, 3, 3, 130, 300, 40, 17, 70, None, None),  # S > a key block, M < N
    (2, 6, 2, 1, 600, 64, 64, 3, [0, 40], None),  # decode: the split-key path, S in the first piece
    (1, 2, 1, 1, 700, 16, 300, 9, None, [[True, False]]),  # decode, skipped head, window > a piece
    (1, 4, 1, 90, 90, 24, 30, 40, [10], None),  # S >= W, MQA, left padding past a sink token
    (1, 2, 2, 50, 100, 16, 60, 50, None, None),  # S + W >= N: plain causal
    (1, 2, 1, 20, 50, 8, 60, 3, None, None),  # W >= N: plain causal
    (2, 2, 1, 200, 200, 72, 8, 2, [0, 150], None),  # every sink token padded in row 1
]


def _case_id(c):
    return "B{}_Hq{}_Hkv{}_M{}_N{}_D{}_w{}_s{}_pad{}".format(*c[:9]) + ("_skip" if c[9] else "")


def _skip(case):
    B, Hq = case[0], case[1]
    return None if case[9] is None else torch.tensor(case[9], dtype=torch.bool).expand(B, Hq).contiguous()


def _inputs(case, dtype=torch.float32, seed=0):
    B, Hq, Hkv, M, N, D, window, sink, pads, _ = case
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, dtype=dtype, seed=seed + M + N + D, noncontiguous_q=True)
    pad = left_padding_mask(B, N, pads) if pads else None
    return q * 2, k, v, pad  # larger logits: the sink tokens matter


def _check_forward(out, argmax, case, q, k, v, pad, skip, rows, dtype=torch.float32, argmax_atol=None):
    window, sink = case[6], case[7]
    ref, _ = reference_attention(
        q.float(), k.float(), v.float(), key_padding_mask=pad, skip_heads=skip, window=window, sink_tokens=sink
    )  # fmt: skip
    assert not torch.isnan(out).any(), "unwritten (NaN poison) output"
    torch.testing.assert_close(out.float(), ref, **OUT_TOL[dtype])
    if rows:
        assert not (argmax == POISON_INDEX).any(), "unwritten argmax"
        assert_argmax_matches(
            argmax, q.float(), k.float(), causal=True, sm_scale=None, key_padding_mask=pad, skip_heads=skip,
            atol=argmax_atol or ARGMAX_ATOL[dtype], window=window, sink_tokens=sink,
        )  # fmt: skip


def _cpp(q, k, v, pad, skip, case, rows, **kw):
    """The fused kernel into poisoned caller buffers."""
    B, Hq, M, D = q.shape
    out = torch.full((B, Hq, M, D), POISON_FLOAT, dtype=q.dtype)
    argmax = torch.full((B, Hq, rows), POISON_INDEX, dtype=torch.int64) if rows else None
    return cpu.cpp_forward(
        q, k, v, causal=True, sm_scale=D**-0.5, key_padding_mask=pad, skip_heads=skip, argmax_rows=rows, out=out,
        argmax=argmax, window=case[6], sink_tokens=case[7], **kw,
    )  # fmt: skip


@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_cpu_forward_matches_reference(case):
    q, k, v, pad = _inputs(case)
    skip = _skip(case)
    rows = min(case[3], 7)  # the last rows only
    out, argmax = _cpp(q, k, v, pad, skip, case, rows)
    _check_forward(out, argmax, case, q, k, v, pad, skip, rows)
    # the public entry point, all rows
    out, argmax = attention(
        q, k, v, key_padding_mask=pad, skip_heads=skip, window=case[6], sink_tokens=case[7], return_argmax=True,
        backend="cpu",
    )  # fmt: skip
    _check_forward(out, argmax, case, q, k, v, pad, skip, case[3])


@pytest.mark.parametrize("isa", [name for name, _ in cpu.builds()])
@pytest.mark.parametrize("block_m,block_n", [(16, 32), (200, 64)])
def test_cpu_builds_and_tiles(isa, block_m, block_n):
    """Every kernel build, lanes and row-major tiles, sink tokens spanning two 32-key blocks and the
    window's first block cutting through them."""
    for case in [(2, 4, 2, 40, 160, 24, 30, 45, [0, 9], [[False, True, False, False]] * 2),
                 (1, 2, 1, 3, 160, 16, 25, 70, None, None)]:  # fmt: skip
        q, k, v, pad = _inputs(case, seed=3)
        skip = _skip(case)
        out, argmax = _cpp(q, k, v, pad, skip, case, case[3], isa=isa, block_m=block_m, block_n=block_n)
        _check_forward(out, argmax, case, q, k, v, pad, skip, case[3])


@pytest.mark.parametrize("bf16_dot", [False, True])
def test_cpu_bfloat16(bf16_dot):
    """bf16 inputs, with the fp32 micro-kernels and with the bf16 dot-product layout (emulated where the
    CPU has no AVX512-BF16)."""
    case = (2, 4, 2, 48, 130, 32, 16, 6, [0, 5], [[False, False, True, False]] * 2)
    q, k, v, pad = _inputs(case, dtype=torch.bfloat16, seed=5)
    skip = _skip(case)
    out, argmax = _cpp(q, k, v, pad, skip, case, 10, bf16_dot=bf16_dot)
    _check_forward(out, argmax, case, q, k, v, pad, skip, 10, dtype=torch.bfloat16)


def _tie_inputs(N: int, window: int, sink: int, *, invisible_top: bool):
    """One head whose last row's largest logit is a tie: key 1 (a sink token), a key inside the window and
    a key between them that the row does not see (all three identical). With ``invisible_top`` only the
    invisible key holds the largest logit (10x the query); the argmax must still be a visible key."""
    q, k, v = make_qkv(1, 2, 1, 1, N, 16, seed=9)
    top = q[0, 0, 0] * 3
    mid, inside = sink + (N - window - sink) // 2, N - 2
    k[0, 0, [1, mid, inside]] = top
    if invisible_top:
        k[0, 0, mid] = q[0, 0, 0] * 10
    return q, k, v, mid, inside


@pytest.mark.parametrize("invisible_top", [False, True])
@pytest.mark.parametrize("path", ["cpp", "rowmajor", "blocked"])
def test_argmax_ties_and_invisible_keys(path, invisible_top, monkeypatch):
    N, window, sink = 300, 40, 3
    q, k, v, mid, inside = _tie_inputs(N, window, sink, invisible_top=invisible_top)
    if path == "blocked":
        monkeypatch.setenv(paths.CPU_PATH_ENV, "blocked")
    if path == "rowmajor":  # the decode layout: one row (and split pieces)
        q = q[:, :, -1:]
    else:  # prefill tiles: the row is the last of 8
        q = torch.cat([torch.randn(1, 2, 7, 16, generator=torch.Generator().manual_seed(1)), q], 2)
    _, argmax = attention(q, k, v, window=window, sink_tokens=sink, return_argmax=True, backend="cpu")
    _, want = reference_attention(q, k, v, window=window, sink_tokens=sink, argmax_rows=q.shape[2])
    assert torch.equal(argmax, want)
    assert argmax[0, 0, -1] == 1, "ties keep the smallest index, a sink token; the invisible key never wins"
    assert (argmax != mid).all()


def test_cpu_visits_only_the_sink_and_window_blocks():
    """Work is bounded: the kernel's count of computed logits stays within rows x (window + tile rows +
    two key blocks + S); the sink tokens add at most rows x S to the plain window's. And keys no row sees
    (between the sink tokens and the windows of 40 rows at the end of 300 keys) are never loaded: NaN
    there changes nothing (a loaded NaN value would reach the output through 0 * NaN)."""
    B, Hq, Hkv, N, D, window, sink, bm, bn = 1, 4, 2, 4096, 16, 64, 4, 64, 64
    q, k, v = make_qkv(B, Hq, Hkv, N, N, D, seed=11)
    base, with_sinks = {}, {}
    kw = dict(
        causal=True, sm_scale=0.25, key_padding_mask=None, skip_heads=None, argmax_rows=0, window=window
    )
    cpu.cpp_forward(q, k, v, block_m=bm, block_n=bn, stats=base, **kw)
    cpu.cpp_forward(q, k, v, block_m=bm, block_n=bn, stats=with_sinks, sink_tokens=sink, **kw)
    rows = Hq * N
    assert base["logits"] <= rows * (window + bm + 2 * bn)
    assert 0 < with_sinks["logits"] - base["logits"] <= rows * sink
    full = {}
    cpu.cpp_forward(q, k, v, block_m=bm, block_n=bn, stats=full, **{**kw, "window": None})
    assert full["logits"] > 10 * with_sinks["logits"]  # O(N^2) against O(N * (W + S))
    # decode, split into pieces: the sink tokens once, in the first piece
    dec = {}
    cpu.cpp_forward(q[:, :, -1:], k, v, block_n=bn, stats=dec, sink_tokens=sink, **kw)
    assert dec["logits"] == Hq * (window + sink)

    M, N2, first_window_block = 40, 300, 192  # rows at 260..299 see keys from 245: blocks from 192 on
    q, k, v = make_qkv(B, Hq, Hkv, M, N2, D, seed=12)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, sink:first_window_block] = float("nan")
    v_bad[:, :, sink:first_window_block] = float("nan")
    for isa in [name for name, _ in cpu.builds()]:
        for q_rows in (q, q[:, :, -1:]):
            out, _ = cpu.cpp_forward(q_rows, k_bad, v_bad, block_n=bn, isa=isa, sink_tokens=sink, **kw)
            ref, _ = reference_attention(q_rows, k, v, sm_scale=0.25, window=window, sink_tokens=sink)
            torch.testing.assert_close(out, ref, **OUT_TOL[torch.float32])


# -- the other CPU paths and the SDPA path -----------------------------------------------------------


@pytest.mark.parametrize("case", CPU_CASES[:6], ids=_case_id)
def test_blocked_cpu_path(case, monkeypatch):
    """Without the compiled kernel: query-row chunks against their sink + window keys (chunks made small
    so that several cut through the window, with the sink tokens below it and reaching it)."""
    monkeypatch.setenv(paths.CPU_PATH_ENV, "blocked")
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 4 * case[1] * (case[6] + case[7]))
    q, k, v, pad = _inputs(case, seed=1)
    skip = _skip(case)
    out, argmax = attention(
        q, k, v, key_padding_mask=pad, skip_heads=skip, window=case[6], sink_tokens=case[7], return_argmax=True,
        backend="cpu",
    )  # fmt: skip
    _check_forward(out, argmax, case, q, k, v, pad, skip, case[3])


@pytest.mark.parametrize("case", CPU_CASES[:7], ids=_case_id)
def test_sdpa_path(case):
    """``sdpa.sdpa_attention`` and the backward's ``ops.recompute_attention`` take the pattern as a
    boolean mask; forward and gradients against the oracle's."""
    q, k, v, pad = _inputs(case, seed=2)
    skip = _skip(case)
    D = q.shape[-1]
    kw = dict(causal=True, sm_scale=D**-0.5, key_padding_mask=pad, skip_heads=skip, window=case[6])
    kw["sink_tokens"] = case[7]
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    got = sdpa_attention(*leaves, **kw)
    torch.testing.assert_close(ops.recompute_attention(q, k, v, **kw), got.detach(), rtol=0, atol=0)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref, _ = reference_attention(*ref_leaves, **kw)
    torch.testing.assert_close(got.double(), ref, **OUT_TOL[torch.float32])
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    got_g = torch.autograd.grad(got, leaves, grad_out)
    want_g = torch.autograd.grad(ref, ref_leaves, grad_out.double())
    _assert_grads_close(got_g, want_g, torch.float32)


# -- gradients -----------------------------------------------------------------------------------------


def _assert_grads_close(got, want, dtype):
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert not torch.isnan(g).any(), (name, "unwritten (NaN poison) or NaN")
        err = ((g.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-6)).item()
        assert err < GRAD_TOL[dtype], (name, err)


def _float64_grads(q, k, v, grad_out, pad, skip, window, sink):
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out, _ = reference_attention(
        *leaves, key_padding_mask=pad, skip_heads=skip, window=window, sink_tokens=sink
    )  # fmt: skip
    return torch.autograd.grad(out, leaves, grad_out.double())


# (B, Hq, Hkv, M, N, D, window, sink, pads, skip rows): the C++ backward puts the sink tokens in columns of
# their own when they lie below a row block's window, else in the window's columns from key 0
GRAD_CASES = [
    (2, 4, 2, 37, 37, 16, 5, 3, None, None),  # both: early row blocks share, later ones separate
    (1, 3, 1, 60, 200, 40, 24, 1, [0], None),  # S = 1, M < N: separate columns
    (2, 4, 2, 40, 130, 24, 16, 35, [0, 12], [[False, True, False, False], [False, False, True, True]]),
    (1, 2, 2, 1, 90, 16, 20, 6, None, None),  # one query row
    (1, 4, 1, 120, 120, 72, 10, 60, [30], None),  # S >= W, MQA, padding over sink tokens
    (1, 2, 1, 30, 64, 16, 40, 30, None, None),  # S + W >= N: plain causal
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=_case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backward_kernel(case, dtype):
    """The C++ backward into poisoned buffers, and through autograd (the eager path, "kernel")."""
    B, Hq, Hkv, M, N, D, window, sink, _, _ = case
    q, k, v, pad = _inputs(case, dtype=dtype, seed=6)
    skip = _skip(case)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    want = _float64_grads(q, k, v, grad_out, pad, skip, window, sink)
    out = tuple(torch.full(t.shape, POISON_FLOAT, dtype=dtype) for t in (q, k, v))
    for isa in [name for name, _ in cpu.builds()]:
        for block_m in (0, 16):
            got = cpu_backward.backward(
                grad_out, q, k, v, causal=True, sm_scale=D**-0.5, key_padding_mask=pad, skip_heads=skip,
                window=window, sink_tokens=sink, block_m=block_m, isa=isa, out=out,
            )  # fmt: skip
            _assert_grads_close(got, want, dtype)
    rule = paths.cpu_backward_path(dtype, built=True, traced=False, window=window, softcap=None, sinks=None)
    assert rule == "kernel"
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    attention(*leaves, key_padding_mask=pad, skip_heads=skip, window=window, sink_tokens=sink).backward(
        grad_out
    )
    _assert_grads_close([t.grad for t in leaves], want, dtype)


@pytest.mark.parametrize("case", GRAD_CASES, ids=_case_id)
def test_chunked_backward(case, monkeypatch):
    """The traced graphs' path (``paths.cpu_backward_path`` -> "chunked"), with small chunks."""
    B, Hq, Hkv, M, N, D, window, sink, _, _ = case
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 3 * B * Hq * (window + sink))
    monkeypatch.setattr(paths, "cpu_backward_path", lambda *args, **kwargs: "chunked")
    q, k, v, pad = _inputs(case, seed=8)
    skip = _skip(case)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    attention(*leaves, key_padding_mask=pad, skip_heads=skip, window=window, sink_tokens=sink).backward(
        grad_out
    )
    _assert_grads_close(
        [t.grad for t in leaves], _float64_grads(q, k, v, grad_out, pad, skip, window, sink), torch.float32
    )


def test_cpu_backward_keys_no_row_sees_get_zero_and_are_never_read():
    """40 rows at the end of 300 keys, window 16, S = 4: keys 4..244 are seen by no row, and the blocks of
    rows read only the vectors (8 or 16 keys) holding a sink token or a window key. With NaN in the keys
    between those (16..239), the C++ backward's gradients of q and of the other keys match the clean
    oracle's, and theirs are exactly 0. (A NaN in a loaded vector may make the group's dq NaN: the
    contract leaves that unspecified, reference.py.)"""
    q, k, v = make_qkv(1, 4, 2, 40, 300, 16, seed=13)
    window, sink, lo, hi = 16, 4, 16, 240
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, lo:hi] = float("nan")
    v_bad[:, :, lo:hi] = float("nan")
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(14))
    want = _float64_grads(q, k, v, grad_out, None, None, window, sink)
    dq, dk, dv = cpu_backward.backward(
        grad_out, q, k_bad, v_bad, causal=True, sm_scale=0.25, key_padding_mask=None, skip_heads=None,
        window=window, sink_tokens=sink,
    )  # fmt: skip
    assert (dk[:, :, sink:245] == 0).all() and (dv[:, :, sink:245] == 0).all()
    keep = torch.cat([torch.arange(lo), torch.arange(hi, 300)])
    _assert_grads_close(
        (dq, dk[:, :, keep], dv[:, :, keep]),
        (want[0], want[1][:, :, keep], want[2][:, :, keep]),
        torch.float32,
    )


# -- the operator: schema, fake kernel, torch.compile ----------------------------------------------------


def test_operator_schema_and_fake_kernel():
    q, k, v = make_qkv(1, 4, 2, 9, 20, 16)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    fwd = torch.ops.retmask.attention_fwd.default
    args = (q, k, v, None, None, None, True, 0.25, 3, 4, None, "cpu", False, 2)
    torch.library.opcheck(fwd, args)
    out, argmax, _ = fwd(*args)
    ref, ref_am = reference_attention(q, k, v, sm_scale=0.25, argmax_rows=3, window=4, sink_tokens=2)
    torch.testing.assert_close(out, ref, **OUT_TOL[torch.float32])
    assert torch.equal(argmax, ref_am)


def test_torch_compile_fullgraph():
    """A compiled call sees one operator node; its traced backward takes the chunked path."""
    q, k, v = make_qkv(1, 4, 2, 24, 40, 16, seed=15)

    def f(q, k, v):
        out, argmax = attention(q, k, v, window=6, sink_tokens=3, return_argmax=True, backend="cpu")
        return out, argmax

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, argmax = compiled(*leaves)
    ref, ref_am = reference_attention(q, k, v, window=6, sink_tokens=3, argmax_rows=24)
    torch.testing.assert_close(out, ref, **OUT_TOL[torch.float32])
    assert torch.equal(argmax, ref_am)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(16))
    out.backward(grad_out)
    _assert_grads_close(
        [t.grad for t in leaves], _float64_grads(q, k, v, grad_out, None, None, 6, 3), torch.float32
    )


# -- Triton (the interpreter on CPU-only machines: tiny shapes) --------------------------------------------

# (B, Hq, Hkv, M, N, D, window, sink, pads, skip rows), B = 1, N <= 40, D = 16; the interpreter's tiles are
# 32 rows x 16 keys, so the sink tokens sit in blocks below the window's, or share its first block
TRITON_CASES = [
    (1, 2, 1, 40, 40, 16, 4, 3, None, None),  # prefill, S < a key block
    (1, 2, 2, 9, 40, 16, 5, 17, [6], [[True, False]]),  # M < N, S spans two blocks, padding, skipped head
    (1, 2, 1, 1, 40, 16, 6, 1, None, None),  # decode, S = 1
    (1, 2, 1, 1, 37, 16, 9, 20, [3], None),  # decode, S >= W, padding
    (1, 2, 1, 20, 33, 16, 8, 30, None, None),  # S + W >= N: plain causal
]


@pytest.fixture
def triton_modules(monkeypatch):
    # tests/conftest.py sets TRITON_INTERPRET=1 on machines without a GPU, so this always holds there
    assert INTERPRET or torch.cuda.is_available(), "Triton needs a GPU or TRITON_INTERPRET=1"
    from retmask.kernels.triton import backend as triton_backend
    from retmask.kernels.triton import common as triton_common
    from retmask.kernels.triton import decode as triton_decode

    monkeypatch.setattr(triton_common, "POISON_OUTPUTS", True)
    return triton_backend, triton_decode


@pytest.mark.parametrize("case", TRITON_CASES, ids=_case_id)
@pytest.mark.parametrize("sync_free", [False, True])
def test_triton_forward_and_backward(case, sync_free, triton_modules, monkeypatch):
    from retmask.kernels.triton import common as triton_common

    monkeypatch.setattr(triton_common, "FORCE_SYNC_FREE", sync_free)
    B, Hq, Hkv, M, N, D, window, sink, _, _ = case
    q, k, v, pad = _inputs(case, seed=17)
    skip = _skip(case)
    kw = dict(key_padding_mask=pad, skip_heads=skip, window=window, sink_tokens=sink)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, argmax = on_test_device(attention)(*leaves, return_argmax=True, backend="triton", **kw)
    _check_forward(out.detach(), argmax, case, q, k, v, pad, skip, M)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(18))
    out.backward(grad_out)
    _assert_grads_close(
        [t.grad for t in leaves], _float64_grads(q, k, v, grad_out, pad, skip, window, sink), torch.float32
    )


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_splits_and_ties(splits, triton_modules):
    """Split 0 takes the sink tokens: the argmax keeps the smallest of tied keys whichever split holds
    them, and never picks the invisible key."""
    _, triton_decode = triton_modules
    for invisible_top in (False, True):
        q, k, v, mid, _ = _tie_inputs(40, 8, 3, invisible_top=invisible_top)
        out, argmax, _ = on_test_device(triton_decode.decode_forward)(
            q, k, v, key_padding_mask=None, skip_heads=None, sm_scale=0.25, argmax_rows=1, return_lse=False,
            window=8, sink_tokens=3, num_splits=splits, block_n=16,
        )  # fmt: skip
        ref, ref_am = reference_attention(q, k, v, sm_scale=0.25, argmax_rows=1, window=8, sink_tokens=3)
        torch.testing.assert_close(out, ref, **OUT_TOL[torch.float32])
        assert torch.equal(argmax, ref_am) and argmax[0, 0, 0] == 1


def test_triton_never_loads_keys_no_row_sees(triton_modules):
    """6 rows at the end of 40 keys (positions 34..39), window 3, S = 3, 16-key blocks: keys 3..31 are in no
    row's view, and the block [16, 32) holds neither a sink token nor a window key; NaN there changes no
    output (prefill and split-key kernels) and no dq, and the dk / dv of keys no row sees are 0."""
    from retmask.kernels.triton import bwd as triton_bwd
    from retmask.kernels.triton import fwd as triton_fwd

    q, k, v = make_qkv(1, 2, 1, 6, 40, 16, seed=19)
    window, sink, lo, hi = 3, 3, 16, 32
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, lo:hi] = float("nan")
    v_bad[:, :, lo:hi] = float("nan")
    kw = dict(
        causal=True, sm_scale=0.25, key_padding_mask=None, skip_heads=None, window=window, sink_tokens=sink
    )
    out, _, lse = on_test_device(triton_fwd.attention_forward)(
        q, k_bad, v_bad, argmax_rows=0, return_lse=True, block_m=32, block_n=16, **kw
    )  # fmt: skip
    ref, _ = reference_attention(q, k, v, **kw)
    torch.testing.assert_close(out, ref, **OUT_TOL[torch.float32])
    _, triton_decode = triton_modules
    for splits in (1, 3):  # the split-key kernel on the same 6 rows
        out_split, _, _ = on_test_device(triton_decode.decode_forward)(
            q, k_bad, v_bad, argmax_rows=0, return_lse=False, num_splits=splits, block_n=16, **kw
        )  # fmt: skip
        torch.testing.assert_close(out_split, ref, **OUT_TOL[torch.float32])
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(20))
    dq, dk, dv, _ = on_test_device(triton_bwd.attention_backward)(
        grad_out, q, k_bad, v_bad, out, lse, block_m=32, block_n=16, **kw
    )  # fmt: skip
    want = _float64_grads(q, k, v, grad_out, None, None, window, sink)
    assert (dk[:, :, sink:32] == 0).all() and (dv[:, :, sink:32] == 0).all()
    keep = torch.cat([torch.arange(lo), torch.arange(hi, 40)])
    _assert_grads_close(
        (dq, dk[:, :, keep], dv[:, :, keep]),
        (want[0], want[1][:, :, keep], want[2][:, :, keep]),
        torch.float32,
    )


# -- the Hugging Face attention layer ----------------------------------------------------------------------


def _eager_pattern_mask(M: int, N: int, window: int, sink: int) -> torch.Tensor:
    """The additive 4D mask [1, 1, M, N] of the pattern, for eager attention (bottom-right aligned)."""
    allowed = allowed_keys(M, N, True, None, torch.device("cpu"), window, sink)
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def test_hf_model_call_passes_sink_tokens():
    """``model(..., sliding_window=W, sink_tokens=S)`` reaches every layer of a Llama (no window of its own):
    prefill and step-by-step decoding equal eager attention under the pattern's explicit mask."""
    from ..tiny import tiny_llama

    model, eager = tiny_llama(attn="retmask"), tiny_llama(attn="eager")  # on TEST_DEVICE
    ids = torch.randint(3, 16, (2, 30), generator=torch.Generator().manual_seed(21)).to(model.device)
    window, sink = 6, 3
    mask = _eager_pattern_mask(30, 30, window, sink).expand(2, 1, 30, 30).to(model.device)
    with torch.no_grad():
        got = model(ids, sliding_window=window, sink_tokens=sink).logits
        want = eager(ids, attention_mask=mask).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        step = model(ids[:, :20], sliding_window=window, sink_tokens=sink, use_cache=True)
        logits, cache = [step.logits], step.cache
        for t in range(20, 30):
            step = model(
                ids[:, t : t + 1], cache=cache, sliding_window=window, sink_tokens=sink, use_cache=True
            )
            logits.append(step.logits)
            cache = step.cache
    torch.testing.assert_close(torch.cat(logits, 1), want, atol=1e-4, rtol=1e-4)


def test_hf_sliding_cache_that_dropped_keys_is_refused():
    """Mistral with a window of 5 on every layer: transformers' cache keeps only the last keys of its local
    layers, so a decode step with sink tokens is refused; ``retmask.growing_cache`` keeps them all, and the
    step equals eager attention under the explicit mask."""
    import transformers

    import retmask

    config = transformers.AutoConfig.for_model(
        "mistral", vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2, sliding_window=5,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="retmask").eval()
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    eager.load_state_dict(model.state_dict())  # a config of its own: from_config sets its attention
    eager.eval()
    assert model.config._attn_implementation == "retmask"
    ids = torch.randint(3, 32, (1, 15), generator=torch.Generator().manual_seed(22))
    with torch.no_grad():
        step = model(ids[:, :14], sink_tokens=2, use_cache=True)
        with pytest.raises(ValueError, match="dropped its first .*growing_cache"):
            model(ids[:, 14:], cache=step.cache, sink_tokens=2, use_cache=True)
        cache = retmask.growing_cache(model)
        model(ids[:, :14], cache=cache, sink_tokens=2, use_cache=True)
        got = model(ids[:, 14:], cache=cache, sink_tokens=2, use_cache=True).logits
        want = eager(ids, attention_mask=_eager_pattern_mask(15, 15, 5, 2)).logits[:, 14:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_cpu_kernel_refuses_sink_tokens_without_a_window():
    """The binding checks too (for callers that skip ``attention``'s validation)."""
    q, k, v = make_qkv(1, 2, 1, 4, 6, 8)
    kw = dict(causal=True, sm_scale=0.25, key_padding_mask=None, skip_heads=None)
    with pytest.raises(ValueError, match="sink_tokens.*sliding window"):
        cpu.cpp_forward(q, k, v, argmax_rows=0, sink_tokens=2, **kw)
    with pytest.raises(ValueError, match="sink_tokens.*sliding window"):
        cpu_backward.backward(q, q, k, v, sink_tokens=2, **kw)
    with pytest.raises(ValueError, match="sink_tokens"):
        cpu.cpp_forward(q, k, v, argmax_rows=0, window=2, sink_tokens=-1, **kw)
