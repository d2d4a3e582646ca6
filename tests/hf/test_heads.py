"""Runtime head masks equal checkpoints with zeroed o_proj columns; per-row masks; input errors."""

from __future__ import annotations

import pytest
import torch

import retmask

from .conftest import random_batch, tiny_model, with_attn, zeroed_copy

HEADS = [(0, 1), (1, 0), (1, 3)]  # query heads 0 and 1 share KV head 0: GQA must not leak


def logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_head_mask_equals_zeroed_o_proj(arch):
    model = tiny_model(arch)
    zeroed = zeroed_copy(model, HEADS)
    ids, mask = random_batch(2, 12, left_pad=[0, 3])
    valid = mask.bool()
    retmask.set_head_mask(model, HEADS)
    try:
        torch.testing.assert_close(
            logits(model, ids, mask)[valid], logits(zeroed, ids, mask)[valid], atol=1e-4, rtol=1e-4
        )
    finally:
        retmask.clear_head_mask(model)
    plain = with_attn(model, "sdpa")
    torch.testing.assert_close(
        logits(model, ids, mask)[valid], logits(plain, ids, mask)[valid], atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("path", ["cpp", "bf16dot"])
def test_head_mask_equals_zeroed_o_proj_in_bf16(arch, path, monkeypatch):
    """Both sides in bf16 on retmask attention: the same, bit for bit. A masked head's output is exactly 0
    where the zeroed checkpoint multiplies it by exact zeros, so every o_proj sum has the same non-zero
    terms. (Against SDPA the other heads differ by bf16 rounding, as any two bf16 kernels do.) With the
    CPU kernel's fp32-converting path and with its bf16 dot products (which always use one tile layout,
    so that skipping a head cannot change another head's arithmetic)."""
    monkeypatch.setenv("RETMASK_CPU_PATH", path)
    model = tiny_model(arch).to(torch.bfloat16)
    zeroed = zeroed_copy(model, HEADS, attn="retmask")
    ids, mask = random_batch(2, 12, left_pad=[0, 3])
    valid = mask.bool()
    with retmask.head_mask(model, HEADS):
        masked = logits(model, ids, mask)[valid]
    want = logits(zeroed, ids, mask)[valid]
    assert masked.dtype == torch.bfloat16 and torch.equal(masked, want)
    assert not torch.equal(logits(model, ids, mask)[valid], want)  # the mask changed something


def test_mask_forms_agree_and_context_manager_restores():
    model = tiny_model("qwen3")
    ids, mask = random_batch(2, 8)
    as_tensor = torch.zeros(2, 4, dtype=torch.bool)
    for layer, head in HEADS:
        as_tensor[layer, head] = True
    with retmask.head_mask(model, HEADS) as normalised:
        assert torch.equal(normalised, as_tensor)
        from_pairs = logits(model, ids, mask)
    with retmask.head_mask(model, as_tensor):
        from_tensor = logits(model, ids, mask)
    with retmask.head_mask(model, ["0-1", "1-0", "1-3"]):
        from_strings = logits(model, ids, mask)
    with retmask.head_mask(model, as_tensor.numpy()) as from_numpy:  # a NumPy bool array is a mask too
        assert torch.equal(from_numpy, as_tensor)
    assert torch.equal(from_pairs, from_tensor) and torch.equal(from_pairs, from_strings)
    # Nested: the inner block restores the outer mask, the outer block restores "no mask".
    unmasked = logits(model, ids, mask)
    with retmask.head_mask(model, [(0, 0)]):
        outer = logits(model, ids, mask)
        with retmask.head_mask(model, HEADS):
            pass
        assert torch.equal(logits(model, ids, mask), outer)
    assert torch.equal(logits(model, ids, mask), unmasked)


def test_per_row_masks_equal_separate_runs(arch):
    model = tiny_model(arch)
    ids, mask = random_batch(3, 10, left_pad=[2, 0, 0])
    rows = torch.zeros(3, 2, 4, dtype=torch.bool)
    rows[0, 0, 1] = rows[0, 1, 2] = True  # row 0: two heads
    rows[2, 1, 0] = rows[2, 1, 1] = rows[2, 0, 3] = True  # row 2: three heads; row 1: none
    with retmask.head_mask(model, rows):
        batched = logits(model, ids, mask)
    for b in range(3):
        with retmask.head_mask(model, rows[b]):
            alone = logits(model, ids[b : b + 1], mask[b : b + 1])
        valid = mask[b].bool()
        torch.testing.assert_close(batched[b][valid], alone[0][valid], atol=1e-4, rtol=1e-4)


def test_per_row_generate_equals_separate_generates():
    model = tiny_model("llama")
    ids, mask = random_batch(2, 7, left_pad=[0, 2], seed=5)
    rows = torch.zeros(2, 2, 4, dtype=torch.bool)
    rows[1, 0, 0] = rows[1, 1, 2] = True
    both, plain, masked = _generate_per_row(model, ids, mask, rows, rows, max_new_tokens=6)
    assert torch.equal(both[0], plain[0]) and torch.equal(both[1], masked[1])


def _generate_per_row(model, ids, mask, rows, per_row_mask, **kw):
    """Greedy generate with ``per_row_mask`` set, unmasked, and with row 1's heads on the whole batch."""
    kw = dict(do_sample=False, pad_token_id=0, **kw)
    with retmask.head_mask(model, per_row_mask), torch.no_grad():
        both = model.generate(input_ids=ids, attention_mask=mask, **kw)
    with torch.no_grad():
        plain = model.generate(input_ids=ids, attention_mask=mask, **kw)
        with retmask.head_mask(model, rows[1]):
            masked = model.generate(input_ids=ids, attention_mask=mask, **kw)
    return both, plain, masked


def test_head_mask_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"layer 2, head 0.*\[L, Hq\] = \[2, 4\]"):
        retmask.set_head_mask(model, [(2, 0)])
    with pytest.raises(ValueError, match=r"layer 0, head 4.*\[L, Hq\] = \[2, 4\]"):
        retmask.set_head_mask(model, [(0, 4)])
    with pytest.raises(ValueError, match=r"layer -1"):
        retmask.set_head_mask(model, [(-1, 0)])
    with pytest.raises(ValueError, match=r"\[L, Hq\] = \[2, 4\].*got \[3, 4\]"):
        retmask.set_head_mask(model, torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be bool"):
        retmask.set_head_mask(model, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="head entry #1"):
        retmask.set_head_mask(model, [(0, 0), (1,)])
    with pytest.raises(TypeError, match="list of"):
        retmask.set_head_mask(model, 3)
    with pytest.raises(ValueError, match="meta device .* build it on the CPU"):
        retmask.set_head_mask(model, torch.zeros(2, 4, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="retmask.patch"):
        retmask.set_head_mask(with_attn(model, "sdpa"), [(0, 0)])
    ids, mask = random_batch(2, 5)
    with retmask.head_mask(model, torch.zeros(3, 2, 4, dtype=torch.bool)):
        with pytest.raises(ValueError, match="batch size 3 but this forward call has 2 rows"):
            logits(model, ids, mask)


def test_masked_heads_get_no_gradient_through_attention():
    model = tiny_model("llama")
    model.train()
    ids, _ = random_batch(2, 8)
    with retmask.head_mask(model, [(0, 1)]):
        model(input_ids=ids, labels=ids).loss.backward()
    # The masked head's output is 0, so its o_proj columns receive no gradient.
    grad = model.model.layers[0].self_attn.o_proj.weight.grad
    assert grad[:, 16:32].abs().max() == 0 and grad[:, :16].abs().max() > 0


def test_head_mask_rejects_bools_as_indices():
    """(0, True) would index "every head" of a tensor mask: bools are not layer or head numbers."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"head entry #0 is \(0, True\).*pair of integers"):
        retmask.set_head_mask(model, [(0, True)])
    with pytest.raises(ValueError, match=r"head entry #1 is \(False, 1\)"):
        retmask.set_head_mask(model, [(0, 1), (False, 1)])
    with pytest.raises(ValueError, match=r"head entry #0"):
        retmask.set_head_mask(model, [(torch.tensor(True), 0)])
    layers = retmask.hf.head_layout(model).layers
    assert all(getattr(m, "_retmask_skip", None) is None for m in layers)  # nothing was set


def test_index_arrays_of_pairs_select_the_same_heads_as_the_mask():
    """What users get from a bool mask's indices: mask.nonzero(), np.argwhere(mask), their rows, and
    NumPy integers inside pairs."""
    import numpy as np

    model = tiny_model("llama")
    want = torch.zeros(2, 4, dtype=torch.bool)
    want[0, 1] = want[1, 3] = True
    for spec in (
        want.nonzero(), np.argwhere(want.numpy()), list(want.nonzero()), list(np.argwhere(want.numpy())),
        [(np.int64(0), np.int64(1)), (1, 3)], np.array(["0-1", "1-3"]),
    ):  # fmt: skip
        retmask.set_head_mask(model, spec)
        got = torch.stack([m._retmask_skip for m in retmask.hf.head_layout(model).layers])
        assert torch.equal(got, want), spec
    retmask.set_head_mask(model, torch.zeros(0, 2, dtype=torch.long))  # no pairs: nothing masked
    assert all(m._retmask_skip is None for m in retmask.hf.head_layout(model).layers)


def test_dicts_and_ambiguous_integer_tensors_are_refused_with_the_fix():
    """A scores dict's keys would select every head it scores: refused, naming how to choose heads."""
    import numpy as np

    from retmask.heads import normalize_head_mask

    model = tiny_model("llama")
    with pytest.raises(TypeError, match=r"heads is a dict.*select_top_k.*data\['heads'\]"):
        retmask.set_head_mask(model, {"0-1": [0.9], "1-2": [0.0]})
    with pytest.raises(ValueError, match=r"must be bool.*int8 of shape \[2, 4\].*mask.bool\(\)"):
        retmask.set_head_mask(model, np.zeros((2, 4), dtype=np.int8))
    with pytest.raises(ValueError, match=r"shape \[2, 2\] is ambiguous.*mask.bool\(\).*tolist\(\)"):
        normalize_head_mask(torch.tensor([[0, 1], [1, 0]]), 2, 2)
    assert torch.equal(
        normalize_head_mask(torch.tensor([[0, 1], [1, 0]]).bool(), 2, 2), torch.eye(2).flip(0).bool()
    )


def test_switching_attention_inside_a_mask_is_refused_not_ignored():
    """A mask set, then the model moved to SDPA: the forward call is refused (it would run every head)."""
    model = tiny_model("llama")
    ids, mask = random_batch(2, 5)
    reference = logits(model, ids, mask)
    with retmask.head_mask(model, HEADS):
        model.set_attn_implementation("sdpa")
        with pytest.raises(
            ValueError,
            match="a head mask is active on this model, but it now uses attn_implementation='sdpa', which ignores it",
        ):
            logits(model, ids, mask)
        retmask.patch(model)
        masked = logits(model, ids, mask)
    assert not torch.allclose(masked, reference)
    # the mask is gone after the block: SDPA runs again without complaint and equals the unmasked model
    model.set_attn_implementation("sdpa")
    assert torch.allclose(logits(model, ids, mask), reference, atol=1e-5)
    retmask.patch(model)
    retmask.set_head_mask(model, HEADS)
    retmask.clear_head_mask(model)
    model.set_attn_implementation("sdpa")
    assert torch.allclose(logits(model, ids, mask), reference, atol=1e-5)
    assert all(not m._forward_pre_hooks for m in retmask.hf.layers.head_layout(model).layers)


def test_per_row_mask_under_beam_search_names_the_row_order():
    """generate() with beams runs k copies of each row next to each other: a [B, L, Hq] mask is refused
    naming repeat_interleave, and the mask so expanded gives every beam its row's heads."""
    model = tiny_model("llama")
    ids, mask = random_batch(2, 7, left_pad=[0, 2], seed=5)
    rows = torch.zeros(2, 2, 4, dtype=torch.bool)
    rows[1, 0, 0] = rows[1, 1, 2] = True
    with retmask.head_mask(model, rows), torch.no_grad():
        with pytest.raises(ValueError, match=r"mask.repeat_interleave\(k, dim=0\), not mask.repeat"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=3, pad_token_id=0)
    expanded = rows.repeat_interleave(3, dim=0)
    both, plain, masked = _generate_per_row(model, ids, mask, rows, expanded, max_new_tokens=5, num_beams=3)
    assert torch.equal(both[0], plain[0]) and torch.equal(both[1], masked[1])
    assert not torch.equal(plain[1], masked[1])  # the heads change row 1's beams: the test can fail
