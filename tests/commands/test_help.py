"""Every command's ``--help``: rendered through the real parser, each option's default shown once and in one
form (``(default: X)`` at the end of its help), every option described, an example command line that the
real parser accepts, the short model names under ``--model``, no stray ``%%``, and no heavy import (torch,
transformers) for building the parsers."""

from __future__ import annotations

import argparse
import re
import shlex
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


# Ways of writing a default other than "(default: X)": "(default)", "cpu (default)", "(labelled, default;",
# "(default; ...)", "(default 0)", "default 0", "default runs/eval", "defaults to".
_OTHER_DEFAULT_STYLES = [
    re.compile(r"[(,]\s*default\s*[,;)]", re.IGNORECASE),
    re.compile(r"\bdefault\s+(?!:)", re.IGNORECASE),
    re.compile(r"\bdefaults\s+to\b", re.IGNORECASE),
]


def _help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """An option's help as printed (the formatter's appended default included), on one line, %% undone."""
    return " ".join(parser._get_formatter()._expand_help(action).split())


def _without_default(text: str) -> str:
    """``text`` less its ``(default: ...)``, which must be the last thing in it (a balanced group)."""
    start = text.find("(default: ")
    if start < 0:
        return text
    depth, end = 0, start
    while end < len(text):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            break
        end += 1
    assert end == len(text) - 1, f"(default: ...) is not at the end: {text!r}"
    return text[:start].rstrip()


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_default_style_checks_catch_the_old_styles():
    for old in [
        "cpu (default), cuda",
        "(default 0)",
        "default runs/eval",
        "(default; Wu et al.)",
        "(labelled, default; what TRL does)",
        "zeros (default, as the script)",
        "defaults to 3",
    ]:
        assert any(r.search(old) for r in _OTHER_DEFAULT_STYLES), old
    for ok in [
        "first seed (default: 0)",
        "grid preset: default: retmask default: 4 lengths (default: default)",
        "(refused by default)",
        "Defaults follow the paper",
    ]:
        assert not any(r.search(ok) for r in _OTHER_DEFAULT_STYLES), ok
    with pytest.raises(AssertionError):
        _without_default("(default: 0) and more")
    assert (
        _without_default("chunk (tokens) (default: 256 on a CPU (fast), 4096 on a GPU)") == "chunk (tokens)"
    )


@pytest.mark.parametrize("name", COMMANDS)
def test_defaults_are_written_one_way_at_the_end(name):
    parser = _commands()[name]
    for r in _OTHER_DEFAULT_STYLES:
        assert not r.search(" ".join((parser.description or "").split())), (name, r.pattern)
    for action in _options(parser):
        flag = "/".join(action.option_strings)
        text = _help_text(parser, action)
        assert text.count("(default") <= 1, f"{name} {flag}: {text!r}"
        rest = _without_default(text)
        for r in _OTHER_DEFAULT_STYLES:
            match = r.search(rest)
            assert match is None, f"{name} {flag}: write the default as (default: X) at the end: {text!r}"


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_says_what_it_does(name):
    """Not only its default: an option without help (or with just "default X") prints "(default: X)" alone."""
    parser = _commands()[name]
    for action in _options(parser):
        flag = "/".join(action.option_strings)
        assert action.help not in (None, argparse.SUPPRESS), f"{name} {flag} has no help text"
        rest = _without_default(_help_text(parser, action))
        assert len(re.findall(r"[^\W\d_]{2,}", rest)) >= 2, (
            f"{name} {flag}: help is only its default: {rest!r}"
        )


def _example(parser: argparse.ArgumentParser) -> str:
    """The command line under ``example:`` at the end of the epilog (indented lines, ``\\`` continuations)."""
    lines = (parser.epilog or "").rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == "example:"]
    assert starts, f"no 'example:' in the epilog: {parser.epilog!r}"
    body = lines[starts[-1] + 1 :]
    assert body and all(line[:1].isspace() for line in body), body
    return " ".join(line.strip().removesuffix("\\") for line in body)


@pytest.mark.parametrize("name", COMMANDS)
def test_help_ends_with_an_example_the_parser_accepts(name, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")  # narrow: the example line must still print unwrapped, at the end
    parser = _commands()[name]
    example = _example(parser)
    assert parser.format_help().rstrip().endswith("example:\n  " + example), parser.format_help()[-400:]
    argv = shlex.split(example)
    assert argv[:2] == ["retmask", name], example
    args = build_parser().parse_args(argv[1:])  # SystemExit (exit 2) if a flag or value is wrong
    assert args.command == name and callable(args.func)


def test_example_check_rejects_a_stale_flag():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["detect", "--no-such-flag"])


def test_epilog_lines_keep_their_breaks_and_descriptions_still_wrap():
    formatter = HelpFormatter("retmask x", width=40)
    text = formatter._fill_text(
        "a long sentence " * 6 + "\n\nexample:\n  retmask x --a 1 --b 2 --c 3 --d 4 --e 5", 40, ""
    )
    lines = text.splitlines()
    assert max(len(line) for line in lines[:-3]) <= 40 and len(lines) > 4
    assert lines[-3:] == ["", "example:", "  retmask x --a 1 --b 2 --c 3 --d 4 --e 5"]


def test_model_help_lists_the_short_names():
    """The names the loader knows (its own table, so the help cannot drift from it) in every --model."""
    from retmask.hf.loading import NAMED_MODELS

    assert "smollm2" in NAMED_MODELS and "gemma3-270m" in NAMED_MODELS
    seen = []
    for name, parser in _commands().items():
        for action in _options(parser):
            if {"--model", "--rejected-model"} & set(action.option_strings):
                text = _help_text(parser, action)
                seen.append((name, action.option_strings[0]))
                for short in NAMED_MODELS:
                    assert re.search(rf"(?<![\w-]){re.escape(short)}(?![\w-])", text), (name, short, text)
    assert {n for n, _ in seen} >= {
        "ablate",
        "detect",
        "eval",
        "generate",
        "mask",
        "mdqa-score",
        "mudaf-train",
        "niah",
        "pipeline",
        "train",
    }, seen
    assert ("generate", "--rejected-model") in seen and ("pipeline", "--rejected-model") in seen


def test_ablate_help_states_its_own_grid():
    ablate = _commands()["ablate"]
    text = " ".join(ablate.format_help().split())
    assert "runs 3 lengths x 3 depths" in text
    assert "(default: 3 here, not the protocol's)" in text
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


MODEL_COMMANDS = ["ablate", "detect", "eval", "generate", "kv", "mdqa-score", "niah"]
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
    nothing_to_resume = {
        "mask": ["--scores", "s.json", "--top-k", "3"],
        "compare": ["a.json", "b.json"],
        "env": [],
    }
    for name, required in nothing_to_resume.items():  # not told that it resumes
        with pytest.raises(SystemExit):
            main([name, *required, "--resume"])
        err = capsys.readouterr().err
        assert f"retmask {name} keeps nothing to resume" in err and "resumes by itself" not in err
    with pytest.raises(SystemExit):
        main(["detect", "--bogus"])
    assert "retmask detect: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("retmask ")
