"""Multi-process detection: torchrun with 2 CPU processes (gloo) merges into the single-process result."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from retmask.detect import run_detect
from retmask.detect.shard import shard
from retmask.niah import NiahTest

from .test_run import GRID, _cfg, _needles


def test_shards_partition_in_order():
    tests = [
        NiahTest(i, 0, 0, 0, 0, np.zeros(n, np.int64), (0, 1), [1])
        for i, n in enumerate([5, 100, 7, 30, 30, 1])
    ]
    for world in (1, 2, 3, 7):
        parts = [shard(tests, r, world) for r in range(world)]
        assert [t.index for p in parts for t in p] == list(range(6))


@pytest.mark.embedded
def test_torchrun_two_processes_equals_single_process(tmp_path, embedded):
    model, tok = embedded
    needles = _needles(tmp_path)
    single = run_detect(
        _cfg(needles),
        tmp_path / "one" / "s.json",
        model=model,
        tokenizer=tok,
        progress_bar=False,
        log=lambda *a, **k: None,
    )
    out = tmp_path / "two" / "s.json"
    torchrun = shutil.which("torchrun") or f"{sys.executable} -m torch.distributed.run"
    cmd = [*torchrun.split(), "--nproc_per_node", "2", "--master_port", "29533", "-m", "retmask", "detect"]
    cmd += ["--needles", str(needles), *GRID, "--chunk", "128", "--out", str(out), "--no-progress"]
    # Same threads per process as the single-process run, so every matmul has the same shape and split.
    env = os.environ | {"OMP_NUM_THREADS": str(__import__("torch").get_num_threads())}
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=600)
    assert json.loads(out.read_text()) == single.scores
    record = json.loads(out.with_name("s.run.json").read_text())
    assert record["processes"] == 2 and record["tests_run"] == 8
    assert sorted(p.name for p in out.parent.glob("s.json.progress*.json")) == [
        "s.json.progress.rank0.json",
        "s.json.progress.rank1.json",
    ]
