"""Default haystack and haystack files."""

import hashlib

import pytest

from retmask.niah import default_haystack_text, load_haystack, load_needles
from retmask.niah.haystack import PYDOC, HaystackError, pydoc_haystack_text

# sha256 of the shipped default haystack: detection results are comparable only on the same text, so a
# change to it must be deliberate (and noted with the results it invalidates).
DEFAULT_SHA256 = "2524e6a3c59bed807a321d4186cdc756471019c8886635013c9652fa0898ac6f"


def test_default_haystack_is_the_shipped_prose_on_every_python():
    text = default_haystack_text()
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == DEFAULT_SHA256
    assert load_haystack(None) == text and text.isascii()
    assert 9_000 < len(text.split()) < 12_000
    # prose: every paragraph ends a sentence, so the period rule of the reference finds insertion points
    assert all(p.rstrip().endswith((".", "?")) for p in text.strip().split("\n\n"))
    # no needle can be answered from it: no three consecutive answer words and no name of a needle occur
    words = [w.strip(".,'?").lower() for w in text.split()]
    trigrams = set(zip(words, words[1:], words[2:], strict=False))
    for needle in load_needles():
        answer = [w.strip(".,'").lower() for w in needle.real_needle.split()]
        assert not trigrams & set(zip(answer, answer[1:], answer[2:], strict=False)), needle.real_needle
        names = {w.strip(".,'s").lower() for w in needle.needle.split()[1:] if w[0].isupper()}
        assert not names & set(words), (names & set(words), needle.needle)


def test_pydoc_haystack_is_the_earlier_default():
    """``--haystack pydoc`` reproduces runs recorded before the shipped haystack (on their Python)."""
    text = load_haystack(PYDOC)
    assert text == pydoc_haystack_text() and len(text.split()) > 25_000 and ">>>" not in text
    assert all(p.endswith(".") for p in text.strip().split("\n\n"))


def test_file_and_directory(tmp_path):
    (tmp_path / "b.txt").write_text("Second part. ")
    (tmp_path / "a.txt").write_text("First part. ")
    assert load_haystack(tmp_path) == "First part. Second part. "
    assert load_haystack(tmp_path / "b.txt") == "Second part. "


def test_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\nsecond line\n\xff\xfe broken\n")
    with pytest.raises(HaystackError, match=rf"{bad}:3"):
        load_haystack(bad)
    with pytest.raises(HaystackError, match="does not exist"):
        load_haystack(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HaystackError, match=r"no \*.txt"):
        load_haystack(tmp_path / "empty")
