"""The measured choice between the CPU paths (retmask.kernels.cpu_autotune): cases, the decision rule,
the check that a candidate agrees with the fused kernel, the disk cache, the override, and that the
proxy calls it times are valid calls of every path.

The rest of the suite pins ``RETMASK_CPU_PATH=cpp`` (conftest) so that no result depends on timing;
these tests set ``auto`` themselves, with the cache in a temporary folder.
"""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
import torch

from retmask.kernels import attention, cpu_autotune, cpu_blocked, decision_cache, reference_attention
from retmask.kernels import cpu as cpu_backend

from . import fake_clock
from .helpers import left_padding_mask, make_qkv


@pytest.fixture
def auto(monkeypatch, tmp_path):
    """``auto`` mode, an empty cache folder, no decisions in memory (before and after)."""
    monkeypatch.setenv("RETMASK_CPU_PATH", "auto")
    monkeypatch.setenv("RETMASK_CACHE", str(tmp_path / "cache"))
    cpu_autotune.clear_memory()
    yield tmp_path / "cache" / cpu_autotune.CACHE_FILE
    cpu_autotune.clear_memory()


class FakeClock(fake_clock.FakeClock):
    """Each path "takes" its given seconds and returns ``results[path]`` (default: the same output for
    every path, no argmax)."""

    def __init__(self, cost: dict[str, float], results: dict[str, tuple] | None = None):
        super().__init__(cost)
        self.results = results or {}

    def run(self, path: str, call: dict) -> tuple:
        self.tick(path)
        return self.results.get(path, (torch.ones(2, 3), None))


def some_case(**changes) -> cpu_autotune.Case:
    fields = dict(
        dtype="float32", head_dim=16, group=2, causal=True, shape="chunk", argmax="none", padding=False,
        skipped=False, features="-", keys="short", threads=1,
    )  # fmt: skip
    fields.update(changes)
    return cpu_autotune.Case(**fields)


def test_case_of_classifies_calls():
    k = torch.randn(2, 3, 1000, 32)
    q = lambda M, dtype=torch.float32: torch.randn(2, 9, M, 32).to(dtype)  # noqa: E731
    base = dict(causal=True, key_padding_mask=None, skip_heads=None)
    c = cpu_autotune.case_of(q(1), k, argmax_rows=1, **base)
    assert (c.shape, c.argmax, c.group, c.head_dim, c.keys) == ("decode", "few", 3, 32, "long")
    assert cpu_autotune.case_of(q(40), k, argmax_rows=0, **base).shape == "verify"
    assert cpu_autotune.case_of(q(300), k, argmax_rows=300, **base).argmax == "many"
    assert cpu_autotune.case_of(q(1000), k, argmax_rows=256, **base).shape == "prefill"
    c = cpu_autotune.case_of(q(300, torch.bfloat16), k[:, :, :300], argmax_rows=0, **base)
    assert (c.dtype, c.shape, c.argmax, c.keys) == ("bfloat16", "prefill", "none", "short")
    c = cpu_autotune.case_of(
        q(100), k, causal=False, key_padding_mask=torch.ones(2, 1000, dtype=torch.bool),
        skip_heads=torch.zeros(2, 9, dtype=torch.bool), argmax_rows=0, window=8, sinks=torch.zeros(9),
    )  # fmt: skip
    assert (c.shape, c.causal, c.padding, c.skipped, c.features) == (
        "chunk",
        False,
        True,
        True,
        "window+sinks",
    )
    assert c.name().startswith("float32 D32 g3 full chunk argmax=none pad=1 skip=1 features=window+sinks")


def test_blocked_only_where_its_memory_stays_small():
    assert cpu_autotune.blocked_allowed(4096, 4096, 64, causal=True, padding=False)
    assert not cpu_autotune.blocked_allowed(4096, 4096, 257, causal=True, padding=False)  # [g*rows, 2048]
    assert cpu_autotune.blocked_allowed(256, 8192, 0, causal=True, padding=False)  # 2M-element mask
    assert not cpu_autotune.blocked_allowed(16384, 16384, 0, causal=True, padding=True)  # 268M elements
    assert cpu_autotune.blocked_allowed(16384, 16384, 0, causal=True, padding=False)  # is_causal, no mask


@pytest.mark.parametrize(
    ("cpp_s", "blocked_s", "expected"),
    [(4e-3, 2e-3, "blocked"), (4e-3, 3.4e-3, "blocked"), (4e-3, 3.6e-3, "cpp"), (2e-3, 2e-3, "cpp"), (1e-3, 5e-3, "cpp")],
)  # fmt: skip
def test_decision_rule(auto, monkeypatch, cpp_s, blocked_s, expected):
    """ "blocked" only at <= 0.85x the fused kernel's time; both paths timed interleaved, warm-up first."""
    clock = FakeClock({"cpp": cpp_s, "blocked": blocked_s})
    monkeypatch.setattr(decision_cache.time, "perf_counter", clock.perf_counter)
    assert cpu_autotune.choose(some_case(), clock.run)["path"] == expected
    assert clock.calls[:4] == ["cpp", "blocked", "cpp", "blocked"]
    assert clock.calls.count("cpp") == clock.calls.count("blocked") >= 1 + 3
    (decision,) = cpu_autotune.decisions().values()
    assert decision["path"] == expected and decision["fallback"] == "cpp" and decision["rejected"] == {}
    assert decision["ratios"]["blocked"] == pytest.approx(blocked_s / cpp_s, rel=1e-3)


@pytest.mark.parametrize(
    ("gemm_s", "blocked_s", "path", "fallback"),
    [(3e-3, 2e-3, "blocked", "gemm"), (3e-3, 3.3e-3, "gemm", "gemm"), (2e-3, 3e-3, "gemm", "gemm"),
     (3.6e-3, 3.5e-3, "gemm", "gemm"), (3.8e-3, 2e-3, "blocked", "cpp"), (3.8e-3, 3.6e-3, "cpp", "cpp")],
)  # fmt: skip
def test_three_way_decision(auto, monkeypatch, gemm_s, blocked_s, path, fallback):
    """The fastest path within its margin of the fused kernel's time (4 ms here): 0.92x for "gemm"
    (3.68 ms), 0.85x for "blocked" (3.4 ms); the fallback where "blocked" may not run a call is the best
    of the others by the same rule."""
    clock = FakeClock({"cpp": 4e-3, "gemm": gemm_s, "blocked": blocked_s})
    monkeypatch.setattr(decision_cache.time, "perf_counter", clock.perf_counter)
    decision = cpu_autotune.choose(some_case(), clock.run, ("cpp", "gemm", "blocked"))
    assert (decision["path"], decision["fallback"]) == (path, fallback)
    assert clock.calls[:6] == ["cpp", "gemm", "blocked"] * 2
    assert set(decision["times_s"]) == {"cpp", "gemm", "blocked"}


def test_a_candidate_that_disagrees_is_never_used(auto, monkeypatch, caplog):
    """A faster path whose proxy output differs from the fused kernel's is rejected, said, and recorded."""
    good = (torch.ones(1, 2, 4, 8), None)
    bad = (torch.ones(1, 2, 4, 8) * 1.5, None)
    clock = FakeClock(
        {"cpp": 4e-3, "gemm": 1e-3, "blocked": 3e-3}, {"cpp": good, "gemm": bad, "blocked": good}
    )
    monkeypatch.setattr(decision_cache.time, "perf_counter", clock.perf_counter)
    with caplog.at_level(logging.WARNING, logger="retmask.kernels"):
        decision = cpu_autotune.choose(some_case(), clock.run, ("cpp", "gemm", "blocked"))
    assert decision["path"] == "blocked" and "gemm" not in decision["times_s"]
    assert "outputs differ by 0.5" in decision["rejected"]["gemm"]
    assert "'gemm' disagrees with the fused kernel" in caplog.text
    assert clock.calls.count("gemm") == 1  # the checked call only, never timed


def test_disagreement_tolerates_near_ties_only():
    """A different argmax passes only where its key's fp32 logit is within LOGIT_TOL of the row's max;
    NaN rows and -1 rows must sit in the same places."""
    case = some_case(argmax="few", shape="verify")
    call = cpu_autotune.proxy_call(case)  # 16 rows, all with an argmax, the first at position N - 16
    out, argmax = cpu_backend._run_path("cpp", call)
    assert cpu_autotune.disagreement(case, call, (out, argmax), (out.clone(), argmax.clone())) is None
    key = int(argmax[0, 0, 0])
    twin = 0 if key != 0 else 1  # a key every row sees
    k = call["k"].clone()
    k[0, 0, twin] = k[0, 0, key]  # the same logit as the winner: an exact tie for row 0
    call = dict(call, k=k)
    out, argmax = cpu_backend._run_path("cpp", call)
    assert int(argmax[0, 0, 0]) == min(key, twin)  # ties keep the smallest index
    tie = argmax.clone()
    tie[0, 0, 0] = max(key, twin)
    assert cpu_autotune.disagreement(case, call, (out, argmax), (out, tie)) is None
    far = argmax.clone()
    far[0, 0, 1] = int(argmax[0, 0, 1]) + 1  # the next key: not a tie on random inputs
    why = cpu_autotune.disagreement(case, call, (out, argmax), (out, far))
    assert why is not None and "below the maximum logit" in why
    lost = argmax.clone()
    lost[0, 1, 3] = -1
    assert "-1" in cpu_autotune.disagreement(case, call, (out, argmax), (out, lost))
    nan_out = out.clone()
    nan_out[0, 0, 0, 0] = float("nan")
    assert "NaN" in cpu_autotune.disagreement(case, call, (out, argmax), (nan_out, argmax))
    assert "outputs differ" in cpu_autotune.disagreement(case, call, (out, argmax), (out + 1e-3, argmax))


def test_candidates_per_case():
    both = ("gemm", "gemm_fp32")
    assert cpu_autotune.candidates(some_case(), ("gemm",)) == ("cpp", "gemm", "blocked")
    assert cpu_autotune.candidates(some_case(), both) == ("cpp", "gemm", "gemm_fp32", "blocked")
    assert cpu_autotune.candidates(some_case(), ()) == ("cpp", "blocked")
    assert cpu_autotune.candidates(some_case(argmax="many"), both) == ("cpp", "gemm", "gemm_fp32")
    assert cpu_autotune.candidates(some_case(argmax="many"), ()) == ("cpp",)
    # Decode streams the whole cache with one row per head: the GEMM layout's block copies cost more
    # than its products save, whatever the in-cache proxy says.
    assert cpu_autotune.candidates(some_case(shape="decode", argmax="few"), both) == ("cpp", "blocked")
    assert cpu_autotune.candidates(some_case(shape="verify", argmax="few"), both) == (
        "cpp", "gemm", "gemm_fp32", "blocked",
    )  # fmt: skip


def test_only_cpp_means_no_measuring(auto):
    def never(path, call):
        raise AssertionError("must not measure")

    assert cpu_autotune.choose(some_case(), never, ("cpp",))["path"] == "cpp"
    assert not auto.exists() and cpu_autotune.decisions() == {}


def test_blocked_decision_gives_way_where_its_mask_would_be_too_large(auto, monkeypatch):
    """A case decided for "blocked" runs a call whose SDPA mask would exceed BLOCKED_MAX_MASK on its fallback."""
    clock = FakeClock({"cpp": 4e-3, "gemm": 3e-3, "blocked": 1e-3})
    monkeypatch.setattr(decision_cache.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(cpu_autotune, "BLOCKED_MAX_MASK", 100 * 600)
    k = torch.randn(1, 1, 600, 16)
    call = dict(causal=True, key_padding_mask=None, skip_heads=None, argmax_rows=0, kernel_paths=("gemm",))
    assert cpu_autotune.path_for(torch.randn(1, 2, 100, 16), k, clock.run, **call) == "blocked"
    assert cpu_autotune.path_for(torch.randn(1, 2, 101, 16), k, clock.run, **call) == "gemm"  # same case


def test_decisions_persist_on_disk_per_machine(auto, monkeypatch, caplog):
    clock = FakeClock({"cpp": 4e-3, "blocked": 1e-3})
    monkeypatch.setattr(decision_cache.time, "perf_counter", clock.perf_counter)
    case = some_case()
    assert cpu_autotune.choose(case, clock.run)["path"] == "blocked"
    data = json.loads(auto.read_text())
    entry = data["machines"][cpu_autotune.machine_key()]
    assert entry["machine"] == cpu_autotune.machine()
    # a rebuilt kernel is another machine: the key holds the bytes of the loaded extension
    so_path = cpu_backend._library().module.__file__
    assert entry["machine"]["extension_sha256"] == hashlib.sha256(open(so_path, "rb").read()).hexdigest()[:16]
    assert entry["cases"][case.name()]["path"] == "blocked"

    # A new process (memory cleared) reads the decision instead of measuring again.
    cpu_autotune.clear_memory()
    n_calls = len(clock.calls)
    assert cpu_autotune.choose(case, clock.run)["path"] == "blocked"
    assert len(clock.calls) == n_calls
    assert case.name() in cpu_autotune.decisions()

    # Decisions of another machine (other CPU, flags, torch or kernel build) are not used.
    data["machines"] = {"0123456789abcdef": entry}
    auto.write_text(json.dumps(data))
    cpu_autotune.clear_memory()
    clock.cost = {"cpp": 1e-3, "blocked": 4e-3}
    assert cpu_autotune.choose(case, clock.run)["path"] == "cpp"
    assert len(clock.calls) > n_calls
    assert set(json.loads(auto.read_text())["machines"]) == {"0123456789abcdef", cpu_autotune.machine_key()}

    # A torn file is reported and replaced, not fatal.
    auto.write_text('{"format": 2, "machi')
    cpu_autotune.clear_memory()
    with caplog.at_level(logging.WARNING, logger="retmask.kernels"):
        assert cpu_autotune.choose(case, clock.run)["path"] == "cpp"
    assert "ignoring the kernel path cache" in caplog.text
    assert json.loads(auto.read_text())["machines"][cpu_autotune.machine_key()]["cases"][case.name()]


def test_unwritable_cache_keeps_the_decision_in_memory(auto, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("RETMASK_CACHE", str(blocker / "cache"))  # its parent is a file: cannot be created
    clock = FakeClock({"cpp": 4e-3, "blocked": 1e-3})
    monkeypatch.setattr(decision_cache.time, "perf_counter", clock.perf_counter)
    with caplog.at_level(logging.WARNING, logger="retmask.kernels"):
        assert cpu_autotune.choose(some_case(), clock.run)["path"] == "blocked"
    assert "could not save the kernel path cache" in caplog.text
    n_calls = len(clock.calls)
    assert cpu_autotune.choose(some_case(), clock.run)["path"] == "blocked"
    assert len(clock.calls) == n_calls


def test_override_by_environment(monkeypatch):
    q, k, v = make_qkv(1, 4, 2, 6, 50, 16, seed=3)
    seen = []
    real = cpu_blocked.forward
    monkeypatch.setattr(cpu_blocked, "forward", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    monkeypatch.setenv("RETMASK_CPU_PATH", "blocked")
    out_blocked, arg_blocked = attention(q, k, v, return_argmax=True, backend="cpu")
    assert seen == [1]
    monkeypatch.setenv("RETMASK_CPU_PATH", "cpp")
    out_cpp, arg_cpp = attention(q, k, v, return_argmax=True, backend="cpu")
    assert seen == [1]
    torch.testing.assert_close(out_blocked, out_cpp, atol=2e-5, rtol=2e-5)
    assert torch.equal(arg_blocked, arg_cpp)
    monkeypatch.setenv("RETMASK_CPU_PATH", "fastest")
    with pytest.raises(
        ValueError,
        match=r"\$RETMASK_CPU_PATH must be one of \['auto', 'cpp', 'gemm', 'gemm_fp32', 'bf16dot', 'blocked'\]",
    ):
        attention(q, k, v, backend="cpu")


@pytest.mark.parametrize(
    "case",
    [
        some_case(shape="decode", argmax="few", group=3),
        some_case(shape="verify", argmax="few", padding=True, dtype="bfloat16"),
        some_case(shape="chunk", skipped=True, group=1),
        some_case(shape="prefill", features="window+softcap+sinks", skipped=True),
        some_case(shape="chunk", causal=False, padding=True, features="sinks"),
    ],
    ids=lambda c: c.name(),
)
def test_proxy_calls_are_valid_calls_of_every_path(case):
    """What the autotuner times is a real call: every path agrees with the reference on it, and the
    autotuner's own check finds each one in agreement with the fused kernel."""
    call = cpu_autotune.proxy_call(case)
    M, N = call["q"].shape[2], call["k"].shape[2]
    assert N == cpu_autotune.SHORT_KEYS and (M < N) == (case.shape != "prefill")
    assert call["q"].dtype == getattr(torch, case.dtype)
    if call["skip_heads"] is not None:
        assert call["skip_heads"].any() and not call["skip_heads"].all()
    ref_out, ref_arg = reference_attention(**call)
    tol = 2e-2 if case.dtype == "bfloat16" else 2e-5
    cpp_result = cpu_backend._run_path("cpp", call)
    for path in ("cpp", *cpu_backend.gemm_paths(call["q"].dtype), "bf16dot", "blocked"):
        out, arg = cpu_backend._run_path(path, call)[:2]
        torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
        if call["argmax_rows"] and case.dtype == "float32":
            assert torch.equal(arg, ref_arg)
        assert cpu_autotune.disagreement(case, call, cpp_result, (out, arg)) is None, path


def test_auto_end_to_end(auto):
    """The default mode measures a new case once, records it, and returns correct results."""
    q, k, v = make_qkv(2, 6, 3, 8, 200, 16, seed=5)
    kpm = left_padding_mask(2, 200, [0, 30])
    out, arg = attention(q, k, v, key_padding_mask=kpm, return_argmax=True, argmax_rows=3, backend="cpu")
    ref_out, ref_arg = reference_attention(q, k, v, causal=True, key_padding_mask=kpm, argmax_rows=3)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    assert torch.equal(arg, ref_arg)
    (name, decision) = next(iter(cpu_autotune.decisions().items()))
    threads = torch.get_num_threads()
    assert (
        name
        == f"float32 D16 g2 causal verify argmax=few pad=1 skip=0 features=- keys=short threads={threads}"
    )
    assert set(decision["times_s"]) == {"cpp", "gemm", "blocked"} and decision["rejected"] == {}
    assert decision["path"] in decision["times_s"] and min(decision["times_s"].values()) > 0
    assert json.loads(auto.read_text())["machines"][cpu_autotune.machine_key()]["cases"][name] == decision
    # An argmax of every row of a long prefill is never sent to the blocked path: only cpp and gemm.
    q, k, v = make_qkv(1, 2, 1, 300, 300, 16, seed=6)
    out, arg = attention(q, k, v, return_argmax=True, backend="cpu")
    ref_out, ref_arg = reference_attention(q, k, v, causal=True, argmax_rows=300)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    assert torch.equal(arg, ref_arg)
    (prefill,) = (d for n, d in cpu_autotune.decisions().items() if n != name)
    assert set(prefill["times_s"]) == {"cpp", "gemm"}
