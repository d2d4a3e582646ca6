"""ROUGE-1 recall of a response against the answer (a test counts when it is > 0.5)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    # The reference builds RougeScorer(['rouge1', 'rougeL'], use_stemmer=True): stemming on, so
    # "dumpling"/"dumplings" match. ROUGE-1 does not depend on the other types requested.
    return rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)


def rouge1_recall(reference: str, response: str) -> float:
    """ROUGE-1 recall in [0, 1] (the reference multiplies by 100 and keeps tests with > 50)."""
    return float(_scorer().score(reference, response)["rouge1"].recall)
