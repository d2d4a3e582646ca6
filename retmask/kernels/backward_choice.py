"""How an attention backward runs on the CPU: the C++ kernel, PyTorch SDPA in the inputs' dtype, or SDPA
in fp32.

Why. The CPU kernel's gradients come either from its own C++ backward (``cpu_backward``: one pass per
block of whole query rows, fp32 throughout) or from recomputing the attention through PyTorch SDPA and
differentiating that (``ops.recompute_grads``). On a 2-core AMD Zen 5 EPYC the C++ backward took
0.15-0.31x the time of the faster SDPA variant in fp32 and 0.16-0.43x in bf16 (9 / 3 and 32 / 8 heads,
64-4,096 keys; in bf16 the ratio grows with the keys, where SDPA's bf16 backward gets faster); SDPA's bf16 CPU flash backward, in turn, took 1.5-2x the time of the same backward in fp32
on short sequences (10.9 against 7.1 ms at 163 keys: a DPO batch of SmolLM2) and 1.1-1.4x less from 256
keys on. On a CPU whose bf16 GEMM runs on matrix units (AMX), SDPA's bf16 backward may well win. Which
one is fastest is a property of the machine and the shape, so it is measured once per case on a seeded
proxy call, the candidates interleaved, and cached like the other CPU decisions (``decision_cache``):

* a :class:`BackwardCase` is (dtype, batch up to ``MAX_PROXY_BATCH``, query heads, kv heads, head dim,
  keys, square or not, causal, masked, threads, window). Keys are exact below ``EXACT_KEYS`` (SDPA's bf16 time
  is not monotone in them: on that EPYC 192 keys took 10.6 ms and 163 keys 11.9 ms, a multiple of 64
  being fast), rounded up to ``KEYS_BUCKET`` from there, and capped at ``MAX_KEYS``: a longer call uses
  the decision measured at ``MAX_KEYS`` keys, so that a training run with many padded lengths measures
  a bounded number of cases (each once per machine, ~0.1-1 s);
* the candidates: "kernel" where the C++ backward applies (no soft-capping or sinks; a build that has
  it), "native" (SDPA in the dtype; with a sliding window, which SDPA cannot express without an [M, N]
  mask, the query-chunked recompute of ``chunked.py``), and "fp32" (SDPA on fp32 copies, rounded back
  once) for bf16 / fp16 calls without a window below ``MAX_KEYS`` keys (the copies double the memory of
  longer ones). The kernel is used when it is the fastest; otherwise fp32 at <= ``FP32_MAX_RATIO`` of the
  native time, else native.

``RETMASK_CPU_ATTN_BWD=kernel|native|fp32`` forces a choice (``auto``, the default, measures): "kernel"
where it applies (else native), "fp32" for half-precision calls (fp32 calls have only the one SDPA).
The test suite pins ``kernel``. Calls traced by ``torch.compile`` keep the SDPA recompute in the
inputs' dtype, which AOTAutograd can trace.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import cpu_backward
from .cpuinfo import cpu_identity
from .decision_cache import DecisionCache, DecisionStore, forced_choice, interleaved_medians

CHOICE_ENV = "RETMASK_CPU_ATTN_BWD"
CHOICES = ("auto", "kernel", "native", "fp32")
FP32_MAX_RATIO = 0.9
KEYS_BUCKET = 64
EXACT_KEYS = 512
MAX_KEYS = 2048
MAX_PROXY_BATCH = 4
CACHE_FILE = "cpu_attention_backward.json"
_FORMAT = 3  # 1: "precision" native / fp32, before the C++ backward; 2: no window in the case

log = logging.getLogger("retmask.kernels")


class BackwardCase(NamedTuple):
    """What decides how a CPU attention backward runs (see the module docstring)."""

    dtype: str
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    keys: int  # exact below EXACT_KEYS, else rounded up to KEYS_BUCKET, at most MAX_KEYS
    square: bool  # as many queries as keys (training), else queries = min(keys, KEYS_BUCKET)
    causal: bool
    masked: bool
    threads: int
    window: int = 0  # sliding window (keys), 0 = none

    def name(self) -> str:
        return (
            f"{self.dtype} B{self.batch} H{self.q_heads}/{self.kv_heads} D{self.head_dim} N{self.keys} "
            f"{'square' if self.square else 'rect'} causal={self.causal} masked={self.masked} "
            f"threads={self.threads}" + (f" window={self.window}" if self.window else "")
        )


def case_of(
    q: torch.Tensor, k: torch.Tensor, causal: bool, masked: bool, window: int | None = None
) -> BackwardCase:
    """The case of a call with q: [B, Hq, M, D], k: [B, Hkv, N, D] (a window of N or more keys is none)."""
    n = k.shape[2]
    keys = n if n < EXACT_KEYS else min(MAX_KEYS, -(-n // KEYS_BUCKET) * KEYS_BUCKET)
    return BackwardCase(
        str(q.dtype).removeprefix("torch."), min(q.shape[0], MAX_PROXY_BATCH), q.shape[1], k.shape[1], q.shape[3],
        keys, q.shape[2] == n, bool(causal), bool(masked), torch.get_num_threads(),
        int(window) if window is not None and window < min(n, keys) else 0,
    )  # fmt: skip


def forced() -> str:
    """``$RETMASK_CPU_ATTN_BWD``: "auto" (measure), "kernel", "native" or "fp32"; ValueError for anything
    else."""
    return forced_choice(CHOICE_ENV, CHOICES)


def _describe_machine() -> dict[str, str]:
    """What the decisions are valid for: the CPU, the torch version (whose SDPA is measured) and whether
    this build of the extension has the C++ backward (a decision made without it is not one with it)."""
    return {**cpu_identity(), "torch": torch.__version__, "kernel_backward": str(cpu_backward.available())}


_store = DecisionStore(
    DecisionCache(
        CACHE_FILE, _FORMAT, valid=lambda d: d.get("choice") in CHOICES[1:],
        what="the attention backward cache",
    ),
    _describe_machine,
)  # fmt: skip
_chosen: dict[BackwardCase, str] = {}


def decisions() -> dict[str, dict[str, Any]]:
    """The decisions this process used, by case name: ``{"choice", "times_s", "calls"}`` (median seconds
    per candidate on the proxy call)."""
    return _store.decisions()


def clear_memory() -> None:
    """Forget the decisions held in memory (the disk cache stays); for tests and benchmarks."""
    _store.clear_memory()
    _chosen.clear()


Runner = Callable[[str, dict[str, Any]], Any]  # (choice, proxy call) -> gradients


def proxy_call(case: BackwardCase) -> dict[str, Any]:
    """Seeded random q, k, v, output gradient (and a key padding mask with the last row's last quarter
    padded, where the case is masked) of the case's shape."""
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, case.dtype)
    m = case.keys if case.square else min(case.keys, KEYS_BUCKET)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    mask = None
    if case.masked:
        mask = torch.ones(case.batch, case.keys, dtype=torch.bool)
        mask[-1, case.keys - case.keys // 4 :] = False
    return {
        "grad_out": randn(case.batch, case.q_heads, m, case.head_dim),
        "q": randn(case.batch, case.q_heads, m, case.head_dim),
        "k": randn(case.batch, case.kv_heads, case.keys, case.head_dim),
        "v": randn(case.batch, case.kv_heads, case.keys, case.head_dim),
        "causal": case.causal, "key_padding_mask": mask, "sm_scale": case.head_dim**-0.5,
        "window": case.window or None,
    }  # fmt: skip


def candidates(case: BackwardCase, kernel: bool) -> list[str]:
    """What is measured for ``case``: "kernel" if the C++ backward applies (``kernel``), "native", and
    "fp32" for half-precision cases below ``MAX_KEYS`` keys without a window."""
    names = ["kernel"] if kernel else []
    names.append("native")
    if case.dtype in ("bfloat16", "float16") and case.keys < MAX_KEYS and not case.window:
        names.append("fp32")
    return names


def measure(case: BackwardCase, run: Runner, names: list[str], *, min_calls: int = 3, max_calls: int = 9,
            budget_s: float = 0.15) -> dict[str, Any]:  # fmt: skip
    """Time ``names`` on the proxy of ``case``, interleaved; the decision dict."""
    call = proxy_call(case)
    median, n = interleaved_medians(
        lambda name: run(name, call), names, min_calls=min_calls, max_calls=max_calls, budget_s=budget_s
    )
    sdpa = "fp32" if "fp32" in median and median["fp32"] <= FP32_MAX_RATIO * median["native"] else "native"
    choice = "kernel" if "kernel" in median and median["kernel"] <= min(median.values()) else sdpa
    return {"choice": choice, "times_s": median, "calls": n}


def choice_for(case: BackwardCase, run: Runner, *, kernel: bool) -> str:
    """ "kernel", "native" or "fp32" for a call of ``case`` (``kernel``: whether the C++ backward applies to
    it): forced by ``$RETMASK_CPU_ATTN_BWD``, else the (memoised, disk-cached) measurement with ``run``."""
    choice = forced()
    if choice == "auto":
        names = candidates(case, kernel)
        if len(names) == 1:
            return names[0]
        choice = _chosen.get(case)
        if choice is None:

            def measure_now() -> dict[str, Any]:
                decision = measure(case, run, names)
                log.info("CPU attention backward [%s]: %s (median s on a proxy call: %s)",
                         case.name(), decision["choice"], decision["times_s"])  # fmt: skip
                return decision

            choice = _chosen[case] = _store.get(case.name(), measure_now)["choice"]
    if choice == "kernel" and not kernel:
        return "native"
    if choice == "fp32" and (case.dtype not in ("bfloat16", "float16") or case.window):
        return "native"
    return choice
