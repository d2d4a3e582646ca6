"""Answer kinds: complete exactly when ROUGE-1 recall is 1; a copied start that stops early is "cut short",
not "none"; single shared words are not needle content."""

import random

import pytest

from retmask.niah import rouge1_recall
from retmask.niah.answer_kind import ANSWER_KINDS, classify_answer, count_kinds

ANSWER = "toasted quince seeds and a pinch of blue saffron from the hills"


@pytest.mark.parametrize(
    ("response", "kind"),
    [
        ("Toasted quince seeds and a pinch of blue saffron from the hills.", "complete"),
        (
            "The secret is toasted quince seeds and a pinch of blue saffron from the hills. Also tea.",
            "complete",
        ),
        ("The secret ingredient in Grandma Velloria's soup is toasted quince seeds.", "cut short"),
        ("toasted quince", "cut short"),
        ("Toasting quinces!", "cut short"),  # stemmed, as ROUGE compares words
        ("It has blue saffron from the hills in it.", "partial"),
        ("The sea is the main thing.", "none"),
        ("The world of science and philosophy.", "none"),  # "of" and "the" alone are not the needle
        ("toasted bread", "none"),  # one word of the start is not a copy
        ("", "empty"),
        ("...", "empty"),
    ],
)
def test_kinds(response, kind):
    assert classify_answer(ANSWER, response) == kind


def test_complete_exactly_when_recall_is_one():
    rng = random.Random(0)
    words = ANSWER.split() + ["the", "a", "sea", "bread", "hills", "of"]
    for _ in range(300):
        response = " ".join(rng.choice(words) for _ in range(rng.randint(0, 16)))
        kind = classify_answer(ANSWER, response)
        assert (kind == "complete") == (rouge1_recall(ANSWER, response) == 1.0), response
        if kind in ("none", "empty"):
            assert rouge1_recall(ANSWER, response) < 1.0


def test_repeated_answer_word_must_repeat():
    assert classify_answer("the cat and the dog", "the cat and dog") == "cut short"
    assert rouge1_recall("the cat and the dog", "the cat and dog") < 1.0


def test_count_kinds():
    assert count_kinds(["none", "complete", "none"]) == dict.fromkeys(ANSWER_KINDS, 0) | {
        "none": 2,
        "complete": 1,
    }
    assert list(count_kinds([])) == list(ANSWER_KINDS)
    with pytest.raises(ValueError, match="unknown answer kinds"):
        count_kinds(["fine"])
    with pytest.raises(ValueError, match="empty answer"):
        classify_answer("...", "some words")
