"""``attention(..., out_layout="bmhd")``: out as a view of a contiguous [B, M, Hq, D] tensor.

That is the layout transformers' attention functions return (``out.transpose(1, 2)``, contiguous), so
``retmask_attention`` asks for it and its transpose copies nothing. The fused CPU kernel writes that layout
directly; every other path (blocked CPU, reference, the operator used with autograd) computes the
[B, Hq, M, D] layout and copies once. Either way the values must be those of the default layout, bit for
bit, with gradients intact; fresh allocations are poisoned so that an element nobody writes shows.
"""

from __future__ import annotations

import pytest
import torch

from retmask.kernels import attention
from retmask.kernels.cpu import backend as cpu_backend

from .helpers import POISON_FLOAT, POISON_INDEX, left_padding_mask, make_qkv

# (B, Hq, Hkv, M, N, D, causal, argmax rows, left pads, skipped (row, head)): prefill with GQA and an
# awkward N, decode (M = 1) with padding and a skipped head, a chunk against a cache (M < N), MHA
# without causality, a head dim that is not a multiple of the vector width.
CASES = [
    (1, 9, 3, 70, 70, 64, True, 70, None, None),
    (2, 6, 2, 1, 129, 64, True, 1, [0, 5], (1, 4)),
    (2, 4, 1, 33, 150, 32, True, 0, [7, 0], (0, 0)),
    (1, 4, 4, 20, 20, 16, False, 5, None, None),
    (1, 2, 1, 17, 40, 24, True, 3, None, None),
]
CPU_PATHS = ["cpp", "blocked"]
BF16_PATHS = ["cpp", "blocked", "bf16dot"]


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every ``torch.empty`` made during the test comes back filled with NaN (float) or POISON_INDEX
    (int64): an output element the kernel does not write cannot pass for a value."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(POISON_FLOAT)
        elif t.dtype == torch.int64:
            t.fill_(POISON_INDEX)
        return t

    monkeypatch.setattr(torch, "empty", empty)


def _inputs(case, seed: int, dtype: torch.dtype = torch.float32):
    B, Hq, Hkv, M, N, D, causal, rows, pads, skipped = case
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=seed, noncontiguous_q=True, dtype=dtype)
    kpm = left_padding_mask(B, N, pads) if pads else None
    skip = None
    if skipped:
        skip = torch.zeros(B, Hq, dtype=torch.bool)
        skip[skipped] = True
    kw = dict(causal=causal, key_padding_mask=kpm, skip_heads=skip)
    if rows:
        kw.update(return_argmax=True, argmax_rows=rows)
    return q, k, v, kw


def _assert_heads_last(out: torch.Tensor, like: torch.Tensor) -> None:
    assert out.shape == like.shape and out.dtype == like.dtype
    assert out.transpose(1, 2).is_contiguous(), f"strides {out.stride()} are not those of [B, M, Hq, D]"


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_paths_write_heads_last_bit_for_bit(monkeypatch, poisoned_empty, path, case):
    monkeypatch.setenv("RETMASK_CPU_PATH", path)
    q, k, v, kw = _inputs(case, seed=len(path) + case[3])
    default = attention(q, k, v, backend="cpu", **kw)
    heads_last = attention(q, k, v, backend="cpu", out_layout="bmhd", **kw)
    if kw.get("return_argmax"):
        (default, default_argmax), (heads_last, argmax) = default, heads_last
        assert torch.equal(argmax, default_argmax)
    assert default.is_contiguous()
    _assert_heads_last(heads_last, default)
    assert not heads_last.isnan().any()
    assert torch.equal(heads_last, default)


@pytest.mark.parametrize("path", BF16_PATHS)
def test_bf16_paths_write_heads_last_bit_for_bit(monkeypatch, poisoned_empty, path):
    monkeypatch.setenv("RETMASK_CPU_PATH", path)
    q, k, v, kw = _inputs(CASES[0], seed=5, dtype=torch.bfloat16)
    (default, default_argmax) = attention(q, k, v, backend="cpu", **kw)
    heads_last, argmax = attention(q, k, v, backend="cpu", out_layout="bmhd", **kw)
    _assert_heads_last(heads_last, default)
    assert torch.equal(heads_last, default) and torch.equal(argmax, default_argmax)


@pytest.mark.parametrize("path", CPU_PATHS)
def test_window_softcap_and_sinks_in_the_layout(monkeypatch, poisoned_empty, path):
    monkeypatch.setenv("RETMASK_CPU_PATH", path)
    q, k, v, kw = _inputs(CASES[2], seed=9)
    features = dict(window=40, softcap=5.0, sinks=torch.randn(q.shape[1]))
    default = attention(q, k, v, backend="cpu", **features, **kw)
    heads_last = attention(q, k, v, backend="cpu", out_layout="bmhd", **features, **kw)
    _assert_heads_last(heads_last, default)
    assert not heads_last.isnan().any() and torch.equal(heads_last, default)


def test_fused_kernel_writes_the_layout_itself(monkeypatch):
    """The fused path hands back its own [B, M, Hq, D] buffer (no copy after the kernel): the buffer the
    CPU backend allocates is the one returned."""
    monkeypatch.setenv("RETMASK_CPU_PATH", "cpp")
    q, k, v = make_qkv(1, 9, 3, 40, 40, 64, seed=3, noncontiguous_q=True)
    buffers = []
    real_forward = cpu_backend.cpp_forward

    def spy(*args, **kwargs):
        buffers.append(kwargs.get("out"))
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(cpu_backend, "cpp_forward", spy)
    out = attention(q, k, v, backend="cpu", out_layout="bmhd")
    assert len(buffers) == 1 and buffers[0] is not None
    assert out.data_ptr() == buffers[0].data_ptr() and out.stride() == buffers[0].stride()


@pytest.mark.parametrize("case", CASES[:3], ids=str)
def test_reference_backend_copies_into_the_layout(poisoned_empty, case):
    q, k, v, kw = _inputs(case, seed=7)
    default = attention(q.double(), k.double(), v.double(), **kw)
    heads_last = attention(q.double(), k.double(), v.double(), out_layout="bmhd", **kw)
    if kw.get("return_argmax"):
        (default, default_argmax), (heads_last, argmax) = default, heads_last
        assert torch.equal(argmax, default_argmax)
    _assert_heads_last(heads_last, default)
    assert torch.equal(heads_last, default)


@pytest.mark.parametrize("case", CASES[:3], ids=str)
def test_gradients_flow_through_the_layout(case):
    """With autograd the operator runs (it returns [B, Hq, M, D]) and the copy into the layout is
    differentiable: the same gradients as the default layout."""
    q, k, v, kw = _inputs(case, seed=11)
    kw.pop("return_argmax", None), kw.pop("argmax_rows", None)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    grads = {}
    for layout in ("bhmd", "bmhd"):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = attention(*leaves, backend="cpu", out_layout=layout, **kw)
        if layout == "bmhd":
            _assert_heads_last(out, q)
        (out * grad).sum().backward()
        grads[layout] = (out.detach(), *(t.grad for t in leaves))
    for got, want in zip(grads["bmhd"], grads["bhmd"], strict=True):
        assert torch.equal(got, want)


def test_empty_batch_in_the_layout():
    q, k, v = make_qkv(1, 4, 2, 3, 8, 16, seed=1)
    out, argmax = attention(q[:0], k[:0], v[:0], return_argmax=True, out_layout="bmhd")
    assert out.shape == (0, 4, 3, 16) and argmax.shape == (0, 4, 0)


def test_unknown_layout_is_refused_with_the_choices():
    q, k, v = make_qkv(1, 2, 1, 4, 4, 16, seed=2)
    with pytest.raises(ValueError, match=r"out_layout must be 'bhmd' .* or 'bmhd' .* got 'bshd'"):
        attention(q, k, v, out_layout="bshd")
