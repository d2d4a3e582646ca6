"""How a CPU attention backward runs (retmask.kernels.backward_choice): the fp32 SDPA recompute against
float64 and the native one, the kernel where forced, the measured decision (fake clock), its disk cache,
the override variable, and which calls are concerned at all.

The suite pins ``RETMASK_CPU_ATTN_BWD=kernel`` (conftest); these tests set what they need themselves.
"""

from __future__ import annotations

import json

import pytest
import torch

from retmask.kernels import backward_choice as bp
from retmask.kernels import cpu_backward, decision_cache, ops
from retmask.kernels.reference import reference_attention

from . import fake_clock
from .helpers import left_padding_mask, make_qkv


@pytest.fixture
def auto(monkeypatch, tmp_path):
    """``auto`` mode, an empty cache folder, no decisions in memory (before and after)."""
    monkeypatch.setenv(bp.CHOICE_ENV, "auto")
    monkeypatch.setenv("RETMASK_CACHE", str(tmp_path / "cache"))
    bp.clear_memory()
    yield tmp_path / "cache" / bp.CACHE_FILE
    bp.clear_memory()


def grads(q, k, v, grad_out, mask, causal=True):
    return ops.recompute_grads(grad_out, q, k, v, causal=causal, sm_scale=0.125, key_padding_mask=mask,
                               skip_heads=None, window=None, softcap=None, sinks=None)[:3]  # fmt: skip


def float64_grads(q, k, v, grad_out, mask, causal=True):
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    out, _ = reference_attention(qd, kd, vd, causal=causal, sm_scale=0.125, key_padding_mask=mask)
    return torch.autograd.grad(out, (qd, kd, vd), grad_out.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_fp32_backward_is_the_float32_computation_and_closer_to_float64(monkeypatch, dtype, masked):
    """Forced fp32: the gradients are the fp32 recompute's, rounded once to the inputs' dtype, and no
    farther from float64 than the native half-precision backward (GQA, 45 keys, left padding)."""
    q, k, v = make_qkv(2, 6, 2, 45, 45, 32, dtype=dtype, seed=3)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    mask = left_padding_mask(2, 45, [0, 7]) if masked else None
    monkeypatch.setenv(bp.CHOICE_ENV, "fp32")
    ours = grads(q, k, v, grad_out, mask)
    monkeypatch.setenv(bp.CHOICE_ENV, "native")
    native = grads(q, k, v, grad_out, mask)
    exact32 = grads(q.float(), k.float(), v.float(), grad_out.float(), mask)
    want = float64_grads(q, k, v, grad_out, mask)
    for name, a, n, e, w in zip("qkv", ours, native, exact32, want, strict=True):
        assert a.dtype == dtype
        assert torch.equal(a, e.to(dtype)), name
        scale = w.abs().max()
        err_ours, err_native = ((a.double() - w).abs().max() / scale), ((n.double() - w).abs().max() / scale)
        assert err_ours <= err_native + 1e-3 and err_ours < 1e-2, (name, err_ours, err_native)


def test_kernel_choice_runs_the_cpp_backward(monkeypatch):
    """Forced "kernel": plain and windowed attention run the C++ backward (fp32 and bf16 calls), with the
    recompute's gradients; soft-capping keeps the chunked recompute, which the kernel does not cover."""
    calls = []
    real = cpu_backward.backward
    monkeypatch.setattr(
        cpu_backward, "backward", lambda *a, **kw: calls.append(kw["window"]) or real(*a, **kw)
    )
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = make_qkv(1, 4, 2, 20, 20, 16, dtype=dtype, seed=1)
        grad_out = torch.randn(q.shape).to(dtype)
        for window in (None, 6):
            monkeypatch.setenv(bp.CHOICE_ENV, "native")
            want = windowed_grads(q, k, v, grad_out, window)
            monkeypatch.setenv(bp.CHOICE_ENV, "kernel")
            got = windowed_grads(q, k, v, grad_out, window)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == dtype
                torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
    assert calls == [None, 6, None, 6]
    ops.recompute_grads(grad_out, q, k, v, causal=True, sm_scale=0.125, key_padding_mask=None, skip_heads=None,
                        window=None, softcap=5.0, sinks=None)  # fmt: skip
    assert len(calls) == 4


def windowed_grads(q, k, v, grad_out, window):
    return ops.recompute_grads(grad_out, q, k, v, causal=True, sm_scale=0.125, key_padding_mask=None,
                               skip_heads=None, window=window, softcap=None, sinks=None)[:3]  # fmt: skip


def test_fp32_choice_leaves_float32_calls_native(monkeypatch):
    assert bp.choice_for(CASE._replace(dtype="float32"), lambda c, call: None, kernel=True) != "fp32"
    monkeypatch.setenv(bp.CHOICE_ENV, "fp32")
    assert bp.choice_for(CASE._replace(dtype="float32"), lambda c, call: None, kernel=True) == "native"
    assert bp.choice_for(CASE, lambda c, call: None, kernel=True) == "fp32"
    monkeypatch.setenv(bp.CHOICE_ENV, "kernel")
    assert bp.choice_for(CASE, lambda c, call: None, kernel=False) == "native"  # where it does not apply


class FakeClock(fake_clock.FakeClock):
    def run(self, choice: str, call: dict) -> None:
        self.tick(choice)


CASE = bp.BackwardCase("bfloat16", 2, 4, 2, 16, 128, True, True, False, 1)


@pytest.mark.parametrize(
    ("kernel_s", "fp32_s", "want"),
    [
        (None, 0.5, "fp32"), (None, 0.89, "fp32"), (None, 0.95, "native"), (None, 1.5, "native"),
        (0.3, 0.5, "kernel"), (0.5, 0.5, "kernel"), (0.6, 0.5, "fp32"), (1.2, 1.5, "native"),
    ],
)  # fmt: skip
def test_decision_rule(auto, monkeypatch, kernel_s, fp32_s, want):
    times = {"native": 1.0, "fp32": fp32_s} | ({"kernel": kernel_s} if kernel_s is not None else {})
    clock = FakeClock(times)
    monkeypatch.setattr(decision_cache.time, "perf_counter", clock.perf_counter)
    decision = bp.measure(CASE, clock.run, bp.candidates(CASE, kernel_s is not None))
    assert decision["choice"] == want and decision["times_s"] == pytest.approx(times)
    assert decision["calls"] >= 3 and all(clock.calls.count(name) == decision["calls"] for name in times)


def test_candidates():
    assert bp.candidates(CASE, True) == ["kernel", "native", "fp32"]
    assert bp.candidates(CASE, False) == ["native", "fp32"]
    assert bp.candidates(CASE._replace(dtype="float32"), True) == ["kernel", "native"]
    assert bp.candidates(CASE._replace(keys=bp.MAX_KEYS), True) == ["kernel", "native"]  # no fp32 copies
    assert bp.candidates(CASE._replace(window=32), True) == [
        "kernel",
        "native",
    ]  # native: the chunked recompute


def test_window_is_part_of_the_case():
    q, k, _ = make_qkv(1, 4, 2, 100, 100, 16)
    assert bp.case_of(q, k, True, False, 32).window == 32
    assert bp.case_of(q, k, True, False, 100).window == 0  # a window of N keys hides nothing
    assert bp.case_of(q, k, True, False).window == 0


def test_real_measurement_of_a_windowed_proxy(auto):
    case = CASE._replace(window=24)
    decision = bp.measure(case, ops._proxy_grads, bp.candidates(case, True))
    assert set(decision["times_s"]) == {"kernel", "native"}


def test_decisions_are_cached_on_disk_and_reused(auto, monkeypatch):
    measured = []

    def fake_measure(case, run, names):
        measured.append(case)
        return {"choice": "fp32", "times_s": {"native": 1.0, "fp32": 0.5}, "calls": 3}

    monkeypatch.setattr(bp, "measure", fake_measure)
    q, k, v = make_qkv(3, 4, 2, 70, 70, 16, dtype=torch.bfloat16, seed=2)
    grad_out = torch.randn(q.shape).to(torch.bfloat16)
    grads(q, k, v, grad_out, None)
    grads(q, k, v, grad_out, None)
    assert measured == [
        bp.BackwardCase("bfloat16", 3, 4, 2, 16, 70, True, True, False, torch.get_num_threads())
    ]
    cases = json.loads(auto.read_text())["machines"][bp._store.machine_key()]["cases"]
    assert cases[measured[0].name()]["choice"] == "fp32"
    bp.clear_memory()  # a new process on the same machine reads the file instead of measuring
    grads(q, k, v, grad_out, None)
    assert len(measured) == 1 and bp.decisions()[measured[0].name()]["choice"] == "fp32"
    grads(q[:, :, :10], k, v, grad_out[:, :, :10], None, causal=False)  # 10 queries, 70 keys: another case
    assert len(measured) == 2 and measured[1].square is False and measured[1].causal is False


def test_keys_are_exact_below_512_then_bucketed_then_capped():
    q, _, _ = make_qkv(1, 4, 2, 1, 1, 16)
    keys = [
        bp.case_of(q, torch.empty(1, 2, n, 16), True, False).keys
        for n in (163, 511, 512, 513, 600, 2047, 9000)
    ]
    assert keys == [163, 511, 512, 576, 640, bp.MAX_KEYS, bp.MAX_KEYS]


def test_a_single_candidate_is_not_measured(auto, monkeypatch):
    monkeypatch.setattr(bp, "measure", lambda case, run, names: pytest.fail("measured"))
    case = CASE._replace(keys=bp.MAX_KEYS)  # no fp32 copies from MAX_KEYS on; without the kernel: native only
    assert bp.choice_for(case, lambda choice, call: None, kernel=False) == "native"


def test_real_measurement_on_a_proxy(auto):
    decision = bp.measure(CASE, ops._proxy_grads, bp.candidates(CASE, True))
    assert decision["choice"] in ("kernel", "native", "fp32")
    assert set(decision["times_s"]) == {"kernel", "native", "fp32"}


def test_bad_override_names_the_variable(monkeypatch):
    monkeypatch.setenv(bp.CHOICE_ENV, "bf16")
    with pytest.raises(ValueError, match="RETMASK_CPU_ATTN_BWD"):
        bp.choice_for(CASE, lambda choice, call: None, kernel=True)
