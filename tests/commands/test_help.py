"""Every command's ``--help``: rendered through the real parser, each option's default shown once, no stray
``%%``, and no heavy import (torch, transformers) for building the parsers."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from retmask.cli import HelpFormatter, build_parser, main


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


COMMANDS = sorted(_commands())


def _option_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """What argparse prints for one option (its flags, then its help with the default), on one line."""
    return " ".join(parser._get_formatter()._format_action(action).split())


def test_all_commands_found():
    assert {"ablate", "detect", "eval", "generate", "mask", "niah", "pipeline", "train"} <= set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_help_renders_without_doubled_defaults_or_stray_percent(name):
    parser = _commands()[name]
    text = parser.format_help()
    assert "%%" not in text, f"`retmask {name} --help` prints a literal %%"
    assert parser.formatter_class is HelpFormatter
    for action in parser._actions:
        if not action.option_strings or action.help is argparse.SUPPRESS:
            continue
        flag = "/".join(action.option_strings)
        shown = _option_help(parser, action)
        assert shown.count("(default") <= 1, f"{name} {flag}: default shown twice: {shown!r}"
        assert "%%" not in shown, f"{name} {flag}: {shown!r}"
        if action.nargs == 0:  # on/off flags: "(default: True)" after --no-x reads as if it were on
            assert "(default: True)" not in shown and "(default: False)" not in shown, (name, flag, shown)
        elif action.default not in (None, "", [], ()) and action.default is not argparse.SUPPRESS:
            assert "default" in shown.lower(), (
                f"{name} {flag}: default {action.default!r} not shown: {shown!r}"
            )


def test_ablate_help_states_its_own_grid():
    ablate = _commands()["ablate"]
    text = " ".join(ablate.format_help().split())
    assert "runs 3 lengths x 3 depths" in text
    assert "(default 3 here, not the protocol's)" in text
    args = ablate.parse_args([])
    assert (args.num_lengths, args.num_depths, args.num_needles) == (3, 3, 2)


def test_pipeline_protocol_lists_choices():
    pipeline = _commands()["pipeline"]
    (protocol,) = [a for a in pipeline._actions if "--protocol" in a.option_strings]
    assert protocol.choices and "default" in protocol.choices
    assert "under an hour" not in pipeline.format_help()


def test_building_the_parsers_imports_neither_torch_nor_transformers():
    code = (
        "import sys\n"
        "import retmask, retmask.cli\n"
        "retmask.cli.build_parser().format_help()\n"
        "for name, p in retmask.cli.build_parser()._subparsers._group_actions[0].choices.items():\n"
        "    p.format_help()\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'matplotlib', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_help_exits_zero_without_loading_anything():
    out = subprocess.run(
        [sys.executable, "-m", "retmask", "detect", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "--resume" in out.stdout


def test_niah_checks_mask_flags_before_loading_the_model(tmp_path, capsys):
    """A model that does not exist would be the error if the model were loaded first."""
    from retmask.cli import main

    scores = tmp_path / "s.json"
    scores.write_text('{"0-0": [0.5]}')
    rc = main(["niah", "--model", str(tmp_path / "no-model"), "--scores", str(scores), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--scores is only used with --mask-top" in err and "no-model" not in err
    rc = main(["niah", "--model", str(tmp_path / "no-model"), "--mask-top", "3", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--mask-top K needs --scores" in err


MODEL_COMMANDS = ["ablate", "detect", "eval", "generate", "mdqa-score", "niah"]
TRAINING_COMMANDS = ["mudaf-train", "pipeline", "train"]  # float32 or bf16 autocast only


@pytest.mark.parametrize("name", MODEL_COMMANDS + TRAINING_COMMANDS)
def test_every_command_that_runs_a_model_takes_dtype(name):
    parser = _commands()[name]
    (action,) = [a for a in parser._actions if "--dtype" in a.option_strings]
    assert action.default == "float32" and {"auto", "float32", "bfloat16"} <= set(action.choices)
    # training keeps float32 master weights: a float16 or float64 "training dtype" is refused by the parser
    assert ("float16" in action.choices) == (name in MODEL_COMMANDS)


def test_unknown_flags_are_reported_by_the_command_with_a_resume_hint(capsys):
    """An unknown flag is named by the sub-command's own parser (its usage line, not the top level's);
    --resume on a command that resumes by itself says so."""
    with pytest.raises(SystemExit) as exit_info:
        main(["pipeline", "--resume"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: retmask pipeline") and "pipeline resumes by itself" in err
    with pytest.raises(SystemExit):
        main(["detect", "--bogus"])
    assert "retmask detect: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("retmask ")
