"""ROUGE-1 recall as the reference computes it (rouge_score, Porter stemmer on)."""

from retmask.niah import rouge1_recall


def test_exact_and_partial():
    assert rouge1_recall("eat plum dumplings at sunset", "eat plum dumplings at sunset") == 1.0
    assert rouge1_recall("eat plum dumplings at sunset", "eat plum") == 0.4
    assert rouge1_recall("eat plum dumplings", "") == 0.0


def test_stemmer_is_on_like_the_reference():
    # With use_stemmer=True "dumpling" matches "dumplings" and "riding" matches "ride"s stem.
    assert rouge1_recall("plum dumplings", "plum dumpling") == 1.0


def test_recall_not_precision():
    assert rouge1_recall("red bicycle", "I would ride a red bicycle along the canal") == 1.0
