"""The CPU paths (fused C++ kernel, the same kernel on torch's block GEMM, blocked torch) against the
reference oracle.

The C++ kernel writes into caller-provided buffers that each test first fills with NaN (output) and a
sentinel index (argmax), so an element the kernel forgets to write cannot pass by accident.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import sys
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retmask.kernels import attention, reference_attention
from retmask.kernels.cpu import backend as cpu_backend
from retmask.kernels.cpu import blocked as cpu_blocked
from retmask.kernels.paths import bf16_dot_fits

from .helpers import POISON_FLOAT, POISON_INDEX, assert_argmax_matches, left_padding_mask, make_qkv

PATHS = ("cpp", "blocked")
# "bf16dot" (bf16 dot products, emulated on CPUs without AVX512-BF16) changes only bf16 calls.
HALF_PATHS = (*PATHS, "bf16dot")
OUT_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
ARGMAX_TOL = 1e-4  # logits are computed in fp32 from the same (rounded) inputs in every path


def run_path(
    path: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    key_padding_mask: torch.Tensor | None = None,
    skip_heads: torch.Tensor | None = None,
    argmax_rows: int = 0,
    out_transposed: bool = False,
    block_m: int | None = None,
    **features,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One CPU path on [B, Hq, M, D] / [B, Hkv, N, D] inputs; skip_heads bool [B, Hq]; ``features``:
    window / softcap / sinks (and ``bf16_dot=True``: as path "bf16dot", which changes only bf16 calls
    with an even head dim). For the fused kernel the outputs are pre-poisoned caller buffers (optionally
    a non-contiguous out view) and
    ``block_m`` sets the tile rows (small values force row-major tiles)."""
    if path == "blocked":
        out, argmax, _ = cpu_blocked.forward(
            q, k, v, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
            skip_heads=skip_heads, argmax_rows=argmax_rows, **features,
        )  # fmt: skip
        return out, argmax
    bf16_dot = (features.pop("bf16_dot", False) or path == "bf16dot") and bf16_dot_fits(q.dtype, q.shape[-1])
    B, Hq, M, D = q.shape
    if out_transposed:  # [B, M, Hq, D] storage seen as [B, Hq, M, D], like transformers' layout
        out = torch.full((B, M, Hq, D), POISON_FLOAT, dtype=q.dtype).transpose(1, 2)
    else:
        out = torch.full((B, Hq, M, D), POISON_FLOAT, dtype=q.dtype)
    argmax = torch.full((B, Hq, argmax_rows), POISON_INDEX, dtype=torch.int64) if argmax_rows else None
    got_out, got_argmax = cpu_backend.cpp_forward(
        q, k, v, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
        skip_heads=skip_heads, argmax_rows=argmax_rows, out=out, argmax=argmax, block_m=block_m,
        bf16_dot=bf16_dot, **features,
    )  # fmt: skip
    assert got_out is out and got_argmax is argmax
    return out, argmax


def check_against_reference(
    path: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    skip_heads: torch.Tensor | None = None,
    argmax_rows: int = 0,
    out_transposed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``path`` and assert output, argmax, zeros of skipped heads and -1 of invalid rows."""
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    out, argmax = run_path(
        path, q, k, v, causal=causal, sm_scale=scale, key_padding_mask=key_padding_mask,
        skip_heads=skip_heads, argmax_rows=argmax_rows, out_transposed=out_transposed,
    )  # fmt: skip
    ref_out, ref_argmax = reference_attention(
        q, k, v, causal=causal, sm_scale=scale, key_padding_mask=key_padding_mask,
        skip_heads=skip_heads, argmax_rows=argmax_rows,
    )  # fmt: skip
    assert out.dtype == q.dtype and out.shape == q.shape
    assert not torch.isnan(out).any(), "output has NaN (unwritten element or 0/0)"
    tol = OUT_TOL[q.dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    if skip_heads is not None:
        assert (out[skip_heads] == 0).all(), "skipped heads must give exactly 0"
    if argmax_rows:
        assert argmax is not None and argmax.dtype == torch.int64
        assert argmax.shape == (q.shape[0], q.shape[1], argmax_rows)
        assert_argmax_matches(
            argmax, q, k, causal=causal, sm_scale=scale, key_padding_mask=key_padding_mask,
            skip_heads=skip_heads, atol=ARGMAX_TOL,
        )  # fmt: skip
    else:
        assert argmax is None and ref_argmax is None
    return out, argmax


# (B, Hq, Hkv, M, N, D): N not a multiple of the 64-key block; M = 1, some, N; MHA / GQA / MQA.
SHAPES = [
    (1, 2, 2, 1, 1, 16),
    (2, 4, 4, 1, 77, 64),
    (2, 4, 2, 13, 77, 96),
    (1, 6, 2, 130, 130, 64),
    (2, 8, 1, 33, 100, 128),
    (1, 9, 3, 200, 200, 64),
    (1, 4, 1, 65, 129, 16),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [True, False])
def test_matches_reference_fp32(path, shape, causal):
    B, Hq, Hkv, M, N, D = shape
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=sum(shape) + causal)
    check_against_reference(path, q, k, v, causal=causal, argmax_rows=M)


@pytest.mark.parametrize("path", HALF_PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D", [16, 64, 96, 128])
def test_half_precision_dtypes(path, dtype, D):
    q, k, v = make_qkv(2, 6, 2, 21, 90, D, dtype=dtype, seed=D, noncontiguous_q=True)
    pad = left_padding_mask(2, 90, [0, 11])
    check_against_reference(path, q, k, v, causal=True, key_padding_mask=pad, argmax_rows=21)


@pytest.mark.parametrize("path", ("cpp", "bf16dot"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D,dims_strided", [(36, False), (20, True), (64, True)])
def test_key_block_transpose_tails_and_strides(path, dtype, D, dims_strided):
    """The block-GEMM layouts transpose each key block in 8 x 8 tiles of keys x dims: a head dim that is
    not a multiple of 8 (a dim tail), a last block of 37 keys (a key tail), and keys whose dims are not
    contiguous (the element-by-element copy), against the reference with poisoned outputs. "bf16dot"
    pairs the keys of a block (37: an odd last pair) and copies keys whose dims are strided."""
    q, k, v = make_qkv(1, 6, 2, 40, 101, D, dtype=dtype, seed=D)
    if dims_strided:  # k[..., d] at a stride of 2 elements
        k = torch.stack([k, k.neg()], dim=-1).flatten(-2)[..., ::2]
        assert k.stride(-1) == 2
    check_against_reference(path, q, k, v, causal=True, argmax_rows=40)


@pytest.mark.parametrize("path", PATHS)
def test_noncontiguous_inputs_and_output(path):
    q, k, v = make_qkv(2, 4, 2, 17, 70, 64, seed=3, noncontiguous_q=True)
    # k, v as transposed views of [B, N, Hkv, D] buffers (strided along N and heads).
    k = k.transpose(1, 2).contiguous().transpose(1, 2)
    v = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    check_against_reference(path, q, k, v, causal=True, argmax_rows=5, out_transposed=path == "cpp")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("argmax_rows", [0, 1, 7])
def test_argmax_rows_subset(path, argmax_rows):
    q, k, v = make_qkv(2, 8, 2, 40, 150, 64, seed=argmax_rows)
    pad = left_padding_mask(2, 150, [5, 0])
    check_against_reference(path, q, k, v, causal=True, key_padding_mask=pad, argmax_rows=argmax_rows)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [True, False])
def test_rows_without_valid_key(path, causal):
    # Batch 0: 100 left-padded keys, so causal rows at positions < 100 see nothing.
    # Batch 1: every key is padding, so every row is invalid (out 0, argmax -1).
    B, Hq, Hkv, M, N, D = 2, 4, 2, 120, 130, 64
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=11)
    pad = left_padding_mask(B, N, [100, N])
    out, argmax = check_against_reference(path, q, k, v, causal=causal, key_padding_mask=pad, argmax_rows=M)
    assert (out[1] == 0).all() and (argmax[1] == -1).all()
    if causal:
        assert (out[0, :, :90] == 0).all() and (argmax[0, :, :90] == -1).all()


@pytest.mark.parametrize("path", PATHS)
def test_skip_heads_per_row(path):
    B, Hq, Hkv, M, N, D = 3, 8, 2, 9, 100, 64
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=5)
    skip = torch.zeros(B, Hq, dtype=torch.bool)
    skip[0, [1, 2]] = True  # some heads of group 0
    skip[1, 4:] = True  # a whole KV group
    skip[2, :] = True  # everything in one row
    pad = left_padding_mask(B, N, [0, 30, 3])
    out, argmax = check_against_reference(
        path, q, k, v, causal=True, key_padding_mask=pad, skip_heads=skip, argmax_rows=M
    )
    assert (argmax[skip] == -1).all()
    # Other heads of a shared KV group are unaffected by skipping their neighbours.
    ref, _ = reference_attention(q, k, v, causal=True, key_padding_mask=pad)
    torch.testing.assert_close(out[0, 0], ref[0, 0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_m", [1, 16, 64, 256])
def test_cpp_tile_sizes(block_m):
    """Tilings of the C++ kernel: rows per item from 1 (row-major tiles) to 256 (lanes, several vectors)."""
    B, Hq, Hkv, M, N, D = 2, 6, 2, 150, 170, 64
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=block_m)
    skip = torch.zeros(B, Hq, dtype=torch.bool)
    skip[0, 1] = skip[1, 3:] = True
    pad = left_padding_mask(B, N, [0, 40])
    out = torch.full((B, Hq, M, D), POISON_FLOAT)
    argmax = torch.full((B, Hq, M), POISON_INDEX, dtype=torch.int64)
    cpu_backend.cpp_forward(
        q, k, v, causal=True, sm_scale=D**-0.5, key_padding_mask=pad, skip_heads=skip, argmax_rows=M,
        out=out, argmax=argmax, block_m=block_m,
    )  # fmt: skip
    ref_out, _ = reference_attention(q, k, v, key_padding_mask=pad, skip_heads=skip)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    assert_argmax_matches(
        argmax, q, k, causal=True, sm_scale=D**-0.5, key_padding_mask=pad, skip_heads=skip, atol=ARGMAX_TOL
    )


@pytest.mark.parametrize("path", PATHS)
def test_all_heads_skipped(path):
    q, k, v = make_qkv(2, 4, 2, 5, 40, 16, seed=6)
    skip = torch.ones(2, 4, dtype=torch.bool)
    out, argmax = run_path(path, q, k, v, causal=True, sm_scale=0.25, skip_heads=skip, argmax_rows=5)
    assert (out == 0).all() and (argmax == -1).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("skip_shape", ["Hq", "B,Hq"])
def test_public_entry_skip_masks(path, skip_shape, monkeypatch):
    """attention(..., backend="cpu") with a [Hq] or [B, Hq] skip mask on the chosen path."""
    monkeypatch.setenv("RETMASK_CPU_PATH", path)
    q, k, v = make_qkv(2, 6, 3, 12, 80, 32, seed=7)
    if skip_shape == "Hq":
        skip = torch.tensor([True, False, False, True, True, False])
        skip_b = skip.expand(2, 6)
    else:
        skip = torch.tensor(
            [[True, False, False, False, True, True], [False, False, True, False, False, False]]
        )
        skip_b = skip
    out, argmax = attention(q, k, v, skip_heads=skip, return_argmax=True, argmax_rows=4, backend="cpu")
    ref_out, ref_argmax = reference_attention(q, k, v, causal=True, skip_heads=skip_b, argmax_rows=4)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    assert torch.equal(argmax, ref_argmax)
    assert (out[skip_b] == 0).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("M", [1, 10])  # M = 1: the C++ kernel's row-major (decode) tile layout
def test_ties_pick_smallest_index(path, M):
    """Duplicate keys give bit-identical logits: the argmax must be the first copy."""
    B, Hq, Hkv, N, D = 1, 4, 2, 200, 64
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=8)
    # Keys 3, 70 and 150 are identical (in different 64-key blocks); key 130 equals key 131 (same block).
    k[:, :, 70] = k[:, :, 3]
    k[:, :, 150] = k[:, :, 3]
    k[:, :, 131] = k[:, :, 130]
    # Heads of group 0 look for key 3, heads of group 1 for key 130.
    q[:, :2] = 4.0 * k[:, 0, 3][:, None, None, :]
    q[:, 2:] = 4.0 * k[:, 1, 130][:, None, None, :]
    out, argmax = run_path(path, q, k, v, causal=True, sm_scale=D**-0.5, argmax_rows=M)
    assert (argmax[:, :2] == 3).all()
    assert (argmax[:, 2:] == 130).all()
    # Non-causal, all keys equal: every row's argmax is key 0.
    k_same = k[:, :, :1].expand(B, Hkv, N, D).contiguous()
    _, argmax = run_path(path, q, k_same, v, causal=False, sm_scale=D**-0.5, argmax_rows=M)
    assert (argmax == 0).all()


@pytest.mark.parametrize("path", HALF_PATHS)
@pytest.mark.parametrize("M", [1, 10])
def test_half_precision_ties_and_skipped_heads(path, M):
    """bf16: duplicate keys (bit-identical logits in every path) give the first copy; a skipped head gives
    exactly 0 and -1 in the poisoned buffers."""
    B, Hq, Hkv, N, D = 2, 4, 2, 200, 64
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, dtype=torch.bfloat16, seed=12)
    k[:, :, 70] = k[:, :, 3]
    k[:, :, 150] = k[:, :, 3]
    q[:, :2] = 4.0 * k[:, 0, 3][:, None, None, :]
    q[:, 2:] = 4.0 * k[:, 1, 3][:, None, None, :]
    skip = torch.zeros(B, Hq, dtype=torch.bool)
    skip[1, 1] = True
    out, argmax = run_path(path, q, k, v, causal=True, sm_scale=D**-0.5, skip_heads=skip, argmax_rows=M)
    assert (argmax[~skip] == 3).all()
    assert (out[skip] == 0).all() and (argmax[skip] == -1).all()
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("path", PATHS)
def test_large_logits_are_stable(path):
    q, k, v = make_qkv(1, 2, 1, 20, 90, 32, seed=9)
    check_against_reference(path, q * 30, k, v, causal=True, argmax_rows=20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_through_cpu_backend(dtype):
    B, Hq, Hkv, M, N, D = 2, 4, 2, 11, 40, 32
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, dtype=dtype, seed=10, noncontiguous_q=True)
    pad = left_padding_mask(B, N, [0, 35])  # batch 1: the first rows have no valid key
    skip = torch.tensor([[False, True, False, False], [False, False, False, True]])
    grad = torch.randn(B, Hq, M, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = []
    for backend in ("cpu", "reference"):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out, argmax = attention(
            *leaves, key_padding_mask=pad, skip_heads=skip, return_argmax=True, backend=backend
        )
        (out * grad).sum().backward()
        grads.append([t.grad for t in leaves])
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for got, ref in zip(*grads, strict=True):
        assert torch.isfinite(got.float()).all()
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    assert (grads[0][0][:, :][skip] == 0).all(), "skipped heads get zero gradient"


def test_missing_extension_warns_and_falls_back(monkeypatch):
    monkeypatch.setattr(cpu_backend.importlib.util, "find_spec", lambda name: None)
    cpu_backend._library.cache_clear()
    try:
        q, k, v = make_qkv(1, 2, 1, 4, 10, 16, seed=12)
        with pytest.warns(RuntimeWarning, match="not built"):
            out, argmax, _ = cpu_backend.forward(
                q, k, v, causal=True, sm_scale=0.25, key_padding_mask=None, skip_heads=None, argmax_rows=4
            )
        ref_out, ref_argmax = reference_attention(q, k, v, sm_scale=0.25, argmax_rows=4)
        torch.testing.assert_close(out, ref_out)
        assert torch.equal(argmax, ref_argmax)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once only
            cpu_backend.forward(
                q, k, v, causal=True, sm_scale=0.25, key_padding_mask=None, skip_heads=None, argmax_rows=0
            )
    finally:
        monkeypatch.undo()
        cpu_backend._library.cache_clear()
    assert cpu_backend.cpp_available()


def test_decode_tail_block_with_padding():
    """Row-major (decode) tiles with key padding and a partial last block: the key-bias row is read with
    aligned vector loads (it once was a std::vector, 16-byte aligned: a crash on AVX2 for this shape)."""
    q, k, v = make_qkv(1, 3, 3, 130, 130, 128, seed=63)
    pad = left_padding_mask(1, 130, [9])
    for block_m in (1, 2, 5):
        out = torch.full_like(q, POISON_FLOAT)
        argmax = torch.full((1, 3, 130), POISON_INDEX, dtype=torch.int64)
        cpu_backend.cpp_forward(
            q, k, v, causal=True, sm_scale=128**-0.5, key_padding_mask=pad, skip_heads=None, argmax_rows=130,
            out=out, argmax=argmax, block_m=block_m,
        )  # fmt: skip
        ref_out, _ = reference_attention(q, k, v, sm_scale=128**-0.5, key_padding_mask=pad)
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
        assert_argmax_matches(
            argmax, q, k, causal=True, sm_scale=128**-0.5, key_padding_mask=pad, skip_heads=None,
            atol=ARGMAX_TOL,
        )  # fmt: skip


def _binding_args(q, k, v, out, argmax=None, kpm=None, skip=None):
    """Positional arguments of ``retmask._C.attention_fwd`` for these tensors (as ``cpp_forward`` builds them)."""
    codes = cpu_backend._library().codes

    def arg(t):
        return None if t is None else (t.data_ptr(), codes[t.dtype], t.shape, t.stride())

    return [arg(q), arg(k), arg(v), arg(out), arg(argmax), arg(kpm), arg(skip), True, 0.125, 128, 64, 1]


Q, K, V, OUT, ARGMAX, KPM, SKIP, BLOCK_M, BLOCK_N = 0, 1, 2, 3, 4, 5, 6, 9, 10  # positions in _binding_args


def _edit(args: list, edits: dict) -> None:
    """Apply {position: value} to binding arguments; a dict value replaces fields of a tensor tuple."""
    for i, value in edits.items():
        if isinstance(value, dict):
            ptr, dtype, shape, strides = args[i]
            f = {"ptr": ptr, "dtype": dtype, "shape": tuple(shape), "strides": tuple(strides)} | value
            value = (f["ptr"], f["dtype"], f["shape"], f["strides"])
        args[i] = value


BAD_ARGUMENTS = [  # (edits of a valid call: q [2, 6, 5, 16], k/v [2, 3, 40, 16], argmax T = 2, masks), message
    ({Q: {"dtype": 7}}, "q: dtype unknown dtype code 7"),
    ({Q: {"dtype": 3}}, "q: dtype int64, expected float32, float16 or bfloat16"),
    ({K: {"dtype": 1}}, "k: dtype float16, expected float32"),
    ({Q: {"shape": (2, 6, 5), "strides": (80, 16, 1)}}, "q: expected 4 dims, got shape"),
    ({Q: {"strides": (480, 80, 16)}}, "q: expected 4 strides"),
    (
        {K: {"shape": (2, 3, 40, 32)}},
        r"k: shape \[2, 3, 40, 32\], expected \[B, Hkv, N, D\] with B and D of q",
    ),
    ({V: {"shape": (2, 3, 39, 16)}}, r"v: shape \[2, 3, 39, 16\], expected the shape of k"),
    ({OUT: {"shape": (2, 6, 4, 16)}}, r"out: shape \[2, 6, 4, 16\], expected the shape of q"),
    (
        {K: {"shape": (2, 4, 40, 16)}, V: {"shape": (2, 4, 40, 16)}},
        "Hkv: 4 key/value heads do not divide Hq = 6",
    ),
    ({Q: {"shape": (2, 6, 41, 16)}, OUT: {"shape": (2, 6, 41, 16)}}, "M: 41 query rows for N = 40 keys"),
    ({ARGMAX: {"shape": (2, 6, 6), "strides": (36, 6, 1)}}, r"argmax_rows: 6 is not in \[0, M = 5\]"),
    ({ARGMAX: {"shape": (2, 5, 2)}}, r"argmax: shape \[2, 5, 2\], expected \[B, Hq, argmax_rows\]"),
    ({ARGMAX: {"strides": (1, 2, 12)}}, "argmax: must be contiguous"),
    ({ARGMAX: {"dtype": 0}}, "argmax: dtype float32, expected int64"),
    ({KPM: {"shape": (2, 41), "strides": (41, 1)}}, r"key_padding_mask: shape \[2, 41\], expected \[B, N\]"),
    ({SKIP: {"dtype": 0}}, "skip_heads: dtype float32, expected bool"),
    ({Q: {"ptr": 0}}, "q: null data pointer"),
    ({BLOCK_M: 0}, "block_m: 0 rows per work item"),
    ({BLOCK_N: 48}, "block_n: 48 keys per block, need a positive multiple of 32"),
]


@pytest.mark.parametrize("edits, message", BAD_ARGUMENTS, ids=[m.split(":")[0] for _, m in BAD_ARGUMENTS])
def test_binding_rejects_bad_arguments(edits, message):
    """Every check of the binding raises ValueError naming the argument, before anything is written."""
    q, k, v = make_qkv(2, 6, 3, 5, 40, 16, seed=13)
    out = torch.full_like(q, POISON_FLOAT)
    argmax = torch.full((2, 6, 2), POISON_INDEX, dtype=torch.int64)
    kpm = left_padding_mask(2, 40, [0, 3])
    skip = torch.zeros(2, 6, dtype=torch.bool)
    args = _binding_args(q, k, v, out, argmax, kpm, skip)
    cpu_backend._library().module.attention_fwd(*args)  # the unedited call is fine
    assert not out.isnan().any() and (argmax >= 0).all()
    out.fill_(POISON_FLOAT)
    argmax.fill_(POISON_INDEX)
    _edit(args, edits)
    with pytest.raises(ValueError, match=message):
        cpu_backend._library().module.attention_fwd(*args)
    assert out.isnan().all() and (argmax == POISON_INDEX).all()


def test_binding_rejects_wrong_types():
    q, k, v = make_qkv(1, 2, 1, 3, 8, 16, seed=14)
    args = _binding_args(q, k, v, torch.empty_like(q))
    with pytest.raises(TypeError):
        cpu_backend._library().module.attention_fwd(*args[:-1])  # one argument missing
    args[0] = ("not a pointer", 0, q.shape, q.stride())
    with pytest.raises(TypeError):
        cpu_backend._library().module.attention_fwd(*args)


def test_cpp_forward_reports_mismatches_from_the_binding():
    """cpp_forward itself checks nothing it passes on: mismatches come back as the binding's ValueError."""
    q, k, v = make_qkv(1, 4, 2, 3, 20, 32, seed=15)
    kw = dict(causal=True, sm_scale=0.1, key_padding_mask=None, skip_heads=None, argmax_rows=0)
    with pytest.raises(
        ValueError, match=r"k: shape \[1, 2, 20, 16\], expected \[B, Hkv, N, D\] with B and D of q"
    ):
        cpu_backend.cpp_forward(q, k[..., :16], v[..., :16], **kw)
    with pytest.raises(ValueError, match="v: dtype bfloat16, expected float32"):
        cpu_backend.cpp_forward(q, k, v.bfloat16(), **kw)
    with pytest.raises(ValueError, match="out: shape"):
        cpu_backend.cpp_forward(q, k, v, **kw, out=torch.empty(1, 4, 3, 16))
    with pytest.raises(ValueError, match="q: dtype torch.float64 is not supported"):
        cpu_backend.cpp_forward(q.double(), k, v, **kw)
    with pytest.raises(ValueError, match="key_padding_mask: dtype float32, expected bool"):
        cpu_backend.cpp_forward(q, k, v, **(kw | {"key_padding_mask": torch.ones(1, 20)}))


@pytest.mark.parametrize("features", [False, True], ids=["plain", "window-softcap-sinks"])
def test_thread_count_does_not_change_results(features):
    """A call large enough to split over threads gives the same bits on 1 and 2 threads."""
    if features:
        q, k, v = make_qkv(1, 4, 2, 1024, 1024, 64, seed=26)
        kw = dict(
            causal=True, sm_scale=0.125, key_padding_mask=None, skip_heads=None, argmax_rows=64, window=200,
            softcap=4.0, sinks=torch.randn(4),
        )  # fmt: skip
    else:
        q, k, v = make_qkv(1, 9, 3, 1, 4096, 64, seed=16)
        kw = dict(causal=True, sm_scale=0.125, key_padding_mask=None, skip_heads=None, argmax_rows=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_backend.cpp_forward(q, k, v, **kw)
        torch.set_num_threads(2)
        two = cpu_backend.cpp_forward(q, k, v, **kw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_load_library_gives_a_separate_build(tmp_path):
    """load_library (bench/bench_kernel_ab.py's A/B) loads a copy of the build as a module of its own, not
    the installed one again (pybind11 caches modules by name), and bind_library takes a path."""
    installed = cpu_backend._library()
    copy = tmp_path / "old_C.so"
    shutil.copy(installed.module.__file__, copy)
    other = cpu_backend.load_library(copy)
    assert other.module is not installed.module and other.module.__file__ == str(copy)
    assert sys.modules["retmask._C"] is installed.module
    assert cpu_backend.bind_library(str(copy)).module is other.module
    q, k, v = make_qkv(1, 4, 2, 6, 50, 32, seed=17)
    kw = dict(causal=True, sm_scale=0.2, key_padding_mask=None, skip_heads=None, argmax_rows=6)
    a = cpu_backend.cpp_forward(q, k, v, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_backend, "_library", lambda: other)
        b = cpu_backend.cpp_forward(q, k, v, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads ELF symbols of torch's libraries")
def test_one_openmp_runtime():
    """The kernel and torch share one OpenMP runtime (one thread pool): torch's wheel bundles libgomp under
    the soname the extension links (libgomp.so.1), and the loader maps one object per soname."""
    libtorch = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    # The pinned torch (2.13 CPU wheel) ships libtorch_cpu.so linked against its bundled libgomp.
    assert os.path.exists(libtorch), f"no libtorch_cpu.so at {libtorch}"
    torch_omp = ctypes.cast(ctypes.CDLL(libtorch).omp_get_max_threads, ctypes.c_void_p).value
    ext = ctypes.CDLL(importlib.util.find_spec("retmask._C").origin)
    assert ctypes.cast(ext.omp_get_max_threads, ctypes.c_void_p).value == torch_omp
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert ext.omp_get_max_threads() == 1  # torch's setting is the kernel's runtime's setting
    finally:
        torch.set_num_threads(threads)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    B=st.integers(1, 2),
    Hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    N=st.integers(1, 160),
    D=st.sampled_from([8, 16, 24, 64, 80]),
    causal=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    path=st.sampled_from(PATHS),
)
def test_property_random_shapes(data, B, Hkv, group, N, D, causal, dtype, path):
    Hq = Hkv * group
    M = data.draw(st.integers(1, N), label="M")
    T = data.draw(st.integers(0, M), label="argmax_rows")
    pads = data.draw(st.lists(st.integers(0, N), min_size=B, max_size=B), label="pads")
    skip = data.draw(
        st.one_of(st.none(), st.lists(st.booleans(), min_size=B * Hq, max_size=B * Hq)), label="skip"
    )
    skip_heads = torch.tensor(skip).reshape(B, Hq) if skip is not None else None
    seed = data.draw(st.integers(0, 2**16), label="seed")
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, dtype=dtype, seed=seed, noncontiguous_q=seed % 2 == 0)
    check_against_reference(
        path, q, k, v, causal=causal, key_padding_mask=left_padding_mask(B, N, pads),
        skip_heads=skip_heads, argmax_rows=T,
    )  # fmt: skip


# -- sliding window, soft-capping, sinks: the C++ kernel directly -----------------------------------------

# Row-major tiles need fewer tile rows than the build's vector lanes (8 or 16): 4 rows per item gives them
# whenever g < 8, whichever build runs.
LAYOUTS = ("lanes", "rowmajor")
# bf16 dot products in the lanes layout (fp16: "lanes")
HALF_LAYOUTS = (*LAYOUTS, "bf16dot")
LAYOUT_BLOCK_M = {"lanes": 128, "rowmajor": 4, "bf16dot": 128}
LAYOUT_KW = {name: {"block_m": bm, "bf16_dot": name == "bf16dot"} for name, bm in LAYOUT_BLOCK_M.items()}


def tile_layout(Hq: int, Hkv: int, M: int, skip: torch.Tensor | None, block_m: int) -> str:
    """The FMA tile layout the C++ kernel picks for this call (its make_plan / run, in Python)."""
    g, max_rows = Hq // Hkv, 0
    B = 1 if skip is None else skip.shape[0]
    for b in range(B):
        for hk in range(Hkv):
            active = g if skip is None else int((~skip[b, hk * g : (hk + 1) * g]).sum())
            if active:
                max_rows = max(max_rows, active * min(max(1, block_m // active), M))
    return "lanes" if max_rows >= cpu_backend.vector_lanes() else "rowmajor"


def check_features(
    q, k, v, *, layout, window, softcap, sinks, key_padding_mask=None, skip_heads=None, argmax_rows=None,
    sm_scale=None, out_transposed=False,
):  # fmt: skip
    """The C++ kernel (poisoned caller buffers, the given tile layout) against the float64 oracle."""
    B, Hq, M, D = q.shape
    block_m = LAYOUT_BLOCK_M[layout]
    # The parametrisations only generate shapes that can use ``layout`` (``_feature_cases``).
    tiles = "lanes" if layout == "bf16dot" else layout
    assert tile_layout(Hq, k.shape[1], M, skip_heads, block_m) == tiles, (
        f"this shape cannot use {layout} tiles"
    )
    rows = M if argmax_rows is None else argmax_rows
    scale = D**-0.5 if sm_scale is None else sm_scale
    kw = dict(
        causal=True, sm_scale=scale, key_padding_mask=key_padding_mask, skip_heads=skip_heads, window=window,
        softcap=softcap,
    )  # fmt: skip
    out, argmax = run_path(
        "cpp",
        q,
        k,
        v,
        argmax_rows=rows,
        out_transposed=out_transposed,
        sinks=sinks,
        **LAYOUT_KW[layout],
        **kw,
    )
    ref, _ = reference_attention(
        q.double(), k.double(), v.double(), sinks=None if sinks is None else sinks.double(), **kw
    )
    assert out.dtype == q.dtype and not torch.isnan(out).any(), "output has NaN (unwritten element or 0/0)"
    tol = {torch.float32: 3e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}[q.dtype]
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol)
    if skip_heads is not None:
        assert (out[skip_heads] == 0).all(), "skipped heads must give exactly 0"
    if rows:
        assert_argmax_matches(
            argmax, q[:, :, M - rows :], k, atol=ARGMAX_TOL, window=window, softcap=softcap,
            **{n: kw[n] for n in ("causal", "sm_scale", "key_padding_mask", "skip_heads")},
        )  # fmt: skip
    return out, argmax


# (B, Hq, Hkv, M, N, D, window, pads)
FEATURE_SHAPES = [
    (1, 4, 2, 100, 200, 64, 70, None),  # window cutting through 64-key blocks, chunk against a cache
    (1, 2, 1, 64, 64, 64, 64, None),  # window == N == one block
    (1, 3, 1, 40, 50, 80, 1000, [3]),  # window > N, padding
    (2, 4, 4, 33, 90, 96, 1, [0, 20]),  # window 1: each row sees only itself; strided k/v
    (2, 9, 3, 1, 300, 64, 100, [0, 250]),  # decode (row-major only), SmolLM2 heads
    (1, 4, 1, 80, 80, 256, 17, None),  # Gemma-3 head dim 256, MQA, M = N; strided k/v
    (1, 8, 2, 20, 150, 128, 64, [10]),  # window of one block, not aligned to blocks
    (2, 4, 2, 24, 130, 64, None, [0, 5]),  # no window: soft-capping / sinks alone
    (1, 4, 2, 16, 2000, 64, 37, None),  # many blocks before the window are never visited
]
FEATURE_MIXES = [(None, False), (2.5, False), (None, True), (6.0, True)]  # (softcap, sinks)


def _feature_cases():
    """(layout, shape, softcap, sinks) of FEATURE_SHAPES x FEATURE_MIXES x layouts, less what cannot run:
    lanes tiles for decode shapes, and no feature at all."""
    for shape in FEATURE_SHAPES:
        B, Hq, Hkv, M, N, D, window, pads = shape
        for softcap, with_sinks in FEATURE_MIXES:
            if window is None and softcap is None and not with_sinks:
                continue
            for layout in LAYOUTS:
                skip = torch.zeros(B, Hq, dtype=torch.bool)
                skip[0, -1] = True
                if tile_layout(Hq, Hkv, M, skip, LAYOUT_BLOCK_M[layout]) == layout:
                    case_id = "B{}_Hq{}_Hkv{}_M{}_N{}_D{}_w{}_pad{}".format(*shape)
                    yield pytest.param(
                        layout,
                        shape,
                        softcap,
                        with_sinks,
                        id=f"{case_id}-cap{softcap}-sinks{with_sinks}-{layout}",
                    )


@pytest.mark.parametrize("layout,shape,softcap,with_sinks", list(_feature_cases()))
def test_cpp_features_match_reference(layout, shape, softcap, with_sinks):
    B, Hq, Hkv, M, N, D, window, pads = shape
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=M + N + D + (window or 0), noncontiguous_q=True)
    if D in (96, 256):  # k, v as [B, N, Hkv, D] buffers seen as [B, Hkv, N, D]
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    sinks = torch.randn(Hq, generator=torch.Generator().manual_seed(N)) * 2 if with_sinks else None
    skip = torch.zeros(B, Hq, dtype=torch.bool)
    skip[0, -1] = True
    check_features(
        q * 2, k, v, layout=layout, window=window, softcap=softcap, sinks=sinks,
        key_padding_mask=left_padding_mask(B, N, pads) if pads else None, skip_heads=skip,
        argmax_rows=min(M, 9), out_transposed=layout == "lanes",
    )  # fmt: skip


@pytest.mark.parametrize("layout", HALF_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D", [64, 256])
def test_cpp_features_half_precision(layout, dtype, D):
    q, k, v = make_qkv(2, 4, 2, 40, 110, D, dtype=dtype, seed=D, noncontiguous_q=True)
    check_features(
        q, k, v, layout=layout, window=45, softcap=4.0, sinks=torch.randn(4),
        key_padding_mask=left_padding_mask(2, 110, [0, 30]), argmax_rows=40,
    )  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("softcap,with_sinks", FEATURE_MIXES, ids=lambda x: str(x))
def test_cpp_window_of_n_or_more_is_bit_identical_to_none(layout, softcap, with_sinks):
    B, Hq, Hkv, M, N, D = 1, 6, 2, 70, 130, 64
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=21)
    pad = left_padding_mask(B, N, [7])
    kw = dict(
        causal=True, sm_scale=0.125, key_padding_mask=pad, argmax_rows=M, **LAYOUT_KW[layout],
        softcap=softcap, sinks=torch.randn(Hq) if with_sinks else None,
    )  # fmt: skip
    none = run_path("cpp", q, k, v, **kw)
    for window in (N, N + 1, 10 * N):
        got = run_path("cpp", q, k, v, window=window, **kw)
        assert torch.equal(got[0], none[0]) and torch.equal(got[1], none[1]), window


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpp_softcap_with_huge_logits(layout):
    """Logits in the thousands: the cap saturates (ties at +-c), nothing overflows, matches the oracle."""
    q, k, v = make_qkv(1, 4, 2, 30, 150, 64, seed=22)
    out, argmax = check_features(
        q * 300, k, v, layout=layout, window=90, softcap=3.0, sinks=torch.randn(4), argmax_rows=30
    )
    assert torch.isfinite(out).all() and (argmax >= 0).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpp_sinks_above_every_logit(layout):
    B, Hq, Hkv, M, N, D = 1, 4, 2, 24, 100, 64
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=23)
    kw = dict(causal=True, sm_scale=0.125, argmax_rows=M, **LAYOUT_KW[layout], window=30, softcap=None)
    top = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.125).amax((0, 2, 3))
    # A sink 8 above each head's largest logit: the outputs shrink ~e^8-fold and still match the oracle.
    sinks = (top + 8).float()
    out, argmax = run_path("cpp", q, k, v, sinks=sinks, **kw)
    ref, _ = reference_attention(
        q.double(), k.double(), v.double(), sinks=sinks.double(), window=30, sm_scale=0.125
    )
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-9)
    assert 0 < out.abs().max() < 1e-2
    _, plain_argmax = run_path("cpp", q, k, v, **kw)
    assert torch.equal(argmax, plain_argmax), "a sink is never an argmax"
    # Far above (no overflow: exactly 0 out); -inf: exactly no sink; NaN: NaN rows, argmax untouched.
    out, argmax = run_path("cpp", q, k, v, sinks=torch.full((Hq,), 1e30), **kw)
    assert (out == 0).all() and torch.equal(argmax, plain_argmax)
    plain = run_path("cpp", q, k, v, **kw)[0]
    assert torch.equal(run_path("cpp", q, k, v, sinks=torch.full((Hq,), float("-inf")), **kw)[0], plain)
    sinks = torch.tensor([0.0, float("nan"), 0.0, float("inf")])
    out, argmax = run_path("cpp", q, k, v, sinks=sinks, **kw)
    assert torch.isnan(out[:, [1, 3]]).all() and not torch.isnan(out[:, [0, 2]]).any()
    assert torch.equal(argmax, plain_argmax)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "features", [{}, {"window": 1}, {"window": 3, "softcap": 5.0, "sinks": True}], ids=str
)
def test_cpp_non_finite_contract(layout, features):
    """NaN / +inf logits poison exactly the rows that may see them (NaN everywhere, argmax -1), in both
    tile layouts; NaN keys that a row may not see (padding, outside its window) leave it alone. Key 40 is
    lane 40 of its block: with window 1 it is the only key row 40 sees, a NaN among -inf."""
    B, Hq, Hkv, M, N, D = 1, 4, 2, 64, 100, 32
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, seed=24)
    kw = dict(features)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(Hq)
    pad = left_padding_mask(B, N, [20])
    k[0, 0, 40, 3] = float("nan")  # kv head 0: seen by rows at positions >= 40 (query heads 0, 1)
    k[0, 1, 10, 0] = float("nan")  # kv head 1: a padding key, seen by nobody
    q[0, 2, 50, 1] = float("nan")  # one query row
    q[0, 3, 60, 0] = float("inf")  # +-inf logits: poisoned unless capped
    out, argmax = run_path(
        "cpp", q, k, v, causal=True, sm_scale=D**-0.5, key_padding_mask=pad, argmax_rows=M,
        **LAYOUT_KW[layout], **kw,
    )  # fmt: skip
    ref, ref_argmax = reference_attention(
        q, k, v, sm_scale=D**-0.5, key_padding_mask=pad, argmax_rows=M, **kw
    )  # fmt: skip
    nan_rows = torch.isnan(out).any(-1)
    assert torch.equal(nan_rows, torch.isnan(out).all(-1)), "a poisoned row is NaN in every element"
    assert torch.equal(nan_rows, torch.isnan(ref).any(-1)), "the oracle's NaN rows"
    assert bool(nan_rows[0, :2, 4].all()) and bool(nan_rows[0, 2, 50]), (
        "the row at key 40 / the NaN query row"
    )
    assert not bool(nan_rows[0, 2:, :50].any()), "the NaN padding key poisons nothing"
    assert torch.equal(argmax == -1, ref_argmax == -1) and torch.equal(
        argmax, ref_argmax.where(argmax >= 0, -1)
    )
    torch.testing.assert_close(out[~nan_rows], ref[~nan_rows], rtol=0, atol=3e-5)


def test_cpp_window_visits_only_its_blocks():
    """A local layer costs O(M * window): window 64 at 4K keys takes a small fraction of full causal."""
    q, k, v = make_qkv(1, 2, 1, 4096, 4096, 64, seed=25)
    kw = dict(causal=True, sm_scale=0.125, key_padding_mask=None, skip_heads=None, argmax_rows=0)

    def best(calls, **features):
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            cpu_backend.cpp_forward(q, k, v, **kw, **features)
            times.append(time.perf_counter() - t0)
        return min(times)

    full, local = best(1), best(3, window=64)
    assert local < 0.3 * full, (local, full)  # ~(64 + 128 + 64) / 2048 of the key blocks


BAD_FEATURES = [  # (keyword arguments of a valid call, message)
    ({"window": -1}, "window: -1 keys, need >= 1"),
    ({"window": 4, "causal": False}, r"window: a sliding window \(4 keys\) needs causal attention"),
    ({"softcap": -1.0}, "softcap: -1 is not a finite value > 0"),
    ({"softcap": float("nan")}, "softcap: nan is not a finite value"),
    ({"softcap": float("inf")}, "softcap: inf is not a finite value"),
    ({"softcap": 1e-60}, "softcap: 1e-60 is not representable as a float32 > 0"),
    ({"softcap": 1e60}, "softcap: 1e[+]60 is not representable as a float32 > 0"),
    ({"sinks": torch.zeros(6, dtype=torch.float16)}, "sinks: dtype float16, expected float32"),
    ({"sinks": torch.zeros(5)}, r"sinks: shape \[5\], expected \[Hq\] = \[6\]"),
    ({"sinks": torch.zeros(6, 2)}, "sinks: expected 1 dims"),
    ({"sinks": torch.zeros(12)[::2]}, "sinks: must be contiguous"),
    ({"sinks": "null"}, "sinks: null data pointer"),
]


@pytest.mark.parametrize(
    "kwargs, message", BAD_FEATURES, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(BAD_FEATURES)]
)
def test_binding_rejects_bad_features(kwargs, message):
    q, k, v = make_qkv(2, 6, 3, 5, 40, 16, seed=13)
    out = torch.full_like(q, POISON_FLOAT)
    args = _binding_args(q, k, v, out)
    lib = cpu_backend._library()
    kwargs = dict(kwargs)
    if "causal" in kwargs:
        args[7] = kwargs.pop("causal")
    sinks = kwargs.pop("sinks", None)
    if isinstance(sinks, torch.Tensor):
        kwargs["sinks"] = (sinks.data_ptr(), lib.codes[sinks.dtype], sinks.shape, sinks.stride())
    elif sinks == "null":
        kwargs["sinks"] = (0, lib.codes[torch.float32], (6,), (1,))
    with pytest.raises(ValueError, match=message):
        lib.module.attention_fwd(*args, **kwargs)
    assert out.isnan().all()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    B=st.integers(1, 2),
    Hkv=st.integers(1, 2),
    group=st.sampled_from([1, 3, 4]),
    N=st.integers(1, 200),
    D=st.sampled_from([16, 64, 80]),
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_property_features(data, B, Hkv, group, N, D, layout, dtype):
    Hq = Hkv * group
    M = data.draw(st.integers(1, N), label="M")
    window = data.draw(st.one_of(st.none(), st.integers(1, N + 5)), label="window")
    softcap = data.draw(st.one_of(st.none(), st.floats(0.5, 20.0)), label="softcap")
    with_sinks = data.draw(st.booleans(), label="sinks")
    pads = data.draw(st.lists(st.integers(0, N), min_size=B, max_size=B), label="pads")
    skip = data.draw(st.lists(st.booleans(), min_size=B * Hq, max_size=B * Hq), label="skip")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, dtype=dtype, seed=seed, noncontiguous_q=seed % 2 == 0)
    block_m = LAYOUT_BLOCK_M[layout]
    skip_heads = torch.tensor(skip).reshape(B, Hq)
    if tile_layout(Hq, Hkv, M, skip_heads, block_m) != layout:
        layout = "rowmajor" if layout == "lanes" else "lanes"  # the other one, then (or a skip)
    check_features(
        q * 2, k, v, layout=layout, window=window, softcap=softcap,
        sinks=torch.randn(Hq, generator=torch.Generator().manual_seed(seed)) * 2 if with_sinks else None,
        key_padding_mask=left_padding_mask(B, N, pads), skip_heads=skip_heads,
        argmax_rows=data.draw(st.integers(0, M), label="argmax_rows"),
    )  # fmt: skip


def test_bf16dot_non_finite_contract():
    """The bf16 dot-product layout keeps the non-finite contract: a NaN key poisons exactly the rows that
    may see it (NaN everywhere, argmax -1; P of a poisoned row stays NaN through the bf16 rounding), a NaN
    padding key poisons nothing, and the other rows match the oracle."""
    B, Hq, Hkv, M, N, D = 1, 4, 2, 64, 100, 32
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, dtype=torch.bfloat16, seed=24)
    pad = left_padding_mask(B, N, [20])
    k[0, 0, 40, 3] = float("nan")  # kv head 0: seen by rows at positions >= 40 (query heads 0, 1)
    k[0, 1, 10, 0] = float("nan")  # kv head 1: a padding key, seen by nobody
    q[0, 2, 50, 1] = float("nan")  # one query row
    kw = dict(causal=True, sm_scale=D**-0.5, key_padding_mask=pad, argmax_rows=M)
    out, argmax = run_path("bf16dot", q, k, v, block_m=128, **kw)
    ref, ref_argmax = reference_attention(q.double(), k.double(), v.double(), **kw)
    nan_rows = torch.isnan(out).any(-1)
    assert torch.equal(nan_rows, torch.isnan(out).all(-1)), "a poisoned row is NaN in every element"
    assert torch.equal(nan_rows, torch.isnan(ref).any(-1)), "the oracle's NaN rows"
    assert (
        bool(nan_rows[0, :2, 40:].all()) and bool(nan_rows[0, 2, 50]) and not bool(nan_rows[0, 2:, :50].any())
    )
    assert torch.equal(argmax == -1, ref_argmax == -1)
    torch.testing.assert_close(out[~nan_rows].double(), ref[~nan_rows], rtol=0, atol=3e-2)


@pytest.mark.parametrize(
    "dtype,D,message",
    [
        (torch.float32, 16, "bf16_dot: bf16 dot products are for bfloat16 inputs"),
        (torch.float16, 16, "bf16_dot: bf16 dot products are for bfloat16 inputs"),
        (torch.bfloat16, 15, "bf16_dot: bf16 dot products take pairs of dims: D must be even, got 15"),
    ],
    ids=["float32", "float16", "odd-D"],
)
def test_binding_rejects_bad_bf16_dot(dtype, D, message):
    q, k, v = make_qkv(2, 6, 3, 5, 40, D, dtype=dtype, seed=13)
    out = torch.full_like(q, POISON_FLOAT)
    lib = cpu_backend._library()
    kwargs = {"bf16_dot": True}
    with pytest.raises(ValueError, match=message):
        lib.module.attention_fwd(*_binding_args(q, k, v, out), **kwargs)
    assert out.isnan().all()


def test_bf16dot_is_taken_where_it_is_native(monkeypatch):
    """The rule takes "bf16dot" for bf16 calls with an even head dim and more than one query row on the
    build that runs vdpbf16ps, never elsewhere (the other builds only emulate it) and never for decode; a
    forced "bf16dot" runs other calls as "cpp", bit for bit."""
    from retmask.kernels.paths import cpu_forward_path

    assert cpu_backend.bf16_dot_native("avx2") is False
    assert cpu_backend.bf16_dot_native() == (cpu_backend.selected_isa() == "avx512bf16")
    native = "avx512bf16"
    assert cpu_forward_path(torch.bfloat16, 64, 30, build=native) == "bf16dot"
    assert cpu_forward_path(torch.bfloat16, 64, 1, build=native) == "cpp"  # decode
    assert cpu_forward_path(torch.bfloat16, 63, 30, build=native) == "cpp"
    assert cpu_forward_path(torch.float16, 64, 30, build=native) == "cpp"
    assert cpu_forward_path(torch.float32, 64, 30, build=native) == "cpp"
    assert cpu_forward_path(torch.bfloat16, 64, 30, build="avx512") == "cpp"
    assert cpu_forward_path(torch.bfloat16, 64, 30, build="") == "blocked"  # no extension
    q32, k32, v32 = make_qkv(1, 6, 2, 30, 90, 64, seed=5)
    monkeypatch.setenv("RETMASK_CPU_PATH", "bf16dot")
    assert cpu_forward_path(torch.float32, 64, 30, build=native) == "cpp"
    forced = attention(q32, k32, v32, causal=True, return_argmax=True, backend="cpu")
    monkeypatch.setenv("RETMASK_CPU_PATH", "cpp")
    plain = attention(q32, k32, v32, causal=True, return_argmax=True, backend="cpu")
    assert torch.equal(forced[0], plain[0]) and torch.equal(forced[1], plain[1])


@pytest.mark.parametrize("M", [1, 5, 12, 40])
def test_bf16dot_skipping_heads_changes_no_other_head(M):
    """ "bf16dot" runs every tile in the lanes layout (a tile of fewer rows than a vector is padded), so a
    row's arithmetic does not depend on how many rows share its tile: skipping heads leaves every other
    head's output and argmax bit for bit as it was (what makes a head mask equal an o_proj-zeroed
    checkpoint in bf16), also where the skips leave fewer rows than a vector."""
    q, k, v = make_qkv(2, 4, 2, M, 70, 16, dtype=torch.bfloat16, seed=M)
    kw = dict(causal=True, sm_scale=0.25, argmax_rows=M, block_m=128)
    full_out, full_argmax = run_path("bf16dot", q, k, v, **kw)
    skip = torch.tensor([[False, True, True, False], [True, False, False, False]])
    out, argmax = run_path("bf16dot", q, k, v, skip_heads=skip, **kw)
    assert torch.equal(out[~skip].view(torch.int16), full_out[~skip].view(torch.int16))
    assert torch.equal(argmax[~skip], full_argmax[~skip])
    assert (out[skip] == 0).all() and (argmax[skip] == -1).all()
