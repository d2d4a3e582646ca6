"""Generated long-context tasks: seeded data, unique keys, strict scoring, answers equal plain greedy."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest

from retmask.detect.stopping import stop_token_ids
from retmask.evaluate.synthetic import (
    exact_number,
    kv_items,
    multi_needle_items,
    run_items,
    run_task,
    unique_words,
    word_recalled,
)

from .conftest import greedy_reference


def test_unique_words_are_unique_and_seeded():
    a = unique_words(random.Random("s"), 300)
    assert len(set(a)) == 300 and a == unique_words(random.Random("s"), 300)
    assert a != unique_words(random.Random("t"), 300)
    assert not set(unique_words(random.Random("s"), 50, exclude=a[:10])) & set(a[:10])


def test_kv_items_keys_values_unique_lengths_and_determinism(tokenizer):
    items = kv_items(tokenizer, [600, 1500], depths=(0, 50, 100), seed=3)
    assert [it.key for it in items] == [f"kv-L{n}-d{d}" for n in (600, 1500) for d in (0, 50, 100)]
    for n in (600, 1500):
        group = [it for it in items if it.length == n]
        text = tokenizer.decode(group[0].prompt_ids)
        lines = [ln for ln in text.split("\n") if ": " in ln and ln.split(": ")[1].isdigit()]
        keys = [ln.split(": ")[0] for ln in lines]
        values = [ln.split(": ")[1] for ln in lines]
        assert len(keys) > 10 and len(set(keys)) == len(keys) and len(set(values)) == len(values)
        assert all(it.answer in values and it.answer not in it.others for it in group)
        assert len({it.answer for it in group}) == 3  # first, middle and last key differ
        assert n - 200 <= len(group[0].prompt_ids) <= n  # the list fills the requested length
        # questions on one context share everything up to the question
        assert all(np.array_equal(g.prompt_ids[:100], group[0].prompt_ids[:100]) for g in group)
    again = kv_items(tokenizer, [600, 1500], depths=(0, 50, 100), seed=3)
    assert all(
        np.array_equal(a.prompt_ids, b.prompt_ids) and a.answer == b.answer
        for a, b in zip(items, again, strict=True)
    )
    other = kv_items(tokenizer, [600], depths=(50,), seed=4)
    assert other[0].answer != items[1].answer


def test_multi_needle_items(tokenizer):
    items = multi_needle_items(tokenizer, [800, 1600], num_needles=3, seed=0)
    assert len(items) == 6
    for n in (800, 1600):
        group = [it for it in items if it.length == n]
        text = tokenizer.decode(group[0].prompt_ids)
        pos = [text.find(f"vault is {it.answer}.") for it in group]
        assert all(p > 0 for p in pos) and pos == sorted(pos)  # in the context, in depth order
        assert len({it.answer for it in group}) == 3 and [it.depth for it in group] == [10, 50, 90]
        assert all(it.span != (0, 0) for it in group)
        assert n - 200 <= len(group[0].prompt_ids) <= n + 10
    with pytest.raises(ValueError, match="leaves no haystack"):
        multi_needle_items(tokenizer, [220], num_needles=3)


@pytest.mark.parametrize(
    "answer,response,ok",
    [
        ("tromavek", "The password is tromavek.", True),
        ("tromavek", "TROMAVEK", True),
        ("tromavek", "The password is tromaveks.", False),
        ("tromavek", "It is trom avek", False),
        ("tromavek", "", False),
    ],
)
def test_word_recalled(answer, response, ok):
    assert word_recalled(answer, response) is ok


@pytest.mark.parametrize(
    "response,ok",
    [
        ("The password is tromavek.", True),
        ("tromavek, or maybe pudemel", True),  # the asked value first
        ("pudemel, gigupas or tromavek", False),  # listing the context's passwords gains nothing
        ("Pudemel? No: tromavek.", False),
        ("tromaveks pudemel", False),  # not the whole word, another value named
        ("tromavek, unrelated-word", True),  # only the other needles' values count against it
    ],
)
def test_word_recalled_counts_only_the_asked_value_named_first(response, ok):
    assert word_recalled("tromavek", response, ["pudemel", "gigupas"]) is ok


@pytest.mark.parametrize(
    "answer,response,ok",
    [
        ("48213", "48213", True),
        ("48213", 'The value of the key "volal" is 48213.', True),
        ("48213", "482130", False),
        ("48213", "4821", False),
        ("48213", "It is 11111, not 48213", False),  # the first number decides
        ("48213", "I don't know", False),
    ],
)
def test_exact_number(answer, response, ok):
    assert exact_number(answer, response) is ok


def test_run_items_score_a_listing_answer_by_the_value_named_first(tiny, tokenizer, monkeypatch):
    """A model that answers every question with the context's whole password list is right only on the
    question whose value it names first."""
    import retmask.evaluate.synthetic as synthetic

    items = multi_needle_items(tokenizer, [500], num_needles=3)
    listing = " ".join(it.answer for it in items)

    class ListingDetector:
        def __init__(self, *args, **kwargs):
            pass

        def run(self, prompt_ids, span):
            return types.SimpleNamespace(tokens=tokenizer(listing, add_special_tokens=False)["input_ids"])

    monkeypatch.setattr(synthetic, "FastDetector", ListingDetector)
    entries = run_items(tiny, tokenizer, items, max_new_tokens=8, progress=False)
    assert [e["response"] for e in entries] == [listing] * 3
    assert [e["correct"] for e in entries] == [True, False, False]


def test_run_items_equal_plain_greedy_and_are_scored(tiny, tokenizer):
    items = kv_items(tokenizer, [500], depths=(10, 90)) + multi_needle_items(tokenizer, [500], num_needles=2)
    entries = run_items(tiny, tokenizer, items, max_new_tokens=8, progress=False)
    stops = stop_token_ids(tokenizer, tiny)
    for it, e in zip(items, entries, strict=True):
        ref = greedy_reference(tiny, it.prompt_ids, stops, 8)
        assert e["response"] == tokenizer.decode(ref, skip_special_tokens=True).strip()
        scorer = exact_number if it.task == "kv" else word_recalled
        assert e["correct"] == scorer(it.answer, e["response"], it.others) and e["answer"] == it.answer
    res = run_task(tiny, tokenizer, "kv", [500], kv_depths=(10, 90), max_new_tokens=8, progress=False)
    assert [e["response"] for e in res.entries] == [e["response"] for e in entries[:2]]
    assert res.score == sum(e["correct"] for e in res.entries) / 2 and list(res.by_length()) == [500]
    with pytest.raises(ValueError, match="unknown task"):
        run_task(tiny, tokenizer, "nope", [500])
