"""Draft continuations for prompt-lookup verification.

A draft only decides how many tokens one verification pass can accept; the accepted tokens are always
the greedy ones, so any draft gives the same answer. NIAH answers are copied from the needle, so the
needle's neighbourhood is searched before the rest of the prompt.

The model's earlier answers to the same needle (at other lengths and depths) are the best draft when the
model does *not* copy the needle: a small model that paraphrases or drifts tends to drift the same way at
every depth (SmolLM2-135M gave 2-13 distinct answers over 16 tests per needle on the default grid), and
those answers are nowhere in the prompt. On the benchmark grid this cut the verification passes from 264
to 151 in a replay of the recorded answers (``bench/results/detect.md``).

Past the start, the draft continues the longest suffix n-gram of the answer found in any source (earlier
answers, the answer's own earlier tokens, the needle's neighbourhood, the whole prompt; in that order at
equal length). Trying the sources in a fixed order instead took a short match in the prompt over a longer
one in the answer itself (a model repeating a phrase got the needle's continuation as its draft): that
rule needed 3-4% more passes in replays of four recorded runs (``bench/replay_drafts.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NEIGHBOURHOOD = 64  # tokens around the needle span searched before the whole prompt
# recorded in run records (bench/replay_drafts.py replays by it); records without it: "fixed-order"
DRAFT_RULE = "longest-match"


def _find(haystack: np.ndarray, pattern: np.ndarray) -> int:
    """Start of the first occurrence of ``pattern`` in ``haystack`` followed by at least one token; -1."""
    n = len(pattern)
    if len(haystack) <= n:
        return -1
    cand = np.flatnonzero(haystack[: len(haystack) - n] == pattern[0])
    for off in range(1, n):
        if cand.size == 0:
            break
        cand = cand[haystack[cand + off] == pattern[off]]
    return int(cand[0]) if cand.size else -1


def next_draft_cap(accepted: int, draft_len: int, max_draft: int, min_draft: int) -> int:
    """The longest draft allowed in the next pass: ``max_draft`` after a fully accepted draft, else
    ``max(min_draft, 2 * accepted)`` (a rejected draft costs its rows for nothing)."""
    return max_draft if accepted == draft_len else max(min_draft, 2 * accepted)


def continue_earlier_answer(generated: list[int], history: Sequence[list[int]]) -> list[int]:
    """The continuation of ``generated`` in the earlier answers that start with it: the most frequent one
    (ties: the longest, then the most recent); [] if no earlier answer extends ``generated``."""
    votes: dict[tuple[int, ...], tuple[int, int, int]] = {}
    n = len(generated)
    for recency, answer in enumerate(history):
        if len(answer) > n and answer[:n] == generated:
            rest = tuple(answer[n:])
            count = votes.get(rest, (0, 0, 0))[0]
            votes[rest] = (count + 1, len(rest), recency)
    return list(max(votes, key=votes.__getitem__)) if votes else []


def propose_draft(
    prompt: np.ndarray,
    span: tuple[int, int],
    generated: list[int],
    max_len: int,
    history: Sequence[list[int]] = (),
    max_ngram: int = 4,
) -> list[int]:
    """Up to ``max_len`` draft tokens continuing ``prompt + generated``.

    prompt: int64 [n]; history: earlier answers (token lists) to the same needle, oldest first. In order:
    the continuation of ``generated`` shared by most earlier answers that start with it; nothing generated
    yet -> the needle span itself (the expected answer); else the tokens after the longest suffix n-gram
    (n <= ``max_ngram``) of ``generated`` found in an earlier answer (latest first), in ``generated``
    itself (a loop), near the needle, or anywhere in the prompt (that order at equal n); else nothing.
    """
    if max_len <= 0:
        return []
    earlier = continue_earlier_answer(generated, history)
    if earlier:
        return earlier[:max_len]
    s, e = span
    if not generated:
        return prompt[s:e][:max_len].tolist()
    gen = np.asarray(generated, dtype=prompt.dtype)
    answers = [np.asarray(a, dtype=prompt.dtype) for a in reversed(history)]  # latest first, converted once
    lo, hi = max(0, s - NEIGHBOURHOOD), min(len(prompt), e + NEIGHBOURHOOD)
    for n in range(min(max_ngram, len(gen)), 0, -1):
        pattern = gen[-n:]
        for answer in answers:
            pos = _find(answer, pattern)
            if pos >= 0:
                return answer[pos + n : pos + n + max_len].tolist()
        # the answer repeating itself: the tokens after the pattern's earlier occurrence
        pos = _find(gen[:-1], pattern) if len(gen) > n else -1
        if pos >= 0:
            return gen[pos + n : pos + n + max_len].tolist()
        for start, stop in ((lo, hi), (0, len(prompt))):
            pos = _find(prompt[start:stop], pattern)
            if pos >= 0:
                begin = start + pos + n
                return prompt[begin : begin + max_len].tolist()
    return []
