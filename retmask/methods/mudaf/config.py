"""Settings of MuDAF scoring and training (``MDQAScoreConfig``, ``MuDAFConfig``) and the similarity
names: plain data, no torch, so the command line can show the defaults without loading the training code."""

from __future__ import annotations

from dataclasses import dataclass, field

from retmask.heads import Head
from retmask.methods.mudaf.mdqa import MDQAError

SIMILARITIES = ("concat", "per-head")

DEFAULT_EPSILON = 0.3


@dataclass
class MDQAScoreConfig:
    """Settings of an MDQA scoring run (recorded in the run JSON)."""

    epsilon: float = DEFAULT_EPSILON
    batch_size: int = 1
    max_length: int | None = None  # None = the model's max_position_embeddings

    def check(self) -> None:
        if not 0.0 <= self.epsilon < 1.0:
            raise MDQAError(f"epsilon must be in [0, 1) (attention mass on one passage), got {self.epsilon}")
        if self.batch_size < 1:
            raise MDQAError(f"batch size must be >= 1, got {self.batch_size}")


@dataclass
class MuDAFConfig:
    """MuDAF training settings. ``lambda_con`` = λ of ``L_CLM + λ·L_CON``; ``alpha`` switches to the reference
    code's ``(1-α)·L_CLM + α·L_CON`` (it used α = 0.3); ``vanilla_sft`` = λ = 0 (the vanilla SFT baseline)."""

    heads: list[Head] = field(default_factory=list)
    lambda_con: float = 1.0
    alpha: float | None = None
    vanilla_sft: bool = False
    temperature: float = 0.05
    similarity: str = "concat"
    learning_rate: float = 5e-6  # MuDAF's published one (Llama-3.1-8B, full fine-tuning)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_steps: int = 100
    batch_size: int = 1  # the reference code's
    grad_accum: int = 1
    max_length: int | None = None  # None = the model's context
    seed: int = 0
    save_every: int = 0  # optimizer steps between resume checkpoints; 0 = none
    dtype: str = "float32"  # or "bfloat16": bf16 autocast over float32 master weights
    # recompute each decoder layer's forward in the backward pass: less memory, the same gradients
    gradient_checkpointing: bool = False

    def check(self, *, heads: bool = True) -> None:
        """MDQAError naming the setting that is out of range or in conflict; ``heads=False`` leaves out the
        target heads (known only once the model has loaded: the command checks the rest before)."""
        if self.vanilla_sft and self.alpha not in (None, 0):
            raise MDQAError("--vanilla-sft trains on the CLM loss only; drop --alpha")
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise MDQAError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.lambda_con < 0:
            raise MDQAError(f"lambda must be >= 0, got {self.lambda_con}")
        if self.temperature <= 0:
            raise MDQAError(f"temperature must be > 0, got {self.temperature}")
        if self.similarity not in SIMILARITIES:
            raise MDQAError(f"similarity must be one of {SIMILARITIES}, got {self.similarity!r}")
        for name in ("max_steps", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise MDQAError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise MDQAError(f"dtype must be float32 or bfloat16 (bf16 autocast), got {self.dtype!r}")
        if self.learning_rate <= 0 or self.warmup_steps < 0 or self.save_every < 0:
            raise MDQAError("learning rate must be > 0, warm-up steps and save-every >= 0")
        if heads and not self.vanilla_sft and not self.heads:
            raise MDQAError(
                "MuDAF needs target heads: pass --heads heads.json or --scores mdqa_scores.json (sampled), "
                "or --vanilla-sft for the CLM-only baseline"
            )

    @property
    def con_weight(self) -> float:
        """Weight of L_CON in the optimised loss (0 for vanilla SFT)."""
        if self.vanilla_sft:
            return 0.0
        return self.alpha if self.alpha is not None else self.lambda_con
