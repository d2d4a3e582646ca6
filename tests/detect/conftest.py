"""Fixtures of the end-to-end detection tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .small_grid import grid_config, needles_file


@pytest.fixture(scope="session")
def embedded_detection(tmp_path_factory, embedded) -> tuple[Path, Path, Any]:
    """(needles file, scores path, result) of one default single-process detection of the embedded model on
    the small grid: the run that resumed, sharded and option-changed runs must reproduce (run once; read
    it, do not change it)."""
    from retmask.detect import run_detect

    model, tok = embedded
    folder = tmp_path_factory.mktemp("detect-reference")
    needles = needles_file(folder)
    out = folder / "ref" / "s.json"
    result = run_detect(
        grid_config(needles), out, model=model, tokenizer=tok, progress_bar=False, log=lambda *a, **k: None
    )
    return needles, out, result
