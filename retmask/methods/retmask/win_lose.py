"""The Win-Lose-Pair baseline's judge: which of two samples of the unmasked model is the better one.

In RetMask's published runs this baseline samples two responses from the same model, and an LLM judge
(Gemma-3-27B-IT) makes the better one chosen and the worse one rejected: preference optimisation on output
quality, without any head masked. No such judge runs here; the responses are ranked against the
instruction's known answer (``Instruction.reference``) by ROUGE-L F1 with stemming, which rewards a
response that contains the answer and little else. Pairs whose two responses score the same are dropped
("tied"; the pipeline makes up for them with further instructions, so this baseline trains on as many
pairs as the masked variants), and instructions without a reference cannot be judged (the pipeline draws
this baseline's instructions from those that have one).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from retmask.methods.retmask.sampling import Completion

JUDGE = "ROUGE-L F1 against the instruction's reference answer"


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def quality(reference: str, response: str) -> float:
    """ROUGE-L F1 in [0, 1] of ``response`` against ``reference``."""
    return float(_scorer().score(reference, response)["rougeL"].fmeasure)


@dataclass(frozen=True)
class JudgedPair:
    """Two samples ordered by ``quality``: chosen scored strictly higher than rejected."""

    chosen: Completion
    rejected: Completion
    chosen_quality: float
    rejected_quality: float


def judge_pair(reference: str, first: Completion, second: Completion) -> JudgedPair | None:
    """The better of two samples as chosen, or None when they score the same (a tie teaches nothing)."""
    q1, q2 = quality(reference, first.text), quality(reference, second.text)
    if q1 == q2:
        return None
    if q1 > q2:
        return JudgedPair(first, second, q1, q2)
    return JudgedPair(second, first, q2, q1)
