"""The rule of which path a call takes (``retmask.kernels.paths``) and the description of this machine."""

from __future__ import annotations

import pytest
import torch

from retmask.kernels import attention, describe, paths
from retmask.kernels.cpu import backend as cpu_backend
from retmask.kernels.cpu import backward as cpu_backward
from retmask.kernels.ops import _sdpa_grads

from .helpers import make_qkv


def test_forward_rule():
    rule = paths.cpu_forward_path
    assert rule(torch.float32, 64, 100, build="avx2") == "cpp"
    assert rule(torch.float32, 64, 100, build="avx512bf16") == "cpp"  # fp32 never takes bf16 products
    assert rule(torch.bfloat16, 64, 100, build="avx512bf16") == "bf16dot"
    assert rule(torch.bfloat16, 64, 1, build="avx512bf16") == "cpp"  # decode
    assert rule(torch.float16, 64, 100, build="avx512bf16") == "cpp"
    assert rule(torch.bfloat16, 64, 100, build="") == "blocked"  # the extension is not built


def test_forward_rule_forced_and_refused(monkeypatch):
    monkeypatch.setenv("RETMASK_CPU_PATH", "blocked")
    assert paths.cpu_forward_path(torch.float32, 64, 100, build="avx2") == "blocked"
    monkeypatch.setenv("RETMASK_CPU_PATH", "gemm")
    with pytest.raises(
        ValueError, match=r"\$RETMASK_CPU_PATH must be one of \['cpp', 'bf16dot', 'blocked'\]"
    ):
        paths.cpu_forward_path(torch.float32, 64, 100, build="avx2")
    with pytest.raises(ValueError, match="RETMASK_CPU_PATH"):
        paths.check_settings()


def test_backward_rule():
    rule = paths.cpu_backward_path
    plain = dict(window=None, softcap=None, sinks=None)
    assert rule(torch.float32, built=True, traced=False, **plain) == "kernel"
    assert rule(torch.bfloat16, built=True, traced=False, **{**plain, "window": 8}) == "kernel"
    assert rule(torch.float32, built=True, traced=False, **{**plain, "softcap": 5.0}) == "chunked"
    assert rule(torch.float32, built=True, traced=False, **{**plain, "sinks": torch.zeros(2)}) == "chunked"
    assert rule(torch.bfloat16, built=True, traced=True, **plain) == "sdpa_fp32"
    assert rule(torch.float32, built=True, traced=True, **plain) == "sdpa"
    assert rule(torch.float32, built=True, traced=True, **{**plain, "window": 8}) == "chunked"
    assert rule(torch.float32, built=False, traced=False, **plain) == "sdpa"


def test_default_backward_runs_the_cpp_kernel(monkeypatch):
    """An eager CPU backward with the defaults runs the C++ backward, whose gradients equal SDPA's."""
    calls = []
    real = cpu_backward.backward
    monkeypatch.setattr(cpu_backward, "backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = make_qkv(1, 4, 2, 30, 30, 32, seed=3)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = attention(q, k, v, causal=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert calls == [1]
    want = _sdpa_grads(grad, q.detach(), k.detach(), v.detach(), causal=True, sm_scale=32**-0.5,
                       key_padding_mask=None, skip_heads=None)  # fmt: skip
    for got, ref in zip((q.grad, k.grad, v.grad), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_describe_names_the_path_of_every_kind_of_call(monkeypatch):
    monkeypatch.delenv("RETMASK_CPU_PATH", raising=False)
    monkeypatch.delenv("RETMASK_CPU_ISA", raising=False)
    d = describe()
    assert d["machine"]["torch"] == torch.__version__
    assert d["machine"]["kernel_build_used"] == cpu_backend.selected_isa()
    kinds = {name for name in d["attention"] if name.startswith("cpu float32")}
    assert kinds == {f"cpu float32 {kind}" for kind in paths.KINDS} | {"cpu float32 backward"}
    bf16_prefill = d["attention"]["cpu bfloat16 prefill / chunk (M > 1)"]["path"]
    assert bf16_prefill == ("bf16dot" if cpu_backend.bf16_dot_native() else "cpp")
    assert d["attention"]["cpu float32 decode (M = 1)"]["path"] == "cpp"
    assert d["attention"]["cpu float32 backward"]["path"] == "kernel"
    assert all(entry["why"] for entry in d["attention"].values())
    monkeypatch.setenv("RETMASK_CPU_PATH", "blocked")
    forced = describe()["attention"]["cpu float32 decode (M = 1)"]
    assert forced == {"path": "blocked", "why": "SDPA + a blocked argmax scan: $RETMASK_CPU_PATH=blocked"}
