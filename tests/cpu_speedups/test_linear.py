"""CPU linears on torch's, oneDNN's or retmask's few-row kernel (retmask.cpu_speedups.linear): the oneDNN and
retmask products against a float64 reference (forward and every gradient, awkward shapes and layouts),
which calls are left to F.linear, the measured decision (fake clock), its disk cache and the switch that
turns it off. The kernel itself: test_rows_kernel.py.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from retmask.cpu_speedups import decisions as decision_cache
from retmask.cpu_speedups import linear as linear_cpu

from . import fake_clock


@pytest.fixture
def onednn(monkeypatch):
    """Every case decided for oneDNN (what the measurement picks where it is faster)."""
    monkeypatch.setattr(linear_cpu, "_backends", _Always("onednn"))


@pytest.fixture
def retmask_kernel(monkeypatch):
    """Every case decided for retmask's few-row kernel."""
    monkeypatch.setattr(linear_cpu, "_backends", _Always("retmask"))


class _Always(dict):
    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend

    def get(self, case, default=None):
        return self.backend


@pytest.fixture
def auto(monkeypatch, tmp_path):
    """The default (measured) mode, an empty cache folder, no decisions in memory (before and after)."""
    monkeypatch.delenv("RETMASK_CPU_SPEEDUPS", raising=False)
    monkeypatch.setenv("RETMASK_CACHE", str(tmp_path / "cache"))
    linear_cpu.clear_memory()
    yield tmp_path / "cache" / linear_cpu.CACHE_FILE
    linear_cpu.clear_memory()


def test_onednn_is_available_here():
    # The x86 CPU wheels of torch ship oneDNN; if this fails, every other test here proves nothing.
    assert linear_cpu.onednn_available()


def _inputs(lead: tuple[int, ...], n_in: int, n_out: int, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, n_in, generator=gen)
    w = torch.randn(n_out, n_in, generator=gen) * n_in**-0.5
    b = torch.randn(n_out, generator=gen) if bias else None
    return x, w, b


SHAPES = [  # (leading dims of x, in, out, bias)
    ((1, 1), 19, 37, True),  # one row: the gemv case
    ((3, 7), 19, 37, False),  # awkward sizes, no bias
    ((2, 33), 64, 48, True),
    ((129,), 576, 192, True),  # 2-D input
    ((1, 5, 4), 72, 40, True),  # 4-D input
]


FEW_SHAPES = [  # (leading dims of x, in, out, bias): the row counts retmask's kernel is a candidate for
    ((1, 1), 19, 37, True),
    ((3,), 33, 20, False),
    ((2, 4), 64, 48, True),
    ((1, 1, 1), 576, 192, False),
]
CASES = [("onednn", *shape) for shape in SHAPES] + [("retmask", *shape) for shape in FEW_SHAPES]


@pytest.mark.parametrize(("backend", "lead", "n_in", "n_out", "bias"), CASES)
def test_forward_and_gradients_match_float64(monkeypatch, backend, lead, n_in, n_out, bias):
    """The forward on the forced backend (oneDNN, or retmask's kernel at the row counts it takes), the
    gradients through torch's or oneDNN's products; without an autograd graph the backend directly."""
    calls = []
    name = "_onednn_forward" if backend == "onednn" else "_rows_forward"
    real = getattr(linear_cpu, name)
    monkeypatch.setattr(linear_cpu, name, lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(linear_cpu, "_backends", _Always(backend))
    x, w, b = _inputs(lead, n_in, n_out, bias, seed=n_in)
    params = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    y = linear_cpu.linear(params[0], params[1], params[2] if bias else None)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    y.backward(grad)
    assert calls, f"the forced {backend} backend did not run"
    ref = [t.double().requires_grad_() for t in (x, w, b) if t is not None]
    y_ref = F.linear(ref[0], ref[1], ref[2] if bias else None)
    y_ref.backward(grad.double())
    assert y.dtype == torch.float32 and y.shape == y_ref.shape
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(params, ref, strict=True):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5)
    calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(linear_cpu.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert calls


def test_rows_kernel_in_bfloat16_matches_torch(retmask_kernel):
    """bfloat16 calls of few rows: within one bf16 step of torch's own bf16 linear, gradients too."""
    x, w, b = (t.bfloat16() for t in _inputs((2, 3), 64, 40, True, seed=6))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = linear_cpu.linear(xg, wg, b)
    assert y.dtype == torch.bfloat16
    y.float().pow(2).sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_ref = F.linear(xr, wr, b)
    y_ref.float().pow(2).sum().backward()
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(xg.grad.float(), xr.grad.float(), rtol=2**-6, atol=2e-2)
    torch.testing.assert_close(wg.grad.float(), wr.grad.float(), rtol=2**-6, atol=2e-2)


def test_which_calls_are_decided_in_bfloat16(auto, monkeypatch):
    """bfloat16: one row and up to FEW_ROWS rows are decided (retmask's kernel is a candidate); more rows
    are torch's own linear without a decision."""
    seen = []
    monkeypatch.setattr(linear_cpu, "backend_for", lambda case: seen.append(case) or "torch")
    w = torch.randn(12, 16).bfloat16()
    for rows in (1, linear_cpu.FEW_ROWS, linear_cpu.FEW_ROWS + 1):
        x = torch.randn(rows, 16).bfloat16()
        assert torch.equal(linear_cpu.linear(x, w), F.linear(x, w))
    assert [(c.kind, c.dtype) for c in seen] == [("gemv", "bfloat16"), ("few", "bfloat16")]


@pytest.mark.parametrize("backward_backend", ["onednn", "torch"])
def test_backward_products_on_either_backend(auto, monkeypatch, backward_backend):
    """The forward on oneDNN, the backward's products on the backend decided for "backward" (either one),
    and only the gradients that are needed (a frozen weight, an input without grad)."""
    kinds = []
    monkeypatch.setattr(
        linear_cpu,
        "backend_for",
        lambda case: (
            kinds.append(case.kind) or (backward_backend if case.kind.startswith("backward") else "onednn")
        ),
    )
    x, w, b = _inputs((4, 9), 24, 16, True, seed=3)
    frozen_w = w.clone()
    xg = x.clone().requires_grad_()
    linear_cpu.linear(xg, frozen_w, b).sum().backward()
    torch.testing.assert_close(xg.grad, frozen_w.sum(0).expand_as(x), rtol=1e-5, atol=1e-5)
    wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
    linear_cpu.linear(x, wg, bg).pow(2).sum().backward()
    wd, bd = w.double().requires_grad_(), b.double().requires_grad_()
    F.linear(x.double(), wd, bd).pow(2).sum().backward()
    torch.testing.assert_close(wg.grad.double(), wd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bg.grad.double(), bd.grad, rtol=1e-5, atol=1e-5)
    assert kinds == ["gemm", "backward", "gemm", "backward"]
    long_x = torch.randn(linear_cpu.LONG_BACKWARD_ROWS, 24).requires_grad_()
    linear_cpu.linear(long_x, w, b).sum().backward()
    assert kinds[-1] == "backward-long"
    torch.testing.assert_close(long_x.grad, w.sum(0).expand_as(long_x), rtol=1e-5, atol=1e-5)


def test_strided_inputs_and_weights(onednn):
    """Inputs whose rows are not unit-stride (a transposed view, every second column) and a transposed
    weight view are copied for oneDNN, not refused."""
    x, w, b = _inputs((6, 40), 30, 20, True, seed=5)
    wide = torch.randn(6, 40, 60)
    views = [x.transpose(0, 1).contiguous().transpose(0, 1), wide[..., ::2]]
    w_view = w.t().contiguous().t()
    for view in views:
        torch.testing.assert_close(
            linear_cpu.linear(view, w_view, b), F.linear(view, w, b), rtol=1e-5, atol=1e-5
        )


def test_other_calls_go_to_f_linear(onednn, monkeypatch):
    """bf16, float64, CPU autocast and 1-D inputs are F.linear's, untouched (autocast must see F.linear to
    cast it)."""
    monkeypatch.setattr(linear_cpu, "_onednn_forward", lambda *a: pytest.fail("oneDNN called"))
    x, w, b = _inputs((3, 5), 8, 4, True, seed=7)
    assert torch.equal(
        linear_cpu.linear(x.double(), w.double(), b.double()), F.linear(x.double(), w.double(), b.double())
    )
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(linear_cpu.linear(xb, wb), F.linear(xb, wb))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cpu.linear(x, w, b)
    assert out.dtype == torch.bfloat16
    assert torch.equal(linear_cpu.linear(x[0, 0], w, b), F.linear(x[0, 0], w, b))
    with torch.device("cpu"):  # a torch function mode must see F.linear
        assert torch.equal(linear_cpu.linear(x, w, b), F.linear(x, w, b))
    grad_w = torch.func.grad(lambda w_: linear_cpu.linear(x, w_, b).sum())(w)  # a functorch transform
    torch.testing.assert_close(grad_w, x.reshape(-1, 8).sum(0).expand(4, 8))
    with torch.autograd.forward_ad.dual_level():  # forward-mode AD: the tangent comes through
        dual = torch.autograd.forward_ad.make_dual(x, torch.ones_like(x))
        tangent = torch.autograd.forward_ad.unpack_dual(linear_cpu.linear(dual, w, b)).tangent
    torch.testing.assert_close(tangent, F.linear(torch.ones_like(x), w))


@pytest.mark.parametrize("backend", ["onednn", "retmask"])
def test_flop_counter_counts_the_other_backends(monkeypatch, backend):
    """A dispatch mode has no public query: it sees oneDNN's operator or retmask::linear_rows, which
    torch's FLOP counter counts as it counts aten's linear, forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setattr(linear_cpu, "_backends", _Always(backend))
    x, w, b = _inputs((3, 1), 8, 4, True, seed=7)
    w.requires_grad_(True)
    with FlopCounterMode(display=False) as counter:
        linear_cpu.linear(x, w, b).sum().backward()
    with FlopCounterMode(display=False) as want:
        F.linear(x, w.detach().requires_grad_(True), b).sum().backward()
    assert counter.get_total_flops() == want.get_total_flops() == 2 * (2 * 3 * 4 * 8)


def test_speedups_off_never_calls_onednn(monkeypatch):
    monkeypatch.setenv("RETMASK_CPU_SPEEDUPS", "0")
    monkeypatch.setattr(linear_cpu, "_onednn_forward", lambda *a: pytest.fail("oneDNN called"))
    x, w, b = _inputs((3, 5), 8, 4, True, seed=8)
    assert torch.equal(linear_cpu.linear(x, w, b), F.linear(x, w, b))


def test_bad_switch_names_the_variable(monkeypatch):
    monkeypatch.setenv("RETMASK_CPU_SPEEDUPS", "mkl")
    with pytest.raises(ValueError, match=r"RETMASK_CPU_SPEEDUPS='mkl'.*1.*0"):
        linear_cpu.linear(torch.randn(2, 3), torch.randn(4, 3))


def test_without_onednn_torch_runs(auto, monkeypatch):
    monkeypatch.setattr(linear_cpu, "onednn_available", lambda: False)
    monkeypatch.setattr(linear_cpu, "_onednn_forward", lambda *a: pytest.fail("oneDNN called"))
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    assert torch.equal(linear_cpu.linear(x, w), F.linear(x, w))


# ---- the decision -------------------------------------------------------------------------------------


class FakeClock(fake_clock.FakeClock):
    """Each backend "takes" its given seconds; oneDNN's result is off by ``perturb_onednn``."""

    def __init__(self, cost: dict[str, float], perturb_onednn: float = 0.0):
        super().__init__(cost)
        self.perturb = perturb_onednn

    def run(self, backend: str, call: dict) -> tuple:
        self.tick(backend)
        result = linear_cpu.run_backend("torch", call)
        return tuple(r + self.perturb for r in result) if backend == "onednn" else result


FEW_CASE = linear_cpu.LinearCase(48, 32, True, "few", 1)


CASE = linear_cpu.LinearCase(48, 32, True, "gemm", 1)


@pytest.mark.parametrize(
    ("onednn_s", "want"), [(0.5, "onednn"), (0.89, "onednn"), (0.95, "torch"), (2.0, "torch")]
)
def test_decision_rule(auto, monkeypatch, onednn_s, want):
    clock = FakeClock({"torch": 1.0, "onednn": onednn_s})
    monkeypatch.setattr(decision_cache.time, "perf_counter", clock.perf_counter)
    decision = linear_cpu.measure(CASE, clock.run)
    assert decision["backend"] == want
    assert decision["ratios"] == {"onednn": pytest.approx(onednn_s)}
    assert decision["calls"] >= 3 and clock.calls.count("torch") == clock.calls.count("onednn")


@pytest.mark.parametrize(
    ("onednn_s", "retmask_s", "want"),
    [
        (0.5, 0.4, "retmask"),
        (0.4, 0.5, "onednn"),
        (0.95, 0.85, "retmask"),
        (0.95, 0.92, "torch"),
        (2.0, 3.0, "torch"),
    ],
)
def test_decision_rule_of_three_candidates(auto, monkeypatch, onednn_s, retmask_s, want):
    """The fastest backend at <= MAX_RATIO of torch's time; torch's on a near tie."""
    clock = FakeClock({"torch": 1.0, "onednn": onednn_s, "retmask": retmask_s})
    monkeypatch.setattr(decision_cache.time, "perf_counter", clock.perf_counter)
    assert linear_cpu.candidates(FEW_CASE) == ("torch", "onednn", "retmask")
    decision = linear_cpu.measure(FEW_CASE, clock.run)
    assert decision["backend"] == want
    assert decision["ratios"] == {"onednn": pytest.approx(onednn_s), "retmask": pytest.approx(retmask_s)}


def test_a_disagreeing_candidate_is_rejected_and_another_may_win(auto, monkeypatch, caplog):
    clock = FakeClock({"torch": 1.0, "onednn": 0.1, "retmask": 0.5}, perturb_onednn=1e-2)
    monkeypatch.setattr(decision_cache.time, "perf_counter", clock.perf_counter)
    with caplog.at_level(logging.WARNING, logger="retmask.kernels"):
        decision = linear_cpu.measure(FEW_CASE, clock.run)
    assert decision["backend"] == "retmask" and set(decision["rejected"]) == {"onednn"}
    assert "onednn" not in decision["times_s"] and "the onednn linear disagrees" in caplog.text


def test_disagreeing_onednn_is_rejected(auto, monkeypatch, caplog):
    clock = FakeClock({"torch": 1.0, "onednn": 0.1}, perturb_onednn=1e-2)
    monkeypatch.setattr(decision_cache.time, "perf_counter", clock.perf_counter)
    with caplog.at_level(logging.WARNING, logger="retmask.kernels"):
        decision = linear_cpu.measure(CASE, clock.run)
    assert decision["backend"] == "torch" and "differs by" in decision["rejected"]["onednn"]
    assert "disagrees" in caplog.text


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [("gemv", "float32"), ("few", "float32"), ("gemm", "float32"), ("backward", "float32"),
     ("backward-long", "float32"), ("gemv", "bfloat16"), ("few", "bfloat16")],
)  # fmt: skip
def test_real_measurement_agrees_and_decides(auto, kind, dtype):
    """On this machine's real backends: every candidate agrees with torch on its kind of proxy, and the
    decision is one of them with all times recorded (retmask's kernel is a candidate for gemv and few)."""
    case = linear_cpu.LinearCase(96, 80, kind != "gemm", kind, 1, dtype)
    want = {"torch", "onednn"} if dtype == "float32" else {"torch"}
    if kind in ("gemv", "few"):
        want.add("retmask")
    assert set(linear_cpu.candidates(case)) == want
    decision = linear_cpu.measure(case)
    assert decision["rejected"] == {}
    assert decision["backend"] in want and set(decision["times_s"]) == want


def test_decisions_are_cached_on_disk_and_reused(auto, monkeypatch):
    measured = []

    def fake_measure(case, run=None):
        measured.append(case)
        return {"backend": "onednn", "times_s": {"torch": 1.0, "onednn": 0.5}, "ratios": {"onednn": 0.5},
                "rejected": {}, "calls": 3, "proxy": "fake"}  # fmt: skip

    monkeypatch.setattr(linear_cpu, "measure", fake_measure)
    x, w = torch.randn(12, 32), torch.randn(48, 32)
    out = linear_cpu.linear(x, w)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    linear_cpu.linear(x, w)
    assert len(measured) == 1 and measured[0].kind == "gemm"
    data = json.loads(auto.read_text())
    assert data["format"] == linear_cpu._FORMAT
    cases = data["machines"][linear_cpu.machine_key()]["cases"]
    assert cases[measured[0].name()]["backend"] == "onednn"
    linear_cpu.clear_memory()  # a new process on the same machine reads the file instead of measuring
    linear_cpu.linear(x, w)
    assert len(measured) == 1
    assert linear_cpu.decisions()[measured[0].name()]["backend"] == "onednn"
    linear_cpu.linear(x[:1], w)  # one row is another case
    assert len(measured) == 2 and measured[1].kind == "gemv"


def test_a_torn_cache_file_is_measured_again(auto, monkeypatch, caplog):
    auto.parent.mkdir(parents=True)
    auto.write_text('{"format": 1, "machi')
    monkeypatch.setattr(linear_cpu, "measure", lambda case, run=None: {"backend": "torch", "ratios": {}})
    with caplog.at_level(logging.WARNING, logger="retmask.kernels"):
        linear_cpu.linear(torch.randn(3, 4), torch.randn(2, 4))
    assert "ignoring the linear backend cache" in caplog.text
    assert json.loads(auto.read_text())["format"] == linear_cpu._FORMAT


def test_a_cached_rows_kernel_decision_needs_the_kernel(auto, monkeypatch):
    """A stored "retmask" decision from a build with the few-row kernel is measured again by a process
    whose retmask._C lacks it (an older build), instead of calling a missing function."""
    x, w = torch.randn(1, 32), torch.randn(48, 32)
    monkeypatch.setattr(linear_cpu, "measure", lambda case, run=None: {"backend": "retmask", "ratios": {}})
    torch.testing.assert_close(linear_cpu.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    linear_cpu.clear_memory()
    monkeypatch.setattr(linear_cpu.rows_kernel, "available", lambda: False)
    remeasured = []
    monkeypatch.setattr(
        linear_cpu, "measure", lambda case, run=None: remeasured.append(case) or {"backend": "torch"}
    )
    assert torch.equal(linear_cpu.linear(x, w), F.linear(x, w))
    assert len(remeasured) == 1 and "retmask" not in linear_cpu.candidates(remeasured[0])


@pytest.mark.parametrize(
    ("kind", "streams"), [("gemv", True), ("few", True), ("gemm", False), ("backward", False)]
)
def test_decode_kinds_read_their_proxy_weight_from_memory(kind, streams):
    """gemv / few proxies sweep copies of the weight (distinct memory, equal values, STREAM_BYTES in all or
    STREAM_COPIES of them), as a decode step reads each layer's weight once per token; the others reuse one."""
    small, large = (linear_cpu.proxy_call(linear_cpu.LinearCase(n, 576, False, kind, 1)) for n in (8, 1536))
    if not streams:
        assert "weights" not in small and "weights" not in large
        return
    assert len(small["weights"]) == linear_cpu.STREAM_COPIES  # 18 KB: the copy count caps the sweep
    weights = large["weights"]
    assert sum(w.numel() * w.element_size() for w in weights) >= linear_cpu.STREAM_BYTES
    assert len({w.data_ptr() for w in weights}) == len(weights)
    assert all(torch.equal(w, weights[0]) for w in weights)
    ys = linear_cpu.run_backend("torch", large)
    assert len(ys) == len(weights) and all(torch.equal(y, ys[0]) for y in ys)
