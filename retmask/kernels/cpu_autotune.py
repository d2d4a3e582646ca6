"""Which CPU path runs a call, chosen per *case* by measurement and cached on disk (a small autotuner).

The CPU backend has four paths with the same contract:

  "cpp"      the fused C++ kernel: online softmax carrying the argmax, skipped heads cost nothing,
             memory linear in N; its block products are FMA micro-kernels (bf16 / fp16 converted to fp32).
  "gemm"     the same kernel with both block products (Q K^T, P V) run by torch's CPU block GEMM
             (``cpu_gemm``: oneDNN, on AMX tiles where the CPU has them, native bf16 dot products or a
             tuned fp32 GEMM elsewhere); softmax, masks and argmax stay the kernel's, in fp32.
  "gemm_fp32" fp16 / bf16 calls only: "gemm" with each block converted to fp32 (exactly) for torch's
             fp32 GEMM, for CPUs whose half-precision GEMM only converts (no AMX / native bf16).
  "bf16dot"  bf16 calls with an even head dim, on CPUs with AVX512-BF16: the fused kernel with both block
             products as bf16 dot products (vdpbf16ps, twice the multiply-adds of an fp32 FMA per
             instruction; P rounded to bf16 before P V, as SDPA does), softmax and argmax in fp32.
  "blocked"  torch's SDPA for the output plus a key-blocked fp32 argmax scan of the wanted rows
             (``cpu_blocked``); SDPA runs its products through oneDNN too.

Which one is faster depends on the CPU and the dtype, not only on the shapes (on the AVX2 EPYC of
docs/kernel_optimisation.md v12 "gemm" wins fp32 prefill and loses bf16; on a CPU with AMX the torch
GEMMs run bf16 several times faster than FMAs). So the choice is measured on the machine itself, once
per case:

* A :class:`Case` holds what decides the winner: dtype, head dim, query heads per KV head, causal,
  decode / verify / chunk / prefill, how many rows want an argmax, padding, skipped heads, window /
  softcap / sinks, short or long keys, threads. Batch size, head count and the exact lengths do not
  enter: the first call of a case times every candidate on a small *proxy* (one KV group, at most
  ``PROXY_LONG_KEYS`` keys, seeded random inputs), interleaved, median of at least 3 calls each.
* Another path replaces "cpp" only if it takes at most ``ALT_MAX_RATIO[path]`` of the fused kernel's
  time (the fastest such one): on a near tie the fused kernel stays, so that a decision does not flip
  between machines of one kind. "blocked" must win clearly (0.85x: it gives up what only the fused
  kernel has, free skipped heads and memory linear in N); the block-GEMM paths are the fused kernel
  with other block products (same memory, same skipping), so 0.92x is enough: above the proxy's
  timing noise, and low enough to take the 0.82-0.87x they gave at the Llama-3.1-8B shape on the AVX2
  EPYC of docs/kernel_optimisation.md v13.
* A candidate must first agree with the fused kernel on the proxy (same argmax wherever the fp32
  logits have a clear maximum, output within the dtype's tolerance), so a branch this project could
  not run on its own machines (AMX packing) is checked on the machine that runs it before it is used;
  one that disagrees is rejected for good on that machine, with a warning.
* The block-GEMM paths and "bf16dot" are not candidates for decode (one query row per head; "bf16dot"
  pads decode tiles to a vector, and at real sizes it was 0.84-1.09x the fused kernel's row-major tiles
  on the Zen 4 EPYC of docs/kernel_optimisation.md v15, no gain worth a near-tie decision): the proxy's keys fit in
  cache, where the GEMM layout's per-block copies of K and V are cheap and it measured 0.85x the fused
  kernel, but real decode calls stream the whole cache, and on the AVX2 EPYC of
  docs/kernel_optimisation.md v14 it was 1.14-1.21x the fused kernel at 8K-32K keys (and 1.17x at the
  Llama-3.1-8B shape with 2K keys).
* "blocked" is never a candidate where it would cost memory that grows faster than N: an argmax of more
  than ``BLOCKED_MAX_ARGMAX_ROWS`` rows (its scan holds [g * rows, 2048] logits) or an explicit SDPA mask
  (padding, or a chunk against a cache) of more than ``BLOCKED_MAX_MASK`` elements; a case decided for
  "blocked" runs such a call on the next fastest path it measured.
* Decisions live in memory and in ``<cache>/cpu_paths.json`` (``retmask.cache_dir.cache_root``) under a
  key of the machine: CPU model and feature flags, torch version, kernel build and the compiled
  extension's bytes (so a rebuilt kernel is measured again). Deleting the file is safe.

``RETMASK_CPU_PATH=cpp|gemm|gemm_fp32|bf16dot|blocked`` forces a path for every call (``auto``, the default, measures).
:func:`decisions` lists the decisions this process used, for run records and benchmark pages.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .cpuinfo import cpu_flags, cpu_model
from .decision_cache import DecisionCache, DecisionStore, forced_choice, interleaved_medians
from .env import setting

PATH_ENV = "RETMASK_CPU_PATH"
PATH_CHOICES = ("auto", "cpp", "gemm", "gemm_fp32", "bf16dot", "blocked")
# Another path must take <= this share of the fused kernel's time to be chosen (see the module doc).
ALT_MAX_RATIO = {"gemm": 0.92, "gemm_fp32": 0.92, "bf16dot": 0.92, "blocked": 0.85}
BLOCKED_MAX_ARGMAX_ROWS = 256
BLOCKED_MAX_MASK = 1 << 26  # elements of an explicit [M, N] SDPA mask (64 MiB as bool)
SHORT_KEYS = 512  # calls with at most this many keys are "short" and measured at this length
PROXY_LONG_KEYS = 2048  # longer calls are measured at this length
CACHE_FILE = "cpu_paths.json"
_FORMAT = 5  # 2: several candidates per case ("gemm"), times by path; 3: "gemm_fp32"; 4: no GEMM for decode;
# 5: "bf16dot"

log = logging.getLogger("retmask.kernels")


class Case(NamedTuple):
    """What decides which CPU path is faster for a call (see the module docstring). A named tuple: built
    and hashed on every call, as the key of the per-process memo."""

    dtype: str  # "float32" | "bfloat16" | "float16"
    head_dim: int
    group: int  # query heads per KV head
    causal: bool
    shape: str  # "decode" (M = 1) | "verify" (M <= 64) | "chunk" (64 < M < N) | "prefill" (M = N)
    argmax: str  # "none" | "few" (<= BLOCKED_MAX_ARGMAX_ROWS rows) | "many"
    padding: bool
    skipped: bool  # some heads skipped
    features: str  # "+"-joined subset of window / softcap / sinks, or "-"
    keys: str  # "short" (N <= SHORT_KEYS) | "long"
    threads: int

    def name(self) -> str:
        """A stable, readable key: ``bfloat16 D64 g3 causal prefill argmax=none ...``."""
        parts = [
            self.dtype, f"D{self.head_dim}", f"g{self.group}", "causal" if self.causal else "full",
            self.shape, f"argmax={self.argmax}", f"pad={int(self.padding)}", f"skip={int(self.skipped)}",
            f"features={self.features}", f"keys={self.keys}", f"threads={self.threads}",
        ]  # fmt: skip
        return " ".join(parts)


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def case_of(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    argmax_rows: int,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> Case:
    """The case of a call. q: [B, Hq, M, D]; k: [B, Hkv, N, D]; skip_heads: bool [B, Hq] or None.

    Padding and skipping count when their tensors are given, whatever they hold: that is what changes
    the blocked path's work (an explicit SDPA mask; the per-row head gather), and it needs no reduction
    over a tensor on every call.
    """
    _, Hq, M, D = q.shape
    _, Hkv, N, _ = k.shape
    # The classes of Case's docstring, as expressions: every distinct function a call enters costs ~5 us
    # in a decode step, where the caches are cold.
    shape = "decode" if M == 1 else "verify" if M <= 64 else "chunk" if M < N else "prefill"
    argmax = "none" if argmax_rows == 0 else "few" if argmax_rows <= BLOCKED_MAX_ARGMAX_ROWS else "many"
    if window is None and softcap is None and sinks is None:
        features = "-"
    else:
        named = (("window", window), ("softcap", softcap), ("sinks", sinks))
        features = "+".join(name for name, value in named if value is not None)
    return Case(
        _DTYPE_NAMES.get(q.dtype) or str(q.dtype).removeprefix("torch."),
        D,
        Hq // Hkv,
        bool(causal),
        shape,
        argmax,
        key_padding_mask is not None,
        skip_heads is not None,
        features,
        "short" if N <= SHORT_KEYS else "long",
        torch.get_num_threads(),
    )  # positional, in the field order of Case: this runs on every call


def blocked_allowed(M: int, N: int, argmax_rows: int, causal: bool, padding: bool) -> bool:
    """Whether the blocked path's memory stays linear enough for this call (see the module docstring)."""
    if argmax_rows > BLOCKED_MAX_ARGMAX_ROWS:
        return False
    builds_mask = padding or (causal and M != N)
    return not builds_mask or M * N <= BLOCKED_MAX_MASK


def forced_path() -> str:
    """``$RETMASK_CPU_PATH`` (default ``auto``); ValueError naming the variable for anything else."""
    return forced_choice(PATH_ENV, PATH_CHOICES)


# ---- the machine key ---------------------------------------------------------------------------------


def _file_sha256(path: str | None) -> str:
    try:
        with open(path or "", "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return "unknown"


def _describe_machine() -> dict[str, str]:
    """What the decisions are valid for: CPU model and feature flags, torch version, the kernel build
    that runs and the bytes of the compiled extension (a rebuilt kernel is measured again)."""
    from . import cpu  # the kernel build; imported here because cpu imports this module

    lib = cpu._library()
    return {
        "cpu": cpu_model(),
        "flags_sha256": hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "kernel_build": cpu.selected_isa() if lib is not None else "not built",
        "extension_sha256": _file_sha256(getattr(lib.module, "__file__", None)) if lib is not None else "-",
    }


# ---- the decisions -----------------------------------------------------------------------------------

_store = DecisionStore(
    DecisionCache(
        CACHE_FILE, _FORMAT, valid=lambda d: d.get("path") in PATH_CHOICES[1:], what="the kernel path cache"
    ),
    _describe_machine,
)
_paths: dict[Case, dict[str, Any]] = {}  # case -> decision: a call of a decided case costs a few microseconds
machine = _store.machine
machine_key = _store.machine_key


def cache_path() -> Path:
    return _store.cache.path()


def decisions() -> dict[str, dict[str, Any]]:
    """The path decisions this process used, by case name: ``{"path", "fallback", "times_s", "ratios",
    "rejected", "calls", "proxy", "case"}``: median time of one proxy call per measured path, each
    other path's time over the fused kernel's, and the candidates that disagreed with it (and why)."""
    return _store.decisions()


def clear_memory() -> None:
    """Forget the decisions held in memory (the disk cache stays); for tests and benchmarks."""
    _store.clear_memory()
    _paths.clear()


# ---- measuring ---------------------------------------------------------------------------------------

Runner = Callable[[str, dict[str, Any]], Any]  # (path, proxy call) -> result of that path


def proxy_call(case: Case) -> dict[str, Any]:
    """Seeded random inputs and settings of the small call that stands for ``case``:
    q [1, g, M, D], k / v [1, 1, N, D] (two KV heads when one head of a group of one is skipped)."""
    N = SHORT_KEYS if case.keys == "short" else PROXY_LONG_KEYS
    M = {"decode": 1, "verify": 16, "chunk": N // 4, "prefill": N}[case.shape]
    rows = {"none": 0, "few": min(64, M), "many": M}[case.argmax]
    hkv = 2 if case.skipped and case.group == 1 else 1
    hq = case.group * hkv
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, hq, M, case.head_dim, generator=gen).to(dtype)
    k = torch.randn(1, hkv, N, case.head_dim, generator=gen).to(dtype)
    v = torch.randn(1, hkv, N, case.head_dim, generator=gen).to(dtype)
    kpm = None
    if case.padding:  # left padding of 1/16 of the keys
        kpm = torch.ones(1, N, dtype=torch.bool)
        kpm[:, : N // 16] = False
    skip = None
    if case.skipped:  # half the heads, at least one, never all
        skip = torch.zeros(1, hq, dtype=torch.bool)
        skip[:, : max(1, hq // 2)] = True
    features = set(case.features.split("+"))
    return {
        "q": q, "k": k, "v": v, "causal": case.causal, "sm_scale": case.head_dim**-0.5,
        "key_padding_mask": kpm, "skip_heads": skip, "argmax_rows": rows,
        "window": N // 4 if "window" in features else None,
        "softcap": 30.0 if "softcap" in features else None,
        "sinks": torch.randn(hq, generator=gen) if "sinks" in features else None,
    }  # fmt: skip


OUT_TOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 3e-2}  # |out - cpp out| on a proxy call
LOGIT_TOL = 1e-3  # a different argmax must point at a key this close to the row's maximum fp32 logit


def disagreement(case: Case, call: dict[str, Any], cpp_result: Any, other_result: Any) -> str | None:
    """Why another path's result on the proxy ``call`` is not the fused kernel's, or None if it agrees:
    NaN rows and -1 argmaxes in the same places, outputs within ``OUT_TOL``, and each differing argmax
    (accumulation-order near-ties) at a key whose fp32 logit is within ``LOGIT_TOL`` of the maximum."""
    from .reference import reference_logits

    out, argmax = cpp_result[0], cpp_result[1]
    other_out, other_argmax = other_result[0], other_result[1]
    if other_out.shape != out.shape or other_out.dtype != out.dtype:
        return f"output {other_out.dtype} {list(other_out.shape)}, expected {out.dtype} {list(out.shape)}"
    nan, other_nan = torch.isnan(out), torch.isnan(other_out)
    if not torch.equal(nan, other_nan):
        return f"NaN in {int((nan != other_nan).sum())} other elements"
    diff = (out.float() - other_out.float()).abs().masked_fill(nan, 0).max().item() if out.numel() else 0.0
    if diff > OUT_TOL[case.dtype]:
        return f"outputs differ by {diff:.3g} (tolerance {OUT_TOL[case.dtype]:g})"
    if argmax is None or torch.equal(argmax, other_argmax):
        return None
    if not torch.equal(argmax == -1, other_argmax == -1):
        return "argmax -1 (no valid key / poisoned row) in other rows"
    rows = argmax.shape[-1]
    logits = reference_logits(
        call["q"][:, :, -rows:].float(), call["k"].float(), causal=call["causal"], sm_scale=call["sm_scale"],
        key_padding_mask=call["key_padding_mask"], window=call["window"], softcap=call["softcap"],
    )[:, :, -rows:]  # fmt: skip
    top = logits.amax(-1)
    picked = logits.gather(-1, other_argmax.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    far = (other_argmax >= 0) & (picked < top - LOGIT_TOL)
    if bool(far.any()):
        return f"argmax of {int(far.sum())} rows at keys more than {LOGIT_TOL:g} below the maximum logit"
    return None


def decide(times: dict[str, float], exclude: tuple[str, ...] = ()) -> str:
    """The path to run: the fastest of those taking at most ``ALT_MAX_RATIO[path]`` of the fused kernel's
    time, else "cpp". times: median seconds per measured path (has "cpp"); ``exclude``: paths not allowed."""
    best = "cpp"
    for path, t in times.items():
        if path in exclude or path == "cpp":
            continue
        if t <= ALT_MAX_RATIO[path] * times["cpp"] and (best == "cpp" or t < times[best]):
            best = path
    return best


def measure(
    case: Case,
    run: Runner,
    paths: tuple[str, ...] = ("cpp", "blocked"),
    *,
    min_calls: int = 3,
    max_calls: int = 9,
    budget_s: float = 0.3,
) -> dict:
    """Check and time ``paths`` (the first is "cpp") on the proxy of ``case``: one warm-up call each,
    whose result each other path must agree with (``disagreement``), then the agreeing ones interleaved
    (cpp, gemm, blocked, cpp, ...), at least ``min_calls`` each, more (up to ``max_calls``) while under
    ``budget_s``."""
    call = proxy_call(case)
    results = {path: run(path, call) for path in paths}
    rejected = {}
    for path in paths[1:]:
        why = disagreement(case, call, results["cpp"], results[path])
        if why is not None:
            rejected[path] = why
            log.warning("CPU attention path %r disagrees with the fused kernel on [%s]: %s; not used",
                        path, case.name(), why)  # fmt: skip
    del results
    median, n = interleaved_medians(
        lambda path: run(path, call), [p for p in paths if p not in rejected], min_calls=min_calls,
        max_calls=max_calls, budget_s=budget_s,
    )  # fmt: skip
    cpp_s = median["cpp"]
    M, N = call["q"].shape[2], call["k"].shape[2]
    return {
        "path": decide(median),
        "fallback": decide(median, exclude=("blocked",)),  # where "blocked" may not run a call
        "times_s": median,
        "ratios": {
            p: round(t / cpp_s, 4) if cpp_s > 0 else float("inf") for p, t in median.items() if p != "cpp"
        },
        "rejected": rejected,
        "calls": n,
        "proxy": f"q [1, {call['q'].shape[1]}, {M}, {case.head_dim}], k/v [1, {call['k'].shape[1]}, {N}, "
        f"{case.head_dim}], argmax rows {call['argmax_rows']}",
        "case": case._asdict(),
    }


def candidates(case: Case, kernel_paths: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The paths measured for ``case``: "cpp", the other layouts of the fused kernel that exist for the
    call (``kernel_paths``: "gemm" / "gemm_fp32" / "bf16dot", see ``cpu.kernel_paths``) unless it is a
    decode step, "blocked" unless the case wants the argmax of many rows (see the module docstring)."""
    kernel = () if case.shape == "decode" else tuple(kernel_paths)
    return ("cpp",) + kernel + (("blocked",) if case.argmax != "many" else ())


def choose(case: Case, run: Runner, paths: tuple[str, ...] = ("cpp", "blocked")) -> dict[str, Any]:
    """The decision for ``case`` among ``paths`` (memory, disk, or measured now), or a plain "cpp"
    decision when ``paths`` offers nothing else. Not for forced paths (see ``path_for``)."""
    if len(paths) < 2:
        return {"path": "cpp", "fallback": "cpp"}
    name = case.name()

    def measure_now() -> dict[str, Any]:
        decision = measure(case, run, paths)
        log.info(
            "CPU attention path for [%s]: %s (time over the fused kernel's on a proxy call: %s)",
            name, decision["path"], decision["ratios"],
        )  # fmt: skip
        return decision

    return _store.get(name, measure_now)


def path_for(
    q: torch.Tensor,
    k: torch.Tensor,
    run: Runner,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    argmax_rows: int,
    kernel_paths: tuple[str, ...] | Callable[[], tuple[str, ...]] = (),
    **features: Any,
) -> str:
    """The path for one call: forced by ``$RETMASK_CPU_PATH``, else the decision for its case
    (``choose`` among ``candidates(case, kernel_paths)``), memoised on the case so that a call of a decided case
    costs a few microseconds; a "blocked" decision gives way to its fallback where this call's sizes
    would make SDPA build too large a mask. q: [B, Hq, M, D]; k: [B, Hkv, N, D]; ``kernel_paths``: the
    other layouts of the fused kernel that exist for this call (``cpu.kernel_paths``), or a function
    giving them, asked only when a case is decided; ``features``: window, softcap, sinks (as in
    ``case_of``)."""
    # $RETMASK_CPU_PATH is validated (forced_path) only when set: unset, this is one dict lookup.
    if setting(PATH_ENV) not in ("", "auto"):
        return forced_path()
    case = case_of(
        q, k, causal=causal, key_padding_mask=key_padding_mask, skip_heads=skip_heads,
        argmax_rows=argmax_rows, **features,
    )  # fmt: skip
    decision = _paths.get(case)
    if decision is None:
        others = kernel_paths() if callable(kernel_paths) else kernel_paths
        decision = _paths[case] = choose(case, run, candidates(case, others))
    path = decision["path"]
    if path == "blocked" and not blocked_allowed(
        q.shape[2], k.shape[2], argmax_rows, causal, key_padding_mask is not None
    ):
        return decision["fallback"]
    return path
