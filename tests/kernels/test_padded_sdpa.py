"""SDPA per key run (``retmask/kernels/padded_sdpa.py``) and its use in the CPU backend's backward: same
outputs and gradients as one SDPA call with the dense [B, 1, M, N] mask, for left and right padding, rows
without any valid key, GQA, both dtypes; masks that are not one run per row keep the dense call, and so
does a traced graph."""

from __future__ import annotations

import pytest
import torch

from retmask.kernels import attention, ops, reference_attention
from retmask.kernels.padded_sdpa import key_runs, sdpa_over_key_runs
from retmask.kernels.sdpa import sdpa_attention

from .helpers import make_qkv


@pytest.fixture(autouse=True)
def sdpa_backward(monkeypatch):
    """These tests are about the SDPA recompute of the CPU backend's backward, not the C++ backward."""
    monkeypatch.setenv("RETMASK_CPU_ATTN_BWD", "native")


def mask_from_runs(N: int, runs: list[tuple[int, int]]) -> torch.Tensor:
    mask = torch.zeros(len(runs), N, dtype=torch.bool)
    for b, (s, e) in enumerate(runs):
        mask[b, s:e] = True
    return mask


@pytest.mark.parametrize(
    "runs",
    [[(0, 9), (0, 4)], [(3, 9), (0, 9)], [(0, 0), (2, 7)], [(9, 9)], [(0, 1)], [(8, 9), (0, 9)]],
    ids=["right", "left", "empty-row", "no-key", "first-key", "last-key"],
)
def test_key_runs_reads_the_runs(runs):
    got = key_runs(mask_from_runs(9, runs))
    assert got == [(s, e) if e > s else (0, 0) for s, e in runs]


def test_key_runs_refuses_holes():
    mask = mask_from_runs(9, [(0, 9), (2, 8)])
    mask[1, 5] = False
    assert key_runs(mask) is None
    mask = mask_from_runs(9, [(0, 3)])
    mask[0, 7] = True
    assert key_runs(mask) is None


# (B, Hq, Hkv, M, N, D, causal, runs): right and left padding, a batch row without keys, MQA, non-causal
# with fewer queries than keys; N = 37 and 50 are not multiples of any block.
CASES = [
    (3, 4, 2, 37, 37, 16, True, [(0, 37), (0, 20), (0, 1)]),
    (2, 6, 1, 37, 37, 32, True, [(11, 37), (36, 37)]),
    (3, 4, 4, 50, 50, 16, True, [(0, 0), (5, 50), (0, 31)]),
    (2, 4, 2, 7, 50, 16, False, [(0, 23), (13, 50)]),
    (2, 4, 2, 50, 50, 64, False, [(0, 0), (0, 50)]),
]


def _outputs_and_grads(fn, q, k, v, grad) -> list[torch.Tensor]:
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_per_run_equals_the_dense_mask(case, dtype):
    """Output, dq, dk, dv of the per-run call against the dense-mask call. fp32: equal up to summation
    order. bf16: both round differently, so each is compared with the fp32 dense result, and the per-run
    error may not exceed twice the dense call's own (plus one bf16 ulp at 1)."""
    B, Hq, Hkv, M, N, D, causal, runs = case
    q, k, v = (t.to(dtype) for t in make_qkv(B, Hq, Hkv, M, N, D, seed=4))
    mask = mask_from_runs(N, runs)
    grad = torch.randn((B, Hq, M, D), generator=torch.Generator().manual_seed(5))

    def per_run(q, k, v):
        return sdpa_over_key_runs(q, k, v, key_runs(mask), causal=causal, sm_scale=0.2)

    def dense(q, k, v):
        return sdpa_attention(q, k, v, causal=causal, sm_scale=0.2, key_padding_mask=mask)

    got = _outputs_and_grads(per_run, q, k, v, grad)
    want = _outputs_and_grads(dense, q, k, v, grad)
    assert got[0].shape == want[0].shape and got[0].dtype == dtype
    no_key_rows = [b for b, (s, e) in enumerate(runs) if s == e]
    assert all(bool((got[0][b] == 0).all()) for b in no_key_rows)
    if dtype == torch.float32:
        for g, w in zip(got, want, strict=True):  # gradients sum over up to 50 rows: summation-order noise
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
        return
    exact = _outputs_and_grads(dense, q.float(), k.float(), v.float(), grad)
    for name, g, w, x in zip(("out", "dq", "dk", "dv"), got, want, exact, strict=True):
        err_got, err_want = (float((t.float() - x).abs().max()) for t in (g, w))
        assert err_got <= 2 * err_want + 2**-8, (name, err_got, err_want)


def test_causal_needs_square():
    q, k, v = make_qkv(1, 2, 2, 3, 5, 8, seed=0)
    with pytest.raises(ValueError, match="M=3, N=5"):
        sdpa_over_key_runs(q, k, v, [(0, 5)], causal=True, sm_scale=0.3)


@pytest.fixture
def per_run_calls(monkeypatch):
    """Lower the key threshold so small shapes take the per-run path; record its calls."""
    calls = []

    def recorded(*args, **kwargs):
        calls.append(args[3])
        return sdpa_over_key_runs(*args, **kwargs)

    monkeypatch.setattr(ops, "KEY_RUNS_MIN_KEYS", 8)
    monkeypatch.setattr(ops, "sdpa_over_key_runs", recorded)
    return calls


def test_backward_takes_the_per_run_path_with_the_same_gradients(per_run_calls):
    """The CPU backend's backward (recompute) on a right-padded batch with skipped heads: per run, with the
    oracle's gradients; a mask with a hole and a causal call with M != N keep the dense call."""
    B, Hq, Hkv, N, D = 3, 4, 2, 29, 16
    q, k, v = (t.detach().requires_grad_(True) for t in make_qkv(B, Hq, Hkv, N, N, D, seed=7))
    runs = [(0, 29), (0, 17), (0, 5)]
    mask = mask_from_runs(N, runs)
    skip = torch.zeros(B, Hq, dtype=torch.bool)
    skip[1, 2] = True
    kw = dict(causal=True, key_padding_mask=mask, skip_heads=skip)
    out = attention(q, k, v, backend="cpu", **kw)
    want = reference_attention(q, k, v, **kw)[0]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    got_grads = torch.autograd.grad(out, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    assert per_run_calls == [runs]
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
    assert bool((got_grads[0][1, 2] == 0).all())  # a skipped head gets no gradient

    holed = mask.clone()
    holed[0, 10] = False
    out = attention(q, k, v, backend="cpu", causal=True, key_padding_mask=holed)
    torch.autograd.grad(out, (q, k, v), grad)
    q_tail = q[:, :, -6:].detach().requires_grad_(True)  # 6 query rows against 29 keys (a cache)
    out = attention(q_tail, k, v, backend="cpu", causal=True, key_padding_mask=mask)
    torch.autograd.grad(out, (q_tail, k, v), torch.ones_like(out))
    assert len(per_run_calls) == 1


def test_short_keys_keep_the_masked_call(monkeypatch):
    calls = []
    monkeypatch.setattr(
        ops, "sdpa_over_key_runs", lambda *a, **kw: calls.append(a) or sdpa_over_key_runs(*a, **kw)
    )
    q, k, v = (t.detach().requires_grad_(True) for t in make_qkv(2, 4, 2, 20, 20, 16, seed=1))
    mask = mask_from_runs(20, [(0, 20), (0, 9)])
    out = attention(q, k, v, backend="cpu", causal=True, key_padding_mask=mask)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert ops.KEY_RUNS_MIN_KEYS > 20 and calls == []


def test_traced_backward_keeps_the_masked_call(per_run_calls):
    """Under torch.compile the key runs cannot be read on the host: the compiled backward (traced by
    AOTAutograd) uses the dense mask and still equals the eager gradients."""

    def fn(q, k, v, mask):
        return attention(q * 1.5, k, v, causal=True, key_padding_mask=mask, backend="cpu").sin()

    q, k, v = (t.detach().requires_grad_(True) for t in make_qkv(2, 4, 2, 12, 12, 16, seed=3))
    mask = mask_from_runs(12, [(0, 12), (0, 7)])
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, mask)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(9))
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    assert per_run_calls == []  # the traced backward did not take the host-read path
    want = fn(q, k, v, mask)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    assert len(per_run_calls) == 1  # eager does
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_padded_batch_through_a_model_trains_alike(monkeypatch):
    """A right-padded batch of 1,100 tokens through a tiny Llama on retmask attention: every parameter's
    gradient with the per-run backward (default at this length) equals the dense-mask backward's."""
    from tests.tiny import tiny_llama

    model = tiny_llama(64, seed=2, init=0.05).train()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 64, (2, 1100), generator=g)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 700:] = 0
    labels = ids.masked_fill(attention_mask == 0, -100)
    assert ops.KEY_RUNS_MIN_KEYS <= 1100

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    calls = []
    monkeypatch.setattr(
        ops, "sdpa_over_key_runs", lambda *a, **kw: calls.append(a[3]) or sdpa_over_key_runs(*a, **kw)
    )
    per_run = grads()
    assert calls == [[(0, 1100), (0, 700)]] * 2  # both layers
    monkeypatch.setattr(ops, "KEY_RUNS_MIN_KEYS", 1 << 62)
    dense = grads()
    for name, want in dense.items():
        torch.testing.assert_close(per_run[name], want, atol=1e-6, rtol=1e-4, msg=name)
