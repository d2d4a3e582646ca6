"""Numeric flags checked at parse time: argparse ``type=`` factories with an allowed range.

``p.add_argument("--chunk", type=int_range(1))`` turns ``--chunk -5`` into ``retmask detect: error:
argument --chunk: -5 is out of range: must be >= 1`` and exit code 2, before any file is read or any
model is loaded (argparse names the flag; the message names the value and the range). The named
instances below are the ranges the commands use.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path


def _describe(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo:g}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi:g}")
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    return " and ".join(parts) or "any number"


def _check(x: float, text: str, lo, hi, lo_open: bool, hi_open: bool) -> None:
    low_bad = lo is not None and (x <= lo if lo_open else x < lo)
    high_bad = hi is not None and (x >= hi if hi_open else x > hi)
    if low_bad or high_bad:
        raise argparse.ArgumentTypeError(
            f"{text} is out of range: must be {_describe(lo, hi, lo_open, hi_open)}"
        )


def int_range(
    lo: int | None = None,
    hi: int | None = None,
    *,
    also: tuple[int, ...] = (),
    cap: int | None = None,
    why: str = "",
) -> Callable[[str], int]:
    """An integer in ``[lo, hi]`` (either bound may be None = unbounded), or one of ``also``.

    ``cap``: a sanity ceiling on a size-like flag (a count or a number of tokens), where a huge value would
    allocate memory or run for ever before any other check could fail; ``why`` says where it comes from.
    Either violation reads ``N is out of range: must be >= lo and <= cap (why)``.
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value in also:
            return value
        if cap is not None and (value > cap or (lo is not None and value < lo)):
            low = f">= {lo} and " if lo is not None else ""
            raise argparse.ArgumentTypeError(
                f"{text} is out of range: must be {low}<= {cap}" + (f" ({why})" if why else "")
            )
        try:
            _check(value, text, lo, hi, False, False)
        except argparse.ArgumentTypeError as err:
            if also:
                raise argparse.ArgumentTypeError(f"{err} (or {', '.join(map(str, also))})") from None
            raise
        return value

    parse.__name__ = "int"  # argparse's fallback message says "invalid int value"
    return parse


def float_range(
    lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False
) -> Callable[[str], float]:
    """A finite float in ``[lo, hi]``; ``lo_open`` / ``hi_open`` exclude the bound."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        _check(value, text, lo, hi, lo_open, hi_open)
        return value

    parse.__name__ = "float"
    return parse


positive_int = int_range(1)  # chunk, lengths, counts, max new tokens, batch sizes, steps
nonneg_int = int_range(0)  # seeds, K = 0 heads, "0 = off" intervals
positive_float = float_range(0.0, lo_open=True)  # learning rates, epochs, temperatures of a softmax
nonneg_float = float_range(0.0)  # sampling temperature (0 = greedy), weight decay, loss weights
unit_float = float_range(0.0, 1.0)  # thresholds, ratios, probabilities in [0, 1]
open_unit_float = float_range(0.0, 1.0, lo_open=True)  # top-p in (0, 1]
percent_int = int_range(0, 100)  # depths in percent
steps_or_off = int_range(1, also=(-1,))  # max steps: N >= 1, or -1 = by epochs

# Ceilings of size-like flags (see ``int_range(cap=...)``): values past them can only be typos, and would
# otherwise allocate gigabytes (a grid of a billion lengths, a KV cache reserved for a billion tokens) or
# run for ever before any error.
MAX_TOKENS = 1 << 24  # 16,777,216 tokens: above the longest context of any model (10M)
MAX_DEPTHS = 101  # depths are whole percentages 0..100 (= retmask.niah.grid.MAX_DEPTHS; kept import-free)
MAX_SEED = (1 << 32) - 1  # numpy's legacy seeding takes no more (torch takes 64 bits)
MAX_DRAWS = 1000  # random draws per K of an ablation (each draw is a whole NIAH grid)
MAX_HEADS = 1 << 16  # heads of a model, or its layers (the largest have ~16,000 heads)
MAX_NEEDLES = 1000  # generated needles per multi-needle context (each a ~12-token sentence)

# contexts, max new tokens, prefill chunks, token limits
token_count = int_range(1, cap=MAX_TOKENS, why="more tokens than any model's context")
# number of grid lengths: the exact bound is the number of distinct lengths in [min, max] (checked with
# the grid, retmask.niah.grid.check_grid_counts)
length_count = int_range(1, cap=MAX_TOKENS, why="more lengths than any context has tokens")
depth_count = int_range(1, cap=MAX_DEPTHS, why="depths are whole percentages 0..100")
seed_int = int_range(0, cap=MAX_SEED, why="seeds are 32-bit")
draw_count = int_range(1, cap=MAX_DRAWS, why="each draw is a whole NIAH grid")
head_count = int_range(1, cap=MAX_HEADS, why="no model has that many")
needle_count = int_range(1, cap=MAX_NEEDLES, why="each needle is a sentence of the context")


def png_path(text: str) -> Path:
    """A ``--plot`` file: plots are always rendered as PNG (``retmask.plotting.save_figure``), so a name with
    another suffix (``plot.pdf``, ``plot``) is refused at parse time rather than after the computation, or
    written as a PNG under a misleading name."""
    path = Path(text)
    if not path.name.lower().endswith(".png"):
        if not path.name:  # a folder such as "/" or "."
            fix = f"e.g. {path / 'plot.png'}"
        else:
            fix = f"e.g. {path.with_suffix('.png')}" if path.suffix else f"e.g. {path}.png"
        raise argparse.ArgumentTypeError(
            f"{text!r} does not end in .png: plots are written as PNG images; give a .png file name ({fix})"
        )
    return path


png_path.__name__ = "PNG path"  # argparse's fallback message says "invalid PNG path value"


def file_stem(text: str) -> str:
    """A ``--prefix``: the stem of output file names inside ``--out-dir``, so a plain name. A path
    (``../x``, ``a/b``) would write outside the folder or beside its lock; an empty name or one starting
    with a dot gives hidden files (``.configs``)."""
    if not text or text.startswith(".") or "/" in text or "\\" in text or "\0" in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a plain file name: the prefix names files inside --out-dir; give a name without "
            "a slash that does not start with a dot (e.g. 'run2')"
        )
    return text


file_stem.__name__ = "file name prefix"
