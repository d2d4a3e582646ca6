"""Shared host-side helpers of the Triton kernels: tile configs, active-pair lists, output allocation.

Nothing here launches a kernel. The kernels themselves live in ``triton.fwd`` (prefill forward),
``triton.decode`` (split-key forward of few-row calls) and ``triton.bwd`` (backward).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
from triton.runtime.errors import OutOfResources

LOG2E = 1.4426950408889634  # kernels work in base 2: exp(x) = exp2(x * log2(e))
LN2 = 0.6931471805599453

# Test aids (module attributes, set by the tests, not by users). POISON_OUTPUTS: every output buffer starts
# filled with a poison value (NaN for floats, POISON_INDEX for argmax) instead of uninitialised memory, so
# an element a kernel forgot to write is caught by comparison with the oracle instead of passing by luck.
# FORCE_SYNC_FREE: the sync-free grid everywhere (see ``sync_free``), so the interpreter covers it.
POISON_OUTPUTS = False
FORCE_SYNC_FREE = False
POISON_INDEX = -12345


def interpreting() -> bool:
    """True when the kernels run in the Triton interpreter (CPU tensors, tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` for ``tl.dot``: IEEE fp32 for fp32 inputs (TF32 drops 13 mantissa bits and
    flips near-tie argmaxes), the native tensor-core path otherwise (ignored for fp16/bf16)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch parameters of one kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Tile tables per head dim (the padded BLOCK_D), as flash-attention keeps them per architecture: 2-byte
# inputs (fp16 / bf16), and _FP32 tables for fp32 inputs, whose IEEE tl.dot runs on the CUDA cores and needs
# far more registers. The entries for D = 64, 128 and 256 are the fastest of 8-12 candidates each on a
# Hopper GPU (bf16 and fp32, causal, 8K keys, the SmolLM2 / Llama-3.1-8B / Gemma-3 head layouts;
# ``bench/tune_triton.py``, pages in bench/RESULTS.md); where the fastest spilled much, a spill-free one
# was kept. D = 16 / 32 take D = 64's entry. Windows, soft-capping and sinks take the same tiles: compiled
# as a launch specialises them, the 2-byte forward tiles hold them without spills for sm_90, and the
# backward's at most a few hundred bytes, as its plain D = 128 entry does. Register allocation differs
# between Triton versions: ``python -m retmask.kernels.triton.aot`` shows a table's spills under the
# installed one.
_FWD_CONFIGS: dict[int, TileConfig] = {
    16: TileConfig(64, 64, 4, 3),
    32: TileConfig(64, 64, 4, 3),
    64: TileConfig(64, 64, 4, 3),
    128: TileConfig(128, 64, 8, 3),
    256: TileConfig(64, 32, 4, 3),
}
_FWD_CONFIGS_FP32: dict[int, TileConfig] = {
    16: TileConfig(64, 32, 8, 2),
    32: TileConfig(64, 32, 8, 2),
    64: TileConfig(64, 32, 8, 2),
    128: TileConfig(64, 32, 8, 2),
    256: TileConfig(16, 16, 4, 1),
}
# The backward holds k, v, dk, dv (dK/dV kernel) or q, do, dq (dQ kernel) tiles at once: smaller tiles.
_BWD_CONFIGS: dict[int, TileConfig] = {
    16: TileConfig(64, 64, 4, 2),
    32: TileConfig(64, 64, 4, 2),
    64: TileConfig(64, 64, 4, 2),
    128: TileConfig(64, 64, 4, 2),
    256: TileConfig(32, 32, 4, 1),
}
# fp32 backward: the dK/dV kernel spills about 0.5 KB per thread at D = 64 and 1 KB at D = 128 (7.9 KB with
# soft-capping, window and sinks) to local memory (sm_90, Triton 3.9), which Hopper's caches absorb; a GPU with smaller L1 / L2 may prefer the
# spill-free 32 x 32 / 8 warps.
_BWD_CONFIGS_FP32: dict[int, TileConfig] = {
    16: TileConfig(32, 32, 4, 2),
    32: TileConfig(32, 32, 4, 2),
    64: TileConfig(32, 32, 4, 2),
    128: TileConfig(32, 32, 4, 1),
    256: TileConfig(16, 32, 8, 1),
}
# Decode and other few-row calls: one program per (KV head, key split, row block) holds up to block_m of
# the group's (query row, head) pairs as a [BLOCK_G, D] tile (BLOCK_G = M * G padded to >= 16, at most
# block_m; derived from the shapes) and walks keys in BLOCK_N chunks. Memory-bound at M = 1:
# BLOCK_N * BLOCK_D near 4-8K elements keeps loads in flight per program.
_DECODE_CONFIGS: dict[int, TileConfig] = {
    16: TileConfig(64, 128, 4, 2),
    32: TileConfig(64, 128, 4, 2),
    64: TileConfig(64, 64, 4, 2),
    128: TileConfig(64, 64, 8, 2),
    256: TileConfig(32, 32, 8, 2),
}
# fp32 tiles of 64 rows spill 0.8-6.6 KB per thread (sm_90, Triton 3.9): 32 rows at most.
_DECODE_CONFIGS_FP32: dict[int, TileConfig] = {
    16: TileConfig(32, 128, 4, 2),
    32: TileConfig(32, 128, 4, 2),
    64: TileConfig(32, 64, 4, 2),
    128: TileConfig(32, 64, 8, 2),
}
# In the interpreter small tiles make tiny test shapes span several blocks (ragged edges, causal
# diagonal, multi-block online softmax) while keeping the number of simulated programs low.
_INTERPRET_CONFIG = TileConfig(32, 16, 1, 1)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host-side ints. Plain Python on purpose: ``triton.cdiv`` is a constexpr function
    whose wrapper costs microseconds per call, and a decode step makes several (launch overhead is most
    of a decode call's time)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for n <= 1), for host-side ints (see ``cdiv``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def block_d(head_dim: int) -> int:
    """Head dim padded to a power of two (>= 16, the smallest ``tl.dot`` operand); extra lanes masked."""
    return max(16, next_power_of_2(head_dim))


def _lookup(
    table: dict[int, TileConfig], fp32_table: dict[int, TileConfig], head_dim: int, dtype: torch.dtype
) -> TileConfig:
    if interpreting():
        return _INTERPRET_CONFIG
    bd = block_d(head_dim)
    if dtype == torch.float32 and bd in fp32_table:
        return fp32_table[bd]
    return table[bd]


def fwd_config(head_dim: int, dtype: torch.dtype) -> TileConfig:
    return _lookup(_FWD_CONFIGS, _FWD_CONFIGS_FP32, head_dim, dtype)


def bwd_config(head_dim: int, dtype: torch.dtype) -> TileConfig:
    return _lookup(_BWD_CONFIGS, _BWD_CONFIGS_FP32, head_dim, dtype)


def decode_config(head_dim: int, dtype: torch.dtype) -> TileConfig:
    return _lookup(_DECODE_CONFIGS, _DECODE_CONFIGS_FP32, head_dim, dtype)


def with_blocks(cfg: TileConfig, block_m: int | None, block_n: int | None) -> TileConfig:
    """``cfg`` with BLOCK_M / BLOCK_N overridden where given (the launchers' test hooks)."""
    if block_m is None and block_n is None:  # the usual call: skip dataclasses.replace (microseconds)
        return cfg
    return replace(cfg, block_m=block_m or cfg.block_m, block_n=block_n or cfg.block_n)


def shrunk(cfg: TileConfig) -> TileConfig | None:
    """The next smaller config to try where ``cfg`` needs more shared memory than the GPU has: fewer
    pipeline stages first (same tile, same speed class), then half the key block, then half the query
    block, never below 16 (the smallest ``tl.dot`` operand); None when nothing smaller is left."""
    if cfg.num_stages > 1:
        return replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_n > 16:
        return replace(cfg, block_n=cfg.block_n // 2)
    if cfg.block_m > 16:
        return replace(cfg, block_m=cfg.block_m // 2)
    return None


_log = logging.getLogger(__name__)
_FITTED: dict[
    tuple, TileConfig
] = {}  # ((kernel family, D, dtype, device, ...), table config) -> config that ran
T = TypeVar("T")


def launch_fitting(key: tuple, cfg: TileConfig, launch: Callable[[TileConfig], T]) -> T:
    """Run ``launch(cfg)``, shrinking ``cfg`` until the GPU can run it.

    The tile tables were measured on Hopper (227 KB of shared memory per block); GPUs with less (about
    99 KB on consumer Ampere / Ada, 163 KB on the A100, 64 KB on Turing) refuse some of their tiles with
    Triton's ``OutOfResources`` at launch. Then the next smaller config (``shrunk``) is tried, and the one
    that ran is remembered for (``key``, ``cfg``), so later calls go straight to it; ``key`` must hold
    everything else the kernel's shared memory depends on. Other errors pass through."""
    start = cfg
    cfg = _FITTED.get((key, start), start)
    while True:
        try:
            result = launch(cfg)
        except OutOfResources as err:
            smaller = shrunk(cfg)
            if smaller is None:
                raise
            _log.info(
                "retmask Triton %s: %s does not fit this GPU (%s); trying %s", key[0], cfg, err, smaller
            )
            cfg = smaller
            continue
        _FITTED[(key, start)] = cfg
        return result


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a nominal 4 in the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def sync_free(device: torch.device | None = None) -> bool:
    """Grid mode for head skipping: sync-free while a CUDA graph is being captured on ``device``'s
    current stream, or everywhere with ``FORCE_SYNC_FREE`` (tests); else exact.

    exact: the grid has one program per *enabled* pair, read from a pair list; sizing it needs the
    enabled count on the host, i.e. one device->host sync per call, and the disabled heads' fixed outputs
    are written with torch ops. sync-free: the grid has one program per pair in natural order and each
    program reads its pair's disabled flag (the mask itself): a disabled pair's program runs empty key
    loops, so its epilogue writes exactly the fixed outputs. No host sync, which graph capture requires
    (a sync during capture is an error), and no extra kernel to build a pair list; the extra programs do
    no math.
    """
    if FORCE_SYNC_FREE:
        return True
    return device is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class PairList:
    """The (batch, head) pairs one grid axis visits.

    pairs: int32 [grid] flat indices ``b * cols + h`` of the enabled pairs, in order (exact grid; None:
    program i visits pair i); disabled: bool [grid], True where pair i is disabled (sync-free grid: the
    kernels read it; None: nothing to check); grid: programs on the axis; host_fill: the disabled pairs
    get no program, so their fixed outputs must be written on the host (``fill_skipped``).
    """

    pairs: torch.Tensor | None
    disabled: torch.Tensor | None
    grid: int
    host_fill: bool


def active_pairs(
    skip: torch.Tensor | None, rows: int, cols: int, *, always_sync_free: bool = False
) -> PairList:
    """Pair list for ``skip``: bool [rows, cols] (True = disabled) or None (nothing disabled).

    always_sync_free: the sync-free grid whatever ``sync_free()`` says; for launches whose disabled
    programs cost nothing next to a host sync (decode: a handful of programs, host-bound on a GPU).
    """
    if skip is None:
        return PairList(None, None, rows * cols, host_fill=False)
    flat = skip.reshape(-1)
    if always_sync_free or sync_free(skip.device):
        return PairList(None, flat.contiguous(), rows * cols, host_fill=False)
    pairs = (~flat).nonzero().flatten().to(torch.int32)  # host sync: the count sizes the grid
    return PairList(pairs, None, int(pairs.numel()), host_fill=True)


def first_valid_keys(key_padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """int32 [B]: index of each batch row's first valid key (0 if it has none), or None without a mask.

    Kernels start their key loops at the block holding it: with left padding the blocks before it hold
    only padding (skipping them is exact for any mask), and query rows inside the padding do no work.
    """
    if key_padding_mask is None:
        return None
    return key_padding_mask.to(torch.uint8).argmax(dim=1).to(torch.int32)  # argmax: first maximal index


def effective_window(window: int | None, kv_len: int) -> int | None:
    """The sliding window the kernels must apply: None when it cannot exclude a key (window >= N: every
    row sits at a position p <= N - 1, so p - window < 0), which compiles the window masks out."""
    return None if window is None or window >= kv_len else int(window)


def effective_pattern(
    window: int | None, sink_tokens: int | None, kv_len: int
) -> tuple[int | None, int | None]:
    """(window, sink_tokens) as the kernels must apply them: ``effective_window``, and no sink tokens
    without a window or where they reach every row's window start (sink_tokens + window >= N: row
    p <= N - 1 has p - window < sink_tokens, so its window and its sink tokens cover all of [0, p]; plain
    causal attention, which compiles both masks out)."""
    window = effective_window(window, kv_len)
    if window is None or sink_tokens is None:
        return window, None
    if sink_tokens + window >= kv_len:
        return None, None
    return window, int(sink_tokens)


def fp32_sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """Sink logits as the kernels read them: fp32 [Hq], contiguous, outside autograd."""
    return None if sinks is None else sinks.detach().to(torch.float32).contiguous()


def poisoning() -> bool:
    return POISON_OUTPUTS


def new_float(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised float buffer (NaN-filled when poisoning)."""
    if poisoning():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def new_index(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Uninitialised int64 buffer (POISON_INDEX-filled when poisoning)."""
    if poisoning():
        return torch.full(shape, POISON_INDEX, dtype=torch.int64, device=device)
    return torch.empty(shape, dtype=torch.int64, device=device)


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s GPU the current one (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def fill_skipped(
    skip: torch.Tensor | None,
    out: torch.Tensor,
    argmax: torch.Tensor | None,
    lse: torch.Tensor | None,
) -> None:
    """Write the fixed results of disabled heads when no program visits them (exact grid mode): out 0,
    argmax -1, lse +inf (+inf makes exp(s - lse) = 0: a backward that read it gives zero gradients).

    skip: bool [B, Hq]; out: [B, Hq, M, D]; argmax: [B, Hq, T]; lse: [B, Hq, M]. ``masked_fill_`` with
    the mask broadcast over the rows, not ``out[skip] = 0``: assigning through a boolean index turns the
    mask into indices first, a device-to-host sync on a GPU for each tensor.
    """
    if skip is None:
        return
    out.masked_fill_(skip[:, :, None, None], 0)
    if argmax is not None:
        argmax.masked_fill_(skip[:, :, None], -1)
    if lse is not None:
        lse.masked_fill_(skip[:, :, None], float("inf"))
