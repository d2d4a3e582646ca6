"""ROUGE-1 recall of a response against the answer (a test counts when it is > 0.5), and the words it
compares (one tokenizer for both, so answer kinds agree with the recall)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _tokenizer():
    from rouge_score import tokenizers

    # The reference builds RougeScorer(['rouge1', 'rougeL'], use_stemmer=True): stemming on, so
    # "dumpling"/"dumplings" match.
    return tokenizers.DefaultTokenizer(use_stemmer=True)


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    # ROUGE-1 does not depend on the other types the reference requests.
    return rouge_scorer.RougeScorer(["rouge1"], tokenizer=_tokenizer())


def rouge1_recall(reference: str, response: str) -> float:
    """ROUGE-1 recall in [0, 1] (the reference multiplies by 100 and keeps tests with > 50)."""
    return float(_scorer().score(reference, response)["rouge1"].recall)


def rouge_words(text: str) -> list[str]:
    """The words ROUGE-1 compares: lower-cased, punctuation dropped, Porter-stemmed."""
    return list(_tokenizer().tokenize(text))
