"""retmask's C++ linear kernel for few input rows (retmask.cpu_speedups.rows_kernel, csrc/linear_cpu_kernel.h):
every build this CPU runs against a float64 reference on fresh random inputs (awkward sizes, bias, row
strides, bfloat16), every output element written (poisoned first), special values, batch invariance, the
argument checks, and the registered operator (fake kernel, FLOP formula).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from retmask.cpu_speedups import rows_kernel
from retmask.kernels.cpu import backend as cpu_backend

BUILDS = [name for name, _ in cpu_backend.builds()]
LIB = cpu_backend._library()

# (rows, N, K): one row (a decode step) and more; N not a multiple of the 4 weight rows of a step, K not a
# multiple of the vector (8 / 16 fp32, 32 bf16 for the dot-product instruction) and smaller than one; rows
# longer than 4 KB (no software prefetch) in both dtypes.
SHAPES = [(1, 1, 1), (1, 7, 37), (1, 64, 96), (2, 5, 16), (3, 13, 100), (5, 33, 64), (9, 6, 31), (4, 19, 577),
          (1, 9, 2100), (2, 6, 1100)]  # fmt: skip


def test_the_kernel_is_built_here():
    # retmask._C is built by `make install`; if this fails, every other test here proves nothing.
    assert rows_kernel.available() and BUILDS


def _inputs(rows: int, n: int, k: int, bias: bool, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def _poisoned_call(x, w, b, isa: str, threads: int = 2) -> torch.Tensor:
    """The binding itself with y pre-filled with NaN, so that an element the kernel skips shows."""
    y = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype)
    arg = cpu_backend.tensor_arg
    LIB.module.linear_rows(arg("x", x, LIB.codes), arg("weight", w, LIB.codes),
                           None if b is None else arg("bias", b, LIB.codes), arg("y", y, LIB.codes),
                           threads, isa)  # fmt: skip
    return y


def _reference(x, w, b) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_float32_matches_float64(isa, rows, n, k, bias):
    x, w, b = _inputs(rows, n, k, bias, torch.float32, seed=rows * 1000 + n * 10 + k)
    y = _poisoned_call(x, w, b, isa)
    torch.testing.assert_close(y.double(), _reference(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
def test_bfloat16_is_the_exact_product_rounded_once(isa, rows, n, k):
    """bf16 in, bf16 out: the fp32 sum of exact products (fp32 rounding only) rounded once, so within
    one bf16 step (2^-8 of the value) of the float64 product of the same bf16 numbers."""
    x, w, b = _inputs(rows, n, k, True, torch.bfloat16, seed=k)
    y = _poisoned_call(x, w, b, isa)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), _reference(x, w, b), rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_and_a_weight_slice(isa, dtype):
    """x rows and weight rows with a row stride larger than K (views into wider tensors) are read in place."""
    wide_x = torch.randn(6, 90).to(dtype)
    wide_w = torch.randn(23, 80).to(dtype)
    x, w = wide_x[:, 5:69], wide_w[:, 3:67]  # K = 64, row strides 90 and 80
    assert x.stride() == (90, 1) and w.stride() == (80, 1)
    y = _poisoned_call(x, w, None, isa)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-8, "atol": 1e-5}
    torch.testing.assert_close(y.double(), _reference(x, w, None), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_strided_bias_through_the_operator(dtype):
    """``rows_kernel.run`` copies a strided bias before the call; the copy must outlive the call (the
    binding keeps only its address: a copy made in the argument list was freed before the kernel read it)."""
    x, w, b = _inputs(3, 40, 64, True, dtype, seed=7)
    strided = torch.stack([b, torch.full_like(b, 1e4)], dim=1)[:, 0]  # every other element of a wider tensor
    assert strided.stride() == (2,) and torch.equal(strided, b)
    for _ in range(20):  # allocations between the copy and the kernel would reuse freed memory
        y = rows_kernel.run(x, w, strided)
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-8, "atol": 1e-5}
        torch.testing.assert_close(y.double(), _reference(x, w, b), **tol)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_and_thread_invariance(isa, dtype):
    """Each output is one dot product summed in one order whatever the other rows or the threads: row r of
    a call of several rows equals the call of row r alone, bit for bit, on 1 or 2 threads."""
    x, w, b = _inputs(7, 300, 200, True, dtype, seed=11)  # 420K multiply-adds: split over the threads
    together = _poisoned_call(x, w, b, isa, threads=2)
    assert torch.equal(together, _poisoned_call(x, w, b, isa, threads=1))
    for r in range(x.shape[0]):
        assert torch.equal(_poisoned_call(x[r : r + 1], w, b, isa, threads=2)[0], together[r])


@pytest.mark.parametrize("isa", BUILDS)
def test_nan_and_inf_propagate(isa):
    x, w, b = _inputs(2, 9, 40, False, torch.float32, seed=3)
    x[0, 17] = float("nan")
    w[4, 3] = float("inf")
    y = _poisoned_call(x, w, b, isa)
    ref = _reference(x, w, b)
    assert torch.isnan(y[0]).all()
    assert torch.equal(torch.isnan(y[1]), torch.isnan(ref[1])) and torch.equal(
        torch.isinf(y[1]), torch.isinf(ref[1])
    )
    finite = torch.isfinite(ref[1])
    torch.testing.assert_close(y[1][finite].double(), ref[1][finite], rtol=1e-5, atol=1e-5)


def test_empty_sizes():
    """No rows or no output features: nothing to write; K = 0: every output is its bias."""
    w = torch.randn(4, 0)
    b = torch.randn(4)
    torch.testing.assert_close(rows_kernel.run(torch.randn(3, 0), w, b), b.expand(3, 4))
    assert rows_kernel.run(torch.randn(0, 5), torch.randn(4, 5), None).shape == (0, 4)
    assert rows_kernel.run(torch.randn(2, 5), torch.randn(0, 5), None).shape == (2, 0)


def test_layouts_the_kernel_cannot_read_are_copied():
    """run() copies an x or weight without unit stride along K (a transposed view) instead of refusing it."""
    x, w, b = _inputs(3, 10, 12, True, torch.float32, seed=4)
    xt, wt = x.t().contiguous().t(), w.t().contiguous().t()
    torch.testing.assert_close(rows_kernel.run(xt, wt, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"w": torch.randn(5, 8, dtype=torch.float64)},
            r"weight: dtype unknown dtype code 5, expected float32",
        ),
        (
            {"x": torch.randn(2, 8, dtype=torch.float16), "w": torch.randn(5, 8, dtype=torch.float16)},
            r"x: dtype float16, expected float32 or bfloat16",
        ),  # fmt: skip
        ({"w": torch.randn(5, 7)}, r"weight: shape \[5, 7\], expected \[N, K\] with K of x = \[5, 8\]"),
        ({"b": torch.randn(4)}, r"bias: shape \[4\], expected \[N\] = \[5\]"),
        ({"y": torch.empty(5, 2).t()}, r"y: must be contiguous"),
        ({"x": torch.randn(8, 2).t()}, r"x: needs unit stride along its last dim"),
        ({"isa": "sse9"}, r"isa: 'sse9' is not a build this CPU can run"),
    ],
)
def test_bad_arguments_are_named(change, message):
    args = {
        "x": torch.randn(2, 8),
        "w": torch.randn(5, 8),
        "b": torch.randn(5),
        "y": torch.empty(2, 5),
        "isa": "",
    }
    args.update(change)
    arg = cpu_backend.tensor_arg
    codes = {**LIB.codes, torch.float64: 5}  # a code the binding does not know, to reach its own message
    with pytest.raises(ValueError, match=message):
        LIB.module.linear_rows(arg("x", args["x"], codes), arg("w", args["w"], codes), arg("b", args["b"], codes),
                               arg("y", args["y"], codes), 1, args["isa"])  # fmt: skip


def test_the_operator_dispatch_modes_see():
    """torch.ops.retmask.linear_rows: the kernel's result, a fake kernel for meta tensors, and a FLOP
    formula torch's FLOP counter uses."""
    from torch.utils.flop_counter import FlopCounterMode

    x, w, b = _inputs(3, 20, 24, True, torch.float32, seed=9)
    with FlopCounterMode(display=False) as counter:
        y = rows_kernel.linear_rows(x, w, b)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert counter.get_total_flops() == 2 * 3 * 20 * 24
    meta = rows_kernel.linear_rows(x.to("meta"), w.to("meta"), None)
    assert meta.device.type == "meta" and meta.shape == (3, 20)
