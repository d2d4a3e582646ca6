"""``evaluate_niah``: answers equal plain greedy decoding (with and without masked heads), a masked run
equals a run on an o_proj-zeroed copy, grid / mean / JSON round trip, the heatmap, clear errors."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

import retmask
from retmask.detect import stop_token_ids
from retmask.evaluate.niah import NiahResult, evaluate_niah, format_grid, plot_niah
from retmask.hf.export import zero_heads_
from retmask.niah import build_tests, default_haystack_text, load_needles
from retmask.niah.answer_kind import classify_answer

from .conftest import greedy_reference

LENGTHS, DEPTHS = [300, 430], [0, 40, 100]
MASK = [(0, 1), (1, 2), (1, 3)]


def _needles():
    return load_needles()[:2]


def _eval(model, tok, heads=None, max_new_tokens=12, chunk=64):
    return evaluate_niah(
        model, tok, lengths=LENGTHS, depths=DEPTHS, needles=_needles(), heads=heads,
        max_new_tokens=max_new_tokens, progress=False, chunk=chunk,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tiny, tokenizer):
    return {"plain": _eval(tiny, tokenizer), "masked": _eval(tiny, tokenizer, heads=MASK)}


@pytest.mark.parametrize("which", ["plain", "masked"])
def test_answers_equal_step_by_step_greedy(which, runs, tiny, tokenizer):
    res = runs[which]
    tests = build_tests(tokenizer, _needles(), default_haystack_text(), LENGTHS, DEPTHS)
    assert len(res.entries) == len(tests) == 12
    stops = stop_token_ids(tokenizer, tiny)
    mask = MASK if which == "masked" else []
    with retmask.head_mask(tiny, mask):
        for t, e in zip(tests, res.entries, strict=True):
            assert (e["index"], e["length"], e["depth"]) == (t.index, t.length, t.depth)
            want = greedy_reference(tiny, t.prompt_ids, stops, 12)
            assert e["tokens"] == want, t.key
            assert e["response"] == tokenizer.decode(want, skip_special_tokens=True).strip()
            real = _needles()[t.needle_index].real_needle
            assert e["answer_kind"] == classify_answer(real, e["response"])
    assert res.meta["heads"] == [list(h) for h in mask]
    assert (res.meta["dtype"], res.meta["device"]) == ("float32", "cpu")  # recorded, also when the default
    # entries of results written before the kind was recorded are classified from meta["needles"]
    old = NiahResult(
        [{k: v for k, v in e.items() if k != "answer_kind"} for e in res.entries], [], [], res.meta
    )
    assert old.answer_kinds() == res.answer_kinds() and sum(res.answer_kinds().values()) == 12


def test_answers_equal_hf_generate(runs, tiny, tokenizer):
    """The same answers as ``model.generate(do_sample=False)`` stopping on the stop tokens."""
    res = runs["plain"]
    tests = build_tests(tokenizer, _needles(), default_haystack_text(), LENGTHS, DEPTHS)
    stops = sorted(stop_token_ids(tokenizer, tiny))
    for t in (tests[0], tests[-1]):
        ids = torch.as_tensor(t.prompt_ids)[None]
        gen = tiny.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
            eos_token_id=stops, pad_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        assert res.entries[t.index]["tokens"] == gen[0, ids.shape[1] :].tolist()


def test_mask_changes_answers_and_equals_zeroed_copy(runs, tiny, tokenizer):
    plain, masked = runs["plain"], runs["masked"]
    assert any(a["tokens"] != b["tokens"] for a, b in zip(plain.entries, masked.entries, strict=True)), (
        "masking 3 of 8 heads should change some answer, or the masked-vs-zeroed check proves nothing"
    )
    zeroed = zero_heads_(copy.deepcopy(tiny), MASK)
    ref = _eval(zeroed, tokenizer, chunk=128)  # another chunk size too: prefix reuse changes nothing
    assert [e["tokens"] for e in ref.entries] == [e["tokens"] for e in masked.entries]
    assert ref.meta["heads"] == []
    # the context manager restored the unmasked model
    assert [e["tokens"] for e in _eval(tiny, tokenizer).entries] == [e["tokens"] for e in plain.entries]


def test_bool_mask_equals_head_list(runs, tiny, tokenizer):
    mask = torch.zeros(2, 4, dtype=torch.bool)
    for layer, head in MASK:
        mask[layer, head] = True
    res = _eval(tiny, tokenizer, heads=mask)
    assert [e["tokens"] for e in res.entries] == [e["tokens"] for e in runs["masked"].entries]
    assert _eval(tiny, tokenizer, heads=[]).meta["heads"] == []


def _entry(i, length, depth, recall, needle=0):
    return {"index": i, "key": f"n{needle}-L{length}-d{depth}", "needle_index": needle, "length": length,
            "depth": depth, "response": "x", "rouge1_recall": recall}  # fmt: skip


def test_grid_mean_and_json_round_trip(tmp_path):
    entries = [
        _entry(0, 1000, 0, 1.0),
        _entry(1, 1000, 50, 0.5),
        _entry(2, 2000, 0, 0.25),
        _entry(3, 1000, 0, 0.0, needle=1),
        _entry(4, 1000, 50, 0.75, needle=1),
    ]
    res = NiahResult(entries, [1000, 2000], [0, 50], {"heads": [[1, 2]]})
    grid = res.grid()
    assert grid.shape == (2, 2)
    np.testing.assert_allclose(grid[0], [0.5, 0.25])
    assert grid[1, 0] == pytest.approx(0.625) and math.isnan(grid[1, 1])
    assert res.mean == pytest.approx(2.5 / 5)
    text = json.dumps(res.to_json())  # strict JSON: no NaN literal
    assert "NaN" not in text
    back = NiahResult.from_json(json.loads(text))
    np.testing.assert_array_equal(back.grid(), grid)
    assert back.mean == res.mean and back.meta == res.meta and back.entries == entries
    assert math.isnan(NiahResult([], [1000], [0]).mean)
    with pytest.raises(ValueError, match="version"):
        NiahResult.from_json({"lengths": []})
    with pytest.raises(ValueError, match="outside the grid"):
        NiahResult([_entry(0, 999, 0, 1.0)], [1000], [0]).grid()
    table = format_grid(res)
    assert "0.62" in table and "-" in table and "mean ROUGE-1 recall: 0.500" in table
    png = tmp_path / "h.png"
    plot_niah(res, png, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_clear_errors(tiny, tokenizer):
    with pytest.raises(ValueError, match="out of range"):
        _eval(tiny, tokenizer, heads=[(5, 0)])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        evaluate_niah(tiny, tokenizer, lengths=[2000], depths=[0], progress=False)
    with pytest.raises(ValueError, match="depths"):
        evaluate_niah(tiny, tokenizer, lengths=[300], depths=[150], progress=False)
    res = evaluate_niah(
        tiny, tokenizer, lengths=[150, 300], depths=[0], needles=_needles()[:1], max_new_tokens=2,
        progress=False,
    )  # fmt: skip
    assert [s["length"] for s in res.meta["skipped"]] == [150]  # too short for the buffer: reported
    assert [e["length"] for e in res.entries] == [300]


@pytest.mark.embedded
def test_embedded_model_finds_needles_and_top_heads_matter(embedded):
    """Unmasked, SmolLM2 recalls the needles at short lengths; all 9 heads of layers 17-20 masked
    (where its top retrieval heads are) it loses them."""
    model, tok = embedded
    kw = dict(lengths=[600], depths=[0, 50], needles=load_needles()[:2], max_new_tokens=30, progress=False)
    plain = evaluate_niah(model, tok, **kw)
    assert plain.mean > 0.6, [e["response"] for e in plain.entries]
    heads = [(layer, h) for layer in (17, 18, 20, 23) for h in range(9)]
    masked = evaluate_niah(model, tok, heads=heads, **kw)
    assert masked.mean < plain.mean
    # the fast path's masked answer is plain greedy decoding's on the real model too
    t = build_tests(tok, kw["needles"], default_haystack_text(), kw["lengths"], kw["depths"])[3]
    with retmask.head_mask(model, heads):
        want = greedy_reference(model, t.prompt_ids, stop_token_ids(tok, model), 30)
    assert masked.entries[t.index]["tokens"] == want
