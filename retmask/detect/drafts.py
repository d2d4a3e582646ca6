"""Draft continuations for prompt-lookup verification.

A draft only decides how many tokens one verification pass can accept; the accepted tokens are always
the greedy ones, so any draft gives the same answer. NIAH answers are copied from the needle, so the
needle's neighbourhood in the prompt is searched first.

The model's earlier answers to the same needle (at other lengths and depths) are the best draft when the
model does *not* copy the needle: a small model that paraphrases or drifts tends to drift the same way at
every depth (SmolLM2-135M gave 2-13 distinct answers over 16 tests per needle on the default grid), and
those answers are nowhere in the prompt. On the benchmark grid this cut the verification passes from 264
to 151 in a replay of the recorded answers (``bench/results/detect.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NEIGHBOURHOOD = 64  # tokens around the needle span searched before the whole prompt


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


def _lookup_in_answers(generated: list[int], history: Sequence[list[int]], max_ngram: int) -> list[int]:
    """The tokens after the longest suffix n-gram of ``generated`` in an earlier answer (latest first)."""
    for n in range(min(max_ngram, len(generated)), 0, -1):
        pattern = np.asarray(generated[-n:], dtype=np.int64)
        for answer in reversed(history):
            pos = _find(np.asarray(answer, dtype=np.int64), pattern)
            if pos >= 0:
                return list(answer[pos + n :])
    return []


def propose_draft(
    prompt: np.ndarray,
    span: tuple[int, int],
    generated: list[int],
    max_len: int,
    history: Sequence[list[int]] = (),
    max_ngram: int = 3,
) -> list[int]:
    """Up to ``max_len`` draft tokens continuing ``prompt + generated``.

    prompt: int64 [n]; history: earlier answers (token lists) to the same needle, oldest first. In order:
    the continuation of ``generated`` shared by most earlier answers that start with it; nothing generated
    yet -> the needle span itself (the expected answer); the tokens after the longest suffix n-gram
    (n <= ``max_ngram``) of the sequence in an earlier answer, else near the needle, else anywhere in the
    prompt; else a loop of the answer itself.
    """
    if max_len <= 0:
        return []
    earlier = continue_earlier_answer(generated, history)
    if earlier:
        return earlier[:max_len]
    s, e = span
    if not generated:
        return prompt[s:e][:max_len].tolist()
    from_answers = _lookup_in_answers(generated, history, max_ngram)
    if from_answers:
        return from_answers[:max_len]
    seq = np.concatenate([prompt, np.asarray(generated, dtype=prompt.dtype)])
    lo, hi = max(0, s - NEIGHBOURHOOD), min(len(prompt), e + NEIGHBOURHOOD)
    for n in range(min(max_ngram, len(seq)), 0, -1):
        pattern = seq[-n:]
        for start, stop in ((lo, hi), (0, len(prompt))):
            pos = _find(prompt[start:stop], pattern)
            if pos >= 0:
                begin = start + pos + n
                return prompt[begin : begin + max_len].tolist()
    # Small models often loop: the answer so far may predict its own continuation.
    gen = seq[len(prompt) :]
    for n in range(min(max_ngram, len(gen) - 1), 0, -1):
        pos = _find(gen[:-1], gen[-n:])
        if pos >= 0:
            return gen[pos + n : pos + n + max_len].tolist()
    return []
