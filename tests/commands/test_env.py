"""``retmask env``: the machine and the path of every kind of call, as text and as JSON."""

from __future__ import annotations

import json

import torch

from retmask.cli import main
from retmask.kernels import paths


def test_env_prints_the_machine_and_every_kind_of_call(capsys, monkeypatch):
    monkeypatch.delenv("RETMASK_CPU_PATH", raising=False)
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert f"torch              {torch.__version__}" in text
    for dtype in ("float32", "bfloat16", "float16"):
        for kind in (*paths.KINDS, "backward"):
            assert f"cpu {dtype} {kind}" in text
    assert "RETMASK_CPU_SPEEDUPS" in text and "cpu speed-ups:" in text


def test_env_json_and_a_bad_setting(capsys, monkeypatch):
    monkeypatch.setenv("RETMASK_CPU_SPEEDUPS", "0")
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cpu_speedups"]["enabled"] is False and data["settings"]["RETMASK_CPU_SPEEDUPS"] == "0"
    assert data["attention"]["cpu float32 backward"]["path"] == "kernel"
    monkeypatch.setenv("RETMASK_CPU_PATH", "gemm")
    assert main(["env"]) == 2
    assert "RETMASK_CPU_PATH must be one of" in capsys.readouterr().err
