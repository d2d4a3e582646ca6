"""Settings of ``retmask pipeline`` (``PipelineConfig``), its stage and baseline names and its error type:
plain data, no torch, so the command line can show the defaults without loading the pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field

STAGES = ("detect", "mask", "generate", "train", "eval")
# which responses are rejected: the masked model's (retmask: retrieval heads; random / non-retrieval: as many
# other heads), the worse of two samples of the unmasked model (win-lose: Win-Lose-Pair, no head masked), or
# a second, weaker model's (smaller-model: Smaller-Model, --rejected-model, no head masked)
VARIANTS = ("retmask", "random", "non-retrieval", "win-lose", "smaller-model")
UNMASKED_VARIANTS = ("win-lose", "smaller-model")  # their rejected responses come from an unmasked model
OBJECTIVES = ("dpo", "sft")


class PipelineError(ValueError):
    """A pipeline request that cannot run; the message says what to change."""


@dataclass
class PipelineConfig:
    model: str | None = None  # None = the embedded SmolLM2-135M-Instruct
    # what makes the rejected responses: retmask | random | non-retrieval | win-lose | smaller-model (VARIANTS)
    baseline: str = "retmask"
    rejected_model: str | None = None  # smaller-model: the model of the rejected responses (id, folder, GGUF)
    scores: str | None = None  # reuse this scores JSON instead of running detect
    # float32 | bfloat16 (resolved, never "auto"): weights of detect / generate / eval, bf16 autocast in train
    dtype: str = "float32"
    # where every stage runs: "cpu" or "cuda" (training: the Trainer's first visible GPU)
    device: str = "cpu"
    # detect (the protocol's grid unless overridden)
    protocol: str = "default"
    detect_min_len: int | None = None
    detect_max_len: int | None = None
    detect_lengths: int | None = None
    detect_depths: int | None = None
    # mask
    threshold: float | None = 0.1
    top_k: int | None = None
    mask_seed: int = 0
    # generate
    instructions: str = "builtin"
    num_instructions: int = 32
    temperature: float = 0.6
    top_p: float = 1.0
    gen_max_new_tokens: int = 128
    gen_batch_size: int = 8
    gen_seed: int = 0
    # train (RetMask's published optimiser settings; a short run)
    lr: float = 5e-7
    min_lr_rate: float = 0.1  # the cosine ends at 0.1 x lr
    warmup_ratio: float = 0.1  # share of the steps with a linear warm-up from lr 0
    weight_decay: float = 0.1
    epochs: float = 2.0
    max_steps: int = -1
    batch_size: int = 2
    grad_accum: int = 4
    max_length: int = 512
    beta: float = 0.1
    train_seed: int = 0
    # "dpo" (RetMask) or "sft": the SFT baseline, trained on the pairs' chosen responses only
    objective: str = "dpo"
    telemetry_every: int = 2
    # recompute activations in the backward pass (less memory, the same result): not in the fingerprint
    gradient_checkpointing: bool = False
    drop_unfinished: bool = False  # train only on pairs whose responses ended before --gen-max-new-tokens
    # a training checkpoint every N optimizer steps (0: none), so a rerun continues the interrupted training
    # stage instead of starting it over; not in the stage's fingerprint (the result does not depend on it)
    save_every: int = 0
    # eval
    eval_min_len: int = 1000
    eval_max_len: int | None = None
    eval_lengths: int = 3
    eval_depths: int = 3
    eval_needles: int = 3
    eval_cache: str | None = None  # shared per-model eval cache (default run_dir/eval/models)
    eval_tasks: list[str] = field(default_factory=lambda: ["niah", "multi_needle", "kv"])

    def check(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise PipelineError(f"--dtype must resolve to float32 or bfloat16, got {self.dtype!r}")
        if self.baseline not in VARIANTS:
            raise PipelineError(f"--baseline must be one of {VARIANTS}, got {self.baseline!r}")
        if self.baseline == "smaller-model" and not self.rejected_model:
            raise PipelineError(
                "--baseline smaller-model needs --rejected-model: the smaller model whose responses are rejected "
                "(a hub id, a local folder or a GGUF file; it may use another tokenizer)"
            )
        if self.rejected_model and self.baseline != "smaller-model":
            raise PipelineError(
                f"--rejected-model is the Smaller-Model baseline's; add --baseline smaller-model (got --baseline "
                f"{self.baseline}), or drop --rejected-model"
            )
        if (self.threshold is None) == (self.top_k is None):
            raise PipelineError("give exactly one of --threshold or --top-k")
        if self.num_instructions <= 0:
            raise PipelineError(f"--num-instructions must be positive, got {self.num_instructions}")
        if self.objective not in OBJECTIVES:
            raise PipelineError(f"the training objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if not 0.0 <= self.warmup_ratio < 1.0 or not 0.0 <= self.min_lr_rate <= 1.0:
            raise PipelineError("--warmup-ratio must be in [0, 1) and --min-lr-rate in [0, 1]")
        if self.weight_decay < 0:
            raise PipelineError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.telemetry_every < 0:
            raise PipelineError("--telemetry-every must be >= 0 (0 = off)")
