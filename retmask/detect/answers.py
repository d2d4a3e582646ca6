"""The one loop that answers NIAH tests on the fast path, shared by detection and NIAH evaluation.

Tests run in *prefix order* (sorted by prompt ids, so neighbours share the longest KV prefix), and each
test may draft from the model's earlier answers to the same needle (``earlier_answers``): drafts change
how many tokens a verification pass accepts, never the greedy answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from retmask.detect.core import FastDetector, TestOutcome
from retmask.niah import Needle, NiahTest, rouge1_recall

HistoryFn = Callable[[NiahTest], list[list[int]]]


def prefix_order(tests: list[NiahTest]) -> list[NiahTest]:
    """Tests sorted by their prompt ids, lexicographically: neighbours share the longest prefixes, so the
    carried KV cache computes every distinct prefix (trie node) about once."""
    return sorted(tests, key=lambda t: (t.prompt_ids.astype(">u4").tobytes(), t.index))


def earlier_answers(ordered: list[NiahTest], done: Mapping[int, dict]) -> HistoryFn:
    """``history_of(t)``: the answers (token lists) of the tests of ``t``'s needle that come before ``t`` in
    ``ordered`` (the prefix order of all runnable tests), read from ``done[index]["tokens"]`` when asked.

    Tests run in that order and processes get whole needles (``shard(..., by_needle=True)``), so when a
    test runs, every earlier test of its needle is done -- in this process or in the run being resumed --
    and the history, hence every verification pass's shape, is the same for any process count or resume
    point. (A missing earlier answer would only shorten the history: the answer stays the greedy one.)"""
    seen: dict[int, list[int]] = {}  # needle -> indices of its tests so far in ``ordered``
    before: dict[int, list[int]] = {}  # test index -> indices of the earlier tests of its needle
    for t in ordered:
        earlier = seen.setdefault(t.needle_index, [])
        before[t.index] = list(earlier)
        earlier.append(t.index)

    def history_of(t: NiahTest) -> list[list[int]]:
        return [done[i]["tokens"] for i in before.get(t.index, []) if i in done]

    return history_of


@dataclass
class Answer:
    """One answered test: the detector's outcome, the decoded response and its ROUGE-1 recall."""

    test: NiahTest
    outcome: TestOutcome
    response: str
    recall: float


def answer_tests(
    detector: FastDetector,
    tokenizer,
    tests: Iterable[NiahTest],
    needles: Sequence[Needle],
    history_of: HistoryFn | None = None,
) -> Iterator[Answer]:
    """Answer ``tests`` in the given order (callers pass prefix order), lazily: a consumer that stops
    early (e.g. once scores are stable) runs no further test.

    A test whose answer the span rule could not locate (``span is None``) still runs with an empty span:
    the span only seeds the drafts and the copy counts, never the answer.
    """
    for t in tests:
        span = t.span if t.span is not None else (0, 0)
        out = detector.run(t.prompt_ids, span, history_of(t) if history_of is not None else ())
        response = tokenizer.decode(out.tokens, skip_special_tokens=True).strip()
        yield Answer(t, out, response, rouge1_recall(needles[t.needle_index].real_needle, response))
