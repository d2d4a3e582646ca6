"""Needle span rule: the sliding-window implementation equals the reference's direct definition."""

import random

import pytest

from retmask.niah import find_needle_span


def direct(prompt, answer, threshold=0.9):
    want = set(answer)
    for i in range(len(prompt)):
        if len(set(prompt[i : i + len(answer)]) & want) / len(want) > threshold:
            return i, i + len(answer)
    return None


@pytest.mark.parametrize("seed", range(200))
def test_matches_direct_definition(seed):
    rng = random.Random(seed)
    vocab = rng.choice([5, 12, 40])
    answer = [rng.randrange(vocab) for _ in range(rng.randint(1, 15))]
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 80))]
    if rng.random() < 0.5 and prompt:
        at = rng.randrange(len(prompt))
        noisy = [t if rng.random() < 0.9 else rng.randrange(vocab) for t in answer]
        prompt[at:at] = noisy
    for th in (0.9, 0.5):
        assert find_needle_span(prompt, answer, th) == direct(prompt, answer, th)


def test_leading_space_variant_still_found():
    # 11 distinct answer ids, the first one tokenised differently in context: 10/11 > 90%
    answer = list(range(20, 31))
    prompt = [1, 2, 3, 99, *answer[1:], 4, 5]
    assert find_needle_span(prompt, answer) == (3, 14)


def test_not_found_and_empty_answer():
    assert find_needle_span([1, 2, 3], [7, 8]) is None
    with pytest.raises(ValueError):
        find_needle_span([1, 2], [])
