"""Needles JSONL parsing: the shipped set, and errors that name file and line."""

import json

import pytest

from retmask.niah import DEFAULT_NEEDLES_PATH, NeedleFileError, load_needles


def test_shipped_needles():
    needles = load_needles()
    assert len(needles) >= 5
    for n in needles:
        assert n.real_needle.lower() in n.needle.lower() or n.real_needle.split()[-1] in n.needle
        assert n.question.endswith("?")
    # published key names, one object per line
    for line in DEFAULT_NEEDLES_PATH.read_text().splitlines():
        assert set(json.loads(line)) == {"needle", "question", "real_needle"}


@pytest.mark.parametrize(
    "bad, match",
    [
        ("{not json", "not valid JSON"),
        ('["a", "b"]', "expected a JSON object"),
        ('{"needle": "x", "question": "q?"}', r"missing key\(s\) \['real_needle'\]"),
        ('{"needle": "", "question": "q?", "real_needle": "x"}', "non-empty string"),
        ('{"needle": 3, "question": "q?", "real_needle": "x"}', "non-empty string"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad, match):
    good = json.dumps({"needle": "N.", "question": "Q?", "real_needle": "N"})
    path = tmp_path / "needles.jsonl"
    path.write_text(f"{good}\n\n{bad}\n")
    with pytest.raises(NeedleFileError, match=match) as info:
        load_needles(path)
    assert f"{path}:3" in str(info.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(NeedleFileError, match="does not exist"):
        load_needles(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(NeedleFileError, match="no needles"):
        load_needles(tmp_path / "empty.jsonl")
