"""retmask's own warnings print like its errors on the command line: ``retmask: warning: <message>``."""

from __future__ import annotations

import json
import warnings

from retmask.cli import _show_warning, main


def test_score_above_one_warns_in_one_line(tmp_path, capsys):
    raw = {f"{layer}-{head}": [0.1, 0.2] for layer in range(2) for head in range(2)}
    raw["1-1"] = [5.0, 0.2]
    scores = tmp_path / "s.json"
    scores.write_text(json.dumps(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        code = main(["mask", "--scores", str(scores), "--top-k", "1", "--out", str(tmp_path / "h.json")])
    err = capsys.readouterr().err
    assert code == 0
    assert "retmask: warning: scores file" in err and "head '1-1'" in err
    assert "ScoreAboveOneWarning" not in err and "warnings.warn" not in err


def test_other_libraries_warnings_keep_pythons_format(capsys):
    _show_warning(UserWarning("from elsewhere"), UserWarning, "/elsewhere/lib.py", 7)
    err = capsys.readouterr().err
    assert "lib.py:7: UserWarning: from elsewhere" in err
