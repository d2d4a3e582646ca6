"""Head selection: score parsing, threshold/top-k, baselines, MuDAF sampling, heads files."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from retmask.heads.selection import (
    SelectionError,
    check_heads,
    heads_from_json,
    load_scores,
    mean_scores,
    mudaf_selection,
    parse_heads_arg,
    read_heads,
    sample_non_retrieval,
    sample_random,
    sample_softmax_heads,
    select_heads,
    select_threshold,
    select_top_k,
    stable_softmax,
    write_heads,
)

L, H = 4, 8  # fixture model shape: 32 heads


def fixture_scores() -> dict[str, list[float]]:
    """A published-format scores object: sparse retrieval heads, many zeros, one score per test for every
    head (every published file has lists of one length)."""
    raw: dict[str, list[float]] = {}
    for layer in range(L):
        for head in range(H):
            key = f"{layer}-{head}"
            if (layer * H + head) % 7 == 0:
                raw[key] = [0.0, 0.0, 0.0]  # never copied
            else:
                base = ((layer * 5 + head * 3) % 11) / 100  # 0.00 .. 0.10
                raw[key] = [base, base + 0.02, base - 0.02 if base >= 0.02 else 0.0]
    raw["2-3"] = [0.9, 0.8, 0.85]
    raw["1-5"] = [0.5, 0.6, 0.55]
    raw["3-0"] = [0.3, 0.2, 0.25]
    raw["0-7"] = [0.12, 0.1, 0.11]
    return raw


@pytest.fixture
def scores_file(tmp_path):
    path = tmp_path / "scores.json"
    path.write_text(json.dumps(fixture_scores()))
    return path


def test_mean_scores(scores_file):
    s = load_scores(scores_file)
    assert len(s) == L * H
    assert s[(2, 3)] == pytest.approx(0.85)
    assert s[(1, 5)] == pytest.approx(0.55)
    assert s[(0, 0)] == 0.0
    assert all(0.0 <= v <= 1.0 for v in s.values())


def test_one_empty_list_among_full_ones_is_refused(tmp_path):
    raw = fixture_scores()
    raw["1-1"] = []
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(SelectionError, match=r"empty score list \(e\.g\. '1-1'\).*damaged or edited"):
        load_scores(path)


def test_lists_of_different_lengths_are_refused(tmp_path):
    raw = fixture_scores()
    raw["1-1"] = raw["1-1"] + [0.0]
    path = tmp_path / "merged.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(
        SelectionError, match=r"different lengths \('0-0': 3, '1-1': 4\).*damaged, edited or merged"
    ):
        load_scores(path)


def test_a_heads_file_given_as_scores_is_named(tmp_path):
    path = tmp_path / "heads.json"
    path.write_text(json.dumps({"version": 1, "heads": [[0, 1]], "num_heads": 1}))
    with pytest.raises(SelectionError, match=r"this is a heads file .*`retmask mask`.*pass the scores JSON"):
        load_scores(path)


@pytest.mark.parametrize("key", ["a-b", "1-2-3", "1_2", "-1-2", "3", " 1-2", "1.0-2"])
def test_malformed_key_is_named(key):
    with pytest.raises(SelectionError, match="key " + json.dumps(key).replace(".", r"\.").replace('"', "'")):
        mean_scores({"0-0": [0.1], key: [0.2]})


@pytest.mark.parametrize(
    "value", [0.5, "0.5", [0.1, "x"], [0.1, None], [True], [float("nan")], [float("inf")]]
)
def test_malformed_value_is_named(value):
    with pytest.raises(SelectionError, match="'4-2'"):
        mean_scores({"0-0": [0.1], "4-2": value})


def test_bad_files(tmp_path):
    with pytest.raises(SelectionError, match="does not exist"):
        load_scores(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SelectionError, match="not valid JSON"):
        load_scores(bad)
    bad.write_text("[]")
    with pytest.raises(SelectionError, match="JSON object"):
        load_scores(bad)
    bad.write_text("{}")
    with pytest.raises(SelectionError, match="empty"):
        load_scores(bad)
    with pytest.raises(SelectionError, match="appears twice"):
        mean_scores({"1-2": [0.1], "01-2": [0.3]})


def test_threshold_selects_exactly_heads_above(scores_file):
    s = load_scores(scores_file)
    for tau in (0.05, 0.1, 0.2, 0.5):
        sel = select_threshold(s, tau)
        assert all(s[h] >= tau for h in sel)
        assert all(s[h] < tau for h in set(s) - set(sel))
        assert [s[h] for h in sel] == sorted((s[h] for h in sel), reverse=True)
    assert select_threshold(s, 0.5) == [(2, 3), (1, 5)]
    with pytest.raises(SelectionError, match="no head has a retrieval score >= 0.95"):
        select_threshold(s, 0.95)


def test_top_k(scores_file):
    s = load_scores(scores_file)
    for k in (1, 3, 10, L * H):
        sel = select_top_k(s, k)
        assert len(sel) == len(set(sel)) == k
        rest = set(s) - set(sel)
        if rest:
            assert min(s[h] for h in sel) >= max(s[h] for h in rest)
    assert select_top_k(s, 3) == [(2, 3), (1, 5), (3, 0)]
    for bad in (0, -1, L * H + 1):
        with pytest.raises(SelectionError, match="top-k"):
            select_top_k(s, bad)


@pytest.mark.parametrize("rule", [{"threshold": 0.1}, {"top_k": 6}])
def test_non_retrieval_baseline(scores_file, rule):
    s = load_scores(scores_file)
    retrieval = select_heads(s, **rule).heads
    picks = []
    for seed in range(20):
        sel = select_heads(s, **rule, baseline="non-retrieval", seed=seed)
        assert len(sel.heads) == len(retrieval)
        assert not set(sel.heads) & set(retrieval)
        assert len(set(sel.heads)) == len(sel.heads)
        assert set(sel.heads) <= set(s)
        assert sel.retrieval_heads == retrieval and sel.seed == seed and sel.baseline == "non-retrieval"
        assert sel.heads == select_heads(s, **rule, baseline="non-retrieval", seed=seed).heads  # seeded
        picks.append(tuple(sel.heads))
    assert len(set(picks)) > 10  # different seeds give different draws


def test_random_baseline_can_include_retrieval_heads(scores_file):
    s = load_scores(scores_file)
    retrieval = set(select_threshold(s, 0.1))
    overlaps = 0
    draws = set()
    for seed in range(200):
        sel = select_heads(s, threshold=0.1, baseline="random", seed=seed)
        assert len(sel.heads) == len(retrieval) == len(set(sel.heads))
        assert sel.heads == sample_random(len(retrieval), s, seed)
        overlaps += bool(set(sel.heads) & retrieval)
        draws.add(tuple(sel.heads))
    assert overlaps > 50 and len(draws) > 150


def test_baseline_errors(scores_file):
    s = load_scores(scores_file)
    with pytest.raises(SelectionError, match="only 2 exist"):
        sample_non_retrieval(select_top_k(s, 30), s, 0)
    with pytest.raises(SelectionError, match="exactly one"):
        select_heads(s, threshold=0.1, top_k=3)
    with pytest.raises(SelectionError, match="exactly one"):
        select_heads(s)
    with pytest.raises(SelectionError, match="unknown baseline"):
        select_heads(s, top_k=3, baseline="smaller-model")


def test_model_shape_fills_absent_heads_and_validates(tmp_path):
    raw = {"0-1": [0.4], "1-2": [0.2]}  # a sparse file: the other heads are absent
    s = mean_scores(raw)
    sel = select_heads(s, top_k=2, baseline="non-retrieval", seed=1, model_shape=[3, 4])
    assert len(sel.heads) == 2 and not {(0, 1), (1, 2)} & set(sel.heads)
    assert all(0 <= ly < 3 and 0 <= h < 4 for ly, h in sel.heads)
    assert select_heads(s, top_k=5, model_shape=[3, 4]).scores[2:] == [0.0, 0.0, 0.0]
    with pytest.raises(
        SelectionError, match=r"head \[1, 2\] does not exist in a model with \[L, Hq\] = \[1, 4\]"
    ):
        select_heads(s, top_k=1, model_shape=[1, 4])
    with pytest.raises(SelectionError, match="needs 2 non-retrieval heads but only 1 exist"):
        select_heads(
            mean_scores({"0-0": [0.4], "0-1": [0.2]}), top_k=2, baseline="non-retrieval", model_shape=[1, 3]
        )
    with pytest.raises(SelectionError, match="model shape"):
        check_heads([(0, 0)], [0, 4])


def test_heads_file_round_trip_and_errors(tmp_path, scores_file):
    s = load_scores(scores_file)
    sel = select_heads(s, threshold=0.1, baseline="non-retrieval", seed=7, source=str(scores_file))
    path = write_heads(sel, tmp_path / "out" / "heads.json")
    data = json.loads(path.read_text())
    assert data["heads"] == [list(h) for h in sel.heads]
    assert data["method"] == "threshold" and data["threshold"] == 0.1 and data["seed"] == 7
    assert data["baseline"] == "non-retrieval" and data["source"] == str(scores_file)
    back = read_heads(path, model_shape=[L, H])
    assert (
        back.heads == sel.heads and back.scores == sel.scores and back.retrieval_heads == sel.retrieval_heads
    )
    with pytest.raises(SelectionError, match=r"does not exist in a model with \[L, Hq\] = \[2, 8\]"):
        read_heads(path, model_shape=[2, 8])

    bare = tmp_path / "bare.json"
    bare.write_text("[[0, 1], [3, 2]]")
    assert read_heads(bare).heads == [(0, 1), (3, 2)] and read_heads(bare).method == "explicit"
    for text, msg in [
        ("[[0, 1], [0, 1]]", "listed twice"),
        ('[[0, "1"]]', r"heads\[0\]"),
        ("[[0, -1]]", r"heads\[0\]"),
        ("[]", "non-empty"),
        ('{"x": 1}', "expected"),
        ("{oops", "not valid JSON"),
    ]:
        bare.write_text(text)
        with pytest.raises(SelectionError, match=msg):
            read_heads(bare)
    with pytest.raises(SelectionError, match="does not exist"):
        read_heads(tmp_path / "nope.json")


def test_stable_softmax():
    p = stable_softmax([1000.0, 999.0, 0.0], temperature=0.05)  # naive exp(20000) overflows
    assert math.isclose(sum(p), 1.0) and p[0] > 0.99999 and p[2] == 0.0
    q = stable_softmax([0.1, 0.2, 0.3], temperature=0.05)
    z = sum(math.exp(v / 0.05) for v in (0.1, 0.2, 0.3))
    assert q == pytest.approx([math.exp(v / 0.05) / z for v in (0.1, 0.2, 0.3)])
    with pytest.raises(SelectionError):
        stable_softmax([0.1], temperature=0.0)


def test_mudaf_sampling_basic(scores_file):
    s = load_scores(scores_file)
    heads = sample_softmax_heads(s, n=8, temperature=0.05, seed=3)
    assert len(heads) == len(set(heads)) == 8
    assert heads == sample_softmax_heads(s, n=8, temperature=0.05, seed=3)
    assert (2, 3) in heads  # exp(0.85 / 0.05) dwarfs every other weight
    with pytest.raises(SelectionError, match="cannot sample"):
        sample_softmax_heads(s, n=L * H + 1)


def test_mudaf_sampling_distribution():
    # 4 heads at 0.3, 28 at 0.2: each high head weighs e^2 ≈ 7.4 times a low one.
    scores = {(0, h): 0.3 for h in range(4)} | {(1 + h // 8, h % 8): 0.2 for h in range(28)}
    first = Counter(sample_softmax_heads(scores, n=1, seed=seed)[0] for seed in range(3000))
    probs = dict(zip(sorted(scores), stable_softmax([scores[h] for h in sorted(scores)], 0.05), strict=True))
    p_high = sum(probs[(0, h)] for h in range(4))
    assert sum(first[(0, h)] for h in range(4)) / 3000 == pytest.approx(p_high, abs=0.03)
    # Over 8 draws without replacement, high heads are chosen far more often than low ones.
    counts = Counter(h for seed in range(400) for h in sample_softmax_heads(scores, n=8, seed=seed))
    high = sum(counts[(0, h)] for h in range(4)) / 4
    low = sum(c for h, c in counts.items() if h[0] > 0) / 28
    assert high > 3 * low
    assert sum(counts.values()) == 400 * 8


def test_mudaf_selection_record_and_explicit_heads(tmp_path, scores_file):
    s = load_scores(scores_file)
    sel = mudaf_selection(s, seed=4, model_shape=[L, H], source="x.json")
    assert sel.method == "mudaf-sample" and sel.temperature == 0.05 and len(sel.heads) == 8
    assert sel.heads == sample_softmax_heads(s, n=8, temperature=0.05, seed=4)
    # described as sampled, never as "the 8 highest" (the checkpoint's provenance, the eval's head-set name)
    from retmask.evaluate.suite import _heads_name
    from retmask.hf.export import _rule

    assert sel.top_k is None and _rule(sel.to_json()).startswith(
        "8 heads sampled with P(h) ~ exp(score / 0.05)"
    )
    assert "sampled, temperature 0.05" in _heads_name(sel, "m.json")
    assert read_heads(write_heads(sel, tmp_path / "m.json")).heads == sel.heads  # draw order kept
    assert parse_heads_arg("15-30, 16-1") == [(15, 30), (16, 1)]
    assert parse_heads_arg("[[15, 30], [16, 1]]") == [(15, 30), (16, 1)]
    with pytest.raises(SelectionError, match="'15:30'"):
        parse_heads_arg("15:30")
    with pytest.raises(SelectionError, match="empty head list"):
        parse_heads_arg(" , ")
    with pytest.raises(SelectionError, match=r"\[2, 0\] does not exist"):
        heads_from_json({"heads": [[2, 0]], "model_shape": [2, 4]})


@pytest.mark.parametrize("text", ["１-２", "٣-4", "²-1"])
def test_head_list_with_non_ascii_digits_is_refused(text):
    with pytest.raises(SelectionError, match="two non-negative integers"):
        parse_heads_arg(text)
