"""Settings of ``retmask eval`` (``EvalConfig``), its task names and length cap: plain data, no torch, so
the command line can show the defaults without loading the evaluation code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_LEN = 4000  # cap on CPUs: the embedded model's retrieval already fades by 4K

TASK_LABELS = {
    "niah": "NIAH (ROUGE-1 recall)",
    "multi_needle": "multi-needle recall",
    "kv": "key-value exact match",
}


@dataclass
class EvalConfig:
    """Settings that determine a model's results (part of the cache fingerprint)."""

    min_len: int = 1000
    max_len: int | None = None  # None: min(DEFAULT_MAX_LEN, the model's maximum - answer budget)
    num_lengths: int = 3
    num_depths: int = 3  # NIAH depths evenly in [0, 100]
    niah_needles: int = 3  # the first N shipped needles
    mn_needles: int = 4  # needles per multi-needle context
    kv_depths: list[int] = field(default_factory=lambda: [10, 50, 90])
    max_new_tokens: int = 32
    seed: int = 0
    tasks: list[str] = field(default_factory=lambda: ["niah", "multi_needle", "kv"])
    dtype: str = "float32"  # of the weights and activations (a resolved name: never "auto")

    def lengths(self, model: Any) -> list[int]:
        from retmask.hf.loading import max_context
        from retmask.niah import length_grid

        limit = max_context(model)
        hi = self.max_len
        if hi is None:
            hi = DEFAULT_MAX_LEN if limit is None else min(DEFAULT_MAX_LEN, limit - self.max_new_tokens)
        elif limit is not None and hi + self.max_new_tokens > limit:
            raise ValueError(
                f"--max-len {hi} (+{self.max_new_tokens} answer tokens) exceeds the model's maximum of {limit} "
                f"tokens; use --max-len {limit - self.max_new_tokens} or less"
            )
        if hi < self.min_len:
            where = "given" if self.max_len is not None else "the default for this model"
            raise ValueError(
                f"empty grid: the longest context {hi} ({where}; --max-len, --eval-max-len in a pipeline) is "
                f"below the shortest {self.min_len} (--min-len / --eval-min-len); raise the one or lower the other"
            )
        if self.num_lengths < 1 or self.num_depths < 1:
            raise ValueError(
                f"empty grid: {self.num_lengths} lengths x {self.num_depths} depths; both must be >= 1"
            )
        return length_grid(self.min_len, hi, self.num_lengths)

    def check(self) -> None:
        bad = [t for t in self.tasks if t not in TASK_LABELS]
        if bad or not self.tasks:
            raise ValueError(f"unknown task(s) {bad}; choose from {list(TASK_LABELS)}")
        if self.niah_needles < 1 or self.mn_needles < 1 or self.max_new_tokens < 1:
            raise ValueError("needle counts and max_new_tokens must be >= 1")
        from retmask.hf.loading import DTYPES

        if self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be one of {sorted(DTYPES)} (resolve 'auto' first), got {self.dtype!r}"
            )
