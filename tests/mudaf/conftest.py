"""Fixtures for MuDAF tests: synthetic MDQA examples, a byte-level BPE trained on them, a tiny Llama.

Tiny = hidden 64, 2 layers, 4 query heads over 2 KV heads (GQA), head dim 16, vocabulary = the BPE's.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from retmask.mdqa import build_prompt, generate_mdqa


@pytest.fixture(scope="session")
def mdqa_examples():
    """24 examples with 3 distractors each (1-2 golden passages), seeded."""
    return generate_mdqa(24, seed=3, num_distractors=3)


@pytest.fixture(scope="session")
def bpe_tokenizer(mdqa_examples):
    """A byte-level BPE (the SmolLM2 family's scheme) trained on the examples in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([build_prompt(e).text for e in mdqa_examples], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def tiny_llama(
    vocab: int, attn: str = "retmask", seed: int = 0, layers: int = 2
) -> transformers.PreTrainedModel:
    """Random tiny Llama in float32, eval mode; a large init range gives peaked, varied attention."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.2,
        pad_token_id=1, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn, dtype=torch.float32
    ).eval()


@pytest.fixture
def tiny(bpe_tokenizer):
    return tiny_llama(len(bpe_tokenizer))
