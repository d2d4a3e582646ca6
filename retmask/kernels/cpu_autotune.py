"""Which CPU path runs a call, chosen per *case* by measurement and cached on disk (a small autotuner).

The CPU backend has two paths with the same contract:

  "cpp"      the fused C++ kernel: online softmax carrying the argmax, skipped heads cost nothing,
             memory linear in N; bf16 / fp16 are converted to fp32 and multiplied with FMAs.
  "blocked"  torch's SDPA for the output plus a key-blocked fp32 argmax scan of the wanted rows
             (``cpu_blocked``); SDPA runs its products through oneDNN, which uses AMX tiles for bf16
             where the CPU has them.

Which one is faster depends on the CPU and the dtype, not only on the shapes: on AVX2 / AVX-512 CPUs
without native bf16 the fused kernel wins every measured case, on a CPU with AMX SDPA's bf16 products
run several times faster than FMAs. So the choice is measured on the machine itself, once per case:

* A :class:`Case` holds what decides the winner: dtype, head dim, query heads per KV head, causal,
  decode / verify / chunk / prefill, how many rows want an argmax, padding, skipped heads, window /
  softcap / sinks, short or long keys, threads. Batch size, head count and the exact lengths do not
  enter: the first call of a case times both paths on a small *proxy* (one KV group, at most
  ``PROXY_LONG_KEYS`` keys, seeded random inputs), interleaved, median of at least 3 calls each.
* "blocked" is chosen only if it takes at most ``BLOCKED_MAX_RATIO`` of the fused kernel's time: on a
  near tie the fused kernel stays, as it saves the work of skipped heads and never builds an [M, N]
  mask, and its argmax comes from the same logits as its output.
* "blocked" is never a candidate where it would cost memory that grows faster than N: an argmax of more
  than ``BLOCKED_MAX_ARGMAX_ROWS`` rows (its scan holds [g * rows, 2048] logits) or an explicit SDPA mask
  (padding, or a chunk against a cache) of more than ``BLOCKED_MAX_MASK`` elements.
* Decisions live in memory and in ``<cache>/cpu_paths.json`` (``retmask.cache_dir.cache_root``) under a
  key of the machine: CPU model and feature flags, torch version, kernel build and the compiled
  extension's bytes (so a rebuilt kernel is measured again). Deleting the file is safe.

``RETMASK_CPU_PATH=cpp|blocked`` forces a path for every call (``auto``, the default, measures).
:func:`decisions` lists the decisions this process used, for run records and benchmark pages.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .cpuinfo import cpu_flags, cpu_model

PATH_ENV = "RETMASK_CPU_PATH"
PATH_CHOICES = ("auto", "cpp", "blocked")
BLOCKED_MAX_RATIO = 0.85  # "blocked" must take <= this share of the fused kernel's time to be chosen
BLOCKED_MAX_ARGMAX_ROWS = 256
BLOCKED_MAX_MASK = 1 << 26  # elements of an explicit [M, N] SDPA mask (64 MiB as bool)
SHORT_KEYS = 512  # calls with at most this many keys are "short" and measured at this length
PROXY_LONG_KEYS = 2048  # longer calls are measured at this length
CACHE_FILE = "cpu_paths.json"
_FORMAT = 1

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


def _shape_class(M: int, N: int) -> str:
    if M == 1:
        return "decode"
    if M <= 64:
        return "verify"
    return "chunk" if M < N else "prefill"


def _argmax_class(argmax_rows: int) -> str:
    if argmax_rows == 0:
        return "none"
    return "few" if argmax_rows <= BLOCKED_MAX_ARGMAX_ROWS else "many"


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
    named = (("window", window), ("softcap", softcap), ("sinks", sinks))
    return Case(
        str(q.dtype).removeprefix("torch."),
        D,
        Hq // Hkv,
        bool(causal),
        _shape_class(M, N),
        _argmax_class(argmax_rows),
        key_padding_mask is not None,
        skip_heads is not None,
        "+".join(name for name, value in named if value is not None) or "-",
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
    value = os.environ.get(PATH_ENV, "").strip() or "auto"
    if value not in PATH_CHOICES:
        raise ValueError(
            f"${PATH_ENV} must be one of {list(PATH_CHOICES)}, got {value!r}; unset it to measure"
        )
    return value


# ---- the machine key ---------------------------------------------------------------------------------


def _file_sha256(path: str | None) -> str:
    try:
        with open(path or "", "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return "unknown"


@cache
def machine() -> dict[str, str]:
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


def machine_key() -> str:
    return hashlib.sha256(json.dumps(machine(), sort_keys=True).encode()).hexdigest()[:16]


# ---- the cache ---------------------------------------------------------------------------------------

_lock = threading.Lock()
_decided: dict[str, dict[str, Any]] = {}  # case name -> decision, for this process and machine key
_paths: dict[Case, str] = {}  # case -> path, so a call of a decided case costs a few microseconds


def cache_path() -> Path:
    from retmask.cache_dir import cache_root

    return cache_root() / CACHE_FILE


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # a torn or foreign file: measure again, say so once
        log.warning("ignoring the kernel path cache %s (%s); it will be rewritten", path, exc)
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return {}
    return data


def _stored(case_name: str) -> dict[str, Any] | None:
    entry = _read_cache(cache_path()).get("machines", {}).get(machine_key(), {})
    found = entry.get("cases", {}).get(case_name)
    return found if isinstance(found, dict) and found.get("path") in ("cpp", "blocked") else None


def _store(case_name: str, decision: dict[str, Any]) -> None:
    from retmask.runfiles import atomic_write_json

    path = cache_path()
    data = _read_cache(path) or {"format": _FORMAT, "machines": {}}
    entry = data["machines"].setdefault(machine_key(), {"machine": machine(), "cases": {}})
    entry["cases"][case_name] = decision
    try:
        atomic_write_json(path, data)
    except OSError as exc:  # a read-only home: keep the decision in memory only
        log.warning(
            "could not save the kernel path cache %s (%s); decisions last for this process", path, exc
        )


def decisions() -> dict[str, dict[str, Any]]:
    """The path decisions this process used, by case name: ``{"path", "cpp_s", "blocked_s", "ratio",
    "proxy"}`` (times of one proxy call, median), plus the machine they were measured on."""
    with _lock:
        return {name: dict(d) for name, d in _decided.items()}


def clear_memory() -> None:
    """Forget the decisions held in memory (the disk cache stays); for tests and benchmarks."""
    with _lock:
        _decided.clear()
        _paths.clear()
    machine.cache_clear()


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


def measure(
    case: Case, run: Runner, *, min_calls: int = 3, max_calls: int = 9, budget_s: float = 0.3
) -> dict:
    """Time both paths on the proxy of ``case``, interleaved (cpp, blocked, cpp, ...) after one warm-up
    call each; at least ``min_calls`` each, more (up to ``max_calls``) while under ``budget_s``."""
    call = proxy_call(case)
    times: dict[str, list[float]] = {"cpp": [], "blocked": []}
    for path in times:
        run(path, call)
    start = time.perf_counter()
    while True:
        for path, ts in times.items():
            t0 = time.perf_counter()
            run(path, call)
            ts.append(time.perf_counter() - t0)
        n = len(times["cpp"])
        if n >= max_calls or (n >= min_calls and time.perf_counter() - start > budget_s):
            break
    cpp_s, blocked_s = (sorted(ts)[len(ts) // 2] for ts in times.values())
    ratio = blocked_s / cpp_s if cpp_s > 0 else float("inf")
    M, N = call["q"].shape[2], call["k"].shape[2]
    return {
        "path": "blocked" if ratio <= BLOCKED_MAX_RATIO else "cpp",
        "cpp_s": cpp_s,
        "blocked_s": blocked_s,
        "ratio": round(ratio, 4),
        "calls": n,
        "proxy": f"q [1, {call['q'].shape[1]}, {M}, {case.head_dim}], k/v [1, {call['k'].shape[1]}, {N}, "
        f"{case.head_dim}], argmax rows {call['argmax_rows']}",
        "case": case._asdict(),
    }


def choose(case: Case, run: Runner, *, allowed: bool = True) -> str:
    """The path for a call of ``case``: forced by ``$RETMASK_CPU_PATH``, "cpp" if "blocked" is not
    ``allowed`` for this call's sizes, else the decision measured for the case (memory, disk, or now)."""
    forced = forced_path()
    if forced != "auto":
        return forced
    if not allowed:
        return "cpp"
    name = case.name()
    with _lock:  # one measurement per case, even with several threads calling
        decision = _decided.get(name)
        if decision is None:
            decision = _stored(name)
            if decision is None:
                decision = measure(case, run)
                log.info(
                    "CPU attention path for [%s]: %s (blocked/cpp time %.2f on a proxy call)",
                    name, decision["path"], decision["ratio"],
                )  # fmt: skip
                _store(name, decision)
            _decided[name] = decision
    return decision["path"]


def path_for(
    q: torch.Tensor,
    k: torch.Tensor,
    run: Runner,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    argmax_rows: int,
    **features: Any,
) -> str:
    """The path for one call (``choose`` on its case), memoised on the case: a call of a decided case
    costs a few microseconds. q: [B, Hq, M, D]; k: [B, Hkv, N, D];
    ``features``: window, softcap, sinks (as in ``case_of``)."""
    forced = forced_path()
    if forced != "auto":
        return forced
    if not blocked_allowed(q.shape[2], k.shape[2], argmax_rows, causal, key_padding_mask is not None):
        return "cpp"
    case = case_of(
        q, k, causal=causal, key_padding_mask=key_padding_mask, skip_heads=skip_heads,
        argmax_rows=argmax_rows, **features,
    )  # fmt: skip
    path = _paths.get(case)
    if path is None:
        path = _paths[case] = choose(case, run)
    return path
