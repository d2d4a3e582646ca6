"""Sliding window, logit soft-capping and attention sinks, and the non-finite-input contract.

The oracle (``reference.py``) is first checked against a per-row float64 loop written from the
definitions; every backend is then compared with the oracle on fresh random inputs, with windows smaller
than, equal to and larger than N, windows that cut through a key block, M in {1, some, N}, padding,
GQA, skipped heads and head dims up to 256. Kernel outputs are poisoned first where the backend takes
caller buffers (``test_cpu.py``); here every element of the returned tensors is compared.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from retmask.kernels import attention, reference_attention

from .helpers import assert_argmax_matches, left_padding_mask, make_qkv

# Triton runs these CPU tensors in its interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU).
BACKENDS = ["cpu", *(["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])]
OUT_TOL = {torch.float32: 3e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _triton_cases(request, monkeypatch):
    """Triton cases poison the kernels' output buffers (NaN / -12345, ``triton_common.POISON_OUTPUTS`` as
    in test_triton.py), so an element a kernel forgets to write cannot pass."""
    callspec = getattr(request.node, "callspec", None)
    params = callspec.params if callspec is not None else {}
    if params.get("backend") != "triton":
        return
    from retmask.kernels.triton import common as triton_common

    monkeypatch.setattr(triton_common, "POISON_OUTPUTS", True)


def loop_attention(q, k, v, *, sm_scale, window, softcap, sinks, key_padding_mask=None):
    """The definitions, one row at a time, in float64: causal, row i at position N - M + i."""
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
                    if j <= p and (window is None or j > p - window)
                    and (key_padding_mask is None or bool(key_padding_mask[b, j]))
                ]  # fmt: skip
                if not keys:
                    continue
                s = torch.stack([(q[b, h, i].double() @ k[b, kh, j].double()) * sm_scale for j in keys])
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                top = s.max()
                argmax[b, h, i] = keys[int((s == top).nonzero()[0])]
                w = torch.exp(s - top)
                denom = w.sum() + (torch.exp(sinks[h].double() - top) if sinks is not None else 0.0)
                out[b, h, i] = sum(w[n] * v[b, kh, j].double() for n, j in enumerate(keys)) / denom
    return out, argmax


@pytest.mark.parametrize(
    "window,softcap,with_sinks", [(3, None, False), (None, 5.0, False), (None, None, True), (4, 2.0, True)]
)
def test_reference_matches_the_definitions(window, softcap, with_sinks):
    q, k, v = make_qkv(2, 4, 2, 5, 9, 8, dtype=torch.float64, seed=1)
    q = q * 3  # large logits: the cap and the sink both matter
    sinks = torch.randn(4, dtype=torch.float64) if with_sinks else None
    pad = left_padding_mask(2, 9, [0, 3])
    want_out, want_am = loop_attention(
        q, k, v, sm_scale=0.4, window=window, softcap=softcap, sinks=sinks, key_padding_mask=pad
    )
    out, am = reference_attention(
        q,
        k,
        v,
        sm_scale=0.4,
        key_padding_mask=pad,
        argmax_rows=5,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    assert torch.equal(am, want_am)


# (B, Hq, Hkv, M, N, D, window, pads)
SHAPES = [
    (1, 2, 1, 70, 70, 16, 5, None),  # window smaller than a key block, prefill
    (2, 4, 2, 1, 150, 32, 64, [0, 40]),  # decode, window equal to a block, left padding
    (1, 3, 3, 33, 100, 64, 70, None),  # chunk against a cache, window cutting through blocks
    (2, 6, 2, 40, 40, 80, 40, [7, 0]),  # window == N: same as no window
    (1, 2, 1, 20, 50, 96, 500, None),  # window > N
    (1, 4, 1, 17, 17, 256, 9, None),  # Gemma-3 head dim 256, MQA
    (1, 2, 2, 65, 129, 128, 1, None),  # window 1: each row sees only itself
]


def _case_id(c):
    return "B{}_Hq{}_Hkv{}_M{}_N{}_D{}_w{}_pad{}".format(*c)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SHAPES, ids=_case_id)
@pytest.mark.parametrize("softcap,with_sinks", [(None, False), (8.0, False), (None, True), (3.0, True)])
def test_backend_matches_reference(backend, case, softcap, with_sinks):
    B, Hq, Hkv, M, N, D, window, pads = case
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=M + N + D, noncontiguous_q=True)
    q = q * 2
    pad = left_padding_mask(B, N, pads) if pads else None
    sinks = torch.randn(Hq) * 2 if with_sinks else None
    skip = torch.zeros(B, Hq, dtype=torch.bool)
    skip[0, -1] = True
    kw = dict(
        causal=True, sm_scale=D**-0.5, key_padding_mask=pad, skip_heads=skip, window=window, softcap=softcap,
        sinks=sinks,
    )  # fmt: skip
    rows = min(M, 7)
    out, am = attention(q, k, v, return_argmax=True, argmax_rows=rows, backend=backend, **kw)
    ref_out, _ = reference_attention(q.double(), k.double(), v.double(), argmax_rows=0, **kw)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=OUT_TOL[torch.float32])
    assert bool((out[0, -1] == 0).all()), "a skipped head's output is exactly 0"
    assert_argmax_matches(
        am, q[:, :, -rows:], k, causal=True, sm_scale=D**-0.5, key_padding_mask=pad, skip_heads=skip,
        atol=1e-4, window=window, softcap=softcap,
    )  # fmt: skip


# Triton x bf16 is not generated: ``tl.dot`` on bf16 is wrong in the Triton interpreter (triton#11584),
# so there it is checked by the sm_90 compile (triton_aot) only.
@pytest.mark.parametrize(
    "backend,dtype",
    [
        (b, d)
        for b in BACKENDS
        for d in (torch.float16, torch.bfloat16)
        if (b, d) != ("triton", torch.bfloat16)
    ],
)
@pytest.mark.parametrize("sinks_dtype", ["model", torch.float32, torch.float64])
def test_backend_low_precision_features(backend, dtype, sinks_dtype):
    """Sinks in any float dtype: a bf16 model holds its sink logits in bf16 (the CPU backend once passed
    the address of a temporary fp32 copy, freed before the kernel read it: garbage outputs)."""
    q, k, v = make_qkv(1, 4, 2, 48, 96, 64, dtype=dtype, seed=5)
    sinks = torch.randn(4).to(dtype if sinks_dtype == "model" else sinks_dtype)
    kw = dict(causal=True, sm_scale=0.125, window=37, softcap=6.0, sinks=sinks)
    out = attention(q, k, v, backend=backend, **kw)
    ref, _ = reference_attention(q, k, v, **kw)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=OUT_TOL[dtype])


def test_window_equal_to_n_is_full_attention():
    q, k, v = make_qkv(1, 2, 1, 30, 30, 16, seed=3)
    full = attention(q, k, v, backend="cpu")
    assert torch.equal(attention(q, k, v, window=30, backend="cpu"), full)
    assert torch.equal(attention(q, k, v, window=10_000, backend="cpu"), full)


def test_window_leaving_no_valid_key_gives_zero_and_minus_one():
    # Row positions 0..7; the first 6 keys are padding; window 2 -> rows 0..5 see nothing valid.
    q, k, v = make_qkv(1, 2, 1, 8, 8, 16, seed=4)
    pad = left_padding_mask(1, 8, [6])
    for backend in ["reference", *BACKENDS]:
        out, am = attention(q, k, v, key_padding_mask=pad, window=2, return_argmax=True, backend=backend)
        assert bool((out[:, :, :6] == 0).all()) and bool((am[:, :, :6] == -1).all()), backend
        assert bool((am[:, :, 6:] >= 6).all()), backend


# -- gradients -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "window,softcap,with_sinks", [(6, None, False), (None, 4.0, False), (None, None, True), (9, 3.0, True)]
)
def test_gradients_match_reference(backend, window, softcap, with_sinks):
    q, k, v = make_qkv(2, 4, 2, 24, 40, 16, seed=11)
    q = q * 2
    sinks = torch.randn(4) if with_sinks else None
    pad = left_padding_mask(2, 40, [0, 9])
    skip = torch.tensor([[False, False, True, False], [False, False, False, False]])
    grad = torch.randn(2, 4, 24, 16)
    kw = dict(
        causal=True, sm_scale=0.3, key_padding_mask=pad, skip_heads=skip, window=window, softcap=softcap,
    )  # fmt: skip

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        s = sinks.detach().to(dtype).requires_grad_(True) if sinks is not None else None
        out = fn(*leaves, sinks=s, **kw)
        out = out[0] if isinstance(out, tuple) else out
        (out * grad.to(dtype)).sum().backward()
        return [t.grad for t in leaves] + ([s.grad] if s is not None else [])

    got = grads(lambda *a, **k_: attention(*a, backend=backend, **k_), torch.float32)
    want = grads(reference_attention, torch.float64)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)
    assert bool((got[0][0, 2] == 0).all()), "a skipped head gets no gradient"


def test_sinks_gradient_by_finite_differences():
    q, k, v = make_qkv(1, 2, 1, 5, 7, 8, dtype=torch.float64, seed=2)
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(
        lambda s: attention(q, k, v, sinks=s, window=3, softcap=2.0, backend="reference"), (sinks,)
    )


# -- non-finite inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("features", [{}, {"window": 4, "softcap": 5.0, "sinks": True}])
def test_non_finite_queries_and_keys_poison_their_rows(backend, features):
    """A NaN/+inf logit poisons its row: NaN out, argmax -1 (and only that row)."""
    B, Hq, Hkv, M, N, D = 1, 4, 2, 6, 20, 16
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=9)
    kw = dict(features)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(Hq)
    capped = "softcap" in kw
    q[0, 0, 2, 3] = float("nan")  # query row 2 of head 0
    q[0, 1, 4, 0] = float("inf")  # query row 4 of head 1: +-inf logits (finite once soft-capped)
    k[0, 1, N - 3, 5] = float("nan")  # a key of kv head 1 (query heads 2, 3), seen by rows >= M - 3
    out, am = attention(q, k, v, return_argmax=True, backend=backend, **kw)
    ref_out, ref_am = reference_attention(q, k, v, argmax_rows=M, **kw)
    nan_rows = torch.isnan(out).any(-1)
    assert torch.equal(nan_rows, torch.isnan(out).all(-1)), "a poisoned row is NaN in every element"
    assert torch.equal(nan_rows, torch.isnan(ref_out).any(-1)), "NaN rows agree with the oracle"
    assert bool(nan_rows[0, 0, 2]) and bool(am[0, 0, 2] == -1), "NaN query row: NaN out, argmax -1"
    assert bool(nan_rows[0, 1, 4]) != capped and bool(am[0, 1, 4] == -1) != capped, "inf query row"
    assert bool(nan_rows[0, 2:, M - 3 :].all()) and bool((am[0, 2:, M - 3 :] == -1).all()), "NaN key"
    assert not bool(nan_rows[0, 2:, : M - 3].any()), "rows before the NaN key are untouched"
    finite = ~nan_rows
    torch.testing.assert_close(out[finite], ref_out[finite], rtol=0, atol=3e-5)
    assert torch.equal(am == -1, ref_am == -1)
    assert torch.equal(am[am >= 0], ref_am[am >= 0])
    # A skipped head never reads its inputs: exact 0 and -1 even with NaN inside.
    skip = torch.tensor([True, False, False, False])
    out_s, am_s = attention(q, k, v, skip_heads=skip, return_argmax=True, backend=backend, **kw)
    assert bool((out_s[0, 0] == 0).all()) and bool((am_s[0, 0] == -1).all())


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_non_finite_values_reach_the_output_not_the_argmax(backend):
    q, k, v = make_qkv(1, 2, 1, 6, 20, 16, seed=10)
    _, clean_am = attention(q, k, v, return_argmax=True, window=5, backend=backend)
    v[0, 0, 16, 7] = float("nan")  # seen by the rows at positions 16..19 = the last 4 rows (window 5)
    out, am = attention(q, k, v, return_argmax=True, window=5, backend=backend)
    # Rows that see the key are NaN; rows that do not may be NaN too (a zero weight times NaN is NaN,
    # as in eager attention), so only the first group is asserted.
    assert bool(torch.isnan(out[0, :, 2:]).any(-1).all())
    assert torch.equal(am, clean_am), "v does not enter the logits"


# -- empty inputs and bad arguments ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("shape", [(0, 4, 2, 3, 5), (2, 0, 1, 3, 5), (2, 4, 2, 0, 5), (1, 2, 1, 0, 0)])
def test_empty_inputs(backend, shape):
    B, Hq, Hkv, M, N = shape
    q, k, v = torch.randn(B, Hq, M, 8), torch.randn(B, Hkv, N, 8), torch.randn(B, Hkv, N, 8)
    out, am = attention(q, k, v, return_argmax=True, backend=backend)
    assert out.shape == (B, Hq, M, 8) and out.dtype == q.dtype
    assert am.shape == (B, Hq, 0) and am.dtype == torch.int64
    assert attention(q, k, v, backend=backend).shape == (B, Hq, M, 8)
    # in a training graph: zero gradients for every input (SDPA's answer), not "does not require grad"
    sinks = torch.randn(Hq, requires_grad=True)
    for t in (q, k, v):
        t.requires_grad_(True)
    attention(q, k, v, sinks=sinks, backend=backend).sum().backward()
    for t in (q, k, v, sinks):
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"causal": "false"}, "causal and return_argmax must be bools, got 'false'"),
        ({"return_argmax": "no"}, "must be bools, got True and 'no'"),
        ({"sm_scale": float("nan")}, "sm_scale must be finite"),
        ({"sm_scale": math.inf}, "sm_scale must be finite"),
        ({"sm_scale": "0.1"}, "sm_scale must be a finite float"),
        ({"window": 0}, "window must be >= 1"),
        ({"window": -3}, "window must be >= 1"),
        ({"window": 2.5}, "window must be a positive int"),
        ({"window": True}, "window must be a positive int"),
        ({"window": 4, "causal": False}, "needs causal=True"),
        ({"softcap": 0.0}, "softcap must be a finite float > 0"),
        ({"softcap": -1.0}, "softcap must be a finite float > 0"),
        ({"softcap": float("inf")}, "softcap must be a finite float > 0"),
        ({"sinks": torch.zeros(3)}, r"sinks must have shape \[Hq\] = \[4\]"),
        ({"sinks": torch.zeros(1, 4)}, r"sinks must have shape \[Hq\] = \[4\]"),
        ({"sinks": torch.zeros(4, dtype=torch.int64)}, "sinks must be a floating-point tensor"),
        ({"sinks": [0.0] * 4}, "sinks must be a float tensor"),
        ({"sinks": torch.zeros(4, device="meta")}, "sinks is on meta"),
    ],
)
def test_bad_feature_arguments_name_the_problem(kwargs, match):
    q, k, v = make_qkv(1, 4, 2, 3, 5, 8)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, **kwargs)
