"""A few TRL DPOTrainer steps run through retmask attention (padding, backward) and change the weights."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

import retmask

from .conftest import tiny_config


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(retmask.default_model_path())
    tok.pad_token = tok.pad_token or tok.eos_token
    return tok


def test_dpo_steps_change_weights(tmp_path, tokenizer):
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                         initializer_range=0.02)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", attn_implementation="retmask")
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    rows = [
        {"prompt": "Name a colour.", "chosen": " Blue is a colour.", "rejected": " Seven."},
        {
            "prompt": "What is two plus two? Answer briefly.",
            "chosen": " Four.",
            "rejected": " It is five or six.",
        },
        {"prompt": "Say hello.", "chosen": " Hello!", "rejected": " No."},
        {"prompt": "Capital of France?", "chosen": " Paris.", "rejected": " Berlin, I think."},
    ]
    args = DPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=2, max_steps=2,
        learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], max_length=64,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = DPOTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    # TRL rebuilt the reference model from the saved path: it must use retmask attention too.
    ref = trainer.ref_model
    assert ref is not None and ref is not model and ref.config._attn_implementation == "retmask"
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    changed = [k for k, v in model.named_parameters() if not torch.equal(v.detach(), before[k])]
    assert any("self_attn" in k for k in changed), changed
