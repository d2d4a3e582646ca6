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
    lo: int | None = None, hi: int | None = None, *, also: tuple[int, ...] = ()
) -> Callable[[str], int]:
    """An integer in ``[lo, hi]`` (either bound may be None = unbounded), or one of ``also``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value in also:
            return value
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
