"""Generated long-context tasks: multi-needle recall and key–value retrieval (seeded; all data made here).

* **Multi-needle recall**: ``needles`` generated facts ("The password for the Dravelon vault is
  tromavek.") inserted at evenly spread depths (sentence boundaries, as the NIAH context rule) into the
  default prose haystack of a given length; one question per needle, each asked on the same context.
  A needle is recalled when its value appears as a whole word in the answer (case-insensitive) before any
  other needle's value: an answer that lists several of the context's passwords counts only when the asked
  one comes first, so naming them all is no better than naming one. Score: the fraction of needles recalled.
* **Key–value retrieval**: a list of ``key: value`` lines (keys: generated pseudo-words, all distinct;
  values: distinct 5-digit numbers) filling the context; the question asks for the value of one key,
  picked at ``depths`` (percent of the list). Exact match: the first number in the answer must equal the
  value (a wrong number first, or no number, scores 0).

Names are pseudo-words built from syllables by ``random.Random`` seeded with a string (stable across
Python versions), so a seed reproduces every context, question and answer.

Answers are greedy, at most ``max_new_tokens``, stopping after a newline or EOS token: the detection fast
path (``FastDetector`` with ``count_copies=False``, KV-prefix reuse: the questions of one context share
its prefill) gives exactly the step-by-step greedy answer.
"""

from __future__ import annotations

import contextlib
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from retmask.detect.core import FastDetector
from retmask.detect.stopping import stop_token_ids
from retmask.hf.heads import head_mask
from retmask.niah import (
    build_prompt_ids,
    find_needle_span,
    haystack_token_ids,
    load_haystack,
    period_token_ids,
)
from retmask.niah.prompt import chat_prompt_text, is_chat_tokenizer

ONSETS = (
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "gr",
    "kl",
    "st",
    "tr",
)
VOWELS = ("a", "e", "i", "o", "u")
CODAS = ("", "", "", "n", "l", "r", "s", "k")
TASKS = ("multi_needle", "kv")
BUFFER = 200  # tokens left for the template, the question and the answer (as the NIAH context rule)
NUMBER = re.compile(r"\d+")


def pseudo_word(rng: random.Random, syllables: int = 3) -> str:
    """A pronounceable lower-case non-word, e.g. ``'tromavek'``."""
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(syllables)) + rng.choice(CODAS)


def unique_words(rng: random.Random, n: int, syllables: int = 3, exclude: Sequence[str] = ()) -> list[str]:
    """``n`` distinct pseudo-words (none in ``exclude``)."""
    seen, out = set(exclude), []
    while len(out) < n:
        w = pseudo_word(rng, syllables)
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


@dataclass
class SyntheticItem:
    """One question. prompt_ids: int64 [n]; span: the answer's tokens in the prompt (seeds the drafts
    only; (0, 0) when not located); others: the values of the other items of the same context."""

    task: str
    key: str
    length: int
    depth: int
    question: str
    answer: str
    prompt_ids: np.ndarray
    span: tuple[int, int]
    others: list[str] = field(default_factory=list)


# --- scoring -------------------------------------------------------------------------------------------


def _word_start(word: str, text: str) -> int | None:
    """Where ``word`` first occurs in ``text`` as a whole word (case-insensitive); None if nowhere."""
    m = re.search(rf"(?<![A-Za-z0-9]){re.escape(word)}(?![A-Za-z0-9])", text, re.IGNORECASE)
    return m.start() if m else None


def word_recalled(answer: str, response: str, others: Sequence[str] = ()) -> bool:
    """Multi-needle: ``answer`` occurs as a whole word of ``response`` (case-insensitive), and none of
    ``others`` (the other needles' values in the same context) occurs before it."""
    first = _word_start(answer, response)
    if first is None:
        return False
    return all((at := _word_start(other, response)) is None or at > first for other in others)


def exact_number(answer: str, response: str, others: Sequence[str] = ()) -> bool:
    """Key–value: the first number in ``response`` is exactly ``answer`` (no number -> False); thousands
    separators between digits are dropped first ("48,213" reads as 48213). ``others`` is not needed: only
    the first number counts, so listing other values gains nothing."""
    m = NUMBER.search(re.sub(r"(?<=\d)[,\u202f](?=\d{3}(?!\d))", "", response))
    return m is not None and m.group(0) == answer


SCORERS = {"multi_needle": word_recalled, "kv": exact_number}


# --- multi-needle ----------------------------------------------------------------------------------------


def _insert_points(kept: Sequence[int], depths: Sequence[int], periods: frozenset[int]) -> list[int]:
    """Insertion index in ``kept`` for each depth, walked back to a sentence end (period token)."""
    points = []
    for d in depths:
        p = len(kept) if d >= 100 else int(len(kept) * d / 100)
        while 0 < p < len(kept) and kept[p - 1] not in periods:
            p -= 1
        points.append(p)
    return points


def needle_depths(n: int) -> list[int]:
    """``n`` depths spread over the context, away from the very ends: 10..90%."""
    return [10] if n == 1 else [int(round(10 + 80 * i / (n - 1))) for i in range(n)]


def multi_needle_items(
    tokenizer: Any, lengths: Sequence[int], num_needles: int = 4, seed: int = 0, haystack: str | None = None
) -> list[SyntheticItem]:
    """For each length, one context holding ``num_needles`` generated facts and one question per fact."""
    if num_needles < 1:
        raise ValueError(f"multi-needle needs at least 1 needle, got {num_needles}")
    text = load_haystack(haystack)
    periods = period_token_ids(tokenizer)
    items: list[SyntheticItem] = []
    for length in lengths:
        rng = random.Random(f"retmask-multi-needle-{seed}-{length}")
        places = [w.capitalize() for w in unique_words(rng, num_needles)]
        values = unique_words(rng, num_needles, exclude=[p.lower() for p in places])
        facts = [f" The password for the {p} vault is {v}." for p, v in zip(places, values, strict=True)]
        fact_ids = [tokenizer(f, add_special_tokens=False)["input_ids"] for f in facts]
        keep = length - BUFFER - sum(len(f) for f in fact_ids)
        if keep <= 0:
            raise ValueError(
                f"multi-needle length {length} leaves no haystack for {num_needles} needles and the {BUFFER}-token "
                f"buffer; use lengths > {BUFFER + sum(len(f) for f in fact_ids)}"
            )
        kept = haystack_token_ids(tokenizer, text, keep)[:keep]
        depths = needle_depths(num_needles)
        points = _insert_points(kept, depths, periods)
        ctx: list[int] = []
        prev = 0
        for p, f in zip(points, fact_ids, strict=True):  # points are non-decreasing
            ctx += kept[prev:p] + f
            prev = p
        ctx += kept[prev:]
        context = tokenizer.decode(ctx)
        for i, (p, v) in enumerate(zip(places, values, strict=True)):
            question = f"What is the password for the {p} vault?"
            prompt = np.asarray(build_prompt_ids(tokenizer, context, question), dtype=np.int64)
            items.append(_item("multi_needle", f"mn-L{length}-n{i}", length, depths[i], question, v, prompt,
                               tokenizer, [x for x in values if x != v]))  # fmt: skip
    return items


# --- key-value -----------------------------------------------------------------------------------------

KV_INTRO = "Below is a list of keys and their values, one per line.\n\n"
KV_QUESTION = 'What is the value of the key "{key}"? Answer with the number only.'


def kv_items(
    tokenizer: Any, lengths: Sequence[int], depths: Sequence[int] = (10, 50, 90), seed: int = 0
) -> list[SyntheticItem]:
    """For each length, a ``key: value`` list filling about ``length`` prompt tokens and one question per
    depth (the asked key's position in the list, percent)."""
    items: list[SyntheticItem] = []
    for length in lengths:
        rng = random.Random(f"retmask-kv-{seed}-{length}")
        budget = length - BUFFER // 2  # the list; the template and question take the rest
        keys: list[str] = []
        values: list[str] = []
        used_values: set[str] = set()
        lines: list[str] = []
        tokens = len(tokenizer(KV_INTRO, add_special_tokens=False)["input_ids"])
        seen: set[str] = set()
        while True:
            key = unique_words(rng, 1, syllables=2, exclude=seen)[0]
            value = str(rng.randrange(10000, 100000))
            while value in used_values:
                value = str(rng.randrange(10000, 100000))
            line = f"{key}: {value}\n"
            n = len(tokenizer(line, add_special_tokens=False)["input_ids"])
            if tokens + n > budget:
                break
            seen.add(key)
            used_values.add(value)
            keys.append(key)
            values.append(value)
            lines.append(line)
            tokens += n
        if len(keys) < 2:
            raise ValueError(f"key-value length {length} holds fewer than 2 pairs; use a longer length")
        body = KV_INTRO + "".join(lines)
        for d in depths:
            i = min(len(keys) - 1, int(round(d / 100 * (len(keys) - 1))))
            question = KV_QUESTION.format(key=keys[i])
            if is_chat_tokenizer(tokenizer):
                text = chat_prompt_text(tokenizer, body + "\n" + question)
                prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                prompt = tokenizer(body + "\n" + question + "\nAnswer:")["input_ids"]
            prompt = np.asarray(prompt, dtype=np.int64)
            items.append(_item("kv", f"kv-L{length}-d{d}", length, int(d), question, values[i], prompt, tokenizer,
                               [v for v in values if v != values[i]]))  # fmt: skip
    return items


def _item(task, key, length, depth, question, answer, prompt, tokenizer, others) -> SyntheticItem:
    ids = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
    span = find_needle_span(prompt.tolist(), ids) or (0, 0)
    return SyntheticItem(task, key, int(length), int(depth), question, answer, prompt, span, others)


# --- running -------------------------------------------------------------------------------------------


@dataclass
class TaskResult:
    """entries: per question ``{task, key, length, depth, question, answer, response, correct}``."""

    task: str
    entries: list[dict]
    lengths: list[int]
    seconds: float = 0.0

    @property
    def score(self) -> float:
        """Fraction of questions answered correctly (NaN without questions)."""
        return (
            math.fsum(e["correct"] for e in self.entries) / len(self.entries)
            if self.entries
            else float("nan")
        )

    def by_length(self) -> dict[int, float]:
        out = {}
        for n in self.lengths:
            es = [e for e in self.entries if e["length"] == n]
            out[n] = math.fsum(e["correct"] for e in es) / len(es) if es else float("nan")
        return out

    def to_json(self) -> dict:
        return {"task": self.task, "score": self.score, "by_length": {str(k): v for k, v in self.by_length().items()},
                "lengths": self.lengths, "seconds": round(self.seconds, 3), "entries": self.entries}  # fmt: skip


@torch.no_grad()
def run_items(
    model: Any,
    tokenizer: Any,
    items: Sequence[SyntheticItem],
    *,
    heads: Any = None,
    max_new_tokens: int = 24,
    progress: bool = True,
    desc: str = "synthetic",
) -> list[dict]:
    """Greedy answers to ``items`` (prefix-ordered: questions on one context share its KV prefix), scored.
    ``heads``: None or heads to mask during the run (list of (layer, head) / bool [L, Hq])."""
    from tqdm import tqdm

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    detector = FastDetector(model, stop_token_ids(tokenizer, model), max_new_tokens, count_copies=False)
    order = sorted(range(len(items)), key=lambda i: (items[i].prompt_ids.astype(">u4").tobytes(), i))
    out: dict[int, dict] = {}
    masked = heads is not None and (len(heads) if not isinstance(heads, torch.Tensor) else bool(heads.any()))
    ctx = head_mask(model, heads) if masked else contextlib.nullcontext()
    with ctx, tqdm(total=len(items), desc=desc, unit="q", disable=not progress, leave=False) as bar:
        for i in order:
            it = items[i]
            res = detector.run(it.prompt_ids, it.span)
            response = tokenizer.decode(res.tokens, skip_special_tokens=True).strip()
            out[i] = {
                "task": it.task, "key": it.key, "length": it.length, "depth": it.depth, "question": it.question,
                "answer": it.answer, "response": response,
                "correct": bool(SCORERS[it.task](it.answer, response, it.others)),
                "prompt_tokens": int(len(it.prompt_ids)),
            }  # fmt: skip
            bar.update(1)
    return [out[i] for i in range(len(items))]


def run_task(
    model: Any,
    tokenizer: Any,
    task: str,
    lengths: Sequence[int],
    *,
    seed: int = 0,
    num_needles: int = 4,
    kv_depths: Sequence[int] = (10, 50, 90),
    heads: Any = None,
    max_new_tokens: int = 24,
    progress: bool = True,
) -> TaskResult:
    """Build and run one task (``"multi_needle"`` or ``"kv"``) at ``lengths``."""
    import time

    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    start = time.perf_counter()
    if task == "multi_needle":
        items = multi_needle_items(tokenizer, lengths, num_needles, seed)
    else:
        items = kv_items(tokenizer, lengths, kv_depths, seed)
    entries = run_items(model, tokenizer, items, heads=heads, max_new_tokens=max_new_tokens, progress=progress,
                        desc=task)  # fmt: skip
    return TaskResult(task, entries, [int(n) for n in lengths], time.perf_counter() - start)


__all__ = [
    "TASKS",
    "SyntheticItem",
    "TaskResult",
    "exact_number",
    "kv_items",
    "multi_needle_items",
    "pseudo_word",
    "run_items",
    "run_task",
    "unique_words",
    "word_recalled",
]
