"""Extreme parameters and non-finite inputs: one contract on every backend (issue 47).

* ``sm_scale`` and ``softcap`` are refused outside ``validation.SM_SCALE_RANGE`` / ``SOFTCAP_RANGE`` (the
  comment there says why), with a message naming the value and the range; at the ends of the ranges
  every backend agrees with the oracle. ``argmax_rows`` refuses bools like every other int argument.
* A huge soft cap (1e6 .. 1e10, where ``s / softcap`` is tiny) keeps every backend's argmax equal to
  the oracle's: Triton's ``_tanh`` is accurate in relative terms (its exp form alone quantised the
  logits in steps of ~``softcap * 3e-8``).
* The gradient contract for non-finite inputs (``reference.py``'s docstring): isolation per (batch,
  KV head) group, the NaN a poisoned row must spread, exact zeros for skipped heads and keyless rows,
  checked on every backward (the oracle's autograd; on the CPU the C++ backward and the chunked and
  SDPA recomputes; Triton in the interpreter) against the same masks derived from the definitions.

Triton cases poison the kernels' output buffers (NaN / -12345), so an element a kernel forgets to write
cannot pass where the contract asks for a finite or exact value. Shapes are tiny: the Triton interpreter
is slow.
"""

from __future__ import annotations

import os

import pytest
import torch

from retmask.kernels import attention, paths, reference_attention
from retmask.kernels.reference import allowed_keys
from retmask.kernels.validation import SM_SCALE_RANGE, SOFTCAP_RANGE

from ..device import TEST_DEVICE, on_test_device
from .helpers import left_padding_mask, make_qkv

# Triton runs these CPU tensors in its interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU).
HAS_TRITON = os.environ.get("TRITON_INTERPRET") == "1" or TEST_DEVICE.type == "cuda"
BACKENDS = ["cpu", *(["triton"] if HAS_TRITON else [])]
device_attention = on_test_device(attention)


@pytest.fixture(autouse=True)
def _poison_triton_outputs(monkeypatch):
    if HAS_TRITON:
        from retmask.kernels.triton import common as triton_common

        monkeypatch.setattr(triton_common, "POISON_OUTPUTS", True)


def run(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw):
    """``attention`` on ``backend`` (Triton on TEST_DEVICE: the interpreter, or a GPU)."""
    fn = device_attention if backend == "triton" else attention
    return fn(q, k, v, backend=backend, **kw)


# -- parameter ranges ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"sm_scale": 1e300}, r"sm_scale must be in \[1e-06, 10000\], got 1e\+300"),
        ({"sm_scale": 1e5}, r"sm_scale must be in \[1e-06, 10000\], got 100000"),
        ({"sm_scale": 0.0}, r"sm_scale must be in \[1e-06, 10000\], got 0"),
        ({"sm_scale": -0.25}, r"sm_scale must be in \[1e-06, 10000\], got -0.25"),
        ({"sm_scale": 1e-300}, r"sm_scale must be in \[1e-06, 10000\], got 1e-300"),
        ({"sm_scale": float("inf")}, "sm_scale must be finite"),
        ({"sm_scale": True}, "sm_scale must be a finite float, got bool True"),
        ({"softcap": 1e11}, r"softcap must be in \[1e-06, 1e\+10\], got 1e\+11; .*pass softcap=None"),
        ({"softcap": 1e-7}, r"softcap must be in \[1e-06, 1e\+10\], got 1e-07"),
        ({"softcap": 1e300}, r"softcap must be in \[1e-06, 1e\+10\], got 1e\+300"),
        ({"softcap": True}, "softcap must be a positive float or None, got True"),
        ({"return_argmax": True, "argmax_rows": True}, r"argmax_rows must be an int in \[1, M\].*got True"),
        ({"return_argmax": True, "argmax_rows": False}, r"argmax_rows must be an int in \[1, M\].*got False"),
    ],
)
def test_out_of_range_parameters_are_refused_with_the_range(kwargs, match):
    q, k, v = make_qkv(1, 2, 1, 3, 5, 8)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, backend="reference", **kwargs)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_numpy_integers_count_as_ints(backend):
    """argmax_rows, window and sink_tokens computed with NumPy (np.int64) work as the same Python ints;
    NumPy bools are refused as Python bools are."""
    import numpy as np

    q, k, v = make_qkv(1, 2, 1, 6, 9, 8, seed=4)
    kw = dict(backend=backend, return_argmax=True)
    want = attention(q, k, v, argmax_rows=2, window=3, sink_tokens=1, **kw)
    got = attention(q, k, v, argmax_rows=np.int64(2), window=np.int32(3), sink_tokens=np.int16(1), **kw)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    with pytest.raises(ValueError, match=r"argmax_rows must be an int .*got np.True_"):
        attention(q, k, v, argmax_rows=np.bool_(True), **kw)
    with pytest.raises(ValueError, match=r"window must be a positive int .*got np.float64\(2.0\)"):
        attention(q, k, v, window=np.float64(2.0), **kw)


def test_the_ranges_are_the_documented_ones():
    assert SM_SCALE_RANGE == (1e-6, 1e4) and SOFTCAP_RANGE == (1e-6, 1e10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "sm_scale,softcap",
    [(1e-6, None), (1e4, None), (1e4, 1e-6), (1e-6, 1e10), (0.25, 1e-6), (1e4, 1e10)],
    ids=["scale-min", "scale-max", "scale-max-cap-min", "scale-min-cap-max", "cap-min", "both-max"],
)
def test_range_ends_agree_with_the_oracle(backend, sm_scale, softcap):
    """At the ends of the ranges (logits ~1e-6 or ~1e4, caps that saturate every logit or none) every
    backend gives the oracle's argmax and, within fp32 rounding, its output."""
    q, k, v = make_qkv(1, 2, 1, 17, 17, 16, seed=3)
    kw = dict(sm_scale=sm_scale, softcap=softcap, return_argmax=True)
    want_out, want_am = reference_attention(q, k, v, sm_scale=sm_scale, softcap=softcap, argmax_rows=17)
    out, am = run(backend, q, k, v, **kw)
    assert torch.equal(am, want_am)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)


# -- huge soft caps --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [1e6, 1e8, 1e10])
def test_huge_softcap_keeps_the_argmax(backend, softcap):
    """s / softcap ~ 1e-6 .. 1e-10: the capped logits keep their order, so the argmax is the oracle's
    (and the uncapped one's); Triton's former exp-form tanh tied them in steps of ~softcap * 3e-8."""
    q, k, v = make_qkv(1, 2, 1, 17, 17, 16, seed=5)
    kw = dict(sm_scale=0.25, softcap=softcap)
    want_out, want_am = reference_attention(q, k, v, argmax_rows=17, **kw)
    _, uncapped_am = reference_attention(q, k, v, sm_scale=0.25, argmax_rows=17)
    out, am = run(backend, q, k, v, return_argmax=True, **kw)
    assert torch.equal(want_am, uncapped_am), "the oracle: a cap this large changes no argmax"
    assert torch.equal(am, want_am)
    torch.testing.assert_close(out, want_out, rtol=2e-5, atol=2e-5)


if HAS_TRITON:  # a jitted kernel resolves its callees in its module's globals
    import triton
    import triton.language as tl

    from retmask.kernels.triton.fwd import _tanh

    @triton.jit
    def _tanh_kernel(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(Y + offs, _tanh(tl.load(X + offs, mask=ok, other=0.0)), mask=ok)


@pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not importable here (neither the interpreter nor a GPU)"
)
def test_triton_tanh_is_accurate_in_relative_terms():
    """``_tanh`` against float64 tanh, in ulps of the result, over |x| from 1e-30 to 30 (both signs),
    and exact at 0, +-inf and NaN."""
    mags = torch.logspace(-30, 1.5, 2001, dtype=torch.float64)
    x64 = torch.cat([mags, -mags]).float().double()  # exactly representable in fp32
    specials = torch.tensor([0.0, float("inf"), float("-inf"), float("nan")])
    x = torch.cat([x64.float(), specials]).to(TEST_DEVICE)
    y = torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    y = y.cpu()
    got, want = y[: x64.numel()].double(), torch.tanh(x64)
    ulps = (got - want).abs() / torch.finfo(torch.float32).eps / want.abs()
    assert float(ulps.max()) < 4.0, f"max relative error {float(ulps.max()):.1f} ulps"  # ~2 on a GPU's exp2
    assert y[-4:-1].tolist() == [0.0, 1.0, -1.0] and bool(y[-1].isnan())


# -- non-finite inputs: the gradient contract ------------------------------------------------------------

B, HQ, HKV, M, N, D = 2, 4, 2, 17, 17, 16
G = HQ // HKV
PAD = left_padding_mask(B, N, [3, 0])  # batch 0: rows 0-2 see no key (causal, M == N)
SKIP = torch.tensor([[False, False, False, False], [False, False, True, False]])  # head 2 of batch 1

# (name, where the non-finite value goes: (tensor, index), value); every case poisons batch 0 / KV head 0
# or the skipped head (batch 1, query head 2 of KV head 1).
CASES: list[tuple[str, str, tuple[int, ...], float]] = [
    ("nan-query", "q", (0, 1, 9, 3), float("nan")),
    ("inf-query", "q", (0, 1, 9, 3), float("inf")),
    ("nan-key", "k", (0, 0, 7, 3), float("nan")),
    ("nan-value", "v", (0, 0, 7, 3), float("nan")),
    ("nan-padding-key", "k", (0, 0, 1, 3), float("nan")),  # changes no output, may still reach dq
    ("nan-query-without-keys", "q", (0, 0, 1, 3), float("nan")),
    ("nan-query-of-skipped-head", "q", (1, 2, 9, 3), float("nan")),
]
# The backward paths: the oracle's autograd; the CPU backend's three (``paths.cpu_backward_path``);
# Triton's own backward.
GRAD_PATHS = [
    ("reference", None),
    ("cpu", "kernel"),
    ("cpu", "chunked"),
    ("cpu", "sdpa"),
    *([("triton", None)] if HAS_TRITON else []),
]


def _grads(backend: str, path: str | None, monkeypatch, q, k, v, grad_out):
    """(out, dq, dk, dv) of ``attention`` with PAD / SKIP, the CPU backward forced onto ``path``."""
    if path is not None:
        monkeypatch.setattr(paths, "cpu_backward_path", lambda *args, **kwargs: path)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = run(backend, *leaves, causal=True, key_padding_mask=PAD, skip_heads=SKIP)
    out.backward(grad_out)
    return (out.detach(), *(t.grad for t in leaves))


def _contract_masks(q, k, v) -> dict[str, torch.Tensor]:
    """What the contract fixes for these inputs (True = the element is fixed):

    nan_out [B, Hq, M]: rows whose output holds NaN (a non-finite logit or value among the allowed keys;
    exactly these when v is finite, else further rows may follow: 0 * NaN is NaN);
    nan_dq [B, Hq, M], nan_dk, nan_dv [B, Hkv, N]: rows that must be NaN in every element;
    zero_dq [B, Hq, M]: rows of skipped heads, and rows without an allowed key in a group with finite k, v
    (their query may be NaN), exactly 0;
    same_dq [B, Hq, M]: rows with a finite query in a group with finite k, v: dq as in the all-finite
    call, bit for bit (a query reaches no other row's dq);
    same_kv [B, Hkv]: groups without a non-finite input (a skipped head's query aside): dk, dv as in the
    all-finite call, bit for bit.
    """
    allowed = allowed_keys(M, N, True, PAD, q.device).expand(B, HQ, M, N) & ~SKIP[:, :, None, None]
    bad_q = ~torch.isfinite(q).all(-1)  # [B, Hq, M]
    bad_k = (~torch.isfinite(k).all(-1)).repeat_interleave(G, 1)[:, :, None, :]  # [B, Hq, 1, N]
    bad_v = (~torch.isfinite(v).all(-1)).repeat_interleave(G, 1)[:, :, None, :]
    logit_rows = (allowed & (bad_q[..., None] | bad_k)).any(-1)  # [B, Hq, M]
    value_rows = (allowed & bad_v).any(-1)
    nan_rows = logit_rows | value_rows

    def keys_seen_by(rows: torch.Tensor) -> torch.Tensor:  # [B, Hq, M] -> [B, Hkv, N]
        return (allowed & rows[..., None]).any(2).view(B, HKV, G, N).any(2)

    kv_finite = torch.isfinite(k).flatten(2).all(-1) & torch.isfinite(v).flatten(2).all(-1)  # [B, Hkv]
    live_bad_q = bad_q & ~SKIP[:, :, None]  # a skipped head's query reaches nothing
    return dict(
        nan_out=nan_rows,
        nan_dq=nan_rows,
        nan_dk=keys_seen_by(nan_rows),
        nan_dv=keys_seen_by(logit_rows),
        zero_dq=SKIP[:, :, None] | (~allowed.any(-1) & kv_finite.repeat_interleave(G, 1)[:, :, None]),
        same_dq=~live_bad_q & kv_finite.repeat_interleave(G, 1)[:, :, None],
        same_kv=kv_finite & ~live_bad_q.view(B, HKV, G * M).any(-1),
        v_finite=torch.isfinite(v).all(),
    )


def _fixed(masks: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of dq [B, Hq, M], dk and dv [B, Hkv, N] whose NaN-ness the contract fixes."""
    same_kv = masks["same_kv"][:, :, None].expand(B, HKV, N)
    return (
        masks["nan_dq"] | masks["zero_dq"] | masks["same_dq"],
        masks["nan_dk"] | same_kv,
        masks["nan_dv"] | same_kv,
    )


def _check_contract(got, clean, masks) -> None:
    out, dq, dk, dv = got
    out_nan = out.isnan().any(-1)
    assert bool(out_nan[masks["nan_out"]].all()), "the forward contract's NaN rows"
    if masks["v_finite"]:
        assert torch.equal(out_nan, masks["nan_out"]), "with a finite v, only the forward contract's NaN rows"
    assert bool(dq.isnan().all(-1)[masks["nan_dq"]].all()), "dq of a NaN row is NaN"
    assert bool(dk.isnan().all(-1)[masks["nan_dk"]].all()), "dk of every key a NaN row sees is NaN"
    assert bool(dv.isnan().all(-1)[masks["nan_dv"]].all()), "dv of every key a NaN-logit row sees is NaN"
    assert bool((dq[masks["zero_dq"]] == 0).all()), "skipped heads and rows without keys: dq exactly 0"
    same_dq = masks["same_dq"] & ~masks["zero_dq"]
    assert torch.equal(dq[same_dq], clean[1][same_dq]), "dq of a row that sees no non-finite input"
    same_kv = masks["same_kv"]
    assert torch.equal(dk[same_kv], clean[2][same_kv]), "dk of a group without non-finite inputs"
    assert torch.equal(dv[same_kv], clean[3][same_kv]), "dv of a group without non-finite inputs"


def _case_inputs(case):
    """(q, k, v with the case's non-finite value, grad_out, the all-finite q, k, v)."""
    _, which, index, value = case
    clean = make_qkv(B, HQ, HKV, M, N, D, seed=11)
    grad_out = torch.randn(B, HQ, M, D, generator=torch.Generator().manual_seed(12))
    q, k, v = (t.clone() for t in clean)
    dict(q=q, k=k, v=v)[which][index] = value
    return q, k, v, grad_out, clean


@pytest.mark.parametrize("backend,path", GRAD_PATHS, ids=[f"{b}-{p}" if p else b for b, p in GRAD_PATHS])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_non_finite_inputs_follow_the_gradient_contract(backend, path, case, monkeypatch):
    q, k, v, grad_out, clean_inputs = _case_inputs(case)
    clean = _grads(backend, path, monkeypatch, *clean_inputs, grad_out)
    assert all(bool(torch.isfinite(t).all()) for t in clean), "the all-finite call is finite"
    _check_contract(_grads(backend, path, monkeypatch, q, k, v, grad_out), clean, _contract_masks(q, k, v))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_backends_nan_patterns_agree_wherever_the_contract_fixes_them(case, monkeypatch):
    """One case on every backward side by side: the rows that hold a NaN agree across backends in every
    row the contract fixes (``_fixed``); the rest (e.g. dk of keys a NaN query cannot see, reached by
    0 * NaN where a kernel computes a masked block) may differ, and is reported, not compared."""
    q, k, v, grad_out, _ = _case_inputs(case)
    fixed = _fixed(_contract_masks(q, k, v))
    patterns = {}
    for backend, path in GRAD_PATHS:
        with monkeypatch.context() as patch:
            out, *grads = _grads(backend, path, patch, q, k, v, grad_out)
        patterns[f"{backend}-{path}"] = [out.isnan().any(-1), *(g.isnan().any(-1) for g in grads)]
    (first_name, first), *others = patterns.items()
    for name, pattern in others:
        if torch.isfinite(v).all():  # (a NaN value may spread to further rows through 0 * NaN)
            assert torch.equal(pattern[0], first[0]), (name, first_name, "out")
        for what, mine, theirs, where in zip(("dq", "dk", "dv"), pattern[1:], first[1:], fixed, strict=True):
            assert torch.equal(mine[where], theirs[where]), (name, first_name, what)
