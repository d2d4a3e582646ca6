"""Needle span rule: the first window of the prompt whose token-id set covers > 90% of the answer's token
ids (the reference script's ``find_needle_idx``)."""

from __future__ import annotations

from collections.abc import Sequence


def find_needle_span(
    prompt_ids: Sequence[int], answer_ids: Sequence[int], threshold: float = 0.9
) -> tuple[int, int] | None:
    """First ``i`` such that the *set* of ids in ``prompt_ids[i : i + len(answer_ids)]`` covers more than
    ``threshold`` of the set of ``answer_ids``; returns ``(i, i + len(answer_ids))`` or ``None``.

    Linear time: a sliding window keeps a multiset of the window's ids restricted to the answer's ids.
    """
    n = len(answer_ids)
    if n == 0:
        raise ValueError("empty answer: real_needle must tokenise to at least one token")
    want = set(answer_ids)
    need = len(want)
    counts: dict[int, int] = {}
    covered = 0
    prompt = list(prompt_ids)
    # Window [i, i + n) for i = 0 .. len(prompt) - 1 (the reference also tries windows cut by the end).
    for j in range(min(n, len(prompt))):
        t = prompt[j]
        if t in want:
            counts[t] = counts.get(t, 0) + 1
            covered += counts[t] == 1
    for i in range(len(prompt)):
        if covered / need > threshold:
            return i, i + n
        out = prompt[i]
        if out in want:
            counts[out] -= 1
            covered -= counts[out] == 0
        j = i + n
        if j < len(prompt) and prompt[j] in want:
            counts[prompt[j]] = counts.get(prompt[j], 0) + 1
            covered += counts[prompt[j]] == 1
    return None
