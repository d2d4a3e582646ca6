"""What kind of answer a NIAH response is, beyond its ROUGE-1 recall.

ROUGE-1 recall cannot tell an answer that lost the needle from one that starts copying it and stops
early: "toasted quince seeds." and "The world of science." can both score about 0.3 against "toasted
quince seeds and a pinch of blue saffron from the hills". Masking retrieval heads and masking heads that
keep generation going fail in these two different ways, so ablations report the kind next to the score.

Words are ROUGE's (lower-cased, punctuation dropped, Porter-stemmed), so the kinds agree with the recall:

- ``complete``: every word of the answer is in the response, as often as in the answer (exactly when
  recall is 1), whatever follows it.
- ``cut short``: the response copies the answer's first two or more words in order, then stops or turns
  to other text before the answer ends.
- ``partial``: two or more consecutive answer words appear, but not from the answer's start.
- ``none``: no two consecutive answer words (single shared words such as "the" do not count).
- ``empty``: the response has no words at all.
"""

from __future__ import annotations

from collections import Counter

from retmask.niah.rouge import rouge_words

ANSWER_KINDS = ("complete", "cut short", "partial", "none", "empty")
MIN_RUN = 2  # consecutive answer words that count as copied needle content


def _longest_run(answer: list[str], response: list[str], from_start: bool) -> int:
    """Longest run of consecutive answer words found consecutively in the response; with ``from_start``
    only runs that begin at the answer's first word."""
    best = 0
    starts = [0] if from_start else range(len(answer))
    for a in starts:
        for r in range(len(response)):
            n = 0
            while a + n < len(answer) and r + n < len(response) and answer[a + n] == response[r + n]:
                n += 1
            best = max(best, n)
    return best


def classify_answer(real_needle: str, response: str) -> str:
    """One of :data:`ANSWER_KINDS` for ``response`` against the needle's answer ``real_needle``."""
    answer, said = rouge_words(real_needle), rouge_words(response)
    if not said:
        return "empty"
    if not answer:
        raise ValueError("empty answer: real_needle must contain at least one word")
    if not Counter(answer) - Counter(said):  # as ROUGE-1 counts: a word twice in the answer is needed twice
        return "complete"
    if _longest_run(answer, said, from_start=True) >= MIN_RUN:
        return "cut short"
    if _longest_run(answer, said, from_start=False) >= MIN_RUN:
        return "partial"
    return "none"


def count_kinds(kinds: list[str]) -> dict[str, int]:
    """``{kind: count}`` over :data:`ANSWER_KINDS`, in that order (zeros included)."""
    unknown = sorted(set(kinds) - set(ANSWER_KINDS))
    if unknown:
        raise ValueError(f"unknown answer kinds {unknown}; expected {ANSWER_KINDS}")
    return {k: kinds.count(k) for k in ANSWER_KINDS}
