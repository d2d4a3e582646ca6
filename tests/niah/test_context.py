"""Context construction, tokenizer-free on synthetic ids."""

import pytest

from retmask.niah import build_context_ids

PERIOD = 9


def hay(n: int) -> list[int]:
    # sentences of 5 tokens: 1 2 3 4 PERIOD 1 2 3 4 PERIOD ...
    return [PERIOD if i % 5 == 4 else 1 + i % 5 for i in range(n)]


NEEDLE = [100, 101, 102]


def test_keeps_first_tokens_after_buffer_and_needle():
    ctx, p = build_context_ids(
        hay(1000), NEEDLE, length=250, depth_percent=0, period_ids={PERIOD}, buffer=200
    )
    assert p == 0
    assert ctx == NEEDLE + hay(1000)[: 250 - 200 - 3]


def test_walks_back_to_a_period():
    h = hay(1000)
    ctx, p = build_context_ids(h, NEEDLE, length=300, depth_percent=50, period_ids={PERIOD}, buffer=200)
    kept = h[:97]
    raw = int(97 * 0.5)  # 48
    assert p <= raw and kept[p - 1] == PERIOD and all(t != PERIOD for t in kept[p:raw])
    assert ctx == kept[:p] + NEEDLE + kept[p:]


def test_depth_100_appends_like_the_reference():
    h = hay(1000)
    ctx, p = build_context_ids(h, NEEDLE, length=300, depth_percent=100, period_ids={PERIOD}, buffer=200)
    assert p == 97 and ctx == h[:97] + NEEDLE


def test_no_period_walks_back_to_start():
    ctx, p = build_context_ids([1] * 500, NEEDLE, length=300, depth_percent=60, period_ids={PERIOD})
    assert p == 0 and ctx[:3] == NEEDLE


def test_too_short_length_and_haystack_raise():
    with pytest.raises(ValueError, match="buffer"):
        build_context_ids(hay(1000), NEEDLE, length=203, depth_percent=0, period_ids={PERIOD})
    with pytest.raises(ValueError, match="longer haystack"):
        build_context_ids(hay(10), NEEDLE, length=300, depth_percent=0, period_ids={PERIOD})


class _DummyPrefixTokenizer:
    """SentencePiece with a dummy prefix, as Llama 2: "." alone is "▁." (869); after a word it is "." (29889)."""

    vocab = {"▁.": 869, "▁sentence": 100, ".": 29889}

    def __call__(self, text, add_special_tokens=False):
        if text == ".":
            return {"input_ids": [869]}
        ids = [100] if text.startswith("sentence") else []
        return {"input_ids": ids + ([29889] if text.endswith(".") else [])}


def test_period_ids_include_the_period_after_a_word():
    """Otherwise a dummy-prefix tokenizer's sentence ends are never found and every needle lands at 0."""
    from retmask.niah import period_token_ids

    assert period_token_ids(_DummyPrefixTokenizer()) == {869, 29889}


def test_period_ids_of_the_embedded_tokenizer_are_one_id():
    from transformers import AutoTokenizer

    import retmask
    from retmask.niah import period_token_ids

    tok = AutoTokenizer.from_pretrained(str(retmask.default_model_path()))
    assert period_token_ids(tok) == set(tok(".", add_special_tokens=False)["input_ids"])
