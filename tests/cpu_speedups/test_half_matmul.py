"""``half_matmul``: bf16 / fp16 products as fp32 products of rounded operands give what a native
half-precision GEMM gives (values and gradients), and the emulated linear is taken exactly where torch
would emulate half precision."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import retmask.cpu_speedups.half_matmul as hm


@pytest.fixture
def emulate(monkeypatch):
    """Pretend this CPU has no native half-precision GEMM (or has one: ``emulate(False)``)."""

    def set_(on: bool = True) -> None:
        monkeypatch.setattr(hm, "native_half_matmul", lambda dtype: not on)

    set_(True)
    return set_


def _one_rounding_apart(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Each element equal, or one rounding step of ``dtype`` apart (fp32 sums in another order fall on
    the other side of a rounding edge); most equal. Near zero, where a sum cancels, the step is taken
    at 1/20 of the tensor's scale (torch's fp16 kernel on a CPU without fp16 GEMMs rounds partial sums)."""
    step = 2.0 ** -(8 if dtype == torch.bfloat16 else 11)
    got, want = got.float(), want.float()
    floor = 0.05 * want.abs().max()
    apart = (got - want).abs() > step * torch.maximum(torch.maximum(got.abs(), want.abs()), floor)
    assert not apart.any(), (got - want).abs().max()
    assert (got != want).float().mean() < 0.1


def _inputs(seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 13, 40, generator=g).to(dtype)  # [B, T, in]: 39 rows, not a block multiple
    w = (torch.randn(33, 40, generator=g) * 0.2).to(dtype)  # [out, in]
    b = torch.randn(33, generator=g).to(dtype)
    return x, w, b


@pytest.mark.parametrize("bias", [True, False])
def test_autocast_linear_values_and_gradients_match_torchs(bias, emulate):
    """Under bf16 autocast over fp32 leaves: the output (bf16) and the fp32 gradients of x, weight and
    bias equal torch's autocast linear (its own bf16 GEMM) up to one bf16 rounding step."""
    x, w, b = _inputs(0)
    g_out = torch.randn(3, 13, 33, generator=torch.Generator().manual_seed(1))
    results = []
    for emulated in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bias_ = leaves[2] if bias else None
            if emulated:
                dtype = hm.emulated_linear_dtype(leaves[0], leaves[1], bias_)
                assert dtype == torch.bfloat16
                out = hm.emulated_linear(leaves[0], leaves[1], bias_, dtype)
            else:
                out = F.linear(leaves[0], leaves[1], bias_)
        assert out.dtype == torch.bfloat16
        out.backward(g_out.to(out.dtype))
        results.append((out, [t.grad for t in leaves]))
    (out_e, grads_e), (out_t, grads_t) = results
    _one_rounding_apart(out_e, out_t, torch.bfloat16)
    for name, ge, gt in zip(("x", "weight", "bias"), grads_e, grads_t, strict=True):
        if name == "bias" and not bias:
            assert ge is None and gt is None
            continue
        assert ge.dtype == gt.dtype == torch.float32, name
        _one_rounding_apart(ge, gt, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_weights_without_autocast(dtype, emulate):
    """A model loaded in bf16 / fp16: the linear's output and gradients in that dtype, as torch's."""
    x, w, b = _inputs(2, dtype)
    got_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    want_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    assert hm.emulated_linear_dtype(*got_leaves) == dtype
    got = hm.emulated_linear(*got_leaves, dtype)
    want = F.linear(*want_leaves)
    assert got.dtype == want.dtype == dtype
    _one_rounding_apart(got, want, dtype)
    g_out = torch.randn(got.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    got.backward(g_out), want.backward(g_out)
    for a, c in zip(got_leaves, want_leaves, strict=True):
        assert a.grad.dtype == dtype
        # torch's own half-precision backward may sum the rows in the half dtype: compare at its scale
        torch.testing.assert_close(a.grad.float(), c.grad.float(), rtol=2e-2, atol=2e-2 * c.grad.abs().max())


def test_which_calls_are_emulated(emulate):
    """Only half-precision CPU calls, on a CPU without native kernels, in plain eager execution."""
    x, w, b = _inputs(4)
    assert hm.emulated_linear_dtype(x, w, b) is None  # plain fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert hm.emulated_linear_dtype(x, w, b) == torch.bfloat16
        assert hm.emulated_linear_dtype(x, w, None) == torch.bfloat16
        with torch.device("cpu"):  # a torch function mode must see aten::linear
            assert hm.emulated_linear_dtype(x, w, b) is None
    bf = [t.bfloat16() for t in (x, w, b)]
    assert hm.emulated_linear_dtype(*bf) == torch.bfloat16
    assert hm.emulated_linear_dtype(x, bf[1], None) is None  # mixed dtypes: torch's error, not ours
    assert hm.emulated_linear_dtype(x[0, 0], w, None) is None  # 1-D input
    rows = hm.EMULATE_MIN_ROWS
    few = torch.randn(rows - 1, 40).bfloat16()  # matrix-vector-like calls keep torch's kernel
    assert hm.emulated_linear_dtype(few, bf[1], None) is None
    assert hm.emulated_linear_dtype(torch.randn(rows, 40).bfloat16(), bf[1], None) == torch.bfloat16
    emulate(False)  # a CPU with AMX / AVX512-BF16 keeps torch's native kernels
    assert hm.emulated_linear_dtype(*bf) is None


def test_emulated_linear_runs_no_half_precision_product(emulate):
    """The point of it: forward and backward multiply in fp32 only."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name.split("::")[-1] in {"mm", "addmm", "linear", "matmul", "bmm"}:
                seen.add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    x, w, b = (t.requires_grad_() for t in _inputs(5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dtype = hm.emulated_linear_dtype(x, w, b)
    with Record():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = hm.emulated_linear(x, w, b, dtype)
        out.float().sum().backward()
    assert seen == {torch.float32}


def test_native_half_matmul_follows_the_cpu_flags():
    from retmask.cpuinfo import cpu_flags

    flags = cpu_flags()
    assert hm.native_half_matmul(torch.bfloat16) == bool({"amx_bf16", "amx_tile", "avx512_bf16"} & flags)
    assert hm.native_half_matmul(torch.float32)
