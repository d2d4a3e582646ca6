"""The prefill chunk's default by device, and that detection records the resolved number."""

from __future__ import annotations

import re

import pytest
import torch

from retmask.detect import FastDetector
from retmask.detect.prefill_chunk import (
    ACCELERATOR_PREFILL_CHUNK,
    CPU_PREFILL_CHUNK,
    default_prefill_chunk,
    resolve_prefill_chunk,
)
from tests.device import TEST_DEVICE
from tests.tiny import tiny_llama


@pytest.mark.parametrize(
    "device, expected",
    [
        ("cpu", 256),
        (torch.device("cpu"), 256),
        ("cuda", 4096),
        ("cuda:1", 4096),
        (torch.device("cuda", 0), 4096),
        ("mps", 4096),
    ],
)
def test_default_by_device(device, expected):
    # only the device's type decides: no GPU is needed to ask for a GPU's default
    assert default_prefill_chunk(device) == expected
    assert resolve_prefill_chunk(None, device) == expected


def test_explicit_chunk_wins_on_every_device():
    for device in ("cpu", "cuda"):
        assert resolve_prefill_chunk(100, device) == 100
        assert resolve_prefill_chunk(1, device) == 1
    assert CPU_PREFILL_CHUNK < ACCELERATOR_PREFILL_CHUNK


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "256"])
def test_bad_chunk_is_refused_with_its_value(bad):
    with pytest.raises(
        ValueError, match=r"chunk must be an integer >= 1 or None .*got " + re.escape(repr(bad))
    ):
        resolve_prefill_chunk(bad, "cpu")


def test_fast_detector_takes_the_model_devices_default():
    model = tiny_llama()
    assert FastDetector(model, stop_ids=[0]).chunk == default_prefill_chunk(TEST_DEVICE)
    assert FastDetector(model, stop_ids=[0], chunk=48).chunk == 48
    with pytest.raises(ValueError, match="chunk must be an integer >= 1"):
        FastDetector(model, stop_ids=[0], chunk=0)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 0"):
        FastDetector(model, stop_ids=[0], max_new_tokens=0)
