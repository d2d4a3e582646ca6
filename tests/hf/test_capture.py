"""capture_argmax equals the argmax of eager attention weights: prefill, decode with cache, chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import retmask

from .conftest import assert_argmax_matches, random_batch, tiny_model, with_attn


def eager_attentions(model, ids, mask, past=None):
    """Per-layer eager attention weights [B, Hq, S, N] (stacked: [L, B, Hq, S, N])."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, cache=past, use_cache=past is not None,
                    output_attentions=True)  # fmt: skip
    return torch.stack(out.attentions), out


def test_capture_prefill_left_padded(arch):
    model = tiny_model(arch)
    eager = with_attn(model, "eager")
    ids, mask = random_batch(3, 12, left_pad=[0, 3, 5])
    with retmask.capture_argmax(model, rows=4) as cap, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    weights, _ = eager_attentions(eager, ids, mask)
    assert len(cap.calls) == 1 and cap.last.dtype == torch.int64
    assert cap.last.shape == (2, 3, 4, 4)  # [L, B, Hq, T]
    assert_argmax_matches(cap.last, weights[:, :, :, -4:])
    # Indices are absolute KV positions: never a pad position.
    assert (cap.last[:, 1] >= 3).all() and (cap.last[:, 2] >= 5).all()


def test_capture_rows_clipped_and_mask():
    model = tiny_model("llama")
    eager = with_attn(model, "eager")
    ids, mask = random_batch(2, 6)
    rows = torch.tensor([False, True, False, True, True, False])
    with retmask.capture_argmax(model, rows=50) as cap_all, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    with retmask.capture_argmax(model, rows=rows) as cap_sel, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    weights, _ = eager_attentions(eager, ids, mask)
    assert cap_all.last.shape == (2, 2, 4, 6)  # T' = min(50, 6)
    assert_argmax_matches(cap_all.last, weights)
    assert torch.equal(cap_sel.last, cap_all.last[..., rows])


def test_capture_rows_per_batch_row_right_padded():
    """A [B, S] rows mask selects each batch row's own rows: with right padding, the real tokens only."""
    model = tiny_model("llama")
    eager = with_attn(model, "eager")
    ids, _ = random_batch(3, 7, seed=3)
    lengths = [7, 4, 5]
    mask = torch.zeros(3, 7, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    rows = torch.zeros(3, 7, dtype=torch.bool)
    rows[0, [2, 6]] = True  # 2 rows
    rows[1, [1, 2, 3]] = True  # 3 rows (T' = 3), the widest
    rows[2, [4]] = True  # 1 row
    with retmask.capture_argmax(model, rows=rows) as cap, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    weights, _ = eager_attentions(eager, ids, mask)  # [L, B, Hq, S, N]
    assert cap.last.shape == (2, 3, 4, 3)
    for b in range(3):
        sel = rows[b].nonzero().flatten()
        got = cap.last[:, b, :, : sel.numel()]
        assert_argmax_matches(got, weights[:, b][:, :, sel])
        assert (cap.last[:, b, :, sel.numel() :] == -1).all()  # slots past this row's count
        assert int(got.max()) < lengths[b]  # never a right-pad key


def test_capture_rows_per_batch_row_errors():
    model = tiny_model("llama")
    ids, mask = random_batch(2, 5)
    bad = torch.ones(2, 5, dtype=torch.bool)
    bad[1] = False
    with pytest.raises(ValueError, match="selects no row for batch rows \\[1\\]"):
        retmask.capture_argmax(model, rows=bad)
    with retmask.capture_argmax(model, rows=torch.ones(3, 5, dtype=torch.bool)), torch.no_grad():
        with pytest.raises(ValueError, match="batch size 3"):
            model(input_ids=ids, attention_mask=mask)


def test_capture_decode_steps_and_chunk_against_cache(arch):
    model = tiny_model(arch)
    eager = with_attn(model, "eager")
    ids, mask = random_batch(2, 10, left_pad=[0, 2])
    steps = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1)).to(ids.device)
    full_ids = torch.cat([ids, steps], 1)
    full_mask = torch.cat([mask, torch.ones_like(steps)], 1)
    weights, _ = eager_attentions(eager, full_ids, full_mask)  # [L, B, Hq, 15, 15]

    past = DynamicCache(config=model.config)
    with retmask.capture_argmax(model, rows=1) as cap, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=past, use_cache=True)  # prefill
        for t in range(2):  # two decode steps with the cache
            n = 10 + t + 1
            model(
                input_ids=steps[:, t : t + 1],
                attention_mask=full_mask[:, :n],
                cache=past,
                use_cache=True,
            )
        # a chunk of 3 tokens verified against the cache in one call, argmax of all 3 rows
    with retmask.capture_argmax(model, rows=3) as chunk, torch.no_grad():
        model(input_ids=steps[:, 2:5], attention_mask=full_mask, cache=past, use_cache=True)
    assert len(cap.calls) == 3
    assert_argmax_matches(cap.calls[0], weights[:, :, :, 9:10, :10])
    for t in range(2):
        n = 10 + t + 1
        assert cap.calls[1 + t].shape == (2, 2, 4, 1)
        assert_argmax_matches(cap.calls[1 + t], weights[:, :, :, n - 1 : n, :n])
    assert chunk.last.shape == (2, 2, 4, 3)
    assert_argmax_matches(chunk.last, weights[:, :, :, 12:15, :15])


def test_capture_generate_one_entry_per_step():
    model = tiny_model("qwen2")
    ids, mask = random_batch(2, 7, left_pad=[2, 0])
    with retmask.capture_argmax(model, rows=1) as cap, torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0
        )
    assert out.shape[1] == 11 and len(cap.calls) == 4
    assert [c.shape[-1] for c in cap.calls] == [1, 1, 1, 1]
    # Decode step t attends to the cache: its argmax may point anywhere in the first 7 + t keys.
    for t, c in enumerate(cap.calls):
        assert int(c.max()) < 7 + t + 1


def test_capture_errors():
    model = tiny_model("llama")
    ids, mask = random_batch(1, 5)
    with pytest.raises(ValueError, match="rows must be >= 1"):
        retmask.capture_argmax(model, rows=0)
    with pytest.raises(TypeError, match="rows must be an int"):
        retmask.capture_argmax(model, rows=2.5)
    with pytest.raises(
        TypeError, match=r"bool mask \[S\] or \[B, S\].*got torch.int64 of shape \[5\].*rows.bool\(\)"
    ):
        retmask.capture_argmax(model, rows=torch.tensor([0, 0, 0, 1, 1]))
    with retmask.capture_argmax(model, rows=np.int64(2)) as cap, torch.no_grad():  # NumPy ints are ints
        model(input_ids=ids, attention_mask=mask)
    assert cap.calls[0].shape[-1] == 2
    with retmask.capture_argmax(model, rows=torch.ones(8, dtype=torch.bool)), torch.no_grad():
        with pytest.raises(
            ValueError, match="8 entries but this forward call has 5 query rows.*generate.*rows=<int>"
        ):
            model(input_ids=ids, attention_mask=mask)
    sdpa = with_attn(model, "sdpa")
    with pytest.raises(ValueError, match="retmask.patch"):
        retmask.capture_argmax(sdpa)
    cap = retmask.capture_argmax(model)
    with pytest.raises(RuntimeError, match="no forward call"):
        _ = cap.last
