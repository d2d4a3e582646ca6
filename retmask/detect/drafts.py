"""Draft continuations for prompt-lookup verification.

A draft only decides how many tokens one verification pass can accept; the accepted tokens are always
the greedy ones, so any draft gives the same answer. NIAH answers are copied from the needle, so the
needle's neighbourhood in the prompt is searched first.
"""

from __future__ import annotations

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


def propose_draft(
    prompt: np.ndarray, span: tuple[int, int], generated: list[int], max_len: int, max_ngram: int = 3
) -> list[int]:
    """Up to ``max_len`` draft tokens continuing ``prompt + generated``.

    prompt: int64 [n]. Nothing generated yet -> the needle span itself (the expected answer). Otherwise the
    longest suffix n-gram (n <= ``max_ngram``) of the sequence found near the needle, else anywhere in the
    prompt, and the tokens that follow it there.
    """
    if max_len <= 0:
        return []
    s, e = span
    if not generated:
        return prompt[s:e][:max_len].tolist()
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
