"""The precision of a bf16 / fp16 CPU attention backward (retmask.kernels.backward_precision): the fp32
recompute against float64 and the native one, the measured decision (fake clock), its disk cache, the
override variable, and which calls are concerned at all.

The suite pins ``RETMASK_CPU_ATTN_BWD=native`` (conftest); these tests set what they need themselves.
"""

from __future__ import annotations

import json

import pytest
import torch

from retmask.kernels import backward_precision as bp
from retmask.kernels import decision_cache, ops
from retmask.kernels.reference import reference_attention

from . import fake_clock
from .helpers import left_padding_mask, make_qkv


@pytest.fixture
def auto(monkeypatch, tmp_path):
    """``auto`` mode, an empty cache folder, no decisions in memory (before and after)."""
    monkeypatch.setenv(bp.PRECISION_ENV, "auto")
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
    monkeypatch.setenv(bp.PRECISION_ENV, "fp32")
    ours = grads(q, k, v, grad_out, mask)
    monkeypatch.setenv(bp.PRECISION_ENV, "native")
    native = grads(q, k, v, grad_out, mask)
    exact32 = grads(q.float(), k.float(), v.float(), grad_out.float(), mask)
    want = float64_grads(q, k, v, grad_out, mask)
    for name, a, n, e, w in zip("qkv", ours, native, exact32, want, strict=True):
        assert a.dtype == dtype
        assert torch.equal(a, e.to(dtype)), name
        scale = w.abs().max()
        err_ours, err_native = ((a.double() - w).abs().max() / scale), ((n.double() - w).abs().max() / scale)
        assert err_ours <= err_native + 1e-3 and err_ours < 1e-2, (name, err_ours, err_native)


def test_float32_calls_are_not_concerned(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a float32 backward must not ask for a precision")

    monkeypatch.setattr(bp, "precision_for", fail)
    q, k, v = make_qkv(1, 4, 2, 20, 20, 16, seed=1)
    grad_out = torch.randn(q.shape)
    dq, _, _ = grads(q, k, v, grad_out, None)
    assert dq.dtype == torch.float32


class FakeClock(fake_clock.FakeClock):
    def run(self, precision: str, call: dict) -> None:
        self.tick(precision)


CASE = bp.BackwardCase("bfloat16", 2, 4, 2, 16, 128, True, True, False, 1)


@pytest.mark.parametrize(
    ("fp32_s", "want"), [(0.5, "fp32"), (0.89, "fp32"), (0.95, "native"), (1.5, "native")]
)
def test_decision_rule(auto, monkeypatch, fp32_s, want):
    clock = FakeClock({"native": 1.0, "fp32": fp32_s})
    monkeypatch.setattr(decision_cache.time, "perf_counter", clock.perf_counter)
    decision = bp.measure(CASE, clock.run)
    assert decision["precision"] == want and decision["ratio"] == pytest.approx(fp32_s)
    assert decision["calls"] >= 3 and clock.calls.count("native") == clock.calls.count("fp32")


def test_decisions_are_cached_on_disk_and_reused(auto, monkeypatch):
    measured = []

    def fake_measure(case, run):
        measured.append(case)
        return {"precision": "fp32", "times_s": {"native": 1.0, "fp32": 0.5}, "ratio": 0.5, "calls": 3}

    monkeypatch.setattr(bp, "measure", fake_measure)
    q, k, v = make_qkv(3, 4, 2, 70, 70, 16, dtype=torch.bfloat16, seed=2)
    grad_out = torch.randn(q.shape).to(torch.bfloat16)
    grads(q, k, v, grad_out, None)
    grads(q, k, v, grad_out, None)
    assert measured == [
        bp.BackwardCase("bfloat16", 3, 4, 2, 16, 70, True, True, False, torch.get_num_threads())
    ]
    cases = json.loads(auto.read_text())["machines"][bp._store.machine_key()]["cases"]
    assert cases[measured[0].name()]["precision"] == "fp32"
    bp.clear_memory()  # a new process on the same machine reads the file instead of measuring
    grads(q, k, v, grad_out, None)
    assert len(measured) == 1 and bp.decisions()[measured[0].name()]["precision"] == "fp32"
    grads(q[:, :, :10], k, v, grad_out[:, :, :10], None, causal=False)  # 10 queries, 70 keys: another case
    assert len(measured) == 2 and measured[1].square is False and measured[1].causal is False


def test_keys_are_exact_below_512_then_bucketed():
    q, _, _ = make_qkv(1, 4, 2, 1, 1, 16)
    keys = [bp.case_of(q, torch.empty(1, 2, n, 16), True, False).keys for n in (163, 511, 512, 513, 600)]
    assert keys == [163, 511, 512, 576, 640]


def test_long_calls_stay_native_without_measuring(auto, monkeypatch):
    monkeypatch.setattr(bp, "measure", lambda case, run: pytest.fail("measured"))
    case = CASE._replace(keys=bp.MAX_KEYS)
    assert bp.precision_for(case, lambda precision, call: None) == "native"


def test_real_measurement_on_a_proxy(auto):
    decision = bp.measure(CASE, ops._proxy_grads)
    assert decision["precision"] in ("native", "fp32") and set(decision["times_s"]) == {"native", "fp32"}


def test_bad_override_names_the_variable(monkeypatch):
    monkeypatch.setenv(bp.PRECISION_ENV, "bf16")
    with pytest.raises(ValueError, match="RETMASK_CPU_ATTN_BWD"):
        bp.precision_for(CASE, lambda precision, call: None)
