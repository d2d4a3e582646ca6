"""README.md as a user meets it: its quick starts run as written, its links exist, and it stays a short
guide (<= 250 lines, <= 15,000 characters, no line over 120 characters, no machine history).

The Python snippets are kept, character for character, as modules in tests/readme_examples/ (a test checks
that README.md holds exactly their text) and run by importing them. The shell commands are parsed by the CLI
(flags and choices must exist) and run with a small grid: detect / mask / niah / compare on the embedded
model in place of ``--model``, ``retmask pipeline`` on a tiny random model with every stage cut to a few
steps (its answers count whatever they hold: only the mechanics are checked).
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from retmask.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SMALL_GRID = [
    "--min-len",
    "600",
    "--max-len",
    "600",
    "--num-lengths",
    "1",
    "--num-depths",
    "1",
    "--no-progress",
]


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)


# Pointers into papers a user may not have: section / figure / equation / appendix numbers, "the paper's",
# "et al.". The guide, the docs and the package say the thing itself (published numbers are named as such).
_PAPER_POINTERS = re.compile(
    r"§|\b(?:Eq|Fig|Figure|Table)\.? ?[0-9]|\bApp(?:\.|endix) ?[A-Z]\b|\b[Tt]he papers?'?s?\b|\bet al\b"
)


def test_docs_say_the_thing_itself():
    texts = [README, *(ROOT / "docs").glob("*.md"), *(ROOT / "retmask").rglob("*.py")]
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in texts
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _PAPER_POINTERS.search(line)
    ]
    assert not hits, "\n".join(hits)
    assert _PAPER_POINTERS.search("as in the paper's Fig. 7") and _PAPER_POINTERS.search("Wu et al.'s rule")


def _quick_start_commands() -> list[list[str]]:
    """Every ``retmask ...`` line of the README's bash blocks after the set-up, without comments."""
    text = README.read_text(encoding="utf-8")
    quick = text[text.index("## Quick starts") : text.index("## Commands")]
    lines = [line.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", quick, re.DOTALL)
             for line in block.splitlines()]  # fmt: skip
    return [shlex.split(line) for line in lines if line.startswith("retmask ")]


def test_readme_is_a_short_guide():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 250 and len(text) <= 15_000
    assert max(len(line) for line in lines) <= 120
    for word in ("EPYC", "DESIGN.md", "2026-"):
        assert word not in text, word
    assert _blocks("bash")[:2] == ["make detect\n", "make test\n"]  # the two set-up commands, first
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        assert (ROOT / link).exists(), f"README links {link}, which does not exist"


def test_readme_python_blocks_are_the_example_modules():
    """Each Python block of the README is one of tests/readme_examples/*.py, exactly: what the tests below
    import is what a user copies."""
    examples = {
        path.read_text(encoding="utf-8") for path in (ROOT / "tests/readme_examples").glob("*_example.py")
    }
    assert _blocks("python") and set(_blocks("python")) == examples


def test_quick_start_commands_parse():
    commands = _quick_start_commands()
    assert {c[1] for c in commands} >= {"detect", "mask", "niah", "compare", "pipeline"}
    parser = build_parser()
    for command in commands:
        parser.parse_args(command[1:])  # SystemExit for an unknown flag or choice


def test_every_readme_command_line_parses():
    """Also the lines outside the quick starts (the Gemma-3 first command, ...)."""
    lines = [line.split("#")[0].strip() for block in _blocks("bash") for line in block.splitlines()]
    commands = [shlex.split(line) for line in lines if line.startswith("retmask ")]
    assert any("gemma3-270m" in c for c in commands)
    parser = build_parser()
    for command in commands:
        parser.parse_args(command[1:])


def _runnable(command: list[str], tmp: Path) -> list[str]:
    """The command on the embedded model with a small grid (2 needles, one 600-token test each), its paths
    under ``tmp``."""
    args, i = [], 1
    while i < len(command):
        if command[i] == "--model":  # the embedded model stands for the user's
            i += 2
            continue
        arg = command[i]
        args.append(str(tmp / arg) if arg.startswith("runs/") else arg)
        i += 1
    if command[1] == "detect":  # detection runs every needle of its file
        from retmask.niah import DEFAULT_NEEDLES_PATH

        needles = tmp / "two_needles.jsonl"
        needles.write_text("".join(DEFAULT_NEEDLES_PATH.read_text().splitlines(keepends=True)[:2]))
        args += [*SMALL_GRID, "--needles", str(needles)]
    if command[1] == "niah":
        args += [*SMALL_GRID, "--num-needles", "2"]
    return args


@pytest.mark.embedded
def test_quick_start_detect_mask_niah_compare_run(tmp_path, capsys):
    commands = {c[1]: c for c in _quick_start_commands()}
    for name in ("detect", "mask", "niah"):
        assert main(_runnable(commands[name], tmp_path)) == 0, capsys.readouterr().err
    scores = tmp_path / "runs/qwen/scores.json"
    assert (tmp_path / "runs/qwen/heads.json").is_file() and (tmp_path / "runs/qwen/niah.json").is_file()
    compare = _runnable(commands["compare"], tmp_path)
    for path in compare[1:3]:  # the two score files it compares: copies of the one just made
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(scores.read_bytes())
    assert main(compare) == 0
    assert "Spearman" in capsys.readouterr().out


PIPELINE_TINY = ["--detect-min-len", "300", "--detect-max-len", "300", "--detect-lengths", "1",
                 "--detect-depths", "2", "--top-k", "2", "--num-instructions", "4", "--gen-max-new-tokens", "8",
                 "--gen-batch-size", "2", "--max-steps", "2", "--batch-size", "2", "--grad-accum", "1",
                 "--max-length", "256", "--eval-min-len", "300", "--eval-max-len", "300", "--eval-lengths", "1",
                 "--eval-depths", "1", "--eval-needles", "1", "--no-progress"]  # fmt: skip


def test_quick_start_pipeline_runs(tmp_path, monkeypatch):
    import transformers

    import retmask
    from tests.tiny import tiny_llama_for

    tok = transformers.AutoTokenizer.from_pretrained(retmask.default_model_path())
    model_dir = tmp_path / "tiny"
    tiny_llama_for(tok, init=0.02).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    monkeypatch.setattr("retmask.detect.run.RECALL_THRESHOLD", -1.0)  # a random model retrieves nothing
    command = {c[1]: c for c in _quick_start_commands()}["pipeline"]
    assert main([*_runnable(command, tmp_path), "--model", str(model_dir), *PIPELINE_TINY]) == 0
    state = json.loads((tmp_path / "runs/pipeline/pipeline.json").read_text())
    assert all(stage["status"] == "done" for stage in state["stages"].values())


@pytest.mark.embedded
def test_readme_model_example_runs():
    scope = vars(importlib.import_module("tests.readme_examples.model_example"))
    model = scope["model"]
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    assert scope["cap"].last.shape[:3] == (layers, 1, heads) and scope["cap"].last.shape[3] == 4
    generated = scope["out"]
    assert generated.dtype == torch.long and generated.shape[1] > 1
    # the in-place cache holds the prompt and every generated token but the last
    assert scope["cache"].get_seq_length() == generated.shape[1] - 1


def test_readme_kernel_example_runs_and_matches_the_oracle():
    from retmask.kernels import reference_attention

    scope = vars(importlib.import_module("tests.readme_examples.kernel_example"))
    q, k, v, skip = scope["q"], scope["k"], scope["v"], scope["skip"]
    out, argmax = scope["out"], scope["argmax"]
    assert out.shape == q.shape and argmax.shape == (1, 9, 16)
    ref, ref_argmax = reference_attention(
        q.double(), k.double(), v.double(), skip_heads=skip[None], argmax_rows=16
    )
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(argmax, ref_argmax) and (out[:, 4] == 0).all() and (argmax[:, 4] == -1).all()


@pytest.mark.embedded
def test_readme_sparse_cache_example_runs(tmp_path, monkeypatch):
    import shutil

    scores = tmp_path / "runs/detect/smollm2.json"
    scores.parent.mkdir(parents=True)
    # what `make detect` writes (a detection on the shipped haystack)
    shutil.copy(ROOT / "bench/results/smollm2_scores_shipped-haystack.json", scores)
    monkeypatch.chdir(tmp_path)
    scope = vars(importlib.import_module("tests.readme_examples.sparse_cache_example"))
    assert 0 < scope["held"] < 0.3
    assert scope["out"].shape[1] > scope["ids"].shape[1] and scope["answer"].strip()
