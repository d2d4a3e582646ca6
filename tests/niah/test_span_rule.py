"""``span_rule="tolerant"``: finds answers whose first word the tokenizer splits differently at the start
of a string, and changes nothing where the published rule already finds the answer."""

import pytest
from transformers import AutoTokenizer

import retmask
from retmask.niah import Needle, build_tests, default_haystack_text, load_needles
from retmask.niah.span import answer_forms, locate_answer

# SmolLM2's BPE: "zebra finches" alone -> "ze" "bra" " fin" "ches"; mid-sentence -> " zebra" " fin" "ches".
# The window of 4 prompt tokens covers 2 of the 4 answer ids: the published rule (> 90%) misses it.
SHORT = Needle(
    "The birds in the old barn are zebra finches.", "What birds live in the old barn?", "zebra finches"
)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(retmask.default_model_path()))


def test_reference_misses_and_says_what_to_try(tok):
    tests = build_tests(tok, [SHORT], default_haystack_text(), [500], [0, 50], chat=False)
    for t in tests:
        assert t.span is None
        assert "not found" in t.skip_reason and "--span-rule tolerant" in t.skip_reason


def test_tolerant_locates_the_mid_sentence_form(tok):
    tests = build_tests(
        tok, [SHORT], default_haystack_text(), [500], [0, 50], chat=False, span_rule="tolerant"
    )
    mid = tok(" zebra finches", add_special_tokens=False)["input_ids"]
    for t in tests:
        assert t.skip_reason is None
        s, e = t.span
        assert t.prompt_ids[s:e].tolist() == mid
        assert t.answer_ids == mid and t.meta == {"answer_form": "mid-sentence"}
        # the span is the needle's own answer, not an echo in the question
        assert s < len(t.prompt_ids) - 20


def test_tolerant_equals_reference_where_the_reference_finds_the_answer(tok):
    needles = load_needles()
    ref = build_tests(tok, needles, default_haystack_text(), [400, 900], [0, 100])
    tol = build_tests(tok, needles, default_haystack_text(), [400, 900], [0, 100], span_rule="tolerant")
    assert all(t.span is not None for t in ref)
    for a, b in zip(ref, tol, strict=True):
        assert (a.span, a.answer_ids, a.meta, a.skip_reason) == (b.span, b.answer_ids, b.meta, b.skip_reason)
        assert a.prompt_ids.tolist() == b.prompt_ids.tolist()


def test_forms_and_bad_rule(tok):
    assert [n for n, _ in answer_forms(tok, "zebra finches", "reference")] == ["alone"]
    assert [n for n, _ in answer_forms(tok, "zebra finches", "tolerant")] == ["alone", "mid-sentence"]
    # an answer that already starts with a space has one form
    assert [n for n, _ in answer_forms(tok, " zebra finches", "tolerant")] == ["alone"]
    assert locate_answer([5, 6, 7], [("alone", [8, 9])]) == (None, "alone", [8, 9])
    with pytest.raises(ValueError, match="unknown span rule 'fuzzy'.*reference, tolerant"):
        answer_forms(tok, "x", "fuzzy")
