"""The C++ CPU attention backward (retmask.kernels.cpu_backward) against float64 autograd through the
plain-torch reference: fresh random inputs, awkward shapes (rows, keys and head dims off the vector width
and the row block, GQA / MQA, fewer queries than keys, one query), causal or not, sliding windows, key
padding (with rows that see no key), skipped heads (a whole kv group too), strided inputs and output
gradient, every kernel build this CPU runs, and outputs poisoned with NaN so that an unwritten element
fails.
"""

from __future__ import annotations

import pytest
import torch

from retmask.kernels.cpu import backend as cpu
from retmask.kernels.cpu import backward as cpu_backward
from retmask.kernels.reference import reference_attention

from .helpers import POISON_FLOAT, left_padding_mask, make_qkv

TOL = {torch.float32: 2e-5, torch.bfloat16: 1.2e-2, torch.float16: 2e-3}

# (B, Hq, Hkv, M, N, D)
SHAPES = [
    (2, 4, 2, 37, 37, 16),  # GQA, rows and keys off the vector width
    (1, 3, 1, 5, 70, 40),  # MQA, 5 queries against 70 keys, D not a multiple of 16
    (3, 6, 3, 100, 163, 64),  # a DPO-like batch, rectangular
    (1, 2, 2, 1, 33, 8),  # one query (decode), tiny head dim
    (2, 9, 3, 130, 130, 72),  # SmolLM2's heads, D = 72 (one full vector + a tail)
]


def poisoned(*like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(torch.full(t.shape, POISON_FLOAT, dtype=t.dtype) for t in like)


def float64_grads(q, k, v, grad_out, *, causal, mask, skip, scale, window=None):
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    out, _ = reference_attention(
        qd, kd, vd, causal=causal, sm_scale=scale, key_padding_mask=mask, skip_heads=skip, window=window
    )
    return torch.autograd.grad(out, (qd, kd, vd), grad_out.double())


def assert_close(got, want, dtype, what):
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == dtype, (what, name)
        assert not torch.isnan(g).any(), (what, name, "unwritten (NaN poison) or NaN")
        err = ((g.double() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item()
        assert err < TOL[dtype], (what, name, err)


def run_case(shape, *, dtype, causal, masked, skip_some, seed=0, **kwargs):
    B, Hq, Hkv, M, N, D = shape
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, dtype=dtype, seed=seed)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    mask = skip = None
    if masked:  # left padding, and the last row's last third padded as well
        mask = left_padding_mask(B, N, [(3 * b) % max(N // 2, 1) for b in range(B)])
        mask[-1, N - N // 3 :] = False
    if skip_some:
        skip = torch.rand(B, Hq, generator=torch.Generator().manual_seed(seed + 2)) < 0.4
        skip[0, : Hq // Hkv] = True  # the whole first kv group of batch row 0
    scale = D**-0.5
    out = poisoned(q, k, v)
    got = cpu_backward.backward(grad_out, q, k, v, causal=causal, sm_scale=scale, key_padding_mask=mask,
                                skip_heads=skip, out=out, **kwargs)  # fmt: skip
    assert all(g is o for g, o in zip(got, out, strict=True))
    want = float64_grads(
        q, k, v, grad_out, causal=causal, mask=mask, skip=skip, scale=scale, window=kwargs.get("window")
    )
    return got, want, skip


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(shape, causal, masked, dtype):
    got, want, _ = run_case(shape, dtype=dtype, causal=causal, masked=masked, skip_some=masked)
    assert_close(got, want, dtype, (shape, causal, masked))


@pytest.mark.parametrize("isa", [name for name, _ in cpu.builds()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_build_and_dtype(isa, dtype):
    got, want, _ = run_case((2, 6, 2, 45, 51, 24), dtype=dtype, causal=True, masked=True, skip_some=True,
                            seed=5, isa=isa)  # fmt: skip
    assert_close(got, want, dtype, isa)


# (B, Hq, Hkv, M, N, D, window, block_m)
WINDOWS = [
    (2, 4, 2, 37, 37, 16, 5, 0),  # a window much smaller than the block
    (1, 3, 1, 50, 90, 40, 17, 7),  # fewer queries than keys, several row blocks
    (2, 4, 1, 130, 130, 64, 33, 16),
    (1, 2, 2, 1, 33, 8, 4, 0),  # one query
    (2, 9, 3, 200, 200, 72, 64, 0),
    (1, 4, 1, 150, 150, 256, 100, 0),  # Gemma-3's head dim
    (1, 2, 1, 20, 20, 16, 1, 0),  # each row sees only itself
    (1, 2, 1, 20, 20, 16, 20, 0),  # a window of N keys: no window
]


@pytest.mark.parametrize("case", WINDOWS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window(case, dtype):
    *shape, window, block_m = case
    got, want, _ = run_case(tuple(shape), dtype=dtype, causal=True, masked=True, skip_some=True, seed=11,
                            window=window, block_m=block_m)  # fmt: skip
    assert_close(got, want, dtype, case)


def test_window_needs_causal():
    q, k, v = make_qkv(1, 2, 1, 8, 8, 16)
    with pytest.raises(ValueError, match="window"):
        cpu_backward.backward(q, q, k, v, causal=False, sm_scale=0.25, key_padding_mask=None, skip_heads=None,
                              window=3)  # fmt: skip


@pytest.mark.parametrize("block_m", [1, 7, 16])
def test_several_row_blocks(block_m):
    """Blocks of whole query rows: the causal key range grows from block to block."""
    got, want, _ = run_case((2, 4, 2, 50, 60, 32), dtype=torch.float32, causal=True, masked=True, skip_some=False,
                            seed=7, block_m=block_m)  # fmt: skip
    assert_close(got, want, torch.float32, block_m)


def test_skipped_heads_get_zero_dq_and_add_nothing():
    got, want, skip = run_case((2, 6, 2, 20, 20, 16), dtype=torch.float32, causal=True, masked=False,
                               skip_some=True, seed=3)  # fmt: skip
    dq, dk, dv = got
    assert skip.any() and (dq[skip] == 0).all()
    assert (dk[0, 0] == 0).all() and (dv[0, 0] == 0).all()  # batch row 0's first group: all its heads skipped
    assert_close(got, want, torch.float32, "skip")


def test_rows_without_a_key_get_zero_gradient():
    q, k, v = make_qkv(2, 2, 1, 12, 12, 16, seed=4)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :5] = False  # causal: rows 0-4 of batch row 1 see no valid key
    grad_out = torch.randn(q.shape)
    dq, dk, dv = cpu_backward.backward(grad_out, q, k, v, causal=True, sm_scale=0.25, key_padding_mask=mask,
                                       skip_heads=None, out=poisoned(q, k, v))  # fmt: skip
    assert (dq[1, :, :5] == 0).all() and (dk[1, :, :5] == 0).all() and (dv[1, :, :5] == 0).all()
    want = float64_grads(q, k, v, grad_out, causal=True, mask=mask, skip=None, scale=0.25)
    assert_close((dq, dk, dv), want, torch.float32, "empty rows")


def test_strided_inputs_and_expanded_output_gradient():
    """q as transformers passes it (a transposed view), k / v sliced from a wider buffer, and the output
    gradient of ``out.sum()``: one value expanded with stride 0."""
    q, _, _ = make_qkv(2, 4, 2, 30, 30, 16, seed=6, noncontiguous_q=True)
    kv = torch.randn(2, 2, 30, 48, generator=torch.Generator().manual_seed(7))
    k, v = kv[..., :16], kv[..., 32:]
    grad_out = torch.ones(()).expand(q.shape)
    got = cpu_backward.backward(grad_out, q, k, v, causal=True, sm_scale=0.25, key_padding_mask=None,
                                skip_heads=None, out=poisoned(q, k, v))  # fmt: skip
    want = float64_grads(q, k, v, grad_out, causal=True, mask=None, skip=None, scale=0.25)
    assert_close(got, want, torch.float32, "strided")


def test_ties_and_equal_keys():
    """Duplicate keys (equal logits): the softmax splits the weight evenly, and so do the gradients."""
    q, k, v = make_qkv(1, 2, 1, 9, 9, 16, seed=8)
    k[:, :, 4] = k[:, :, 2]
    grad_out = torch.randn(q.shape)
    got = cpu_backward.backward(grad_out, q, k, v, causal=False, sm_scale=0.25, key_padding_mask=None,
                                skip_heads=None)  # fmt: skip
    assert_close(got, float64_grads(q, k, v, grad_out, causal=False, mask=None, skip=None, scale=0.25),
                 torch.float32, "ties")  # fmt: skip


def test_deterministic_run_to_run_and_close_across_thread_counts():
    """Fixed reduction order: the same call gives the same bits; another thread count may split a kv
    group's heads into other parts (a different order of fp32 sums), never a different result."""
    q, k, v = make_qkv(1, 8, 1, 70, 70, 32, seed=9)
    grad_out = torch.randn(q.shape)
    kw = dict(causal=True, sm_scale=0.2, key_padding_mask=None, skip_heads=None)
    first = cpu_backward.backward(grad_out, q, k, v, **kw)
    again = cpu_backward.backward(grad_out, q, k, v, **kw)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu_backward.backward(grad_out, q, k, v, **kw)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(first, single, strict=True):  # fp32 sums in another order: rounding-level differences
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_empty_inputs():
    q, k, v = make_qkv(2, 2, 1, 0, 5, 8)  # no query rows: dk, dv are zeros
    dq, dk, dv = cpu_backward.backward(q.clone(), q, k, v, causal=True, sm_scale=0.3, key_padding_mask=None,
                                       skip_heads=None, out=poisoned(q, k, v))  # fmt: skip
    assert dq.shape == q.shape and (dk == 0).all() and (dv == 0).all()
    q, k, v = make_qkv(0, 2, 1, 3, 5, 8)
    assert cpu_backward.backward(q, q, k, v, causal=True, sm_scale=0.3, key_padding_mask=None,
                                 skip_heads=None)[1].shape == k.shape  # fmt: skip


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: a.update(v=a["v"][..., :8]), "v: shape"),
        (lambda a: a.update(k=a["k"].double()), "k: dtype"),
        (lambda a: a.update(grad_out=a["grad_out"][:, :1]), "dout: shape"),
        (lambda a: a.update(q=a["q"][:, :3], grad_out=a["grad_out"][:, :3]), "Hkv"),
        (lambda a: a.update(key_padding_mask=torch.ones(2, 4, dtype=torch.bool)), "key_padding_mask: shape"),
        (lambda a: a.update(isa="sse9"), "isa"),
        (lambda a: a.update(block_m=-1), "block_m"),
        (lambda a: a.update(q=torch.randn(2, 4, 21, 16), grad_out=torch.randn(2, 4, 21, 16)), "M: 21 query rows"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(change, match):
    q, k, v = make_qkv(2, 4, 2, 20, 20, 16)
    args = dict(grad_out=torch.randn(q.shape), q=q, k=k, v=v, causal=True, sm_scale=0.25, key_padding_mask=None,
                skip_heads=None)  # fmt: skip
    change(args)
    with pytest.raises(ValueError, match=match):
        cpu_backward.backward(**args)
