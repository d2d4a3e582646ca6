"""Triton backend against the reference oracle (runs in the Triton interpreter on CPU-only machines).

Every test poisons the kernels' output buffers (NaN / POISON_INDEX via ``triton_common.POISON_OUTPUTS``), so an
element a kernel forgets to write shows up as a mismatch. Shapes are tiny because the interpreter is
slow; the interpreter tile config (BLOCK_M=32, BLOCK_N=16) still makes them span several ragged
blocks. bf16 is not tested here: ``tl.dot`` on bf16 is wrong in the interpreter (triton#11584).
What the interpreter cannot check, GPU code generation, is covered by compiling the recorded launches
for sm_90 with ptxas (``test_kernels_compile_for_sm90_without_large_spills``); timing needs a real GPU
(bench/bench_triton.py).

With ``RETMASK_TEST_DEVICE=cuda`` (on a machine with a GPU) the same tests run the compiled kernels on
the GPU, with their GPU tile tables, and also in bfloat16; inputs are still made on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retmask.kernels import attention as _attention
from retmask.kernels import reference_attention
from retmask.kernels.reference import reference_logits
from retmask.kernels.triton import backend as triton_backend
from retmask.kernels.triton import bwd as triton_bwd
from retmask.kernels.triton import common as triton_common
from retmask.kernels.triton import decode as triton_decode
from retmask.kernels.triton import fwd as triton_fwd
from retmask.kernels.triton.common import POISON_INDEX, active_pairs, sync_free

from ..device import TEST_DEVICE, on_test_device
from .helpers import assert_argmax_matches, left_padding_mask, make_qkv

# The entry points under test, on TEST_DEVICE (the CPU and the interpreter unless RETMASK_TEST_DEVICE).
attention = on_test_device(_attention)
attention_forward = on_test_device(triton_fwd.attention_forward)
attention_backward = on_test_device(triton_bwd.attention_backward)
decode_forward = on_test_device(triton_decode.decode_forward)
triton_forward = on_test_device(triton_backend.forward)

# Half precisions under test: bf16 only on a GPU (tl.dot on bf16 is wrong in the interpreter).
HALF = [torch.float16] + ([torch.bfloat16] if TEST_DEVICE.type == "cuda" else [])

TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
ARGMAX_ATOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setattr(triton_common, "POISON_OUTPUTS", True)
    monkeypatch.setattr(triton_common, "FORCE_SYNC_FREE", False)


@pytest.fixture(params=["exact", "sync_free"])
def grid_mode(request, monkeypatch):
    """Run a head-skipping test with both grid modes (see triton_common.sync_free). Tests of the split-key
    kernel alone do without: its grid is sync-free in both modes (``test_launch_grids_cover_only_enabled_heads``)."""
    if request.param == "sync_free":
        monkeypatch.setattr(triton_common, "FORCE_SYNC_FREE", True)
    return request.param


def _random_skip(B: int, Hq: int, seed: int, p: float = 0.4) -> torch.Tensor:
    return torch.rand(B, Hq, generator=torch.Generator().manual_seed(seed)) < p


def _reference_lse(
    q, k, *, causal, sm_scale, key_padding_mask, skip_heads, window=None, softcap=None, sinks=None
):
    """fp32 [B, Hq, M] log-sum-exp (with sinks: ``log(sum_j e^{s_j} + e^{sink})``); +inf where a row has no
    valid key or the head is skipped."""
    logits = reference_logits(
        q,
        k,
        causal=causal,
        sm_scale=sm_scale,
        key_padding_mask=key_padding_mask,
        window=window,
        softcap=softcap,
    )
    has_key = torch.isfinite(logits).any(-1)
    if sinks is not None:
        sink = sinks.to(logits.dtype)[None, :, None, None].expand(*logits.shape[:3], 1)
        logits = torch.cat([logits, sink], dim=-1)
    lse = logits.logsumexp(-1)
    lse = lse.masked_fill(~has_key, float("inf"))
    if skip_heads is not None:
        lse = lse.masked_fill(skip_heads[:, :, None], float("inf"))
    return lse.float()


def check_forward(
    q, k, v, *, causal=True, pad=None, skip=None, argmax_rows=None, sm_scale=None, launcher=None,
    window=None, softcap=None, sinks=None, **kw,
):  # fmt: skip
    """Run the Triton forward (``launcher`` or the public entry) and compare out, argmax and lse."""
    D = q.shape[-1]
    scale = D**-0.5 if sm_scale is None else sm_scale
    T = q.shape[2] if argmax_rows is None else argmax_rows
    feats = dict(window=window, softcap=softcap, sinks=sinks)
    if launcher is None:
        out, argmax = attention(
            q, k, v, causal=causal, sm_scale=scale, key_padding_mask=pad, skip_heads=skip,
            return_argmax=True, argmax_rows=T, backend="triton", **feats,
        )  # fmt: skip
        _, _, lse = triton_forward(
            q, k, v, causal=causal, sm_scale=scale, key_padding_mask=pad, skip_heads=skip,
            argmax_rows=T, return_lse=True, **feats,
        )  # fmt: skip
    else:
        out, argmax, lse = launcher(
            q, k, v, causal=causal, sm_scale=scale, key_padding_mask=pad, skip_heads=skip, argmax_rows=T,
            return_lse=True, **feats, **kw,
        )  # fmt: skip
    ref_out, ref_argmax = reference_attention(
        q, k, v, causal=causal, sm_scale=scale, key_padding_mask=pad, skip_heads=skip, argmax_rows=T, **feats
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    assert argmax.dtype == torch.int64 and argmax.shape == (*q.shape[:2], T)
    assert not torch.isnan(out).any(), "unwritten (poisoned) output elements"
    assert not (argmax == POISON_INDEX).any(), "unwritten (poisoned) argmax elements"
    torch.testing.assert_close(out, ref_out, **TOL[q.dtype])
    assert_argmax_matches(
        argmax, q, k, causal=causal, sm_scale=scale, key_padding_mask=pad, skip_heads=skip,
        atol=ARGMAX_ATOL[q.dtype], window=window, softcap=softcap,
    )  # fmt: skip
    ref_lse = _reference_lse(
        q, k, causal=causal, sm_scale=scale, key_padding_mask=pad, skip_heads=skip, **feats
    )  # fmt: skip
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    return out, argmax


# (B, Hq, Hkv, M, N, D): N not a multiple of 16/32, M in {1, some, N}, MHA / GQA / MQA, odd head dims.
FWD_SHAPES = [
    (1, 1, 1, 1, 1, 16),
    (2, 4, 4, 37, 53, 32),  # MHA, M < N, ragged
    (2, 4, 2, 70, 70, 24),  # GQA, prefill M == N, D padded 24 -> 32
    (1, 4, 1, 17, 65, 64),  # MQA
    (2, 2, 1, 33, 33, 96),  # D padded 96 -> 128
    (1, 2, 2, 16, 48, 128),  # exact multiples of the blocks
    (2, 3, 1, 1, 45, 16),  # decode
]


@pytest.mark.parametrize("shape", FWD_SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_forward_matches_reference(shape, causal):
    """Both forward kernels (the public entry sends a shape to one of them, ``paths.triton_forward_kernel``;
    the tests below call it); the split-key kernel up to the 64 rows it is meant for (the interpreter
    runs its one merge program per row slowly)."""
    B, Hq, Hkv, M, N, D = shape
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=hash(shape) % 1000)
    check_forward(q, k, v, causal=causal, launcher=attention_forward)
    if M <= 64:
        check_forward(q, k, v, causal=causal, launcher=decode_forward)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_forward_padding_skips_noncontiguous(dtype, grid_mode):
    B, Hq, Hkv, M, N = 2, 4, 2, 40, 61
    q, k, v = make_qkv(B, Hq, Hkv, M, N, 32, dtype=dtype, seed=3, noncontiguous_q=True)
    assert not q.is_contiguous()
    pad = left_padding_mask(B, N, [0, 29])  # batch 1: rows at positions < 29 see no valid key
    skip = torch.tensor([[False, True, False, True], [True, False, False, False]])
    out, argmax = check_forward(q, k, v, pad=pad, skip=skip, argmax_rows=25)
    assert (out[skip] == 0).all() and (argmax[skip] == -1).all()
    # Batch 1, rows 0..7 sit at positions 21..28 < 29: no valid key -> 0 and -1.
    assert (out[1, :, :8] == 0).all()


def test_forward_noncontiguous_kv_and_custom_scale():
    q, k, v = make_qkv(2, 4, 2, 20, 50, 16, seed=4)
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)  # [B, Hkv, N, D] view of a [B, N, Hkv, D] buffer
    v_t = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert not k_t.is_contiguous()
    check_forward(q, k_t, v_t, sm_scale=0.7, pad=left_padding_mask(2, 50, [3, 0]), argmax_rows=7)


@pytest.mark.parametrize("window", [None, 12])
def test_kernels_read_no_key_past_the_cache_length(window):
    """K / V as views of a longer cache buffer ([B, Hkv, N_max, D] cut at N, as a static KV cache holds
    them) whose slots past N are NaN: no load reads them, so the forward's outputs and the backward's
    gradients equal the reference's."""
    B, Hq, Hkv, M, N, D, n_max = 2, 4, 2, 21, 45, 24, 64
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=41)
    k_buf = torch.full((B, Hkv, n_max, D), float("nan"))
    v_buf = torch.full((B, Hkv, n_max, D), float("nan"))
    k_buf[:, :, :N], v_buf[:, :, :N] = k, v
    k_view, v_view = k_buf[:, :, :N], v_buf[:, :, :N]
    check_forward(q, k_view, v_view, argmax_rows=9, window=window, launcher=attention_forward)
    kw = dict(causal=True, sm_scale=D**-0.5, key_padding_mask=None, skip_heads=None, window=window)
    out, _, lse = attention_forward(q, k_view, v_view, argmax_rows=0, return_lse=True, **kw)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(42))
    *got, _ = attention_backward(grad_out, q, k_view, v_view, out, lse, **kw)
    _, *ref = _grads("reference", q, k, v, grad_out, causal=True, sm_scale=D**-0.5, window=window)
    for name, a, b in zip(("dq", "dk", "dv"), got, ref, strict=True):
        torch.testing.assert_close(a, b, **GRAD_TOL[torch.float32], msg=lambda m, n=name: f"{n}: {m}")


def test_forward_all_heads_skipped(grid_mode):
    q, k, v = make_qkv(2, 4, 2, 9, 30, 16, seed=5)
    skip = torch.ones(2, 4, dtype=torch.bool)
    out, argmax = check_forward(q, k, v, skip=skip)
    assert (out == 0).all() and (argmax == -1).all()


def test_forward_one_dim_skip_mask_and_argmax_rows(grid_mode):
    q, k, v = make_qkv(2, 4, 1, 50, 67, 32, seed=6)
    # argmax_rows not aligned to a tile: the no-argmax launch and the argmax launch share a tile.
    check_forward(q, k, v, skip=torch.tensor([True, False, False, True]).expand(2, 4), argmax_rows=19)
    out, argmax = attention(
        q, k, v, skip_heads=torch.tensor([True, False, False, True]), return_argmax=True, backend="triton"
    )
    assert argmax.shape == (2, 4, 50) and (argmax[:, [0, 3]] == -1).all()


def test_rows_without_valid_key_fully_padded_batch():
    q, k, v = make_qkv(2, 2, 1, 12, 40, 16, seed=7)
    pad = left_padding_mask(2, 40, [40, 35])  # batch 0: no valid key at all
    for causal in (True, False):
        out, argmax = check_forward(q, k, v, causal=causal, pad=pad)
        assert (out[0] == 0).all() and (argmax[0] == -1).all()


@pytest.mark.parametrize("M", [1, 24])
def test_exact_ties_pick_smallest_index(M):
    """q = 0 makes every logit exactly 0: the argmax is the first valid (and causally visible) key."""
    B, Hq, N = 2, 2, 57
    q, k, v = make_qkv(B, Hq, 1, M, N, 16, seed=8)
    q = torch.zeros_like(q)
    pad = left_padding_mask(B, N, [0, 21])
    _, argmax = check_forward(q, k, v, pad=pad)
    assert (argmax[0] == 0).all() and (argmax[1] == 21).all()


def test_duplicate_keys_tie_across_blocks():
    """Copies of the best key in the same block and in later blocks: the smallest index must win."""
    B, Hq, M, N, D = 1, 2, 6, 64, 16
    q, k, v = make_qkv(B, Hq, 1, M, N, D, seed=9)
    q = q[:, :1, :1].expand(B, Hq, M, D).clone()  # every head and row shares one query
    best = q[0, 0, 0] / q[0, 0, 0].norm() * 8  # a key far more aligned with q than any random key
    for j in (5, 9, 37, 60):  # 5 and 9 share a 16-key block; 37 and 60 are in later blocks
        k[0, 0, j] = best
    _, argmax = check_forward(q, k, v, causal=False)
    assert (argmax == 5).all()
    pad = left_padding_mask(B, N, [6])  # key 5 padded out: the next copy, 9, wins
    _, argmax = check_forward(q, k, v, causal=False, pad=pad)
    assert (argmax == 9).all()


@pytest.mark.parametrize("splits", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_decode_splits(splits, dtype):
    B, Hq, Hkv, N = 2, 4, 2, 70
    q, k, v = make_qkv(B, Hq, Hkv, 1, N, 32, dtype=dtype, seed=10 + splits, noncontiguous_q=True)
    pad = left_padding_mask(B, N, [0, 23])
    skip = _random_skip(B, Hq, seed=splits)
    check_forward(
        q, k, v, pad=pad, skip=skip, launcher=decode_forward, num_splits=splits, block_n=16
    )  # fmt: skip


def test_decode_ties_across_splits_and_empty_splits():
    """Exact ties spread over several splits keep the smallest index; splits holding only padding (all
    -inf) must not disturb the merge; a fully padded row gives 0 / -1 / +inf."""
    B, Hq, N = 3, 2, 64
    q, k, v = make_qkv(B, Hq, 1, 1, N, 16, seed=11)
    q = torch.zeros_like(q)  # every logit is 0
    pad = left_padding_mask(B, N, [0, 40, N])  # batch 1: the first two 16-key splits are empty
    out, argmax = check_forward(q, k, v, pad=pad, launcher=decode_forward, num_splits=4, block_n=16)
    assert argmax[:, :, 0].tolist() == [[0, 0], [40, 40], [-1, -1]]
    assert (out[2] == 0).all()


def test_decode_all_heads_skipped_and_no_argmax():
    q, k, v = make_qkv(1, 2, 1, 1, 20, 16, seed=12)
    out, argmax, lse = decode_forward(
        q, k, v, key_padding_mask=None, skip_heads=torch.ones(1, 2, dtype=torch.bool), sm_scale=0.25,
        argmax_rows=1, return_lse=True,
    )  # fmt: skip
    assert (out == 0).all() and (argmax == -1).all() and torch.isinf(lse).all()
    out, argmax, lse = decode_forward(
        q, k, v, key_padding_mask=None, skip_heads=None, sm_scale=0.25, argmax_rows=0, return_lse=False
    )
    assert argmax is None and lse is None
    torch.testing.assert_close(out, reference_attention(q, k, v, sm_scale=0.25)[0])


def test_prefill_launcher_block_sizes():
    """Other tile shapes (BLOCK_M != BLOCK_N, larger tiles) exercise the full/diagonal loop split."""
    q, k, v = make_qkv(1, 2, 1, 45, 70, 16, seed=13)
    pad = left_padding_mask(1, 70, [9])
    for bm, bn in ((16, 32), (64, 16), (16, 16)):
        check_forward(q, k, v, pad=pad, argmax_rows=45, launcher=attention_forward, block_m=bm, block_n=bn)


def test_active_pairs(monkeypatch):
    skip = torch.tensor([[True, False, False], [False, True, True]])
    exact = active_pairs(skip, 2, 3)
    assert exact.grid == 3 and exact.host_fill and exact.pairs.dtype == torch.int32
    assert exact.pairs.tolist() == [1, 2, 3] and exact.disabled is None
    monkeypatch.setattr(triton_common, "FORCE_SYNC_FREE", True)
    free = active_pairs(skip, 2, 3)  # every pair in natural order; the kernels read the flags themselves
    assert free.grid == 6 and not free.host_fill and free.pairs is None
    assert free.disabled.tolist() == [True, False, False, False, True, True]
    none = active_pairs(None, 2, 3)
    assert none.pairs is None and none.disabled is None and none.grid == 6 and not none.host_fill
    monkeypatch.setattr(triton_common, "FORCE_SYNC_FREE", False)
    forced = active_pairs(skip, 2, 3, always_sync_free=True)  # decode's grid, whatever the mode
    assert forced.grid == 6 and not forced.host_fill and forced.disabled.tolist() == free.disabled.tolist()


def test_grid_mode_is_sync_free_while_a_cuda_graph_is_captured(monkeypatch):
    """Capturing a CUDA graph forbids host syncs, so the grid switches to sync-free on its own there."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not sync_free(cpu) and not sync_free(cuda) and not sync_free()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert sync_free(cuda) and not sync_free(cpu)
    monkeypatch.setattr(triton_common, "FORCE_SYNC_FREE", True)
    assert sync_free(cpu) and sync_free()


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="CUDA graphs need a GPU (RETMASK_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("M", [1, 37])
@pytest.mark.parametrize("with_skip", [False, True])
def test_calls_captured_in_a_cuda_graph_replay_on_new_inputs(M, with_skip):
    """``attention()`` (decode and prefill, argmax, skipped heads) captured once in a CUDA graph, then
    replayed on new values copied into the captured inputs, matches an eager call on those values; with
    skipped heads the prefill's capture succeeds only because its grid went sync-free by itself (decode
    always takes the sync-free grid)."""
    B, Hq, Hkv, N, D = 2, 6, 2, 300, 64
    dev = TEST_DEVICE
    q, k, v = (t.to(dev) for t in make_qkv(B, Hq, Hkv, M, N, D, dtype=torch.bfloat16, seed=40 + M))
    skip = _random_skip(B, Hq, seed=41).to(dev) if with_skip else None

    def call():
        return _attention(q, k, v, skip_heads=skip, return_argmax=True, argmax_rows=min(M, 5))

    call()  # compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, argmax_g = call()
    for seed in (42, 43):
        for dst, src in zip(
            (q, k, v), make_qkv(B, Hq, Hkv, M, N, D, dtype=torch.bfloat16, seed=seed), strict=True
        ):
            dst.copy_(src.to(dev))
        graph.replay()
        out_e, argmax_e = call()
        # Same logits and argmax; the output may differ in rounding between a captured and an eager call.
        torch.testing.assert_close(out_g, out_e, **TOL[torch.bfloat16])
        assert torch.equal(argmax_g, argmax_e)
        ref_out, _ = reference_attention(q.float(), k.float(), v.float(), skip_heads=skip)
        torch.testing.assert_close(out_g.float(), ref_out, **TOL[torch.bfloat16])


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    B=st.integers(1, 2),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    N=st.integers(1, 60),
    m_frac=st.floats(0.0, 1.0),
    D=st.sampled_from([8, 16, 40]),
    causal=st.booleans(),
    pad_frac=st.floats(0.0, 1.0),
    skip_seed=st.integers(0, 100),
)
def test_forward_hypothesis_shapes(B, kv_heads, group, N, m_frac, D, causal, pad_frac, skip_seed, grid_mode):
    M = max(1, round(m_frac * N))
    Hq = kv_heads * group
    q, k, v = make_qkv(B, Hq, kv_heads, M, N, D, seed=skip_seed)
    pad = left_padding_mask(B, N, [int(pad_frac * N)] + [0] * (B - 1))
    skip = _random_skip(B, Hq, seed=skip_seed, p=0.3)
    check_forward(q, k, v, causal=causal, pad=pad, skip=skip, argmax_rows=max(1, M // 2))


# ----------------------------------------------------------------------------------------------------
# Backward


def _grads(backend, q, k, v, grad_out, **kw):
    """(out, dq, dk, dv) of ``attention`` for one backend; reference grads in fp32 for fp16 inputs."""
    if backend == "reference" and q.dtype in HALF:
        q, k, v, grad_out = (t.float() for t in (q, k, v, grad_out))
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = attention(q, k, v, backend=backend, **kw)
    out.backward(grad_out)
    return out, q.grad, k.grad, v.grad


GRAD_TOL = {
    torch.float32: dict(atol=5e-5, rtol=5e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=6e-2),
}

# (B, Hq, Hkv, M, N, D, pads, skip rows)
GRAD_CASES = [
    (1, 2, 2, 33, 33, 16, None, None),  # MHA prefill
    (2, 4, 2, 37, 53, 24, [0, 45], [[False, True, False, False], [True, True, False, False]]),  # GQA
    (2, 4, 1, 20, 47, 32, [5, 0], [[False, False, True, False], [False, False, False, False]]),  # MQA
    (2, 2, 1, 1, 40, 16, [0, 12], [[False, True], [False, False]]),  # decode forward, generic backward
    (1, 2, 1, 18, 30, 64, [30], None),  # every key padded: all gradients 0
    (1, 2, 2, 20, 35, 96, [3], None),  # D padded 96 -> 128
]


@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_backward_matches_reference(case, causal, grid_mode):
    B, Hq, Hkv, M, N, D, pads, skip = case
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=20 + M, noncontiguous_q=True)
    pad = None if pads is None else left_padding_mask(B, N, pads)
    skip = None if skip is None else torch.tensor(skip)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(M))
    kw = dict(causal=causal, key_padding_mask=pad, skip_heads=skip)
    got = _grads("triton", q, k, v, grad_out, **kw)
    ref = _grads("reference", q, k, v, grad_out, **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert not torch.isnan(a).any(), f"{name}: NaN (unwritten or keyless rows)"
        torch.testing.assert_close(a, b, **GRAD_TOL[torch.float32], msg=lambda m, n=name: f"{n}: {m}")
    _, dq, dk, dv = got
    if skip is not None:
        assert (dq[skip] == 0).all(), "disabled heads get no dq"
        kv_off = skip.view(B, Hkv, Hq // Hkv).all(-1)
        assert (dk[kv_off] == 0).all() and (dv[kv_off] == 0).all(), "KV heads of a disabled group"
    if pads is not None and pads[0] == N:
        assert (dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all()


@pytest.mark.parametrize("dtype", HALF)
def test_backward_half_noncontiguous_grad_out(dtype, grid_mode):
    B, Hq, Hkv, M, N, D = 2, 4, 2, 40, 40, 32
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, dtype=dtype, seed=30, noncontiguous_q=True)
    # transformers transposes the output: its gradient arrives as a [B, Hq, M, D] view of [B, M, Hq, D].
    grad_out = torch.randn(B, M, Hq, D, generator=torch.Generator().manual_seed(3)).to(dtype).transpose(1, 2)
    kw = dict(
        causal=True, key_padding_mask=left_padding_mask(B, N, [0, 10]), skip_heads=_random_skip(B, Hq, 4)
    )
    got = _grads("triton", q, k, v, grad_out, **kw)
    ref = _grads("reference", q, k, v, grad_out, **kw)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b, **GRAD_TOL[dtype])


def test_backward_all_heads_skipped_and_tile_shapes(grid_mode):
    q, k, v = make_qkv(1, 2, 1, 21, 37, 16, seed=31)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    out, _, lse = attention_forward(
        q, k, v, causal=True, sm_scale=0.25, key_padding_mask=None, skip_heads=None, argmax_rows=0,
        return_lse=True,
    )  # fmt: skip
    _, *ref = _grads("reference", q, k, v, grad_out, causal=True, sm_scale=0.25)
    for bm, bn in ((16, 32), (64, 16)):
        *got, dsinks = attention_backward(
            grad_out, q, k, v, out, lse, causal=True, sm_scale=0.25, key_padding_mask=None,
            skip_heads=None, block_m=bm, block_n=bn,
        )  # fmt: skip
        assert dsinks is None
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, **GRAD_TOL[torch.float32])
    skip = torch.ones(1, 2, dtype=torch.bool)
    dq, dk, dv, _ = attention_backward(
        grad_out, q, k, v, out, lse, causal=True, sm_scale=0.25, key_padding_mask=None, skip_heads=skip
    )
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_tile_tables_cover_head_dims_and_fit_shared_memory(monkeypatch, dtype):
    """Every supported head dim has GPU configs whose pipelined forward tiles fit H100 shared memory."""
    from retmask.kernels.triton import common as tc

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    size = torch.finfo(dtype).bits // 8
    for D in range(1, 257):
        bd = tc.block_d(D)
        f, b = tc.fwd_config(D, dtype), tc.bwd_config(D, dtype)
        d = tc.decode_config(D, dtype)
        assert min(f.block_m, f.block_n, b.block_m, b.block_n) >= 16, "tl.dot needs >= 16 rows/cols"
        smem = (f.block_m * bd + f.num_stages * 2 * f.block_n * bd) * size
        assert smem <= 227 * 1024, (D, dtype, f, smem)
        assert d.block_n >= 16


# Bytes of spill stack a kernel may use. The tiles are chosen by timing on a GPU (bench/tune_triton.py), and
# register allocation differs between Triton versions: a measured winner may spill a little under another
# Triton's ptxas (the D = 128 backward's 64 x 64 / 4-warp tile: 1,496 B of stack in dK/dV under 3.6 on the
# H200, where it still ran in 0.69x the time of the fastest spill-free candidate; 288-408 B here under
# 3.9). More would mean a tile far too large for the registers.
MAX_SPILL = 512


def test_kernels_compile_for_sm90_without_large_spills(tmp_path):
    """GPU code generation, which the interpreter never exercises: the launches the launchers make with
    the GPU tile tables (fp16: prefill with and without argmax, decode, backward; D = 64 and 128, and
    D = 64, 128, 256 with sliding window + soft-capping + sinks) are recorded here and compiled for sm_90
    by ptxas in a process without TRITON_INTERPRET."""
    import json
    import subprocess
    import sys
    from dataclasses import asdict

    from retmask.kernels.triton.aot import record_standard_launches

    variants = [(64, False), (128, False), (64, True), (128, True), (256, True)]
    launches = [launch for d, f in variants for launch in record_standard_launches(torch.float16, d, f)]
    kernels = {launch.kernel for launch in launches}
    assert kernels == {
        "_fwd_kernel", "_decode_partial_kernel", "_decode_merge_kernel",
        "_bwd_preprocess_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel",
    }  # fmt: skip
    assert {launch.constexprs["SOFTCAP"] for launch in launches if launch.kernel == "_bwd_dq_kernel"} == {
        True,
        False,
    }
    assert {launch.constexprs["TRACK_ARGMAX"] for launch in launches if launch.kernel == "_fwd_kernel"} == {
        True,
        False,
    }
    # Compiled as a launch specialises them: unit strides are the constant 1, 16-byte-aligned pointers and
    # strides divisible by 16 carry the hint (without it ptxas saw address arithmetic no launch runs).
    fwd = next(launch for launch in launches if launch.kernel == "_fwd_kernel")
    assert fwd.signature["stride_kd"] == "constexpr" and fwd.constexprs["stride_kd"] == 1
    assert {"Q", "K", "V", "Out", "stride_kn", "stride_qm"} <= set(fwd.divisible)
    assert "sm_scale" not in fwd.divisible
    path = tmp_path / "launches.json"
    path.write_text(json.dumps([asdict(launch) for launch in launches]))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "retmask.kernels.triton.aot", "--compile", str(path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(launches)
    too_large = []
    for launch, res in zip(launches, results, strict=True):
        if res["stack"] > MAX_SPILL:
            too_large.append(f"{launch.label} {launch.kernel}: {res['stack']} B of stack (limit {MAX_SPILL})")
        assert res["shared"] <= 227 * 1024
    assert not too_large, "\n".join(too_large)  # every offender at once: GPU runs are rare


def test_launch_grids_cover_only_enabled_heads():
    """Work is proportional to the enabled heads: the prefill, dQ and preprocess grids enumerate the
    enabled (batch, head) pairs; the dK/dV kernel enumerates KV heads with at least one enabled query
    head (a fully disabled GQA group costs nothing). The decode grid is always sync-free: one program per
    KV head and split, a disabled group's getting no keys."""
    from retmask.kernels.triton.aot import record_launches

    B, Hq, Hkv, M, N, D = 2, 8, 2, 300, 300, 64
    q = torch.zeros(B, Hq, M, D)
    k = torch.zeros(B, Hkv, N, D)

    def grids(skip):
        kw = dict(sm_scale=0.1, key_padding_mask=None, skip_heads=skip)
        with record_launches() as launches:
            attention_forward(q, k, k, causal=True, argmax_rows=0, return_lse=False, **kw)
            decode_forward(q[:, :, :1], k, k, argmax_rows=0, return_lse=False, **kw)
            attention_backward(q, q, k, k, q, torch.zeros(B, Hq, M), causal=True, **kw)
        return {launch.kernel: launch.grid for launch in launches}

    full = grids(None)
    half = torch.zeros(B, Hq, dtype=torch.bool)
    half[:, 1::2] = True  # every other head: each KV group keeps 2 of its 4 heads
    g = grids(half)
    for kernel in ("_fwd_kernel", "_bwd_preprocess_kernel", "_bwd_dq_kernel"):
        assert full[kernel][1] == B * Hq and g[kernel][1] == B * Hq // 2, kernel
        assert full[kernel][0] == g[kernel][0]
    for kernel in ("_decode_partial_kernel", "_bwd_dkdv_kernel"):
        assert g[kernel][1] == full[kernel][1] == B * Hkv, kernel
    assert g["_decode_merge_kernel"] == (B * Hkv, Hq // Hkv)
    group_off = torch.zeros(B, Hq, dtype=torch.bool)
    group_off[0, :4] = True  # the whole first KV group of batch 0
    g = grids(group_off)
    assert g["_bwd_dkdv_kernel"][1] == B * Hkv - 1
    assert g["_decode_partial_kernel"][1] == B * Hkv and g["_decode_merge_kernel"] == (B * Hkv, Hq // Hkv)
    assert g["_fwd_kernel"][1] == B * Hq - 4
    assert "_fwd_kernel" not in grids(torch.ones(B, Hq, dtype=torch.bool))  # nothing enabled: no launch

    # Sync-free mode: one program per pair (disabled ones only write their fixed outputs), no host sync.
    triton_common.FORCE_SYNC_FREE = True
    try:
        for skip in (half, torch.ones(B, Hq, dtype=torch.bool)):
            g = grids(skip)
            for kernel in ("_fwd_kernel", "_bwd_preprocess_kernel", "_bwd_dq_kernel"):
                assert g[kernel][1] == B * Hq, kernel
            for kernel in ("_decode_partial_kernel", "_bwd_dkdv_kernel"):
                assert g[kernel][1] == B * Hkv, kernel
    finally:
        triton_common.FORCE_SYNC_FREE = False


def test_decode_large_group_mqa():
    """20 query heads on one KV head: the decode tile holds the group as 32 (padded) rows."""
    q, k, v = make_qkv(2, 20, 1, 1, 40, 16, seed=14)
    skip = _random_skip(2, 20, seed=15)
    skip[1] = True  # batch 1: the whole group disabled -> not launched
    out, argmax = check_forward(q, k, v, skip=skip, pad=left_padding_mask(2, 40, [7, 0]))
    assert (out[1] == 0).all() and (argmax[1] == -1).all()


# (B, Hq, Hkv, M, N, D, block_rows, splits, pads): M * G pairs (query row, head) per KV head, cut into
# row blocks of block_rows, keys into splits.
FEW_ROW_CASES = [
    (2, 4, 2, 5, 70, 32, 16, 3, [0, 23]),  # 10 pairs, one row block; padding ends inside a split
    (1, 6, 2, 13, 53, 16, 16, 2, None),  # 39 pairs: three row blocks, the last one ragged
    (2, 4, 1, 9, 40, 24, 32, 5, [7, 0]),  # MQA, D padded 24 -> 32, more splits than key blocks allow
    (1, 3, 3, 30, 30, 16, 16, 1, None),  # MHA, M == N: every row on the causal diagonal
]


@pytest.mark.parametrize("case", FEW_ROW_CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_split_key_forward_with_several_rows(case, causal):
    """Verification passes and other few-row calls: row blocks holding several query rows of every head
    of a group, the causal diagonal inside key splits, the argmax of the last rows only."""
    B, Hq, Hkv, M, N, D, rows, splits, pads = case
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=M * N, noncontiguous_q=True)
    pad = None if pads is None else left_padding_mask(B, N, pads)
    skip = _random_skip(B, Hq, seed=M)
    check_forward(
        q, k, v, causal=causal, pad=pad, skip=skip, argmax_rows=M - 2, launcher=decode_forward,
        num_splits=splits, block_n=16, block_rows=rows,
    )  # fmt: skip


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_split_key_features_with_several_rows(splits, dtype):
    """Window (an edge that moves by row inside the tile), soft-capping and sinks with several rows."""
    B, Hq, Hkv, M, N = 2, 4, 2, 7, 90
    q, k, v = make_qkv(B, Hq, Hkv, M, N, 32, dtype=dtype, seed=60 + splits, noncontiguous_q=True)
    pad = left_padding_mask(B, N, [0, 70])  # batch 1: padding ends inside the window
    skip = _random_skip(B, Hq, seed=splits)
    for window, softcap in ((45, None), (7, 3.0), (20, 2.0)):
        check_forward(
            q * 2, k, v, pad=pad, skip=skip, launcher=decode_forward, num_splits=splits, block_n=16,
            block_rows=16, window=window, softcap=softcap, sinks=_sinks(Hq, seed=window), argmax_rows=M,
        )  # fmt: skip


def test_forward_kernel_rule():
    """The public entry takes the split-key kernel up to ``SPLIT_KEY_ROWS`` query rows, the prefill kernel
    above (``paths.triton_forward_kernel``)."""
    from retmask.kernels.paths import SPLIT_KEY_ROWS
    from retmask.kernels.triton.aot import record_launches

    k = torch.zeros(1, 2, 100, 16)
    kernels = {}
    for M in sorted({1, SPLIT_KEY_ROWS, SPLIT_KEY_ROWS + 1}):
        with record_launches() as launches:
            triton_forward(
                torch.zeros(1, 4, M, 16), k, k, causal=True, sm_scale=0.25, key_padding_mask=None,
                skip_heads=None, argmax_rows=1, return_lse=False,
            )  # fmt: skip
        kernels[M] = [launch.kernel for launch in launches]
    split = ["_decode_partial_kernel", "_decode_merge_kernel"]
    assert kernels == {1: split, SPLIT_KEY_ROWS: split, SPLIT_KEY_ROWS + 1: ["_fwd_kernel"]}


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    N=st.integers(2, 50),
    m_frac=st.floats(0.0, 1.0),
    causal=st.booleans(),
    pad=st.integers(0, 50),
    seed=st.integers(0, 100),
)
def test_backward_hypothesis_shapes(kv_heads, group, N, m_frac, causal, pad, seed, grid_mode):
    B, Hq, M = 2, kv_heads * group, max(1, round(m_frac * N))
    q, k, v = make_qkv(B, Hq, kv_heads, M, N, 16, seed=seed)
    kw = dict(
        causal=causal, key_padding_mask=left_padding_mask(B, N, [min(pad, N), 0]),
        skip_heads=_random_skip(B, Hq, seed=seed, p=0.3),
    )  # fmt: skip
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed))
    got = _grads("triton", q, k, v, grad_out, **kw)
    ref = _grads("reference", q, k, v, grad_out, **kw)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, **GRAD_TOL[torch.float32])


@pytest.mark.parametrize("M", [1, 30])
def test_arbitrary_padding_mask_with_holes(M):
    """Masks are not only left padding: a padded prefix (whole blocks skipped), holes and a padded tail."""
    B, Hq, Hkv, N = 2, 2, 1, 60
    q, k, v = make_qkv(B, Hq, Hkv, M, N, 16, seed=40 + M)
    pad = torch.rand(B, N, generator=torch.Generator().manual_seed(M)) < 0.7
    pad[0, :35] = False  # batch 0: first valid key at >= 35 -> blocks 0..1 skipped
    pad[1, -5:] = False
    check_forward(q, k, v, pad=pad)
    check_forward(q, k, v, pad=pad, causal=False)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    kw = dict(causal=True, key_padding_mask=pad)
    for a, b in zip(
        _grads("triton", q, k, v, grad_out, **kw), _grads("reference", q, k, v, grad_out, **kw), strict=True
    ):
        torch.testing.assert_close(a, b, **GRAD_TOL[torch.float32])


# ----------------------------------------------------------------------------------------------------
# Sliding window, soft-capping, sinks (reference.py defines them) and the non-finite contract.
# The interpreter tiles are BLOCK_M = 32, BLOCK_N = 16: windows of 5, 16, 20, 37 keys cut through key
# blocks, end on a block edge or span several blocks.


def _sinks(Hq: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(Hq, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


# (B, Hq, Hkv, M, N, D, window, softcap, sinks, pads, argmax_rows)
FEATURE_FWD_CASES = [
    (2, 2, 1, 70, 70, 16, 20, None, True, [0, 25], 40),  # M == N: three query tiles, partial argmax
    (1, 3, 1, 37, 90, 32, 16, 5.0, False, None, 37),  # chunk against a cache, window == BLOCK_N, MQA
    (2, 2, 2, 45, 61, 24, 5, 3.0, True, [9, 0], 45),  # window < BLOCK_N; D padded 24 -> 32
    (1, 2, 1, 33, 33, 16, 1, None, True, None, 33),  # window 1: each row sees only itself
    (1, 2, 1, 20, 40, 256, 9, 10.0, True, [3], 20),  # head dim 256
    (2, 4, 2, 1, 75, 16, 37, 4.0, True, [0, 50], 1),  # decode: window cuts a block, padding
    (1, 2, 1, 1, 40, 16, 40, None, True, None, 1),  # decode, window == N (no effect)
]


@pytest.mark.parametrize("case", FEATURE_FWD_CASES)
def test_features_forward_matches_reference(case, grid_mode):
    B, Hq, Hkv, M, N, D, window, softcap, with_sinks, pads, rows = case
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=M + N + D, noncontiguous_q=True)
    q = q * 2  # larger logits: the cap and the sinks matter
    pad = None if pads is None else left_padding_mask(B, N, pads)
    skip = torch.zeros(B, Hq, dtype=torch.bool)
    skip[-1, 0] = True
    sinks = _sinks(Hq, seed=N) if with_sinks else None
    out, argmax = check_forward(
        q, k, v, pad=pad, skip=skip, argmax_rows=rows, window=window, softcap=softcap, sinks=sinks
    )
    assert (out[-1, 0] == 0).all() and (argmax[-1, 0] == -1).all()


def test_features_prefill_tile_shapes():
    """Other tiles (BLOCK_M != BLOCK_N, larger than the window or not): the three-part key loop (window
    edge masked, interior unmasked, causal diagonal masked) for every geometry."""
    q, k, v = make_qkv(1, 2, 1, 45, 70, 16, seed=13)
    pad = left_padding_mask(1, 70, [30])  # the padding start and the window start compete
    for bm, bn in ((16, 32), (64, 16), (16, 16)):
        for window in (3, 13, 40):
            check_forward(
                q, k, v, pad=pad, argmax_rows=45, launcher=attention_forward, block_m=bm, block_n=bn,
                window=window, softcap=2.0, sinks=_sinks(2, seed=window),
            )  # fmt: skip


@pytest.mark.parametrize("splits", [1, 3])
def test_features_decode_splits(splits):
    B, Hq, Hkv, N = 2, 4, 2, 90
    q, k, v = make_qkv(B, Hq, Hkv, 1, N, 32, seed=50 + splits, noncontiguous_q=True)
    pad = left_padding_mask(B, N, [0, 70])  # batch 1: padding ends inside the window
    skip = _random_skip(B, Hq, seed=splits)
    for window, softcap in ((45, None), (7, 3.0)):
        check_forward(
            q * 2, k, v, pad=pad, skip=skip, launcher=decode_forward, num_splits=splits, block_n=16,
            window=window, softcap=softcap, sinks=_sinks(Hq, seed=window),
        )  # fmt: skip


def test_window_loops_skip_blocks_outside_the_window():
    """Key loops start at the first block inside the window: keys in earlier blocks are never loaded.
    Checked by making them NaN (a loaded NaN value reaches the output even with weight 0 in eager
    attention, and here too: 0 * NaN is NaN in ``tl.dot``): the results match the clean oracle."""
    B, Hq, Hkv, M, N, D, window = 1, 2, 1, 70, 150, 16, 12
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=60)
    # Prefill tiles start at positions 80, 112, 144: the first one's window starts at key 69, in the
    # 16-key block [64, 80); keys 0..63 are outside every row's window.
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, :64] = float("nan")
    v_bad[:, :, :64] = float("nan")
    kw = dict(causal=True, sm_scale=0.25, key_padding_mask=None, skip_heads=None, window=window)
    out, _, lse = attention_forward(
        q, k_bad, v_bad, argmax_rows=0, return_lse=True, block_m=32, block_n=16, **kw
    )
    ref_out, _ = reference_attention(q, k, v, **{**kw, "skip_heads": None})
    torch.testing.assert_close(out, ref_out, **TOL[torch.float32])
    # Decode: the row at position 149 sees keys 138..149; the splits share the blocks from [128, 144).
    dec_q = q[:, :, -1:]
    dec, _, _ = decode_forward(
        dec_q, k_bad, v_bad, argmax_rows=0, return_lse=False, num_splits=3, block_n=16, **kw
    )  # fmt: skip
    torch.testing.assert_close(dec, reference_attention(dec_q, k, v, **kw)[0], **TOL[torch.float32])
    # Backward: dQ programs start at the window's first block; dK/dV programs of blocks no row sees
    # store zeros without reading anything.
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    dq, dk, dv, _ = attention_backward(
        grad_out, q, k_bad, v_bad, out, lse, block_m=32, block_n=16, **kw
    )  # fmt: skip
    _, ref_dq, ref_dk, ref_dv = _grads(
        "reference", q, k, v, grad_out, causal=True, sm_scale=0.25, window=window
    )
    torch.testing.assert_close(dq, ref_dq, **GRAD_TOL[torch.float32])
    assert (dk[:, :, :64] == 0).all() and (dv[:, :, :64] == 0).all()
    torch.testing.assert_close(dk[:, :, 64:], ref_dk[:, :, 64:], **GRAD_TOL[torch.float32])
    torch.testing.assert_close(dv[:, :, 64:], ref_dv[:, :, 64:], **GRAD_TOL[torch.float32])


def test_window_dkdv_programs_visit_only_rows_that_see_their_keys():
    """dK/dV programs loop only over the query rows whose window holds their keys: a NaN upstream
    gradient on the last row must not reach the keys that row does not see (a visited row block would
    add 0 * NaN). M = N = 96, window 8, tiles 32 x 16: the row block [64, 96) is visited by the key
    blocks from [48, 64) on, so keys 0..47 stay finite."""
    q, k, v = make_qkv(1, 2, 1, 96, 96, 16, seed=61)
    kw = dict(causal=True, sm_scale=0.25, key_padding_mask=None, skip_heads=None, window=8)
    out, _, lse = attention_forward(q, k, v, argmax_rows=0, return_lse=True, block_m=32, block_n=16, **kw)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(7))
    grad_out[:, :, -1] = 0.0
    _, ref_dq, ref_dk, ref_dv = _grads("reference", q, k, v, grad_out, causal=True, sm_scale=0.25, window=8)
    grad_out[:, :, -1] = float("nan")
    dq, dk, dv, _ = attention_backward(grad_out, q, k, v, out, lse, block_m=32, block_n=16, **kw)
    torch.testing.assert_close(dq[:, :, :-1], ref_dq[:, :, :-1], **GRAD_TOL[torch.float32])
    torch.testing.assert_close(dk[:, :, :48], ref_dk[:, :, :48], **GRAD_TOL[torch.float32])
    torch.testing.assert_close(dv[:, :, :48], ref_dv[:, :, :48], **GRAD_TOL[torch.float32])


def _feature_grads(backend, q, k, v, sinks, grad_out, **kw):
    """(out, dq, dk, dv, dsinks) of ``attention``; the reference runs in fp32 for fp16 inputs."""
    if backend == "reference" and q.dtype in HALF:
        q, k, v, grad_out = (t.float() for t in (q, k, v, grad_out))
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    s = None if sinks is None else sinks.detach().clone().requires_grad_(True)
    out = attention(q, k, v, sinks=s, backend=backend, **kw)
    out.backward(grad_out)
    return out, q.grad, k.grad, v.grad, None if s is None else s.grad


# (B, Hq, Hkv, M, N, D, window, softcap, sinks, pads, skip rows)
FEATURE_GRAD_CASES = [
    (2, 4, 2, 37, 53, 16, 20, 4.0, True, [0, 30], [[False, True, False, False], [False, False, False, True]]),
    (1, 2, 1, 40, 40, 24, 5, None, True, None, None),  # window < BLOCK_N, M == N
    (2, 3, 3, 20, 47, 16, None, 3.0, False, [5, 0], None),  # soft-capping alone
    (2, 2, 1, 1, 40, 16, 17, 2.0, True, [0, 30], [[False, True], [False, False]]),  # decode forward
    (1, 2, 1, 12, 30, 256, 9, 8.0, True, [4], None),  # head dim 256
    (1, 2, 1, 18, 30, 16, 4, None, True, [30], None),  # every key padded: all gradients 0
]


@pytest.mark.parametrize("case", FEATURE_GRAD_CASES)
def test_features_backward_matches_reference(case, grid_mode):
    B, Hq, Hkv, M, N, D, window, softcap, with_sinks, pads, skip = case
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=70 + M, noncontiguous_q=True)
    q = q * 2
    pad = None if pads is None else left_padding_mask(B, N, pads)
    skip = None if skip is None else torch.tensor(skip)
    sinks = _sinks(Hq, seed=M) if with_sinks else None
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(M))
    kw = dict(causal=True, key_padding_mask=pad, skip_heads=skip, window=window, softcap=softcap)
    got = _feature_grads("triton", q, k, v, sinks, grad_out, **kw)
    ref_sinks = None if sinks is None else sinks.double()
    ref = _feature_grads("reference", q.double(), k.double(), v.double(), ref_sinks, grad_out.double(), **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref, strict=True):
        if b is None:
            assert a is None
            continue
        assert not torch.isnan(a).any(), f"{name}: NaN (unwritten or keyless rows)"
        assert a.dtype == torch.float32
        torch.testing.assert_close(
            a.double(), b, **GRAD_TOL[torch.float32], msg=lambda m, n=name: f"{n}: {m}"
        )
    if skip is not None:
        assert (got[1][skip] == 0).all(), "disabled heads get no dq"
    if pads is not None and pads[0] == N:
        assert all((g[0] == 0).all() for g in got[1:4]) and (got[4] == 0).all()


def test_features_backward_fp16_and_sink_dtypes():
    """fp16 inputs with bf16 sinks: dsinks comes back in the sinks' dtype; only the sinks need a
    gradient (the forward still keeps the lse for the Triton backward)."""
    B, Hq, Hkv, M, N, D = 1, 4, 2, 40, 40, 32
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, dtype=torch.float16, seed=80, noncontiguous_q=True)
    sinks = _sinks(Hq, seed=3, dtype=torch.bfloat16)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).half()
    kw = dict(causal=True, key_padding_mask=left_padding_mask(B, N, [6]), window=19, softcap=6.0)
    got = _feature_grads("triton", q, k, v, sinks, grad_out, **kw)
    ref = _feature_grads("reference", q, k, v, sinks.float(), grad_out, **kw)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **GRAD_TOL[torch.float16])
    assert got[4].dtype == torch.bfloat16 and got[1].dtype == torch.float16
    s = sinks.float().requires_grad_(True)
    attention(q, k, v, sinks=s, backend="triton", **kw).backward(grad_out)
    torch.testing.assert_close(s.grad, ref[4].float(), **GRAD_TOL[torch.float16])


@pytest.mark.parametrize("M", [1, 70])
@pytest.mark.parametrize("features", [{}, {"window": 20, "softcap": 5.0, "sinks": True}])
def test_non_finite_rows_in_every_kernel_path(M, features):
    """NaN / +inf logits poison exactly their rows (NaN out, argmax -1) in the prefill tiles without
    argmax bookkeeping (argmax on the last 5 rows only), the argmax tiles and the decode merge (NaN key
    in one of three splits); skipped heads stay 0 / -1."""
    B, Hq, Hkv, N, D = 1, 4, 2, 80, 16
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=90)
    kw = dict(features)
    if kw.pop("sinks", False):
        kw["sinks"] = _sinks(Hq, seed=1)
    q[0, 0, 0, 3] = float("nan")  # the first row of head 0 (a no-argmax tile when M = 70)
    q[0, 1, -1, 0] = float("inf")  # the last row of head 1: +-inf logits (finite once soft-capped)
    k[0, 1, N - 30, 5] = float("nan")  # kv head 1 (query heads 2, 3), in the second of three splits
    k[0, 0, N - 40, 2] = float("-inf")  # -inf logits count as masked ... and +inf ones poison
    rows = min(M, 5)
    out, am = attention(q, k, v, return_argmax=True, argmax_rows=rows, backend="triton", **kw)
    ref_out, ref_am = reference_attention(q, k, v, argmax_rows=rows, **kw)
    nan_rows = torch.isnan(out).any(-1)
    assert torch.equal(nan_rows, torch.isnan(out).all(-1)), "a poisoned row is NaN in every element"
    assert torch.equal(nan_rows, torch.isnan(ref_out).any(-1)), "NaN rows agree with the oracle"
    assert bool(nan_rows.any()) and (M == 1 or not bool(nan_rows.all()))
    torch.testing.assert_close(out[~nan_rows], ref_out[~nan_rows], **TOL[torch.float32])
    assert torch.equal(am, ref_am), "argmax: -1 on poisoned rows, the oracle's index elsewhere"
    skip = torch.tensor([[True, True, False, False]])
    out_s, am_s = attention(q, k, v, skip_heads=skip, return_argmax=True, backend="triton", **kw)
    assert (out_s[0, :2] == 0).all() and (am_s[0, :2] == -1).all()
    if M == 1:
        out3, am3, _ = decode_forward(
            q, k, v, key_padding_mask=None, skip_heads=None, sm_scale=D**-0.5, argmax_rows=1,
            return_lse=False, num_splits=3, block_n=16, **kw,
        )  # fmt: skip
        assert torch.equal(torch.isnan(out3).any(-1), nan_rows) and torch.equal(am3, ref_am)


def test_shrunk_goes_stages_then_key_block_then_query_block():
    from retmask.kernels.triton.common import TileConfig, shrunk

    seen, cfg = [], TileConfig(64, 32, 4, 2)
    while cfg is not None:
        seen.append((cfg.block_m, cfg.block_n, cfg.num_stages))
        cfg = shrunk(cfg)
    assert seen == [(64, 32, 2), (64, 32, 1), (64, 16, 1), (32, 16, 1), (16, 16, 1)]
    assert all(c.num_warps == 4 for c in [TileConfig(64, 32, 4, 2), shrunk(TileConfig(64, 32, 4, 2))])


def test_launch_fitting_retries_smaller_configs_and_remembers_the_fit(monkeypatch):
    from triton.runtime.errors import OutOfResources

    from retmask.kernels.triton import common as tc

    monkeypatch.setattr(tc, "_FITTED", {})
    tried = []

    def launch(cfg):  # a GPU whose shared memory holds block_n * stages <= 32
        tried.append(cfg)
        if cfg.block_n * cfg.num_stages > 32:
            raise OutOfResources(cfg.block_n * cfg.num_stages, 32, "shared memory")
        return "ran"

    start = tc.TileConfig(128, 64, 8, 3)
    assert tc.launch_fitting(("k",), start, launch) == "ran"
    assert tried[-1] == tc.TileConfig(128, 32, 8, 1) and len(tried) == 4  # stages 3, 2, 1; then keys 32
    tried.clear()
    assert tc.launch_fitting(("k",), start, launch) == "ran"
    assert tried == [tc.TileConfig(128, 32, 8, 1)], "the fitted config is remembered per key"

    def never(cfg):
        raise OutOfResources(1 << 20, 1, "shared memory")

    with pytest.raises(OutOfResources):
        tc.launch_fitting(("other",), tc.TileConfig(16, 16, 1, 1), never)

    def broken(cfg):
        raise RuntimeError("not a resource problem")

    with pytest.raises(RuntimeError, match="not a resource"):
        tc.launch_fitting(("third",), start, broken)


class _SmallGpu:
    """Stands in for a Triton kernel on a GPU with little shared memory: launches whose tiles exceed
    BLOCK_N 16 or one pipeline stage are refused with OutOfResources, the others run the real kernel."""

    def __init__(self, kernel, refused):
        self.kernel, self.refused = kernel, refused

    def __getitem__(self, grid):
        from triton.runtime.errors import OutOfResources

        def run(*args, **kwargs):
            if kwargs.get("BLOCK_N", 16) > 16 or kwargs.get("num_stages", 1) > 1:
                self.refused.append(kwargs.get("BLOCK_N"))
                raise OutOfResources(1 << 18, 1 << 16, "shared memory")
            return self.kernel[grid](*args, **kwargs)

        return run


def test_kernels_fall_back_to_tiles_the_gpu_can_run(monkeypatch):
    """Forward, decode and backward shrink their tiles where the GPU refuses them and still give the
    reference's results (the fallback's retry of the backward reruns all three kernels)."""
    from retmask.kernels.triton import common as tc

    monkeypatch.setattr(tc, "_FITTED", {})
    # Interpreter tiles are already 16 keys wide; start from wider ones, as on a GPU.
    monkeypatch.setattr(tc, "_INTERPRET_CONFIG", tc.TileConfig(32, 32, 1, 2))
    refused: list = []
    for module, names in (
        (triton_fwd, ["_fwd_kernel"]),
        (triton_decode, ["_decode_partial_kernel"]),
        (triton_bwd, ["_bwd_dkdv_kernel"]),
    ):
        for name in names:
            monkeypatch.setattr(module, name, _SmallGpu(getattr(module, name), refused))
    q, k, v = make_qkv(2, 4, 2, 37, 53, 16, seed=90)
    pad = left_padding_mask(2, 53, [0, 9])
    check_forward(q, k, v, pad=pad, argmax_rows=5)
    check_forward(q[:, :, -9:], k, v, pad=pad, launcher=decode_forward)  # the split-key kernel, 9 rows
    check_forward(q[:, :, -1:], k, v, pad=pad)  # decode
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(91))
    got = _grads("triton", q, k, v, grad_out, key_padding_mask=pad)
    ref = _grads("reference", q, k, v, grad_out, key_padding_mask=pad)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, **GRAD_TOL[torch.float32])
    assert refused, "the small GPU refused the first tiles"
    assert {key[0] for key, _ in tc._FITTED} == {"fwd", "decode", "bwd"}
    assert all(c.block_n == 16 and c.num_stages == 1 for c in tc._FITTED.values())
