"""Scores JSON format, summary/histogram, the --until-stable rule, drafts, stop tokens."""

import numpy as np
import pytest

from retmask.detect.drafts import propose_draft
from retmask.detect.scores import StabilityTracker, format_summary, head_scores, mean_matrix, summarize


def test_head_scores_published_format():
    c1 = np.array([[3, 0], [1, 0]])
    c2 = np.array([[6, 0], [0, 0]])
    s = head_scores([c1, c2], [6, 12], (2, 2))
    assert list(s) == ["0-0", "0-1", "1-0", "1-1"]
    assert s["0-0"] == [0.5, 0.5] and s["1-0"] == [1 / 6, 0.0] and s["0-1"] == [0.0, 0.0]
    np.testing.assert_allclose(mean_matrix(s, (2, 2)), [[0.5, 0], [1 / 12, 0]])


def test_summary_histogram_and_counts():
    scores = {"0-0": [0.6], "0-1": [0.0], "1-0": [0.07], "1-1": [0.2]}
    s = summarize(scores, (2, 2))
    assert s["histogram"] == {"0": 0.25, "(0, 0.1)": 0.25, "[0.1, 0.5)": 0.25, ">= 0.5": 0.25}
    assert s["retrieval_heads_tau_0.1"] == 2 and s["retrieval_heads_tau_0.05"] == 3
    assert [t["head"] for t in s["top"][:2]] == ["0-0", "1-1"]


def test_summary_says_how_many_tests_passed_the_filter():
    s = summarize({"0-0": [0.6, 0.2], "0-1": [0.0, 0.0]}, (1, 2))
    first = format_summary(s, total_tests=5).splitlines()[0]
    assert first.startswith("2 of 5 tests passed the ROUGE-1 filter (counted")
    assert format_summary(s).splitlines()[0].startswith("2 tests passed the ROUGE-1 filter")


def test_eta_counts_prompt_tokens_left_not_tests():
    """Tests in prefix order share prefixes: the first pays its whole prefill, the next only what differs
    past the shared chunk-aligned prefix; the ETA scales the tokens left by the measured rate."""
    from types import SimpleNamespace

    from retmask.detect.run import DetectEta

    def test(i, ids):
        return SimpleNamespace(index=i, prompt_ids=np.asarray(ids + [9]))

    base = list(range(100, 400))  # 300 tokens
    tests = [test(0, base), test(1, base[:256] + [1] * 44), test(2, base[:130] + [2] * 170)]
    eta = DetectEta(tests, chunk=128)
    assert eta.estimate == {0: 300, 1: 300 - 256, 2: 300 - 128}
    assert eta.seconds() is None
    eta.update(tests[0], SimpleNamespace(prefill_tokens=300, timings={"prefill_s": 3.0, "decode_s": 1.0}))
    # 44 + 172 tokens left at 0.01 s/token, 2 tests x 1 s decode; a per-test rate would say 2 x 4 s
    assert eta.seconds() == pytest.approx(216 * 0.01 + 2 * 1.0)


def test_until_stable_counts_unchanged_tests():
    tr = StabilityTracker((2, 2), patience=3, top_k=2)
    assert not tr.update(np.array([[0.5, 0.0], [0.2, 0.0]]))
    for _ in range(2):
        assert not tr.update(np.array([[0.5, 0.0], [0.2, 0.0]]))
    assert tr.update(np.array([[0.5, 0.0], [0.2, 0.0]]))
    assert not tr.update(np.array([[0.0, 0.0], [0.0, 3.0]]))  # ranking changed: counter restarts


def test_draft_prefers_the_needle_neighbourhood():
    prompt = np.array([5, 6, 7, 8] + [1] * 100 + [5, 6, 9, 9, 9, 2], dtype=np.int64)
    span = (106, 109)
    assert propose_draft(prompt, span, [], 2) == [9, 9]  # nothing generated yet: the answer span
    assert propose_draft(prompt, span, [5, 6], 3) == [9, 9, 9]  # "5 6" next to the needle, not at 0
    assert propose_draft(prompt, (0, 3), [5, 6], 3) == [7, 8, 1]  # ... or next to another span
    assert propose_draft(prompt, span, [4], 3) == []
    assert propose_draft(prompt, span, [5], 0) == []


def test_draft_takes_the_longest_match_whatever_its_source():
    prompt = np.array([5, 6, 7, 8] + [1] * 100 + [5, 6, 9, 9, 9, 2], dtype=np.int64)
    span = (106, 109)
    # an answer repeating "5 6 3": its own loop (match of 2 in the answer itself, as long as the needle's)
    assert propose_draft(prompt, span, [5, 6, 3, 5, 6], 3) == [3, 5, 6]
    # a longer match in the prompt beats a shorter one in the answer: "8 1 1" continues as in the prompt
    assert propose_draft(prompt, span, [1, 4, 8, 1], 3) == [1, 1, 1]
    # at equal length, earlier answers come first
    assert propose_draft(prompt, span, [3, 5, 6], 2, [[4, 5, 6, 7, 7]]) == [7, 7]


def test_draft_continues_the_most_common_earlier_answer():
    prompt = np.array([5, 6, 7, 8] + [1] * 100 + [5, 6, 9, 9, 9, 2], dtype=np.int64)
    span = (106, 109)
    history = [[5, 6, 11, 12, 2], [5, 6, 13, 2], [5, 6, 11, 12, 2], [4, 4, 2]]
    # earlier answers beat the needle span, even before anything is generated: the model's own habit
    assert propose_draft(prompt, span, [], 9, history) == [5, 6, 11, 12, 2]
    assert propose_draft(prompt, span, [5, 6], 9, history) == [11, 12, 2]  # 2 votes against 1
    assert propose_draft(prompt, span, [5, 6, 13], 9, history) == [2]
    assert propose_draft(prompt, span, [5, 6], 2, history) == [11, 12]  # max_len still caps the draft
    # no earlier answer starts with the tokens so far: their suffix n-gram in an earlier answer
    assert propose_draft(prompt, span, [7, 4, 4], 9, history) == [2]
    # ... and nothing there either: the prompt lookup as before
    assert propose_draft(prompt, span, [8, 8, 9], 3, history) == [9, 9, 2]
    # ties in votes: the longer continuation, then the most recent answer
    assert propose_draft(prompt, span, [5], 9, [[5, 3, 2], [5, 3, 3, 2]]) == [3, 3, 2]
    assert propose_draft(prompt, span, [5], 9, [[5, 3, 2], [5, 4, 2]]) == [4, 2]
    assert propose_draft(prompt, span, [5], 9, [[5]]) == [
        6,
        9,
        9,
        9,
        2,
    ]  # an answer equal to the prefix: no vote
