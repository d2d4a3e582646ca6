"""Multi-process detection: torchrun and accelerate launch with 2 CPU processes (gloo) merge into the
single-process result."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from retmask.detect.shard import cpu_oversubscription, shard
from retmask.niah import NiahTest

from .small_grid import GRID


def test_shards_partition_in_order():
    tests = [
        NiahTest(i, 0, 0, 0, 0, np.zeros(n, np.int64), (0, 1), [1])
        for i, n in enumerate([5, 100, 7, 30, 30, 1])
    ]
    for world in (1, 2, 3, 7):
        parts = [shard(tests, r, world) for r in range(world)]
        assert [t.index for p in parts for t in p] == list(range(6))


def test_needle_shards_keep_needles_whole_in_order_and_balanced():
    sizes = {0: [50, 50], 1: [300], 2: [40, 40, 40], 3: [10]}  # prompt lengths per needle
    tests, i = [], 0
    for needle, lengths in sizes.items():
        for n in lengths:
            tests.append(NiahTest(i, needle, 0, 0, 0, np.zeros(n, np.int64), (0, 1), [1]))
            i += 1
    tests = tests[::-1]  # any given order is kept within a process
    for world in (1, 2, 3, 5):
        parts = [shard(tests, r, world, by_needle=True) for r in range(world)]
        assert sorted(t.index for p in parts for t in p) == list(range(len(tests)))
        for p in parts:
            assert [t.index for t in p] == [t.index for t in tests if t in p]
        owners = [{r for r, p in enumerate(parts) if any(t.needle_index == n for t in p)} for n in sizes]
        assert all(len(o) == 1 for o in owners)
    two = [shard(tests, r, 2, by_needle=True) for r in range(2)]
    assert {t.needle_index for t in two[0]} == {1} and {t.needle_index for t in two[1]} == {0, 2, 3}


def test_oversubscribed_cpu_processes_are_named_with_the_fix(monkeypatch):
    """More threads over a machine's local processes than it has cores: a warning that says how many
    threads to set; none when they fit, or when idle threads sleep (OMP_WAIT_POLICY=PASSIVE)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_oversubscription(2) is None
    warning = cpu_oversubscription(4)
    assert "2 processes x 4 threads" in warning and "4 cores" in warning and "OMP_NUM_THREADS=2" in warning
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert cpu_oversubscription(4) is None
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert cpu_oversubscription(4) is None  # one process


def _launcher(name: str, threads: int) -> list[str]:
    """Command prefix starting 2 local processes running ``python -m retmask``."""
    if name == "torchrun":
        torchrun = shutil.which("torchrun") or f"{sys.executable} -m torch.distributed.run"
        return [*torchrun.split(), "--nproc_per_node", "2", "--master_port", "29533", "-m", "retmask"]
    # `accelerate launch --cpu --num_processes 2` silently starts ONE process; --multi_gpu starts the
    # processes through torch.distributed.run, which also works without GPUs (gloo).
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", "29534", "--num_cpu_threads_per_process", str(threads), "-m", "retmask",
    ]  # fmt: skip


@pytest.mark.embedded
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_two_processes_equal_single_process(tmp_path, embedded_detection, launcher):
    needles, _, single = embedded_detection
    out = tmp_path / "two" / "s.json"
    threads = __import__("torch").get_num_threads()
    cmd = [
        *_launcher(launcher, threads),
        "detect",
        "--needles",
        str(needles),
        *GRID,
        "--chunk",
        "128",
        "--out",
        str(out),
        "--no-progress",
    ]
    # Same threads per process as the single-process run, so every matmul has the same shape and split.
    # Two such processes oversubscribe the cores; OpenMP's idle threads then sleep instead of spinning
    # (OMP_WAIT_POLICY=PASSIVE: the same numbers, several times faster on 2 cores).
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=600)
    assert json.loads(out.read_text()) == single.scores
    record = json.loads(out.with_name("s.run.json").read_text())
    assert record["processes"] == 2 and record["tests_run"] == 8
    # Each rank kept its own progress file during the run; rank 0 removes them all once the run is complete.
    assert sorted(p.name for p in out.parent.glob("s.json.progress*.json")) == []
