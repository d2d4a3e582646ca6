"""Default haystack and haystack files."""

import pytest

from retmask.niah import default_haystack_text, load_haystack
from retmask.niah.haystack import HaystackError


def test_default_haystack_is_deterministic_prose():
    text = default_haystack_text()
    assert text == default_haystack_text.__wrapped__()
    words = text.split()
    assert len(words) > 25_000
    assert ">>>" not in text
    # prose: paragraphs end with a period
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
