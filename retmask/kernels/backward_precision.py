"""The precision of a bf16 / fp16 attention backward on the CPU: in the inputs' dtype, or in fp32.

Why. Backends without a backward of their own (the CPU kernel) get their gradients by recomputing the
attention through PyTorch SDPA and differentiating that (``ops.recompute_grads``). On a 2-core AMD Zen 5
EPYC, SDPA's CPU flash backward in bf16 took 1.5-2x the time of the same backward in fp32 on short
sequences (10.9 against 7.1 ms at batch 4, 9 / 3 heads, 163 keys: a DPO batch of SmolLM2), and 1.1-1.4x
less from 256 keys on. Converting q, k, v and the output gradient to fp32 and the gradients back costs a
few copies of [B, H, N, D]; the fp32 backward is also the more accurate one (its products and softmax
are not rounded to bf16). Which one is faster is a property of the machine and the shape, so it is
measured once per case on a seeded proxy call, both interleaved, and cached like the other CPU
decisions (``decision_cache``):

* a :class:`BackwardCase` is (dtype, batch up to ``MAX_PROXY_BATCH``, query heads, kv heads, head dim,
  keys, square or not, causal, masked, threads). Keys are exact below ``EXACT_KEYS`` (SDPA's bf16 time
  is not monotone in them: on that EPYC 192 keys took 10.6 ms and 163 keys 11.9 ms, a multiple of 64
  being fast) and rounded up to ``KEYS_BUCKET`` from there, so that a training run with many padded
  lengths measures a bounded number of cases (each once per machine, ~0.1-0.5 s);
* fp32 is used at <= ``FP32_MAX_RATIO`` of the native time; from ``MAX_KEYS`` keys on the native
  backward is kept without measuring (fp32 copies double the memory there, and it lost on every shape
  measured).

``RETMASK_CPU_ATTN_BWD=native|fp32`` forces a choice (``auto``, the default, measures); the test suite
pins ``native``. Only eager CPU calls in bf16 / fp16 are concerned: others, and ``torch.compile``
tracing, keep the inputs' dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .cpuinfo import cpu_identity
from .decision_cache import DecisionCache, DecisionStore, forced_choice, interleaved_medians

PRECISION_ENV = "RETMASK_CPU_ATTN_BWD"
PRECISION_CHOICES = ("auto", "native", "fp32")
FP32_MAX_RATIO = 0.9
KEYS_BUCKET = 64
EXACT_KEYS = 512
MAX_KEYS = 2048
MAX_PROXY_BATCH = 4
CACHE_FILE = "cpu_attention_backward.json"
_FORMAT = 1

log = logging.getLogger("retmask.kernels")


class BackwardCase(NamedTuple):
    """What decides the precision of a half-precision CPU attention backward (see the module docstring)."""

    dtype: str
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    keys: int  # exact below EXACT_KEYS, else rounded up to KEYS_BUCKET
    square: bool  # as many queries as keys (training), else queries = min(keys, KEYS_BUCKET)
    causal: bool
    masked: bool
    threads: int

    def name(self) -> str:
        return (
            f"{self.dtype} B{self.batch} H{self.q_heads}/{self.kv_heads} D{self.head_dim} N{self.keys} "
            f"{'square' if self.square else 'rect'} causal={self.causal} masked={self.masked} "
            f"threads={self.threads}"
        )


def case_of(q: torch.Tensor, k: torch.Tensor, causal: bool, masked: bool) -> BackwardCase:
    """The case of a call with q: [B, Hq, M, D], k: [B, Hkv, N, D]."""
    n = k.shape[2]
    keys = n if n < EXACT_KEYS else -(-n // KEYS_BUCKET) * KEYS_BUCKET
    return BackwardCase(
        str(q.dtype).removeprefix("torch."), min(q.shape[0], MAX_PROXY_BATCH), q.shape[1], k.shape[1], q.shape[3],
        keys, q.shape[2] == n, bool(causal), bool(masked), torch.get_num_threads(),
    )  # fmt: skip


def forced_precision() -> str:
    """``$RETMASK_CPU_ATTN_BWD``: "auto" (measure), "native" or "fp32"; ValueError for anything else."""
    return forced_choice(PRECISION_ENV, PRECISION_CHOICES)


def _describe_machine() -> dict[str, str]:
    """What the decisions are valid for: the CPU and the torch version (whose SDPA is measured)."""
    return {**cpu_identity(), "torch": torch.__version__}


_store = DecisionStore(
    DecisionCache(
        CACHE_FILE, _FORMAT, valid=lambda d: d.get("precision") in PRECISION_CHOICES[1:],
        what="the attention backward precision cache",
    ),
    _describe_machine,
)  # fmt: skip
_chosen: dict[BackwardCase, str] = {}


def decisions() -> dict[str, dict[str, Any]]:
    """The decisions this process used, by case name: ``{"precision", "times_s", "ratio", "calls"}``
    (ratio: fp32's median time over the native one's)."""
    return _store.decisions()


def clear_memory() -> None:
    """Forget the decisions held in memory (the disk cache stays); for tests and benchmarks."""
    _store.clear_memory()
    _chosen.clear()


Runner = Callable[[str, dict[str, Any]], Any]  # (precision, proxy call) -> gradients


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
    }  # fmt: skip


def measure(case: BackwardCase, run: Runner, *, min_calls: int = 3, max_calls: int = 9,
            budget_s: float = 0.15) -> dict[str, Any]:  # fmt: skip
    """Time both precisions on the proxy of ``case``, interleaved; the decision dict."""
    call = proxy_call(case)
    median, n = interleaved_medians(
        lambda precision: run(precision, call), ["native", "fp32"], min_calls=min_calls, max_calls=max_calls,
        budget_s=budget_s,
    )  # fmt: skip
    ratio = median["fp32"] / median["native"] if median["native"] > 0 else float("inf")
    return {
        "precision": "fp32" if ratio <= FP32_MAX_RATIO else "native",
        "times_s": median, "ratio": round(ratio, 4), "calls": n,
    }  # fmt: skip


def precision_for(case: BackwardCase, run: Runner) -> str:
    """ "native" or "fp32" for a call of ``case``: forced by ``$RETMASK_CPU_ATTN_BWD``, "native" from
    ``MAX_KEYS`` keys on, else the (memoised, disk-cached) measurement with ``run``."""
    forced = forced_precision()
    if forced != "auto":
        return forced
    if case.keys >= MAX_KEYS:
        return "native"
    precision = _chosen.get(case)
    if precision is None:

        def measure_now() -> dict[str, Any]:
            decision = measure(case, run)
            log.info("CPU attention backward [%s]: %s (fp32 / native on a proxy call: %s)",
                     case.name(), decision["precision"], decision["ratio"])  # fmt: skip
            return decision

        precision = _chosen[case] = _store.get(case.name(), measure_now)["precision"]
    return precision
