"""The per-instruction-set builds of the C++ kernel (AVX-512, AVX2, generic): which ones a CPU gets, how a
call picks one, and that every build this CPU runs equals the reference oracle.

The other kernel tests run the default build (the widest); here each build runs the same cases, so a
build that is never the default on this machine (``generic`` next to ``avx2``) is still checked. Builds
this CPU cannot run are not generated: the AVX-512 build is covered on machines that have AVX-512.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

from retmask.kernels import reference_attention
from retmask.kernels.cpu import backend as cpu_backend

from .helpers import POISON_FLOAT, POISON_INDEX, assert_argmax_matches, left_padding_mask, make_qkv

BUILD_NAMES = [name for name, _ in cpu_backend.builds()]


def cpu_flags() -> set[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (Linux)."""
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    raise AssertionError("/proc/cpuinfo has no flags line")


def test_builds_follow_the_cpu_flags():
    """Widest first, generic always last, and a vector build exactly when the CPU reports its features."""
    builds = dict(cpu_backend.builds())
    assert BUILD_NAMES[-1] == "generic" and builds["generic"] == 8
    flags = cpu_flags()
    assert ("avx512" in builds) == ("avx512f" in flags)
    assert ("avx512bf16" in builds) == ({"avx512f", "avx512_bf16"} <= flags)
    assert ("avx2" in builds) == ({"avx2", "fma"} <= flags)
    lanes = [builds[name] for name in BUILD_NAMES]
    assert lanes == sorted(lanes, reverse=True)
    assert cpu_backend.selected_isa() == BUILD_NAMES[0] or cpu_backend.ISA_ENV in os.environ


def _run(q, k, v, *, isa: str | None, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    B, Hq, M, D = q.shape
    rows = kw.pop("argmax_rows")
    out = torch.full((B, Hq, M, D), POISON_FLOAT, dtype=q.dtype)
    argmax = torch.full((B, Hq, rows), POISON_INDEX, dtype=torch.int64)
    cpu_backend.cpp_forward(q, k, v, argmax_rows=rows, out=out, argmax=argmax, isa=isa, **kw)
    return out, argmax


# (B, Hq, Hkv, M, N, D, block_m, window, softcap, sinks, pads): both tile layouts for 8 and 16 lanes
# (block_m 4: row-major; 128: lanes), N off the 64-key block, GQA, padding, skipped heads, features.
CASES = [
    (2, 6, 2, 70, 150, 64, 128, None, None, False, [0, 33]),
    (2, 6, 2, 5, 150, 64, 4, None, None, False, [0, 33]),
    (1, 4, 1, 1, 301, 80, None, None, None, False, None),  # decode, MQA, D not a multiple of 16
    (2, 4, 2, 40, 110, 256, 128, 45, 4.0, True, [0, 30]),  # Gemma-3-like: head dim 256, window, cap, sinks
    (2, 4, 2, 40, 110, 96, 4, 45, 4.0, True, [0, 30]),
]


@pytest.mark.parametrize("isa", BUILD_NAMES)
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "B{}_Hq{}_Hkv{}_M{}_N{}_D{}_bm{}_w{}_cap{}_sinks{}".format(*c)
)
@pytest.mark.parametrize(
    "dtype,bf16_dot",
    [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
    ids=["float32", "bfloat16", "bfloat16-bf16dot"],
)
def test_every_build_matches_reference(isa, case, dtype, bf16_dot):
    """bf16dot: the bf16 dot-product lanes layout (native in the avx512bf16 build, emulated elsewhere),
    which also runs the cases whose tiles are row-major otherwise (block_m 4, decode), padded to a vector."""
    B, Hq, Hkv, M, N, D, block_m, window, softcap, with_sinks, pads = case
    q, k, v = make_qkv(B, Hq, Hkv, M, N, D, dtype=dtype, seed=M + N + D, noncontiguous_q=True)
    q = q * 2  # sharper softmax: a wrong mask or argmax shows
    pad = left_padding_mask(B, N, pads) if pads else None
    skip = torch.zeros(B, Hq, dtype=torch.bool)
    skip[0, -1] = True
    sinks = torch.randn(Hq, generator=torch.Generator().manual_seed(N)) if with_sinks else None
    kw = dict(causal=True, sm_scale=D**-0.5, key_padding_mask=pad, skip_heads=skip, window=window,
              softcap=softcap, sinks=sinks)  # fmt: skip
    rows = min(M, 9)
    out, argmax = _run(q, k, v, isa=isa, argmax_rows=rows, block_m=block_m, bf16_dot=bf16_dot, **kw)
    ref_out, _ = reference_attention(
        q.double(), k.double(), v.double(), **kw | {"sinks": None if sinks is None else sinks.double()}
    )
    tol = 2e-5 if dtype == torch.float32 else 1e-2  # bf16: the kernel rounds its fp32 result once
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    assert (out[skip] == 0).all() and (argmax[skip] == -1).all()
    assert_argmax_matches(
        argmax, q, k, causal=True, sm_scale=D**-0.5, key_padding_mask=pad, skip_heads=skip, atol=1e-4,
        window=window, softcap=softcap,
    )  # fmt: skip


# generic has no FMA (another exp rounding); off x86 it is the only build, compared with itself
FMA_BUILDS = [name for name in BUILD_NAMES if name != "generic"] or BUILD_NAMES


@pytest.mark.parametrize("dims_strided", [False, True], ids=["dims-contiguous", "dims-strided"])
def test_bf16dot_is_bit_identical_on_every_fma_build(dims_strided):
    """The emulated bf16 dot products (avx512, avx2) are vdpbf16ps bit for bit (the avx512bf16 build, where
    the CPU has it): same outputs and argmaxes, with padding, a skipped head, a window, soft-capping and
    sinks, GQA, 150 keys (a last block of 22 keys: whole pairs) and 151 (23: a last key without a partner).
    On a CPU with a single FMA build this compares that build with itself."""
    for N in (150, 151):
        q, k, v = make_qkv(2, 6, 2, 70, N, 64, dtype=torch.bfloat16, seed=N, noncontiguous_q=True)
        if dims_strided:  # k and v with dims at a stride of 2 elements: the copied-key and paired-value loops
            k = torch.stack([k, k.neg()], dim=-1).flatten(-2)[..., ::2]
            v = torch.stack([v, v.neg()], dim=-1).flatten(-2)[..., ::2]
        skip = torch.zeros(2, 6, dtype=torch.bool)
        skip[1, 2] = True
        kw = dict(causal=True, sm_scale=0.125, key_padding_mask=left_padding_mask(2, N, [0, 21]), skip_heads=skip,
                  window=100, softcap=30.0, sinks=torch.randn(6), argmax_rows=70, block_m=128, bf16_dot=True)  # fmt: skip
        results = {isa: _run(q, k, v, isa=isa, **dict(kw)) for isa in FMA_BUILDS}
        first_out, first_argmax = results[FMA_BUILDS[0]]
        assert not torch.isnan(first_out).any()
        for isa, (out, argmax) in results.items():
            assert torch.equal(out.view(torch.int16), first_out.view(torch.int16)), (isa, N)
            assert torch.equal(argmax, first_argmax), (isa, N)


def test_builds_agree_on_ties():
    """Duplicate keys give bit-identical logits within a build, so every build picks the smallest index."""
    q, k, v = make_qkv(1, 6, 2, 40, 130, 64, seed=3)
    k[:, 1] = k[:, 0]  # both KV heads alike, so one query fits every head
    k[:, :, 100] = k[:, :, 7]  # key 100 duplicates key 7
    q[:, :, :, :] = k[:, :1, 7:8, :] * 3  # every row's best key is 7 (and its duplicate)
    for isa in BUILD_NAMES:
        _, argmax = _run(q, k, v, isa=isa, argmax_rows=40, causal=False, sm_scale=0.125, key_padding_mask=None,
                         skip_heads=None)  # fmt: skip
        assert (argmax == 7).all(), isa


def test_environment_variable_selects_the_build(monkeypatch):
    """$RETMASK_CPU_ISA makes plain calls run that build: bit-identical to asking for it by name."""
    q, k, v = make_qkv(1, 6, 2, 64, 200, 64, seed=11)
    kw = dict(argmax_rows=64, causal=True, sm_scale=0.125, key_padding_mask=None, skip_heads=None)
    by_name = {isa: _run(q, k, v, isa=isa, **kw) for isa in BUILD_NAMES}
    for isa in BUILD_NAMES:
        monkeypatch.setenv(cpu_backend.ISA_ENV, isa)
        assert cpu_backend.selected_isa() == isa
        out, argmax = _run(q, k, v, isa=None, **kw)
        assert torch.equal(out, by_name[isa][0]) and torch.equal(argmax, by_name[isa][1])


def test_unknown_build_names_are_refused(monkeypatch):
    q, k, v = make_qkv(1, 2, 1, 3, 20, 16, seed=1)
    kw = dict(argmax_rows=3, causal=True, sm_scale=0.25, key_padding_mask=None, skip_heads=None)
    with pytest.raises(ValueError, match=r"isa: 'sse9' is not a build .* it has " + BUILD_NAMES[0]):
        _run(q, k, v, isa="sse9", **kw)
    monkeypatch.setenv(cpu_backend.ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match=r"\$RETMASK_CPU_ISA: 'avx1024' is not a build"):
        _run(q, k, v, isa=None, **kw)
    # The binding checks the name too (a caller that bypasses cpp_forward), even for an empty batch.
    lib = cpu_backend._library()
    empty = torch.empty(0, 2, 3, 16)
    args = [cpu_backend.tensor_arg(n, t, lib.codes) for n, t in (("q", empty), ("k", empty), ("v", empty))]
    with pytest.raises(ValueError, match="isa: 'neon' is not a build this CPU can run"):
        lib.module.attention_fwd(
            *args, cpu_backend.tensor_arg("out", empty, lib.codes), None, None, None, True, 0.25, 64, 64, 1,
            isa="neon",
        )  # fmt: skip
