"""The "gemm" CPU path's link to torch's block GEMM (retmask.kernels.cpu_gemm) and the kernel's packed
(VNNI) branch, which only matrix-unit CPUs run: here it runs against an emulated matrix unit.

The path's results against the reference are in test_cpu.py (path "gemm", layout "gemm"); this file
covers what decides whether and how the path runs.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from retmask.kernels import cpu as cpu_backend
from retmask.kernels import cpu_autotune, cpu_gemm, reference_attention
from retmask.kernels.cpuinfo import cpu_flags

from .helpers import POISON_FLOAT, POISON_INDEX, assert_argmax_matches, left_padding_mask, make_qkv

GEMM_T = ctypes.CFUNCTYPE(
    None,
    *[ctypes.c_int64] * 6,
    ctypes.c_bool,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_bool,
)
PACK_T = ctypes.CFUNCTYPE(
    None, *[ctypes.c_int64] * 4, ctypes.c_int8, ctypes.c_int8, ctypes.c_void_p, ctypes.c_void_p
)
RELEASE_T = ctypes.CFUNCTYPE(None, ctypes.c_bool)


def test_block_gemm_resolved_from_this_torch():
    """This torch exports the GEMM for all three dtypes; on a CPU without AMX nothing is packed."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert cpu_gemm.available(dtype) and cpu_backend.gemm_available(dtype)
        block = cpu_gemm.block_gemm(dtype, 64)
        assert block is not None and block.gemm and block.release
        assert block.pack_dtype == {torch.float32: 6, torch.bfloat16: 15, torch.float16: 5}[dtype]
    assert not cpu_gemm.available(torch.float64)
    if "amx_bf16" not in cpu_flags():
        assert not cpu_gemm.could_pack(torch.bfloat16)
        assert not cpu_gemm.block_gemm(torch.bfloat16, 128).vnni
    assert not cpu_gemm.could_pack(torch.float32)


@pytest.fixture
def fresh_gemm_caches():
    """Empty memo caches of cpu_gemm and cpu.gemm_paths before and after (the originals: a test may patch the names)."""
    cached = (cpu_gemm.block_gemm, cpu_gemm.available, cpu_gemm.could_pack, cpu_backend.gemm_paths)
    for fn in cached:
        fn.cache_clear()
    yield
    for fn in cached:
        fn.cache_clear()


def test_packing_only_where_the_kernel_can_use_it(monkeypatch, fresh_gemm_caches):
    monkeypatch.setattr(cpu_gemm, "could_pack", lambda dtype: dtype != torch.float32)
    assert cpu_gemm.block_gemm(torch.bfloat16, 64).vnni
    assert cpu_gemm.block_gemm(torch.float16, 256).vnni
    assert not cpu_gemm.block_gemm(torch.bfloat16, 96).vnni  # V chunks of 64 columns
    assert not cpu_gemm.block_gemm(torch.bfloat16, 64, block_n=128).vnni
    assert not cpu_gemm.block_gemm(torch.float32, 64).vnni
    monkeypatch.setenv(cpu_gemm.VNNI_ENV, "0")
    cpu_gemm.block_gemm.cache_clear()
    assert not cpu_gemm.block_gemm(torch.bfloat16, 64).vnni


def test_a_torch_without_the_symbols_has_no_gemm_path(monkeypatch, fresh_gemm_caches):
    monkeypatch.setattr(cpu_gemm, "_address", lambda name: 0)
    assert cpu_gemm.block_gemm(torch.bfloat16, 64) is None and not cpu_backend.gemm_available(torch.bfloat16)
    q, k, v = make_qkv(1, 2, 1, 4, 40, 16, seed=1)
    with pytest.raises(RuntimeError, match="'gemm' CPU path needs torch's block GEMM.*RETMASK_CPU_PATH=cpp"):
        cpu_backend.cpp_forward(
            q,
            k,
            v,
            causal=True,
            sm_scale=0.25,
            key_padding_mask=None,
            skip_heads=None,
            argmax_rows=0,
            gemm=True,
        )
    case = cpu_autotune.case_of(q, k, causal=True, key_padding_mask=None, skip_heads=None, argmax_rows=4)
    assert cpu_backend.gemm_paths(q.dtype) == ()
    assert cpu_autotune.candidates(case, cpu_backend.gemm_paths(q.dtype)) == ("cpp", "blocked")


# -- the packed branch against an emulated matrix unit ------------------------------------------------------


def _u16(ptr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint16)), shape=(n,))


def _bf16(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << 16).view(np.float32)


class EmulatedMatrixUnit:
    """bf16 block GEMM and pack with the paired-k (VNNI) layout of oneDNN's AMX micro-kernels: a packed
    [K, N] operand with row length ld_out holds element (k, n) at ((k // 2) * ld_out + n) * 2 + k % 2.
    Records the calls, so the test can check how the kernel drives it."""

    def __init__(self):
        self.packs: list[tuple[int, int, int, int]] = []
        self.gemms: list[tuple[int, int, int, int, int, int, bool, bool]] = []
        self.releases: list[bool] = []
        self._fns = (GEMM_T(self.gemm), PACK_T(self.pack), RELEASE_T(self.releases.append))

    def block_gemm(self) -> cpu_gemm.BlockGemm:
        gemm, pack, release = (ctypes.cast(f, ctypes.c_void_p).value for f in self._fns)
        return cpu_gemm.BlockGemm(gemm, pack, release, True, 15)

    def pack(self, K, N, ld_in, ld_out, dt_in, dt_out, src, dst):
        assert dt_in == dt_out == 15 and K % 2 == 0 and N <= ld_out <= 64
        self.packs.append((K, N, ld_in, ld_out))
        a = _u16(src, (K - 1) * ld_in + N)
        out = _u16(dst, K * ld_out)
        k, n = np.meshgrid(np.arange(K), np.arange(N), indexing="ij")
        out[((k // 2) * ld_out + n) * 2 + k % 2] = a[k * ld_in + n]

    def gemm(self, M, N, K, lda, ldb, ldc, add_c, A, B, C, vnni):
        self.gemms.append((M, N, K, lda, ldb, ldc, add_c, vnni))
        m, k = np.meshgrid(np.arange(M), np.arange(K), indexing="ij")
        a = _bf16(_u16(A, (M - 1) * lda + K)[m * lda + k])
        k, n = np.meshgrid(np.arange(K), np.arange(N), indexing="ij")
        index = ((k // 2) * ldb + n) * 2 + k % 2 if vnni else k * ldb + n
        b = _bf16(_u16(B, int(index.max()) + 1)[index])
        c = np.ctypeslib.as_array(ctypes.cast(C, ctypes.POINTER(ctypes.c_float)), shape=((M - 1) * ldc + N,))
        m, n = np.meshgrid(np.arange(M), np.arange(N), indexing="ij")
        prod = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
        c[m * ldc + n] = prod + (c[m * ldc + n] if add_c else 0)


def test_packed_branch_on_an_emulated_matrix_unit(monkeypatch):
    """The kernel's AMX branch (pack K^T per block, V in chunks of 64 columns, products on packed
    operands, release per work item) gives the reference's results on an emulated matrix unit: a tail
    block, GQA, left padding, a skipped head, D = 128 (two V chunks)."""
    unit = EmulatedMatrixUnit()
    monkeypatch.setattr(cpu_gemm, "block_gemm", lambda *args, **kw: unit.block_gemm())
    B, Hq, Hkv, M, N, D = 2, 4, 2, 20, 150, 128
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, dtype=torch.bfloat16, seed=7)
    kpm = left_padding_mask(B, N, [0, 70])
    skip = torch.zeros(B, Hq, dtype=torch.bool)
    skip[1, 2] = True
    out = torch.full(q.shape, POISON_FLOAT, dtype=q.dtype)
    argmax = torch.full((B, Hq, M), POISON_INDEX, dtype=torch.int64)
    kw = dict(causal=True, sm_scale=D**-0.5, key_padding_mask=kpm, skip_heads=skip, argmax_rows=M)
    cpu_backend.cpp_forward(q, k, v, out=out, argmax=argmax, gemm=True, **kw)
    ref, _ = reference_attention(q.double(), k.double(), v.double(), **kw)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)
    assert (out[skip] == 0).all()
    assert_argmax_matches(argmax, q, k, atol=1e-4, **{n: kw[n] for n in ("causal", "sm_scale", "key_padding_mask")},
                          skip_heads=skip)  # fmt: skip
    assert set(unit.packs) == {(D, 64, 64, 64), (64, 64, D, 64)}  # K^T blocks; V chunks of 64 columns
    assert all(g[-1] for g in unit.gemms) and unit.releases and all(unit.releases)
    qk = [g for g in unit.gemms if not g[6]]
    pv = [g for g in unit.gemms if g[6]]
    assert len(pv) == 2 * len(qk)  # one P V product per 64-column chunk of V
    assert {g[1:6] for g in qk} == {(64, D, D, 64, 64)} and {g[1:6] for g in pv} == {(64, 64, 64, 64, D)}


@pytest.mark.parametrize(
    "block, dtype, D, block_n, message, fp32",
    [
        ((1, 0, 0, True, 15), torch.bfloat16, 64, 64, "vnni needs a gemm and a pack function", False),
        ((1, 1, 0, True, 6), torch.float32, 64, 64, "vnni .* is for float16 / bfloat16", False),
        ((1, 1, 0, True, 15), torch.bfloat16, 96, 64, "multiple of 64, got D = 96", False),
        ((1, 1, 0, True, 15), torch.bfloat16, 64, 128, "vnni needs block_n = 64, got 128", False),
        ((0, 0, 0, False, 15), torch.bfloat16, 64, 64, "null gemm function address", False),
        ((1, 0, 0, False, 300), torch.bfloat16, 64, 64, "pack dtype code 300 is not an int8", False),
        ((1, 1, 0, True, 6), torch.bfloat16, 64, 64, "fp32 operands are not packed", True),
    ],
)
def test_binding_rejects_bad_block_gemm(monkeypatch, block, dtype, D, block_n, message, fp32):
    """Checked before any function is called (these addresses would crash if they were)."""
    monkeypatch.setattr(cpu_gemm, "block_gemm", lambda *args, **kw: cpu_gemm.BlockGemm(*block))
    q, k, v = make_qkv(1, 2, 1, 4, 40, D, dtype=dtype, seed=2)
    with pytest.raises(ValueError, match=f"block_gemm: .*{message}"):
        cpu_backend.cpp_forward(
            q, k, v, causal=True, sm_scale=0.1, key_padding_mask=None, skip_heads=None, argmax_rows=0,
            gemm=True, gemm_fp32=fp32, block_n=block_n,
        )  # fmt: skip


def test_binding_rejects_fp32_operands_without_a_gemm():
    lib = cpu_backend._library()
    q, k, v = make_qkv(1, 2, 1, 4, 40, 16, dtype=torch.bfloat16, seed=3)
    args = [
        cpu_backend._tensor_arg(n, t, lib.codes)
        for n, t in (("q", q), ("k", k), ("v", v), ("out", q.clone()))
    ]
    with pytest.raises(ValueError, match="gemm_fp32_operands: needs block_gemm"):
        lib.module.attention_fwd(*args, None, None, None, True, 0.25, 64, 64, 1, gemm_fp32_operands=True)


def test_gemm_fp32_path_exists_for_half_dtypes_only(monkeypatch, fresh_gemm_caches):
    """The "gemm_fp32" path is offered for fp16 / bf16 calls (on fp32 calls it would be "gemm"), needs torch's fp32
    GEMM, and forcing it where that is missing names the way out."""
    assert cpu_backend.gemm_paths(torch.bfloat16) == ("gemm", "gemm_fp32")
    assert cpu_backend.gemm_paths(torch.float16) == ("gemm", "gemm_fp32")
    assert cpu_backend.gemm_paths(torch.float32) == ("gemm",)
    case = cpu_autotune.case_of(
        torch.empty(1, 4, 300, 64, dtype=torch.bfloat16), torch.empty(1, 2, 300, 64, dtype=torch.bfloat16),
        causal=True, key_padding_mask=None, skip_heads=None, argmax_rows=300,
    )  # fmt: skip
    assert cpu_autotune.candidates(case, cpu_backend.gemm_paths(torch.bfloat16)) == (
        "cpp",
        "gemm",
        "gemm_fp32",
    )
    fp32_symbol = cpu_gemm.SYMBOLS[torch.float32]
    real_address = cpu_gemm._address
    monkeypatch.setattr(cpu_gemm, "_address", lambda name: 0 if name == fp32_symbol else real_address(name))
    for fn in (cpu_gemm.available, cpu_gemm.block_gemm, cpu_backend.gemm_paths):
        fn.cache_clear()
    assert cpu_backend.gemm_paths(torch.bfloat16) == ("gemm",)
    q, k, v = make_qkv(1, 2, 1, 4, 40, 16, dtype=torch.bfloat16, seed=4)
    with pytest.raises(RuntimeError, match="'gemm_fp32' CPU path needs torch's block GEMM for torch.float32"):
        cpu_backend.cpp_forward(
            q, k, v, causal=True, sm_scale=0.25, key_padding_mask=None, skip_heads=None, argmax_rows=0,
            gemm=True, gemm_fp32=True,
        )  # fmt: skip
