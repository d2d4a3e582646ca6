"""Fixtures for the evaluation tests: the embedded tokenizer, a tiny random Llama over its vocabulary, and
a plain step-by-step greedy decoder (the reference the fast NIAH evaluation must equal)."""

from __future__ import annotations

import pytest
import torch
import transformers

import retmask


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer (chat template, newline tokens, EOS) without loading the model."""
    return transformers.AutoTokenizer.from_pretrained(retmask.default_model_path())


def tiny_llama(tokenizer, seed: int = 0, init: float = 0.2) -> transformers.PreTrainedModel:
    """2 layers, 4 query heads over 2 KV heads, head dim 16, SmolLM2's vocabulary; a large init range keeps
    logits well separated so float rounding (chunked vs one-token passes) decides no argmax."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        initializer_range=init, pad_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="retmask").eval()


@pytest.fixture(scope="session")
def tiny(tokenizer):
    return tiny_llama(tokenizer)


@torch.no_grad()
def greedy_reference(model, prompt_ids, stop_ids, max_new_tokens: int) -> list[int]:
    """Plain greedy decoding: one full forward over the prompt, then one token per call; stops after a
    stop token (included) or ``max_new_tokens``. Any runtime head mask of ``model`` applies."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)[None]
    cache = transformers.DynamicCache(config=model.config)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    tokens: list[int] = []
    while True:
        y = int(out.logits[0, -1].argmax())
        tokens.append(y)
        if y in stop_ids or len(tokens) >= max_new_tokens:
            return tokens
        out = model(input_ids=torch.tensor([[y]]), past_key_values=cache, use_cache=True)


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct on retmask attention."""
    return retmask.load_model()
