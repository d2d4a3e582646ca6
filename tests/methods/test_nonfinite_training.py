"""Training stops at the first non-finite loss or gradient norm (issue 47): ``retmask train`` (DPO and
--sft) and ``retmask mudaf-train`` exit 2 with a message naming the step, the value and the likely cause,
save no weights, and keep MuDAF's last good ``resume.pt``."""

from __future__ import annotations

# ruff: noqa: F811  (the fixtures imported from the subpackages' conftests are test parameters)
import json
import re
from pathlib import Path

import pytest
import torch

import retmask
from retmask.cli import main as cli
from retmask.methods import training_guards
from retmask.methods.mudaf.mdqa import write_mdqa
from retmask.methods.retmask.dpo import train_dpo
from retmask.methods.retmask.train_config import TrainConfig
from retmask.methods.training_guards import NonFiniteTrainingError, check_finite
from tests.methods.mudaf.conftest import bpe_tokenizer, mdqa_examples  # noqa: F401  (fixtures)
from tests.methods.retmask.conftest import tiny_dir, tokenizer  # noqa: F401  (fixtures)
from tests.methods.retmask.test_train import ROWS, conv
from tests.tiny import tiny_llama_for

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "config.json")


@pytest.fixture
def pairs_file(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(conv(*r)) + "\n" for r in ROWS[:2]))
    return path


@pytest.fixture(scope="module")
def mudaf_model_dir(tmp_path_factory, bpe_tokenizer) -> Path:
    """A saved tiny Llama over the MDQA byte-level BPE (a model folder the command loads by path)."""
    folder = tmp_path_factory.mktemp("mudaf-tiny")
    tiny_llama_for(bpe_tokenizer).save_pretrained(folder)
    bpe_tokenizer.save_pretrained(folder)
    return folder


def no_model_in(folder: Path) -> bool:
    """No weights or config written (the folder may be absent); no hidden partial folder left either."""
    if not folder.exists():
        return True
    names = {p.name for p in folder.iterdir()}
    return not (names & set(WEIGHT_FILES)) and not any(n.startswith(".model-partial-") for n in names)


def test_check_finite_names_step_value_and_cause():
    check_finite(3, loss=0.7, grad_norm=torch.tensor(12.0), learning_rate=1e-3, updates=2)  # finite: silent
    with pytest.raises(NonFiniteTrainingError) as err:
        check_finite(4, loss=float("inf"), grad_norm=float("nan"), learning_rate=1000.0, updates=3)
    msg = str(err.value)
    assert "step 4" in msg and "the loss is inf" in msg and "the gradient norm is nan" in msg
    assert "lower --lr (now 1000" in msg and "no weights were saved" in msg
    with pytest.raises(
        NonFiniteTrainingError, match="before any weight update.*learning rate played no part"
    ):
        check_finite(1, loss=torch.tensor(float("nan")), learning_rate=1e-3, updates=0)
    assert training_guards.gradient_norm([torch.nn.Parameter(torch.ones(2))]) == 0.0  # no gradients yet


@pytest.mark.parametrize("sft", [False, True], ids=["dpo", "sft"])
def test_train_with_a_huge_lr_stops_and_saves_nothing(tiny_dir, pairs_file, tmp_path, capsys, sft):
    out = tmp_path / "out"
    argv = ["train", "--pairs", str(pairs_file), "--model", str(tiny_dir), "--out", str(out), "--max-steps", "3",
            "--batch-size", "2", "--grad-accum", "1", "--lr", "1e8", "--warmup-ratio", "0",
            "--max-length", "128"] + (["--sft"] if sft else [])  # fmt: skip
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert re.search(
        r"retmask train: error: training stopped at step [23]: the (loss|gradient norm) is (nan|inf)", err
    ), err
    assert "lower --lr (now 1e+08" in err
    assert no_model_in(out) and not (out / "retmask_train.json").exists()


def test_nan_loss_before_any_update_blames_the_model_not_the_lr(tiny_dir, pairs_file, tmp_path):
    """The loss of the very first micro-batch is checked (not only logged every logging_steps, where the
    Trainer replaces a NaN by the running mean): a model with a NaN weight stops at step 1."""
    model, tok = retmask.load_model(str(tiny_dir))
    ref = tiny_llama_for(tok, init=0.02)  # any finite reference; the policy's NaN decides
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    cfg = TrainConfig(max_steps=2, batch_size=2, grad_accum=2, max_length=128, logging_steps=10)
    out = tmp_path / "out"
    with pytest.raises(
        NonFiniteTrainingError, match=r"step 1: the loss is nan; this is before any weight update"
    ):
        train_dpo(pairs_file, out, cfg=cfg, model=model, ref_model=ref, tokenizer=tok)
    assert no_model_in(out)


def test_mudaf_train_with_a_huge_lr_stops_and_keeps_the_last_checkpoint(
    tmp_path,
    mdqa_examples,
    mudaf_model_dir,
    capsys,
):
    data = write_mdqa(mdqa_examples[:4], tmp_path / "train.jsonl")
    out = tmp_path / "run"
    argv = ["mudaf-train", "--data", str(data), "--model", str(mudaf_model_dir), "--out", str(out), "--vanilla-sft",
            "--steps", "6", "--batch-size", "2", "--lr", "1e8", "--save-every", "1", "--no-progress"]  # fmt: skip
    assert cli(argv) == 2
    err = capsys.readouterr().err
    m = re.search(
        r"retmask mudaf-train: error: training stopped at step (\d+): the (loss|gradient norm)", err
    )
    assert m, err
    step = int(m.group(1))
    assert step >= 2 and "lower --lr (now 1e+08" in err and "resume.pt is kept" in err
    # the checkpoint of the last good step stays, finite; nothing else was written
    state = torch.load(out / "resume.pt", map_location="cpu", weights_only=True)
    assert state["step"] == step - 1
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert no_model_in(out) and not (out / "mudaf_train.json").exists()
