"""The small detection grid of the end-to-end tests: 2 needles x 2 lengths (350, 600) x 2 depths, chunk 128."""

from __future__ import annotations

from pathlib import Path

from retmask.detect import DetectConfig

GRID = ["--min-len", "350", "--max-len", "600", "--num-lengths", "2", "--num-depths", "2"]


def needles_file(folder: Path, n: int = 2) -> Path:
    """``folder/needles.jsonl``: the first ``n`` shipped needles."""
    from retmask.niah import DEFAULT_NEEDLES_PATH

    path = folder / "needles.jsonl"
    path.write_text("\n".join(DEFAULT_NEEDLES_PATH.read_text().splitlines()[:n]) + "\n")
    return path


def grid_config(needles: Path) -> DetectConfig:
    """The configuration ``GRID`` and ``--chunk 128`` give on the command line."""
    return DetectConfig(
        needles=str(needles), min_len=350, max_len=600, num_lengths=2, num_depths=2, chunk=128
    )
