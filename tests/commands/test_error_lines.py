"""Command errors: one line; an exception raised outside retmask's code says where (it may be a bug, not
a mistake in the input), and ``RETMASK_TRACEBACK=1`` adds the traceback."""

from __future__ import annotations

import json

import pytest

from retmask.commands.common import print_error


def _raised_in_json() -> ValueError:
    try:
        json.loads("{")
    except ValueError as err:
        return err
    raise AssertionError("json.loads('{') parsed")


def _raised_here() -> ValueError:
    try:
        from retmask.heads.mask import normalize_head_mask

        normalize_head_mask([(9, 0)], 2, 4)
    except ValueError as err:
        return err
    raise AssertionError("a head outside the model was accepted")


def test_an_error_from_retmask_is_one_line_without_a_hint(capsys, monkeypatch):
    monkeypatch.delenv("RETMASK_TRACEBACK", raising=False)
    print_error("retmask x", _raised_here())
    err = capsys.readouterr().err
    assert err.startswith("retmask x: error: ") and err.count("\n") == 1
    assert "raised in" not in err and "Traceback" not in err


def test_an_error_from_another_library_says_where_and_how_to_see_more(capsys, monkeypatch):
    monkeypatch.delenv("RETMASK_TRACEBACK", raising=False)
    print_error("retmask x", _raised_in_json())
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "json" in err and "may be a retmask bug; rerun with RETMASK_TRACEBACK=1" in err


@pytest.mark.parametrize("make", [_raised_here, _raised_in_json])
def test_the_traceback_follows_on_request(capsys, monkeypatch, make):
    monkeypatch.setenv("RETMASK_TRACEBACK", "1")
    print_error("retmask x", make())
    err = capsys.readouterr().err
    assert err.startswith("retmask x: error: ") and "Traceback (most recent call last)" in err


@pytest.mark.parametrize("traceback_setting", [None, "1"])
def test_a_file_the_machine_refused_is_one_line_and_its_traceback_follows_on_request(
    capsys, monkeypatch, tmp_path, traceback_setting
):
    """An OSError naming a file, caught by ``reports_errors``: the file and the reason on one line, and
    like every other error line the traceback only with RETMASK_TRACEBACK=1."""
    import argparse

    from retmask.commands.common import reports_errors

    if traceback_setting is None:
        monkeypatch.delenv("RETMASK_TRACEBACK", raising=False)
    else:
        monkeypatch.setenv("RETMASK_TRACEBACK", traceback_setting)
    missing = tmp_path / "absent" / "out.json"

    @reports_errors()
    def run(args: argparse.Namespace) -> int:
        missing.write_text("{}")
        return 0

    assert run(argparse.Namespace(command="x")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"retmask x: error: cannot use {missing}: No such file or directory\n")
    assert ("Traceback (most recent call last)" in err) == (traceback_setting == "1")
