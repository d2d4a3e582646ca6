"""Shared training settings (RetMask's published defaults) and the prompt-length check.

RetMask's published set-up: AdamW β1 = 0.9, β2 = 0.95, weight decay 0.1, linear warm-up over 10% of the
steps to the peak lr 5e-7, then cosine down to 5e-8 (transformers' ``cosine_with_min_lr`` with
``min_lr_rate = 0.1``), DPO sigmoid loss with β = 0.1, 2 epochs. The optimizer is torch's fused AdamW
(``adamw_torch_fused``; CPU and CUDA): the same update as the per-parameter loop of ``adamw_torch`` in one
kernel, 0.07 s instead of 0.51 s per step for SmolLM2's 135M fp32 parameters on 2 cores, which is about
7% of a DPO step there, in fp32 and bf16 alike. Precision: ``dtype="float32"`` (the
default here; TRL 1.16 itself defaults to bf16) or ``"bfloat16"`` (the published runs' choice: the
Trainer's bf16 autocast over float32 master weights and optimizer state, on CPU too).

Prompt length. TRL 1.16 has no ``max_prompt_length`` any more: every sequence (prompt + response) is
truncated to ``max_length`` keeping its start, and an example whose prompt *alone* reaches ``max_length``
is silently filtered out. :func:`length_report` counts both cases on the actual chat-templated tokens
before training; :func:`check_lengths` raises when any example would be dropped (so the number of
examples trained on is the number in the file) and reports how many responses will be cut.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from retmask.methods.retmask.pairs import PairsError


@dataclass
class TrainConfig:
    """Optimisation settings common to DPO and the SFT baseline (per-device batch x grad-accum x processes
    = global batch; the published recipe's global batch is 512)."""

    learning_rate: float = 5e-7
    min_lr_rate: float = 0.1  # cosine ends at 0.1 x peak = 5e-8
    warmup_ratio: float = 0.1
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    epochs: float = 2.0
    max_steps: int = -1  # > 0 overrides epochs
    batch_size: int = 2
    grad_accum: int = 8
    max_length: int = 1024
    seed: int = 0
    logging_steps: int = 1
    gradient_checkpointing: bool = False  # TRL 1.16 turns it on by default (as activation_checkpointing); not needed for small models on CPU
    beta: float = 0.1  # DPO only
    dtype: str = "float32"  # or "bfloat16": bf16 autocast, float32 master weights (Trainer's bf16=True)
    # "cpu" or "cuda" (the Trainer places the model itself; on CUDA its first visible GPU)
    device: str = "cpu"
    # train only on pairs whose responses ended by themselves (DPO: both; SFT: the chosen one), not at the
    # generation limit (``pairs.drop_unfinished``)
    drop_unfinished: bool = False
    # write a checkpoint into the output folder every N optimizer steps (0: never), so an interrupted run
    # continues with resume (``retmask.methods.checkpoints``)
    save_every: int = 0

    def warn_if_nothing_trains(self) -> None:
        """Warn when the schedule leaves the weights as they are: the linear warmup starts at learning rate
        0, so a run of one step (``max_steps`` 1) with any warmup takes it at 0 and saves the base model."""
        if self.max_steps == 1 and self.warmup_ratio > 0:
            warnings.warn(
                f"--max-steps 1 with warmup ratio {self.warmup_ratio:g}: the one step is the warmup's first, at "
                "learning rate 0, so the saved model equals the base model; take 2 or more steps, or pass "
                "--warmup-ratio 0 to take the one step at --lr",
                stacklevel=2,
            )

    def trainer_kwargs(self, output_dir: str, use_cpu: bool) -> dict[str, Any]:
        """Keyword arguments shared by ``DPOConfig`` and ``SFTConfig``."""
        return dict(
            output_dir=output_dir, learning_rate=self.learning_rate, lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": self.min_lr_rate}, warmup_steps=self.warmup_ratio,
            weight_decay=self.weight_decay, adam_beta1=self.adam_beta1, adam_beta2=self.adam_beta2,
            optim="adamw_torch_fused", num_train_epochs=self.epochs, max_steps=self.max_steps,
            per_device_train_batch_size=self.batch_size, gradient_accumulation_steps=self.grad_accum,
            max_length=self.max_length, truncation_mode="keep_start", seed=self.seed,
            logging_steps=self.logging_steps, activation_checkpointing=self.gradient_checkpointing,
            use_cpu=use_cpu, bf16=self.dtype == "bfloat16", fp16=False, report_to=[], dataloader_num_workers=0,
            # the newest checkpoint only: the previous one is deleted once the new one is complete
            save_strategy="steps" if self.save_every else "no", save_steps=self.save_every or None,
            save_total_limit=1,
            # the loss is the DPO / SFT loss alone, on every model: TRL 1.16 would add a mixture-of-experts
            # model's router load-balancing loss (router_aux_loss_coef=None: the config's coefficient) and
            # reads the expert count as config.num_experts, which GraniteMoe(Hybrid), PhiMoE and Llama 4
            # configs lack (their training stopped with an AttributeError; a dense GraniteMoeHybrid too)
            router_aux_loss_coef=0.0,
        )  # fmt: skip


def _ids(tokenizer: Any, messages_or_text: Any, generation_prompt: bool) -> list[int]:
    if isinstance(messages_or_text, str):
        return tokenizer(messages_or_text)["input_ids"]
    out = tokenizer.apply_chat_template(
        messages_or_text, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


@dataclass
class LengthReport:
    examples: int
    max_length: int
    prompt_too_long: list[int]  # row indices whose prompt alone reaches max_length (TRL drops them)
    truncated: int  # rows whose prompt + longer response exceeds max_length (the response end is cut)
    longest_prompt: int
    longest_sequence: int

    def summary(self) -> str:
        return (
            f"{self.examples} examples, max_length {self.max_length}: longest prompt {self.longest_prompt} tokens, "
            f"longest prompt+response {self.longest_sequence}; {len(self.prompt_too_long)} prompts reach max_length "
            f"(TRL would drop them), {self.truncated} responses will be truncated"
        )


def length_report(
    rows: Sequence[dict[str, Any]], tokenizer: Any, max_length: int, sides: Sequence[str]
) -> LengthReport:
    """Token lengths as the trainer will see them (chat template applied). ``sides``: the response keys."""
    too_long, truncated, longest_p, longest_s = [], 0, 0, 0
    for i, row in enumerate(rows):
        n_prompt = len(_ids(tokenizer, row["prompt"], generation_prompt=True))
        # message lists and strings both concatenate: prompt + response, as TRL tokenizes them
        n_seq = max(len(_ids(tokenizer, row["prompt"] + row[s], generation_prompt=False)) for s in sides)
        longest_p, longest_s = max(longest_p, n_prompt), max(longest_s, n_seq)
        if n_prompt >= max_length:
            too_long.append(i)
        elif n_seq > max_length:
            truncated += 1
    return LengthReport(len(rows), max_length, too_long, truncated, longest_p, longest_s)


def check_lengths(
    rows: Sequence[dict[str, Any]], tokenizer: Any, max_length: int, sides: Sequence[str], source: str
) -> LengthReport:
    """Raise if any prompt alone reaches ``max_length`` (TRL would drop it silently); return the report."""
    if max_length <= 0:
        raise PairsError(f"max_length must be positive, got {max_length}")
    report = length_report(rows, tokenizer, max_length, sides)
    if report.prompt_too_long:
        first = report.prompt_too_long[:5]
        raise PairsError(
            f"{source}: {len(report.prompt_too_long)} of {report.examples} prompts are at least max_length = "
            f"{max_length} tokens (rows {first}{'...' if len(report.prompt_too_long) > 5 else ''}); TRL would "
            f"drop them silently. Raise --max-length (longest prompt: {report.longest_prompt} tokens) or remove them"
        )
    return report
