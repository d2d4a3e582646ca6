"""Multi-process detection (``torchrun --nproc_per_node N -m retmask detect ...``, gloo on CPUs).

Each process runs a contiguous block of the prefix-ordered tests (neighbours share prefixes, so blocks
keep the KV reuse) or, when drafts reuse earlier answers to the same needle, whole needles (so each test
sees the same earlier answers as in one process); results are gathered and rank 0 writes the outputs. A
test's result does not depend on which tests ran before it in the same process (chunk-aligned prefix
reuse, see ``FastDetector``), so the merged result equals the single-process one.
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


def cpu_oversubscription(threads: int) -> str | None:
    """A warning when the processes of a multi-process run on this machine want more threads than it has
    cores (``LOCAL_WORLD_SIZE`` processes x ``threads`` each), else None.

    Oversubscribed, OpenMP's threads spin while they wait for each other, and a run is several times
    slower than in one process (see docs/reliability.md). torchrun
    gives each process 1 thread unless OMP_NUM_THREADS is set; sleeping instead of spinning
    (OMP_WAIT_POLICY=PASSIVE) keeps the thread count and the numbers, and removes most of the loss."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local * threads <= cores or os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive":
        return None
    return (
        f"warning: {local} processes x {threads} threads each want more than the {cores} cores of this "
        "machine, which makes OpenMP threads spin waiting for each other (several times slower); set "
        f"OMP_NUM_THREADS={max(1, cores // local)}, or OMP_WAIT_POLICY=PASSIVE to keep {threads} threads"
    )


def shard(tests: Sequence[NiahTest], rank: int, world: int, by_needle: bool = False) -> list[NiahTest]:
    """This process's tests, in the given order: contiguous block ``rank`` of ``world`` blocks with about
    equal total prompt length, or (``by_needle``) the tests of the needles given to ``rank``."""
    if world <= 1:
        return list(tests)
    if by_needle:
        return _shard_needles(tests, rank, world)
    total = sum(len(t.prompt_ids) for t in tests)
    lo, hi = total * rank / world, total * (rank + 1) / world
    out, acc = [], 0
    for t in tests:
        mid = acc + len(t.prompt_ids) / 2  # a test belongs to the block holding its midpoint
        if lo <= mid < hi:
            out.append(t)
        acc += len(t.prompt_ids)
    return out


def _shard_needles(tests: Sequence[NiahTest], rank: int, world: int) -> list[NiahTest]:
    """Whole needles per process: largest total prompt length first, each to the least loaded process
    (ties: lowest needle index, lowest rank), so every process computes the same assignment."""
    load: dict[int, int] = {}
    for t in tests:
        load[t.needle_index] = load.get(t.needle_index, 0) + len(t.prompt_ids)
    ranks = [0] * world
    owner: dict[int, int] = {}
    for needle in sorted(load, key=lambda n: (-load[n], n)):
        target = min(range(world), key=lambda r: (ranks[r], r))
        owner[needle] = target
        ranks[target] += load[needle]
    return [t for t in tests if owner[t.needle_index] == rank]


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
