"""Protocols (lengths × depths) and the list of NIAH tests with their prompt ids and needle spans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from retmask.niah.context import DEFAULT_BUFFER, build_context_ids, period_token_ids
from retmask.niah.haystack import haystack_token_ids
from retmask.niah.needles import Needle
from retmask.niah.prompt import build_prompt_ids
from retmask.niah.span import answer_forms, locate_answer

if TYPE_CHECKING:
    import numpy as np

# numpy is imported inside the functions: the command line reads PROTOCOLS for its help text.


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
    # Wu et al. 2024: 20 lengths in [1K, 50K] x 10 depths (x their 3 needles).
    "wu2024": Protocol(1000, 50000, 20, 10, "Wu et al. 2024: 20 lengths in 1K-50K x 10 depths"),
    # RetMask (Ma & Okazaki): 20 lengths in [0, 5K] x 10 depths; lengths too short for the 200-token
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
) -> tuple[list[int], list[int]]:
    """(lengths, depths) of ``protocol`` with any of its four numbers overridden."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose one of {sorted(PROTOCOLS)}")
    p = PROTOCOLS[protocol]
    lo = p.min_len if min_len is None else min_len
    hi = p.max_len if max_len is None else max_len
    nl = p.num_lengths if num_lengths is None else num_lengths
    nd = p.num_depths if num_depths is None else num_depths
    if hi < lo:
        default = f" (the {protocol} protocol's)"
        raise ValueError(
            f"empty grid: --max-len {hi}{'' if max_len is not None else default} is below --min-len {lo}"
            f"{'' if min_len is not None else default}; raise --max-len or lower --min-len"
        )
    if nl < 1 or nd < 1:
        raise ValueError(
            f"empty grid: {nl} lengths x {nd} depths; --num-lengths and --num-depths must be >= 1"
        )
    return length_grid(lo, hi, nl), depth_grid(nd)


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
    the mid-sentence answer form has ``meta["answer_form"] == "mid-sentence"``."""
    import numpy as np

    hay = haystack_token_ids(tokenizer, haystack_text, max(lengths))
    periods = period_token_ids(tokenizer)
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
