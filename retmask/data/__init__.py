"""Data written by this project and shipped with the package (needles, haystack, instructions)."""

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent


def data_path(*parts: str) -> Path:
    """Path of a shipped data file, e.g. ``data_path("instructions", "retmask_instructions.jsonl")``."""
    return DATA_DIR.joinpath(*parts)
