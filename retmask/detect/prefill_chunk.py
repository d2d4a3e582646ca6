"""The default prefill chunk of detection and NIAH evaluation, by device.

Prompts are prefilled into the KV cache in chunks of ``chunk`` tokens, aligned to multiples of ``chunk``,
and a test reuses the cached chunks it shares with the previous test's prompt. The chunk trades two
costs:

* smaller chunks recompute less: only the chunk in which two prompts diverge is computed again;
* larger chunks make fewer forward passes, and every pass has a fixed cost: on a CPU it streams all the
  weights once (small row counts run the linear layers below their large-call speed); on a GPU it is the
  host's launch work for every layer, which at a few thousand tokens of a small model outweighs the
  arithmetic.

Measured on the embedded SmolLM2-135M-Instruct (30 NIAH tests of 1K-5K tokens, fast side of
``bench/bench_detect.py``, pages in bench/RESULTS.md): on 2-core CPUs chunk 256 is fastest (64-512 tried;
128 and 384 within a few percent); on a GPU the fast side's time falls with the chunk up to 4096 (0.64x
of chunk 256's on a Hopper GPU, though 2.5x the tokens are computed). The chunk is a speed
setting: for any chunk the fast path's answers and copy counts equal the step-by-step oracle's (tested
with 16, 64 and 4096 tokens); in bf16 a chunk's call shapes can move KV values at rounding level.
"""

from __future__ import annotations

import numbers

import torch

CPU_PREFILL_CHUNK = 256
ACCELERATOR_PREFILL_CHUNK = 4096


def default_prefill_chunk(device: torch.device | str) -> int:
    """The prefill chunk (tokens) for a model on ``device``: 256 on a CPU, 4096 on a GPU or any other
    accelerator (where each forward pass costs host time whatever its length)."""
    return CPU_PREFILL_CHUNK if torch.device(device).type == "cpu" else ACCELERATOR_PREFILL_CHUNK


def resolve_prefill_chunk(chunk: int | None, device: torch.device | str) -> int:
    """``chunk`` itself (an integer >= 1), or the device's default when it is None."""
    if chunk is None:
        return default_prefill_chunk(device)
    if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1 or None (the device's default), got {chunk!r}")
    return int(chunk)
