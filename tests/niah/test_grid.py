"""Test construction with the embedded tokenizer: prompt template, span, skipped tests, protocols."""

import pytest
from transformers import AutoTokenizer

import retmask
from retmask.niah import (
    PROTOCOLS,
    Needle,
    build_tests,
    default_haystack_text,
    depth_grid,
    length_grid,
    load_needles,
)
from retmask.niah.grid import GridError


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(retmask.default_model_path()))


def test_grids_match_the_reference_rounding():
    assert length_grid(1000, 50000, 20)[:3] == [1000, 3579, 6158]
    assert depth_grid(10) == [0, 11, 22, 33, 44, 56, 67, 78, 89, 100]
    assert PROTOCOLS["wu2024"].num_lengths == 20 and PROTOCOLS["retmask"].max_len == 5000


def test_chat_prompt_and_needle_span(tok):
    needles = load_needles()
    tests = build_tests(tok, needles[:1], default_haystack_text(), [600], [0, 50, 100])
    for t in tests:
        text = tok.decode(t.prompt_ids)
        assert text.startswith("<|im_start|>system")
        assert "<|im_start|>user\n<book>" in text and text.endswith("<|im_start|>assistant\n")
        assert f"</book>\nBased on the content of the book, Question: {needles[0].question}\nAnswer:" in text
        s, e = t.span
        assert e - s == len(t.answer_ids)
        assert needles[0].real_needle.split()[1] in tok.decode(t.prompt_ids[s:e].tolist())
        assert t.skip_reason is None and len(t.prompt_ids) <= 600
    assert tests[0].span[0] < tests[1].span[0] < tests[2].span[0]


def test_base_model_template(tok):
    t = build_tests(tok, load_needles()[:1], default_haystack_text(), [400], [50], chat=False)[0]
    text = tok.decode(t.prompt_ids)
    assert "<|im_start|>" not in text and "<book>" not in text
    assert text.endswith(f"Based on the content of the book, Question: {load_needles()[0].question}\nAnswer:")


def test_needle_not_found_and_too_short_are_reported(tok):
    odd = Needle("A plain sentence about nothing.", "What?", "completely different words entirely here now")
    tests = build_tests(tok, [odd], default_haystack_text(), [0, 400], [50])
    assert "buffer" in tests[0].skip_reason
    assert "not found" in tests[1].skip_reason


@pytest.mark.parametrize(
    "lengths,depths,message",
    [
        ([600], [-10], r"depth -10 is not a percentage of the context in \[0, 100\]"),
        ([600], [150], r"depth 150 is not"),
        ([600], [float("nan")], r"depth nan is not"),
        ([600.7], [50], r"context length 600.7 is not a whole number of tokens"),
        ([-5], [50], r"context length -5 is not"),
        ([], [50], r"at least one length and one depth"),
        ([600], [], r"at least one length and one depth"),
    ],
)
def test_a_grid_outside_its_bounds_is_refused(tok, lengths, depths, message):
    """A depth outside [0, 100] used to place the needle silently elsewhere (-10 -> 90% in, labelled -10)."""
    with pytest.raises(GridError, match=message):
        build_tests(tok, load_needles()[:1], default_haystack_text(), lengths, depths)
