"""Needle span rules: where the needle's answer sits in the prompt's token ids.

``reference`` is the published script's ``find_needle_idx``: the first window of the prompt whose token-id
*set* covers more than 90% of the answer's ids, with the answer tokenised on its own. ``tolerant`` first
applies the same rule and, only when it finds nothing, retries with the answer tokenised as it appears in
the needle sentence: after a space. SentencePiece tokenizers (Gemma, Llama-2) split the first word of a
string differently from the same word mid-sentence (Gemma: ``"to" "asted"`` alone vs ``" toasted"`` in
context), which can drop the coverage of a short answer under 90% and skip the test. On tests the
reference rule locates, both rules give the same span and answer ids, so their scores are identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SPAN_RULES = ("reference", "tolerant")


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


def answer_forms(tokenizer: Any, real_needle: str, rule: str) -> list[tuple[str, list[int]]]:
    """The answer's token ids to try in order, each with a name: ``[("alone", ids)]`` for ``reference``;
    ``tolerant`` adds ``("mid-sentence", ids of " " + real_needle)`` when they differ."""
    if rule not in SPAN_RULES:
        raise ValueError(f"unknown span rule {rule!r}; choose one of {', '.join(SPAN_RULES)}")
    alone = tokenizer(real_needle, add_special_tokens=False)["input_ids"]
    forms = [("alone", list(alone))]
    if rule == "tolerant" and not real_needle.startswith(" "):
        mid = list(tokenizer(" " + real_needle, add_special_tokens=False)["input_ids"])
        if mid != forms[0][1]:
            forms.append(("mid-sentence", mid))
    return forms


def locate_answer(
    prompt_ids: Sequence[int], forms: list[tuple[str, list[int]]]
) -> tuple[tuple[int, int] | None, str, list[int]]:
    """The span of the first answer form the set rule locates: ``(span, form name, answer ids)``; when none
    is found, ``(None, first name, first ids)``."""
    for name, ids in forms:
        span = find_needle_span(prompt_ids, ids)
        if span is not None:
            return span, name, ids
    return None, forms[0][0], forms[0][1]
