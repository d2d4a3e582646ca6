"""``CPUChunkedLogProb`` against a float64 log-softmax over the full logits (values and gradients), and
against TRL's ``ChunkedLogProbFunction``, whose contract it takes over on CPU tensors."""

from __future__ import annotations

import pytest
import torch

import retmask.cpu_speedups.logprob as lp
from retmask.cpu_speedups.logprob import CPUChunkedLogProb

OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
FLOAT_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits")


def reference(h, w, b, targets, temperature, softcap, scale):
    """The five outputs from the full float64 logits."""
    y = h.double() @ w.double().t()
    if b is not None:
        y = y + b.double()
    z = y * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = torch.log_softmax(z, -1)
    p = log_p.exp()
    return {
        "log_probs": log_p.gather(1, targets[:, None])[:, 0],
        "entropy": -(p * log_p).sum(-1),
        "log_sum_sq_probs": torch.log((p * p).sum(-1)),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == targets,
    }


def inputs(n: int, hidden: int, vocab: int, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.5
    b = torch.randn(vocab, generator=g) if bias else None
    targets = torch.randint(0, vocab, (n,), generator=g)
    return h, w, b, targets


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of at most 3 token rows x ``chunk`` vocabulary columns: every chunking path runs."""

    def shrink(rows: int, chunk: int) -> None:
        monkeypatch.setattr(lp, "TOKEN_CHUNK", rows)
        monkeypatch.setattr(lp, "TILE_BYTES", 4 * rows * chunk)

    return shrink


@pytest.fixture
def poisoned(monkeypatch):
    """Buffers the backward must write in full start as NaN."""
    monkeypatch.setattr(lp, "_uninitialized", lambda shape: torch.full(shape, float("nan")))


# (rows, hidden, vocab, chunk, bias, softcap, logit scale, temperature): rows and vocab not multiples of
# the tile, one vocab chunk, a softcap, scales and temperatures other than 1.
CASES = [
    (37, 16, 301, 64, False, None, 1.0, 1.0),
    (50, 24, 1000, 128, True, 5.0, 0.7, 0.8),
    (9, 8, 77, 1000, True, None, 2.0, 1.3),
    (1, 8, 50, 7, False, 3.0, 1.0, 1.0),
]


@pytest.mark.parametrize("rows,hidden,vocab,chunk,bias,softcap,scale,temperature", CASES)
@pytest.mark.parametrize("token_chunk", [4096, 7])
def test_outputs_and_gradients_match_float64(
    rows, hidden, vocab, chunk, bias, softcap, scale, temperature, token_chunk, small_tiles, poisoned
):
    h, w, b, t = inputs(rows, hidden, vocab, bias, seed=rows + vocab)
    if token_chunk < 4096:
        small_tiles(token_chunk, chunk)
    params = [x.clone().requires_grad_() for x in (h, w)] + ([b.clone().requires_grad_()] if bias else [])
    out = CPUChunkedLogProb.apply(params[0], params[1], params[2] if bias else None, t, temperature, chunk,
                                  softcap, scale, OUTPUTS)  # fmt: skip
    ref_params = [x.double().requires_grad_() for x in (h, w)] + (
        [b.double().requires_grad_()] if bias else []
    )
    ref = reference(
        ref_params[0], ref_params[1], ref_params[2] if bias else None, t, temperature, softcap, scale
    )
    for name, value in zip(OUTPUTS, out, strict=True):
        if name == "is_top1":
            assert torch.equal(value, ref[name])
        else:
            assert value.dtype == torch.float32
            torch.testing.assert_close(value.double(), ref[name], rtol=1e-5, atol=2e-5, msg=name)

    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    (out[0] * g_lp + out[1] * g_ent).sum().backward()
    (ref["log_probs"] * g_lp.double() + ref["entropy"] * g_ent.double()).sum().backward()
    for name, p, rp in zip(("hidden", "weight", "bias"), params, ref_params, strict=False):
        assert p.grad.dtype == p.dtype
        scale_ = rp.grad.abs().max()
        torch.testing.assert_close(p.grad.double() / scale_, rp.grad / scale_, rtol=0, atol=2e-6, msg=name)


@pytest.mark.parametrize("which", ["log_probs", "entropy"])
def test_one_output_gradient(which, poisoned):
    """Only one of the two differentiable outputs gets a gradient (the other arrives as None)."""
    h, w, b, t = inputs(13, 8, 90, True, seed=5)
    params = [x.clone().requires_grad_() for x in (h, w, b)]
    out = CPUChunkedLogProb.apply(*params, t, 1.0, 32, None, 1.0, OUTPUTS)
    ref_params = [x.double().requires_grad_() for x in (h, w, b)]
    ref = reference(*ref_params, t, 1.0, None, 1.0)
    out[OUTPUTS.index(which)].sum().backward()
    ref[which].sum().backward()
    for p, rp in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p.grad.double(), rp.grad, rtol=1e-5, atol=1e-6)


def test_outputs_not_requested_are_none_and_no_grad_for_frozen_inputs():
    h, w, _, t = inputs(6, 8, 40, False, seed=2)
    hidden = h.clone().requires_grad_()
    out = CPUChunkedLogProb.apply(hidden, w, None, t, 1.0, 16, None, 1.0, ("log_probs",))
    assert out[0].shape == (6,) and all(x is None for x in out[1:])
    out[0].sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0 and w.grad is None


def test_is_top1_takes_the_first_of_tied_maxima_across_chunks(small_tiles):
    """Vocabulary rows 3 and 11 are equal (tied logits) and lie in different vocab chunks of 8: argmax
    is the first; a target at 11 is then not the top-1, one at 3 is."""
    small_tiles(4096, 8)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(0)) * 0.1
    h = torch.tensor([[1.0, 0.5, -0.3, 0.2], [0.4, 1.0, 0.1, -0.5]])
    w[3] = w[11] = torch.tensor([3.0, 3.0, 0.0, 0.0])  # logits 4.5 and 4.2: far above the rest
    logits = h @ w.t()
    assert torch.equal(logits[:, 3], logits[:, 11])
    assert (logits[:, 3:4] > logits.masked_fill(torch.arange(16) % 8 == 3, -1e9) + 3).all()
    out = CPUChunkedLogProb.apply(h, w, None, torch.tensor([11, 3]), 1.0, 8, None, 1.0, ("is_top1",))
    assert out[4].tolist() == [False, True]


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_float32_agrees_with_trl(softcap):
    from trl.kernels import ChunkedLogProbFunction

    h, w, b, t = inputs(40, 16, 700, True, seed=9)
    results = []
    for fn in (ChunkedLogProbFunction, CPUChunkedLogProb):
        params = [x.clone().requires_grad_() for x in (h, w, b)]
        out = fn.apply(*params, t, 0.9, 256, softcap, 1.1, OUTPUTS)
        (out[0].sum() + 0.3 * out[1].sum()).backward()
        results.append((out, [p.grad for p in params]))
    (trl_out, trl_grads), (our_out, our_grads) = results
    assert torch.equal(trl_out[4], our_out[4])
    for a, c in zip(trl_out[:4], our_out[:4], strict=True):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)
    for a, c in zip(trl_grads, our_grads, strict=True):
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-5)


def test_bfloat16_autocast_is_within_bf16_rounding_of_float64():
    """Under CPU autocast the products run in bf16 with fp32 master weights (as in ``retmask train
    --dtype bfloat16``); the gradients come back in the weights' fp32."""
    from trl.kernels import ChunkedLogProbFunction

    h, w, _, t = inputs(64, 32, 2000, False, seed=4)
    grads = {}
    for name, fn in (("trl", ChunkedLogProbFunction), ("retmask", CPUChunkedLogProb)):
        params = [x.clone().requires_grad_() for x in (h, w)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn.apply(params[0], params[1], None, t, 1.0, 512, None, 1.0, ("log_probs",))
        out[0].sum().backward()
        grads[name] = [p.grad for p in params]
        assert all(g.dtype == torch.float32 for g in grads[name])
    ref_params = [x.double().requires_grad_() for x in (h, w)]
    reference(*ref_params, None, t, 1.0, None, 1.0)["log_probs"].sum().backward()
    for i, rp in enumerate(ref_params):
        scale = rp.grad.abs().max()
        errors = {name: ((g[i].double() - rp.grad).abs().max() / scale).item() for name, g in grads.items()}
        # bf16 inputs and products: about 2^-8 relative; no worse than TRL's fp32-accumulated products x2
        assert errors["retmask"] < 2e-2 and errors["retmask"] < 2 * errors["trl"] + 1e-3, errors


def test_a_one_tile_call_keeps_its_logits_for_the_backward(monkeypatch, small_tiles):
    """One token chunk and one vocab chunk: the backward reuses the forward's logits (one product in
    all); with several vocab chunks it computes each tile again."""
    calls = []
    original = lp._logits_tile
    monkeypatch.setattr(lp, "_logits_tile", lambda *a: calls.append(a[2].shape[0]) or original(*a))
    h, w, _, t = inputs(12, 8, 100, False, seed=6)
    hidden = h.clone().requires_grad_()
    CPUChunkedLogProb.apply(hidden, w, None, t, 1.0, 32, None, 1.0, ("log_probs",))[0].sum().backward()
    assert calls == [100]
    kept = hidden.grad.clone()
    calls.clear()
    small_tiles(12, 32)  # one token chunk of 12 rows, vocab chunks of 32
    hidden.grad = None
    CPUChunkedLogProb.apply(hidden, w, None, t, 1.0, 32, None, 1.0, ("log_probs",))[0].sum().backward()
    assert calls == [32, 32, 32, 4] * 2
    torch.testing.assert_close(hidden.grad, kept, rtol=1e-5, atol=1e-6)


@pytest.fixture(params=["native", "emulated"])
def half_products(request, monkeypatch):
    """Run bf16 / fp16 products as if the CPU had native half-precision GEMMs or not (both work on any
    CPU; the native one is slow where torch emulates it, so shapes stay small)."""
    import retmask.cpu_speedups.half_matmul as hm

    monkeypatch.setattr(hm, "native_half_matmul", lambda dtype: request.param == "native")
    return request.param


def _half_dtype_calls(fn) -> set[torch.dtype]:
    """The dtypes of the matrix products (mm, addmm, linear) ``fn`` runs, forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[torch.dtype] = set()
    products = {"mm", "addmm", "linear", "matmul", "bmm", "_mkldnn_linear", "mkldnn_linear"}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name.split("::")[-1] in products:
                seen.add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("token_chunk", [4096, 5])
def test_bfloat16_autocast_native_and_emulated_products(bias, token_chunk, half_products, small_tiles):
    """Both ways of running the bf16 products give bf16-rounded results of the same fp32 sums: within
    bf16 rounding of float64, and the emulated way runs no half-precision product at all."""
    h, w, b, t = inputs(23, 16, 300, bias, seed=11)
    if token_chunk < 4096:
        small_tiles(token_chunk, 64)
    params = [x.clone().requires_grad_() for x in (h, w)] + ([b.clone().requires_grad_()] if bias else [])

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = CPUChunkedLogProb.apply(params[0], params[1], params[2] if bias else None, t, 1.0, 64,
                                          None, 1.0, OUTPUTS)  # fmt: skip
        (out[0].sum() + 0.5 * out[1].sum()).backward()
        return out

    dtypes = _half_dtype_calls(run)
    assert dtypes == ({torch.float32} if half_products == "emulated" else {torch.bfloat16})
    ref_params = [x.double().requires_grad_() for x in (h, w)] + (
        [b.double().requires_grad_()] if bias else []
    )
    ref = reference(ref_params[0], ref_params[1], ref_params[2] if bias else None, t, 1.0, None, 1.0)
    (ref["log_probs"].sum() + 0.5 * ref["entropy"].sum()).backward()
    for p, rp in zip(params, ref_params, strict=True):
        assert p.grad.dtype == torch.float32
        scale = rp.grad.abs().max()
        assert ((p.grad.double() - rp.grad).abs().max() / scale).item() < 2e-2


def test_bfloat16_emulated_products_equal_native_ones_up_to_summation_order(monkeypatch):
    """The emulated products are the native ones' numbers: every gradient element is equal or one bf16
    rounding step apart (the fp32 sums, in another order, fall on the other side of a rounding edge
    only rarely), and the forward outputs agree to fp32 rounding of those."""
    import retmask.cpu_speedups.half_matmul as hm

    h, w, b, t = inputs(31, 24, 500, True, seed=12)
    results = {}
    for mode in ("native", "emulated"):
        monkeypatch.setattr(hm, "native_half_matmul", lambda dtype, mode=mode: mode == "native")
        params = [x.clone().requires_grad_() for x in (h, w, b)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = CPUChunkedLogProb.apply(*params, t, 1.0, 1024, None, 1.0, OUTPUTS)
        out[0].sum().backward()
        results[mode] = (out, [p.grad for p in params])
    (out_n, grads_n), (out_e, grads_e) = results["native"], results["emulated"]
    assert torch.equal(out_n[4], out_e[4])
    for a, c in zip(out_n[:4], out_e[:4], strict=True):
        torch.testing.assert_close(c, a, rtol=1e-2, atol=1e-2)
    for a, c in zip(grads_n, grads_e, strict=True):
        apart = (a - c).abs() > 2**-7 * torch.maximum(a.abs(), c.abs()) + 1e-12
        assert not apart.any()
        assert (a != c).float().mean() < 0.05


def test_float16_inputs_use_the_same_products(half_products):
    """fp16 tensors (no autocast): the compute dtype is fp16 and the gradients come back in fp16."""
    h, w, _, t = inputs(9, 8, 120, False, seed=13)
    params = [x.half().requires_grad_() for x in (h, w)]
    out = CPUChunkedLogProb.apply(*params, None, t, 1.0, 32, None, 1.0, ("log_probs",))
    out[0].sum().backward()
    assert all(p.grad.dtype == torch.float16 for p in params)
    ref_params = [x.half().double().requires_grad_() for x in (h, w)]
    ref = reference(*ref_params, None, t, 1.0, None, 1.0)
    torch.testing.assert_close(out[0].double(), ref["log_probs"], rtol=1e-2, atol=1e-2)
    ref["log_probs"].sum().backward()
    for p, rp in zip(params, ref_params, strict=True):
        scale = rp.grad.abs().max()
        assert ((p.grad.double() - rp.grad).abs().max() / scale).item() < 5e-3
