"""Multi-process detection (``torchrun --nproc_per_node N -m retmask detect ...``, gloo on CPUs).

Each process runs a contiguous block of the prefix-ordered tests (neighbours share prefixes, so blocks
keep the KV reuse); results are gathered and rank 0 writes the outputs. A test's result does not depend on
which tests ran before it in the same process (chunk-aligned prefix reuse, see ``FastDetector``), so the
merged result equals the single-process one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from retmask.niah import NiahTest


def dist_context() -> tuple[int, int]:
    """(rank, world size); initialises a gloo process group when launched by torchrun/accelerate."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    return dist.get_rank(), dist.get_world_size()


def shard(tests: Sequence[NiahTest], rank: int, world: int) -> list[NiahTest]:
    """Contiguous block ``rank`` of ``world`` blocks with about equal total prompt length."""
    if world <= 1:
        return list(tests)
    total = sum(len(t.prompt_ids) for t in tests)
    lo, hi = total * rank / world, total * (rank + 1) / world
    out, acc = [], 0
    for t in tests:
        mid = acc + len(t.prompt_ids) / 2  # a test belongs to the block holding its midpoint
        if lo <= mid < hi:
            out.append(t)
        acc += len(t.prompt_ids)
    return out


def gather_results(done: dict[int, dict], world: int) -> dict[int, dict]:
    """Union of every process's results (all processes get it)."""
    if world <= 1:
        return done
    import torch.distributed as dist

    parts: list = [None] * world
    dist.all_gather_object(parts, done)
    merged: dict[int, dict] = {}
    for p in parts:
        merged.update(p)
    return merged
