"""Integration with the embedded SmolLM2-135M-Instruct (loaded through the converted-folder cache)."""

from __future__ import annotations

import pytest
import torch

import retmask

from .conftest import assert_argmax_matches, with_attn, zeroed_copy

pytestmark = pytest.mark.embedded

HEADS = [(0, 3), (5, 0), (5, 8), (17, 4), (29, 2)]


@pytest.fixture(scope="module")
def smol():
    model, tok = retmask.load_model()
    tok.padding_side = "left"
    return model, tok


def chat_batch(tok):
    prompts = ["What is the capital of France?", "Write one word that rhymes with cat."]
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]  # fmt: skip
    return tok(texts, return_tensors="pt", padding=True)


def test_embedded_capture_equals_eager_argmax(smol):
    model, tok = smol
    assert (model.config.num_hidden_layers, model.config.num_attention_heads) == (30, 9)
    batch = chat_batch(tok)
    with retmask.capture_argmax(model, rows=4) as cap, torch.no_grad():
        logits = model(**batch).logits
    eager = with_attn(model, "eager")
    with torch.no_grad():
        out = eager(**batch, output_attentions=True)
    assert cap.last.shape == (30, 2, 9, 4)
    assert_argmax_matches(cap.last, torch.stack(out.attentions)[:, :, :, -4:], atol=1e-5)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(logits[valid], out.logits[valid], atol=2e-3, rtol=1e-3)


def test_embedded_masked_heads_equal_zeroed_copy(smol):
    model, tok = smol
    batch = chat_batch(tok)
    valid = batch["attention_mask"].bool()
    zeroed = zeroed_copy(model, HEADS)
    with retmask.head_mask(model, HEADS), torch.no_grad():
        masked = model(**batch).logits
    with torch.no_grad():
        want = zeroed(**batch).logits
        plain = model(**batch).logits
    torch.testing.assert_close(masked[valid], want[valid], atol=2e-3, rtol=1e-3)
    assert (masked[valid] - plain[valid]).abs().max() > 1e-2  # the mask does something
