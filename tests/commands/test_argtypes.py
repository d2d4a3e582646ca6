"""Every numeric flag of every command has a range, checked at parse time: exit 2, naming the flag, the
value and the allowed range, before any file is read or model loaded."""

from __future__ import annotations

import argparse

import pytest

from retmask.cli import build_parser, main
from retmask.commands.argtypes import float_range, int_range, steps_or_off


def test_ranges_and_messages():
    assert int_range(1)("3") == 3 and float_range(0.0, 1.0)("1") == 1.0
    with pytest.raises(argparse.ArgumentTypeError, match=r"^-5 is out of range: must be >= 1$"):
        int_range(1)("-5")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^0 is out of range: must be in \(0, 1\]$"):
        float_range(0.0, 1.0, lo_open=True)("0")
    with pytest.raises(argparse.ArgumentTypeError, match="not an integer"):
        int_range(1)("2.5")
    with pytest.raises(argparse.ArgumentTypeError, match="not a finite number"):
        float_range(0.0)("inf")
    assert steps_or_off("-1") == -1 and steps_or_off("7") == 7
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be >= 1 \(or -1\)"):
        steps_or_off("0")


def test_no_numeric_flag_without_a_range():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    plain = [
        f"{name} {'/'.join(action.option_strings)}"
        for name, p in sub.choices.items()
        for action in p._actions
        if action.type in (int, float)
    ]
    assert plain == [], f"numeric flags without a range: {plain}"


CASES = [
    (["detect", "--chunk", "-5"], "--chunk", "-5 is out of range: must be >= 1"),
    (["detect", "--chunk", "0"], "--chunk", "0 is out of range: must be >= 1"),
    (["detect", "--max-new-tokens", "0"], "--max-new-tokens", "must be >= 1"),
    (["detect", "--min-len", "0"], "--min-len", "must be >= 1"),
    (["detect", "--num-depths", "0"], "--num-depths", "must be >= 1"),
    (["detect", "--patience", "0"], "--patience", "must be >= 1"),
    (["detect", "--seed", "-1"], "--seed", "must be >= 0"),
    (["niah", "--chunk", "0"], "--chunk", "must be >= 1"),
    (["niah", "--mask-top", "0"], "--mask-top", "must be >= 1"),
    (["niah", "--num-needles", "0"], "--num-needles", "must be >= 1"),
    (["ablate", "--seeds", "0"], "--seeds", "must be >= 1"),
    (["ablate", "--limit", "0"], "--limit", "must be >= 1"),
    (["mask", "--threshold", "-0.5"], "--threshold", "-0.5 is out of range: must be in [0, 1]"),
    (["mask", "--threshold", "1.5"], "--threshold", "must be in [0, 1]"),
    (["mask", "--top-k", "0"], "--top-k", "must be >= 1"),
    (["generate", "--temperature", "-1"], "--temperature", "must be >= 0"),
    (["generate", "--top-p", "0"], "--top-p", "must be in (0, 1]"),
    (["generate", "--top-p", "1.5"], "--top-p", "must be in (0, 1]"),
    (["generate", "--batch-size", "0"], "--batch-size", "must be >= 1"),
    (["train", "--lr", "0"], "--lr", "must be > 0"),
    (["train", "--beta", "-1"], "--beta", "must be > 0"),
    (["train", "--warmup-ratio", "1"], "--warmup-ratio", "must be in [0, 1)"),
    (["train", "--max-steps", "0"], "--max-steps", "must be >= 1 (or -1)"),
    (["eval", "--kv-depths", "50", "120"], "--kv-depths", "120 is out of range: must be in [0, 100]"),
    (["eval", "--max-new-tokens", "0"], "--max-new-tokens", "must be >= 1"),
    (["mdqa-score", "--epsilon", "2"], "--epsilon", "must be in [0, 1]"),
    (["mdqa-score", "--batch-size", "0"], "--batch-size", "must be >= 1"),
    (["mudaf-train", "--steps", "0"], "--steps", "must be >= 1"),
    (["mudaf-train", "--lr", "-1"], "--lr", "must be > 0"),
    (["mudaf-train", "--alpha", "2"], "--alpha", "must be in [0, 1]"),
    (["mudaf-train", "--save-every", "-1"], "--save-every", "must be >= 0"),
    (["pipeline", "--threshold", "-0.5"], "--threshold", "must be in [0, 1]"),
    (["pipeline", "--gen-batch-size", "0"], "--gen-batch-size", "must be >= 1"),
    (["pipeline", "--lr", "nan"], "--lr", "not a finite number"),
]


@pytest.mark.parametrize("argv,flag,message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_out_of_range_flag_exits_2_at_parse_time(argv, flag, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"retmask {argv[0]}: error: argument {flag}: " in err and message in err, err


@pytest.mark.parametrize("command", ["ablate", "kv"])
@pytest.mark.parametrize("prefix", ["", ".", "..", ".hidden", "../../etc/x", "a/b"])
def test_prefix_is_a_plain_file_name(command, prefix, tmp_path, capsys):
    """--prefix names files inside --out-dir: a path would write outside it (or away from its lock), a
    leading dot hides the outputs."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--prefix", prefix, "--out-dir", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "argument --prefix: " in (err := capsys.readouterr().err) and "is not a plain file name" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["train", "mudaf-train", "pipeline"])
def test_float16_training_is_refused_with_the_reason(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--dtype", "float16"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "float16 is not a training precision here (it needs loss scaling" in err and "bfloat16" in err
