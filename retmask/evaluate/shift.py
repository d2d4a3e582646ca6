"""Retrieval scores of a model on a small NIAH probe, and the masked-vs-other split: does training raise the
masked heads' scores more than the others'?

The probe is an ordinary detection run (the retrieval score of ``retmask.detect``): the same tests
(``retmask.niah.build_tests``), the same fast path (``FastDetector``: greedy answer + argmax capture in one
pass, prefix-ordered tests sharing KV prefixes), the same ROUGE-1 > 0.5 filter and the same per-head score
(copies / answer tokens, averaged over the counted tests). Only the grid is small, so it can run during
training (``retmask.methods.retmask.telemetry``) and once per model in ``retmask eval``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from retmask.detect.answers import prefix_order
from retmask.detect.core import FastDetector
from retmask.detect.run import run_tests
from retmask.detect.scores import head_scores, mean_matrix
from retmask.detect.stopping import stop_token_ids
from retmask.heads import Head, heads_to_mask, model_shape
from retmask.niah import Needle, NiahTest, build_tests, load_haystack, load_needles, split_runnable


@dataclass
class Probe:
    """A fixed set of detection tests (built once) and what is needed to score them."""

    tests: list[NiahTest]  # runnable tests only, in prefix order (neighbours share KV prefixes)
    needles: list[Needle]
    lengths: list[int]
    depths: list[int]
    skipped: list[str] = field(
        default_factory=list
    )  # 'key: reason' of tests that cannot run (too short, no span)

    @property
    def keys(self) -> list[str]:
        return [t.key for t in self.tests]


def build_probe(
    tokenizer: Any,
    lengths: Sequence[int],
    depths: Sequence[int],
    *,
    num_needles: int | None = None,
    needles_path: str | None = None,
    haystack: str | None = None,
) -> Probe:
    """Detection tests for ``lengths`` × ``depths`` × the first ``num_needles`` shipped needles (all when
    None). Raises ``ValueError`` when no test can run (e.g. every length is shorter than the buffer)."""
    needles = load_needles(needles_path)
    if num_needles is not None:
        if num_needles < 1:
            raise ValueError(f"num_needles must be >= 1, got {num_needles}")
        needles = needles[:num_needles]
    tests = build_tests(tokenizer, needles, load_haystack(haystack), list(lengths), list(depths))
    # as detection does by default: a test whose needle span is not found runs and scores 0 for every head
    runnable, not_run = split_runnable(tests, "zeros")
    if not runnable:
        reasons = sorted({t.skip_reason or "" for t in tests})
        raise ValueError(f"no runnable probe test for lengths {list(lengths)}: {reasons}; use longer lengths")
    skipped = [f"{t.key}: {t.skip_reason}" for t in not_run]
    return Probe(prefix_order(runnable), needles, list(lengths), list(depths), skipped)


@dataclass
class ProbeScores:
    """mean: float64 [L, Hq] retrieval score per head (0 where no test counted); entries: per test, the
    detection record (key, response, rouge1_recall, counted, copies int [L][Hq], ...)."""

    mean: np.ndarray
    entries: list[dict]
    seconds: float

    @property
    def counted(self) -> int:
        return sum(bool(e["counted"]) for e in self.entries)

    @property
    def recall(self) -> float:
        """Mean ROUGE-1 recall of the probe's answers (NaN without tests)."""
        return float(np.mean([e["rouge1_recall"] for e in self.entries])) if self.entries else float("nan")


@torch.no_grad()
def probe_scores(
    model: Any,
    tokenizer: Any,
    probe: Probe,
    *,
    stop_ids: Collection[int] | None = None,
    max_new_tokens: int = 50,
    progress: bool = False,
) -> ProbeScores:
    """Run the probe on ``model`` (retmask attention, any head mask already set applies) and return the
    per-head scores. A fresh detector (= fresh KV cache) each call: weights may have changed in between."""
    import time

    start = time.perf_counter()
    stops = stop_ids if stop_ids is not None else stop_token_ids(tokenizer, model)
    detector = FastDetector(model, stops, max_new_tokens)
    done = run_tests(detector, tokenizer, probe.tests, probe.needles, {}, progress_bar=progress)
    entries = sorted(done.values(), key=lambda e: e["index"])
    counted = [e for e in entries if e["counted"]]
    shape = model_shape(model)
    scores = head_scores(
        [np.asarray(e["copies"]) for e in counted], [e["answer_tokens"] for e in counted], shape
    )
    return ProbeScores(mean_matrix(scores, shape), entries, time.perf_counter() - start)


def head_set_mask(heads: Sequence[Head], shape: Sequence[int]) -> np.ndarray:
    """bool [L, Hq], True at ``heads``; a head outside ``shape`` is an error naming it."""
    return heads_to_mask(heads, shape).numpy()


def split_means(mean: np.ndarray, heads: Sequence[Head]) -> tuple[float, float]:
    """(mean score of ``heads``, mean score of every other head) of a float [L, Hq] score matrix; NaN for
    an empty side."""
    mask = head_set_mask(heads, mean.shape)
    masked = float(mean[mask].mean()) if mask.any() else float("nan")
    other = float(mean[~mask].mean()) if (~mask).any() else float("nan")
    return masked, other
