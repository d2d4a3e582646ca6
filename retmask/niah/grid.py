"""Protocols (lengths × depths) and the list of NIAH tests with their prompt ids and needle spans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from retmask.errors import UsageError
from retmask.niah.context import DEFAULT_BUFFER, build_context_ids, period_token_ids
from retmask.niah.haystack import HaystackError, haystack_name, haystack_token_ids
from retmask.niah.needles import Needle
from retmask.niah.prompt import build_prompt_ids
from retmask.niah.span import answer_forms, locate_answer

if TYPE_CHECKING:
    import numpy as np

# numpy is imported inside the functions: the command line reads PROTOCOLS for its help text.

# Bounds of a grid, checked before anything is built (``check_grid_counts``, ``check_grid_size``): beyond
# them a typo (``--num-lengths 1000000000``) would allocate gigabytes or build prompts for hours before
# any other error. Depths are whole percentages, so 101 distinct ones at most; lengths are whole tokens.
MAX_DEPTHS = 101
MAX_GRID_CELLS = 1_000_000  # lengths x depths: 5,000 times the published 20 x 10 grid
# token ids of all prompts together (int64: 2 GiB), about 17 times the published 3 needles x 200 cells x 25K
MAX_GRID_TOKENS = 1 << 28

GRID_FLAGS = {
    "min_len": "--min-len",
    "max_len": "--max-len",
    "num_lengths": "--num-lengths",
    "num_depths": "--num-depths",
}


class GridError(UsageError):
    """A grid that is empty or larger than it can be (duplicate lengths or depths, too many prompt tokens);
    the message names the flag, its value and the allowed range."""


@dataclass(frozen=True)
class Protocol:
    """A grid preset: ``num_lengths`` lengths evenly spaced in [min_len, max_len] × ``num_depths`` depths
    evenly spaced in [0, 100] (both rounded to integers, as the reference does)."""

    min_len: int
    max_len: int
    num_lengths: int
    num_depths: int
    description: str


PROTOCOLS: dict[str, Protocol] = {
    # the published retrieval-head grid: 20 lengths in [1K, 50K] x 10 depths (x its 3 needles).
    "wu2024": Protocol(
        1000, 50000, 20, 10, "published retrieval-head grid: 20 lengths in 1K-50K x 10 depths"
    ),
    # RetMask's published grid: 20 lengths in [0, 5K] x 10 depths; lengths too short for the 200-token
    # buffer are reported and skipped.
    "retmask": Protocol(0, 5000, 20, 10, "RetMask: 20 lengths in 0-5K x 10 depths"),
    # Default for small models on CPUs (the embedded SmolLM2 retrieves needles at 500-4000 tokens).
    "default": Protocol(500, 4000, 4, 4, "retmask default: 4 lengths in 500-4000 x 4 depths"),
}


def resolve_grid(
    protocol: str = "default",
    *,
    min_len: int | None = None,
    max_len: int | None = None,
    num_lengths: int | None = None,
    num_depths: int | None = None,
    flags: dict[str, str] | None = None,
) -> tuple[list[int], list[int]]:
    """(lengths, depths) of ``protocol`` with any of its four numbers overridden; a :class:`GridError` naming
    the flag when the grid is empty or holds more points than it can (:func:`check_grid_counts`). The
    protocol's number of lengths is capped at the distinct lengths of an overridden range. ``flags``: how
    the command spells the four numbers in messages (see :func:`check_grid_counts`)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose one of {sorted(PROTOCOLS)}")
    p = PROTOCOLS[protocol]
    lo = p.min_len if min_len is None else min_len
    hi = p.max_len if max_len is None else max_len
    # the protocol's count of lengths shrinks to the lengths a narrower range holds (--min-len 2000
    # --max-len 2000 is one length, not four copies of it); a count given explicitly is checked instead
    nl = min(p.num_lengths, max(1, hi - lo + 1)) if num_lengths is None else num_lengths
    nd = p.num_depths if num_depths is None else num_depths
    given = {"min_len": min_len, "max_len": max_len, "num_lengths": num_lengths, "num_depths": num_depths}
    check_grid_counts(
        lo, hi, nl, nd, flags=flags,
        defaults={k for k, v in given.items() if v is None}, default_note=f" (the {protocol} protocol's)",
    )  # fmt: skip
    return length_grid(lo, hi, nl), depth_grid(nd)


def check_grid_counts(
    min_len: int,
    max_len: int,
    num_lengths: int,
    num_depths: int,
    *,
    flags: dict[str, str] | None = None,
    defaults: set[str] | frozenset[str] = frozenset(),
    default_note: str = " (the default)",
) -> None:
    """Refuse, before the grid is built, an empty grid or one with more points than it can hold.

    ``num_lengths`` evenly spaced whole-token lengths in ``[min_len, max_len]`` are distinct only up to
    ``max_len - min_len + 1`` of them, and depths (whole percentages) up to 101: more would repeat tests
    (and a typo would allocate gigabytes). The grid's cells and its prompt tokens (at least ``cells x mean
    length``) are bounded too (``MAX_GRID_CELLS``, ``MAX_GRID_TOKENS``). ``flags`` names the four numbers
    as the command spells them (default ``--min-len`` ...); ``defaults``: the names of those not given on
    the command line, marked ``default_note`` in messages. Raises :class:`GridError`.
    """
    names = {**GRID_FLAGS, **(flags or {})}

    lo, hi, nl, nd = min_len, max_len, num_lengths, num_depths
    values = {"min_len": lo, "max_len": hi, "num_lengths": nl, "num_depths": nd}

    def flag(key: str) -> str:  # "--max-len 300", "--num-lengths 4 (the default protocol's)"
        return f"{names[key]} {values[key]}" + (default_note if key in defaults else "")

    if hi < lo:
        raise GridError(
            f"empty grid: {flag('max_len')} is below {flag('min_len')}; raise {names['max_len']} or "
            f"lower {names['min_len']}"
        )
    if nl < 1 or nd < 1:
        raise GridError(
            f"empty grid: {nl} lengths x {nd} depths; {names['num_lengths']} and {names['num_depths']} must "
            "be >= 1"
        )
    distinct = hi - lo + 1
    if nl > distinct:
        raise GridError(
            f"{flag('num_lengths')} is out of range: [{lo}, {hi}] holds only {distinct} distinct "
            f"whole-token length{'s' if distinct != 1 else ''}; must be >= 1 and <= {distinct} (or widen "
            f"{names['min_len']} / {names['max_len']})"
        )
    if nd > MAX_DEPTHS:
        raise GridError(
            f"{flag('num_depths')} is out of range: depths are whole percentages 0..100; must be >= 1 "
            f"and <= {MAX_DEPTHS}"
        )
    if nl * nd > MAX_GRID_CELLS:
        raise GridError(
            f"{names['num_lengths']} {nl} x {names['num_depths']} {nd} = {nl * nd:,} grid cells, more than "
            f"the {MAX_GRID_CELLS:,} a run can hold; use fewer lengths or depths"
        )
    check_grid_size(nl * nd * (lo + hi) // 2, f"{nl} lengths in [{lo}, {hi}] x {nd} depths")


def check_grid_size(prompt_tokens: int, what: str) -> None:
    """Refuse a grid whose prompts would hold more than ``MAX_GRID_TOKENS`` token ids together (they are
    all built in memory before the first test runs). ``what`` describes the grid for the message."""
    if prompt_tokens > MAX_GRID_TOKENS:
        raise GridError(
            f"the grid ({what}) holds about {prompt_tokens:,} prompt tokens, more than the {MAX_GRID_TOKENS:,} "
            f"({MAX_GRID_TOKENS * 8 >> 30} GiB of token ids) a run builds in memory; use fewer or shorter "
            "lengths, fewer depths or fewer needles"
        )


def check_grid_tests(num_needles: int, lengths: Sequence[int], depths: Sequence[int]) -> None:
    """Refuse, before any prompt is built, a grid that is empty, has a length that is not a whole number of
    tokens (0 and short ones give tests skipped as too short) or a depth outside [0, 100] (the needle would
    be placed, silently, where the label does not say), and tests whose prompts cannot fit in memory
    together (every prompt of the grid is built before the first test runs): ``MAX_GRID_TOKENS``. Raises
    :class:`GridError`."""
    import numpy as np

    if not lengths or not depths:
        raise GridError(f"the grid needs at least one length and one depth, got lengths {list(lengths)} and "
                        f"depths {list(depths)}")  # fmt: skip
    for length in lengths:
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise GridError(f"context length {length!r} is not a whole number of tokens >= 0")
    for depth in depths:
        if isinstance(depth, bool) or not isinstance(depth, (int, float, np.number)) or not 0 <= depth <= 100:
            raise GridError(f"depth {depth!r} is not a percentage of the context in [0, 100]")
    check_grid_size(
        num_needles * len(depths) * sum(lengths),
        f"{num_needles} needles x {len(lengths)} lengths x {len(depths)} depths",
    )


def length_grid(min_len: int, max_len: int, num: int) -> list[int]:
    import numpy as np

    return [int(x) for x in np.round(np.linspace(min_len, max_len, num=num, endpoint=True)).astype(int)]


def depth_grid(num: int) -> list[int]:
    import numpy as np

    return [int(x) for x in np.round(np.linspace(0, 100, num=num, endpoint=True)).astype(int)]


@dataclass
class NiahTest:
    """One test. ``prompt_ids``: int64 [n]; ``span``: needle span ``[s, e)`` in the prompt or ``None`` when
    the answer is not found (see :func:`split_runnable`); ``answer_ids``: ids of ``real_needle``.
    ``insertion`` is -1 when the context is too short for the needle and its buffer (never runs)."""

    index: int  # position in the canonical grid order (needle, length, depth): the order of the scores
    needle_index: int
    length: int
    depth: int
    insertion: int
    prompt_ids: np.ndarray
    span: tuple[int, int] | None
    answer_ids: list[int]
    skip_reason: str | None = None
    meta: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"n{self.needle_index}-L{self.length}-d{self.depth}"

    @property
    def span_missed(self) -> bool:
        """The prompt was built but the span rule did not locate the answer in it."""
        return self.insertion >= 0 and self.span is None


# What a detection does with a test whose needle span is not found.
SPAN_MISS = ("zeros", "skip")


def split_runnable(
    tests: Sequence[NiahTest], span_miss: str = "zeros"
) -> tuple[list[NiahTest], list[NiahTest]]:
    """(runnable, skipped) tests, each in the input order.

    A test whose context is too short for the needle and its buffer never runs. A test whose needle span
    is not found runs under ``span_miss="zeros"``: no head can copy from an empty span, so every head
    scores 0 on it, and it is counted when its answer passes the ROUGE-1 filter. That is what the
    published detection script does (its span search returns (-1, -1) and its copy check then never
    fires), so scores stay comparable with published ones. ``"skip"`` leaves such tests out of the means.
    """
    if span_miss not in SPAN_MISS:
        raise ValueError(f"span_miss must be one of {SPAN_MISS}, got {span_miss!r}")
    runnable, skipped = [], []
    for t in tests:
        runs = t.insertion >= 0 and (t.span is not None or span_miss == "zeros")
        (runnable if runs else skipped).append(t)
    return runnable, skipped


def build_tests(
    tokenizer,
    needles: Sequence[Needle],
    haystack_text: str,
    lengths: Sequence[int],
    depths: Sequence[int],
    chat: bool | None = None,
    buffer: int = DEFAULT_BUFFER,
    span_rule: str = "reference",
) -> list[NiahTest]:
    """All tests in the canonical order: for each needle, each length, each depth (the reference's loops).
    ``span_rule``: ``"reference"`` or ``"tolerant"`` (see :mod:`retmask.niah.span`); a test located through
    the mid-sentence answer form has ``meta["answer_form"] == "mid-sentence"``.

    Before any prompt is built: :class:`GridError` when the prompts would not fit in memory together
    (:func:`check_grid_tests`), :class:`~retmask.niah.haystack.HaystackError` naming the haystack when it
    cannot fill ``max(lengths)`` or has no sentence end for the depths strictly between 0 and 100."""
    import numpy as np

    check_grid_tests(len(needles), lengths, depths)
    hay = haystack_token_ids(tokenizer, haystack_text, max(lengths))
    periods = period_token_ids(tokenizer)
    if any(0 < d < 100 for d in depths) and periods.isdisjoint(hay):
        # the needle goes after the sentence end at or before its depth: with none, every needle would sit
        # at the very start of the context whatever the depth, a grid that silently measures one depth
        raise HaystackError(
            f"{haystack_name(haystack_text)} has no sentence end (no '.' token in its "
            f"{len(hay)} tokens), so every needle would be placed at the start of the context whatever the "
            "depth; use prose made of sentences ending in '.'"
        )
    tests: list[NiahTest] = []
    for ni, nd in enumerate(needles):
        needle_ids = tokenizer(nd.needle, add_special_tokens=False)["input_ids"]
        forms = answer_forms(tokenizer, nd.real_needle, span_rule)
        answer_ids = forms[0][1]
        for length in lengths:
            for depth in depths:
                idx = len(tests)
                try:
                    ctx_ids, p = build_context_ids(hay, needle_ids, length, depth, periods, buffer)
                except ValueError as err:
                    tests.append(
                        NiahTest(
                            idx, ni, length, depth, -1, np.zeros(0, np.int64), None, answer_ids, str(err)
                        )
                    )
                    continue
                context = tokenizer.decode(ctx_ids)
                prompt = np.asarray(build_prompt_ids(tokenizer, context, nd.question, chat), dtype=np.int64)
                span, form, ids = locate_answer(prompt.tolist(), forms)
                reason = None if span is not None else _span_miss(span_rule)
                meta = {"answer_form": form} if form != "alone" else {}
                tests.append(NiahTest(idx, ni, length, depth, p, prompt, span, ids, reason, meta))
    return tests


def _span_miss(span_rule: str) -> str:
    if span_rule == "reference":
        return (
            "needle answer not found in the prompt (span rule; --span-rule tolerant also tries the answer "
            "tokenised mid-sentence)"
        )
    return "needle answer not found in the prompt (span rule, either answer form)"
