"""Fixtures for MuDAF tests: synthetic MDQA examples, a byte-level BPE trained on them, a tiny Llama.

Tiny = hidden 64, 2 layers, 4 query heads over 2 KV heads (GQA), head dim 16, vocabulary = the BPE's.
"""

from __future__ import annotations

import pytest
import transformers

from retmask.methods.mudaf.mdqa import build_prompt, generate_mdqa
from tests.tiny import tiny_llama_for


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


@pytest.fixture
def tiny(bpe_tokenizer):
    return tiny_llama_for(bpe_tokenizer)
