"""retmask attention gives SDPA's outputs: forward, padded batches, generation with a KV cache, gradients."""

from __future__ import annotations

import torch

from .conftest import random_batch, tiny_model, with_attn


def test_forward_equals_sdpa_no_mask(arch):
    model = tiny_model(arch)
    sdpa = with_attn(model, "sdpa")
    ids, _ = random_batch(2, 16)
    with torch.no_grad():
        got = model(input_ids=ids).logits
        want = sdpa(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_forward_equals_sdpa_left_padded(arch):
    model = tiny_model(arch)
    sdpa = with_attn(model, "sdpa")
    ids, mask = random_batch(3, 12, left_pad=[0, 4, 7])
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = sdpa(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()  # pad rows are garbage in every implementation
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)


def test_generate_left_padded_equals_sdpa(arch):
    model = tiny_model(arch)
    sdpa = with_attn(model, "sdpa")
    ids, mask = random_batch(3, 9, left_pad=[0, 2, 5], seed=3)
    kw = dict(
        max_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        got = model.generate(input_ids=ids, attention_mask=mask, **kw)
        want = sdpa.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=1e-4, rtol=1e-4)


def test_padded_row_equals_unpadded_run():
    """Left padding must not change a row's logits (the padding mask reaches the kernel)."""
    model = tiny_model("llama")
    ids, mask = random_batch(2, 10, left_pad=[0, 4])
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask).logits[1, 4:]
        alone = model(input_ids=ids[1:, 4:]).logits[0]
    torch.testing.assert_close(batched, alone, atol=1e-4, rtol=1e-4)


def test_gradients_equal_sdpa(arch):
    model = tiny_model(arch)
    sdpa = with_attn(model, "sdpa")
    model.train()
    sdpa.train()
    ids, mask = random_batch(2, 10, left_pad=[0, 3])
    labels = ids.masked_fill(mask == 0, -100)
    for m in (model, sdpa):
        m.zero_grad()
        m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), sdpa.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=name)
