"""A haystack that cannot fill the context fails with an error naming it, never loops (issue 47).

The old builder sized each repetition from ``len(ids) // reps``, which is 0 once the copies merge into
fewer tokens than copies ("a" * n is about n / 4 tokens): it then asked for the same repetition again and
looped for ever. Fake tokenizers make the merging exact; each counts its calls and fails the test past a
few dozen, so a regression fails instead of hanging.
"""

from __future__ import annotations

import pytest

from retmask.errors import UsageError
from retmask.niah import build_tests, load_haystack, load_needles
from retmask.niah.haystack import (
    MAX_CHARS_PER_TOKEN,
    HaystackError,
    HaystackText,
    haystack_token_ids,
)

CALLS_AT_MOST = 40  # the builder at least doubles the repetition each try: log2 of any bound is far below


class FakeTokenizer:
    """``chars_per_token`` characters per token, or always ``fixed`` tokens; records each text's length."""

    def __init__(self, chars_per_token: int | None = None, fixed: int | None = None):
        self.chars_per_token, self.fixed = chars_per_token, fixed
        self.lengths: list[int] = []

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        self.lengths.append(len(text))
        assert len(self.lengths) <= CALLS_AT_MOST, "the haystack builder loops"
        n = self.fixed if self.fixed is not None else max(1, len(text) // self.chars_per_token)
        return {"input_ids": [7] * n}


@pytest.fixture
def word_file(tmp_path):
    def write(text: str):
        path = tmp_path / "hay.txt"
        path.write_text(text)
        load_haystack.cache_clear()  # the same path with another text
        return path

    yield write
    load_haystack.cache_clear()


def test_copies_that_never_grow_fail_naming_the_haystack(word_file):
    path = word_file("hello")
    tok = FakeTokenizer(fixed=2)  # every repetition gives 2 tokens: the old builder never returned
    with pytest.raises(HaystackError) as err:
        haystack_token_ids(tok, load_haystack(path), 5000)
    msg = str(err.value)
    assert f"haystack {path} cannot fill a 5000-token context" in msg
    assert "5 characters, 2 tokens" in msg and "gives only 2 tokens" in msg
    assert isinstance(err.value, UsageError)  # every command prints it in one line, exit 2
    assert max(tok.lengths) <= 5000 * MAX_CHARS_PER_TOKEN + len("hello")  # the text stayed bounded


def test_text_denser_than_the_bound_fails_after_a_few_tries():
    tok = FakeTokenizer(chars_per_token=MAX_CHARS_PER_TOKEN * 2)  # 128 characters per token
    with pytest.raises(HaystackError, match=r"^the haystack cannot fill a 1000-token context"):
        haystack_token_ids(tok, "a", 1000)  # a plain str: no source to name
    assert len(tok.lengths) < 25 and max(tok.lengths) <= 1000 * MAX_CHARS_PER_TOKEN


@pytest.mark.parametrize("chars_per_token", [1, 4, 7])
def test_short_text_that_can_fill_is_repeated(chars_per_token):
    # "a" * n -> n / 4 tokens: the case that looped before; repeating it is legitimate
    tok = FakeTokenizer(chars_per_token=chars_per_token)
    ids = haystack_token_ids(tok, "a", 3000)
    assert len(ids) >= 3000
    assert len(tok.lengths) <= 6  # sized from the measured tokens per copy, not one copy at a time


def test_haystack_text_keeps_its_source_and_is_a_plain_string(word_file):
    path = word_file("Some prose. More prose.")
    text = load_haystack(path)
    assert isinstance(text, HaystackText) and text.source == str(path)
    assert text == "Some prose. More prose." and str(text) == text
    assert load_haystack(None).source == "(the default essays)"


@pytest.fixture(scope="module")
def smollm_tokenizer():
    import transformers

    import retmask

    return transformers.AutoTokenizer.from_pretrained(retmask.default_model_path())


@pytest.mark.parametrize("word", ["a", "hello", "hello\n"])
def test_one_word_haystack_is_refused_by_the_grid_builder(word, word_file, smollm_tokenizer):
    # With the real tokenizer these fill the context by repetition, but hold no sentence end: every needle
    # would sit at the start whatever the depth. Refused in well under a second (it used to loop).
    path = word_file(word)
    with pytest.raises(HaystackError) as err:
        build_tests(smollm_tokenizer, load_needles()[:1], load_haystack(path), [1000], [0, 50, 100])
    assert f"haystack {path} has no sentence end" in str(err.value)
    assert "whatever the depth" in str(err.value)


def test_short_prose_is_repeated_and_builds_every_test(word_file, smollm_tokenizer):
    path = word_file("The cat sat on the mat.")
    tests = build_tests(smollm_tokenizer, load_needles()[:1], load_haystack(path), [600], [0, 50, 100])
    assert [t.skip_reason for t in tests] == [None, None, None]
    assert 0 < tests[1].insertion < tests[2].insertion  # depth 50 lands mid-context, after a sentence end


def test_depths_at_the_ends_only_need_no_sentence_end(word_file, smollm_tokenizer):
    # depth 0 and 100 do not walk back to a sentence end, so a haystack without one is still meaningful
    path = word_file("hello ")
    tests = build_tests(smollm_tokenizer, load_needles()[:1], load_haystack(path), [600], [0, 100])
    assert [t.insertion for t in tests][0] == 0 and tests[1].insertion > 0
