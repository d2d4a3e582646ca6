"""retmask train: DPO steps change the weights, --sft runs, the schedule follows the published recipe, bad
inputs fail."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from retmask.cli import main as cli
from retmask.methods.retmask.pairs import PairsError, read_pairs_file
from retmask.methods.retmask.train_config import TrainConfig, length_report

ROWS = [
    ("Name a colour.", "Blue is a colour.", "Seven."),
    ("What is two plus two? Answer briefly.", "Four.", "It is five or six."),
    ("Say hello.", "Hello!", "No."),
    ("Capital of France?", "Paris.", "Berlin, I think."),
]


def conv(prompt, chosen, rejected, **extra):
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
        **extra,
    }


@pytest.fixture
def pairs_file(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [conv(*r, id=f"p{i}", metadata={"x": 1}) for i, r in enumerate(ROWS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("sft", [False, True], ids=["dpo", "sft"])
def test_train_two_steps_change_weights(tiny_dir, pairs_file, tmp_path, capsys, sft):
    out = tmp_path / "out"
    argv = ["train", "--pairs", str(pairs_file), "--model", str(tiny_dir), "--out", str(out), "--max-steps", "2",
            "--batch-size", "2", "--grad-accum", "1", "--lr", "1e-2", "--max-length", "128"]  # fmt: skip
    assert cli(argv + (["--sft"] if sft else [])) == 0
    text = capsys.readouterr().out
    assert "2 steps" in text and "0 prompts reach max_length" in text
    summary = json.loads((out / "retmask_train.json").read_text())
    assert summary["mode"] == ("sft" if sft else "dpo") and summary["steps"] == 2
    kernels = summary["kernels"]  # the machine and the path each kind of call took (retmask env)
    assert kernels["attention"]["cpu float32 backward"]["path"] == "kernel"
    assert kernels["cpu_speedups"]["enabled"] is True and kernels["cpu_speedups"]["linear_decisions"]
    assert len(summary["losses"]) == 2 and all(torch.isfinite(torch.tensor(summary["losses"])))
    before, after = weights(tiny_dir), weights(out)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert any("self_attn" in k for k in changed), changed
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


def test_schedule_and_optimizer_follow_the_published_recipe(tiny, tmp_path):
    """Warm-up to the peak over 10% of the steps, cosine to 0.1 x peak, AdamW (0.9, 0.95), wd 0.1, fp32;
    torch's fused AdamW (one kernel for all parameters; 7x faster per step than the loop on the CPU)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model, tok = tiny
    cfg = TrainConfig(max_steps=20, batch_size=1, grad_accum=1)
    args = DPOConfig(**cfg.trainer_kwargs(str(tmp_path), use_cpu=True), beta=cfg.beta, loss_type=["sigmoid"])
    assert (
        args.bf16 is False
        and args.activation_checkpointing is False
        and args.beta == 0.1
        and args.loss_type == ["sigmoid"]
    )
    trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, processing_class=tok,
                         train_dataset=Dataset.from_list([conv(*ROWS[0])]))  # fmt: skip
    trainer.create_optimizer_and_scheduler(num_training_steps=20)
    group = trainer.optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.95) and group["weight_decay"] == 0.1
    assert group["fused"] is True
    lrs = []
    for _ in range(20):
        lrs.append(trainer.lr_scheduler.get_last_lr()[0])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(5e-7)  # 10% of 20 steps = 2 warm-up steps
    assert lrs[1] == pytest.approx(2.5e-7)
    assert all(a >= b for a, b in zip(lrs[2:-1], lrs[3:], strict=True))  # cosine decays monotonically
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(5e-8)  # ends at min_lr_rate x peak


def test_prompt_reaching_max_length_is_an_error(tiny_dir, tmp_path, capsys):
    path = tmp_path / "pairs.jsonl"
    rows = [conv(*ROWS[0]), conv("word " * 200, "Yes.", "No.")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [
        "train",
        "--pairs",
        str(path),
        "--model",
        str(tiny_dir),
        "--out",
        str(tmp_path / "o"),
        "--max-length",
        "100",
    ]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert "1 of 2 prompts" in err and "rows [1]" in err and "drop them silently" in err
    assert not (tmp_path / "o").exists()


def test_length_report_counts_truncation(tokenizer):
    rows = [conv("Hi.", "ok " * 300, "no."), conv("Hi.", "ok", "no")]
    rep = length_report(rows, tokenizer, 200, ("chosen", "rejected"))
    assert rep.prompt_too_long == [] and rep.truncated == 1 and rep.longest_sequence > 300


@pytest.mark.parametrize(
    "content,match",
    [
        ("", "no pairs"),
        ("not json\n", "line 1: not valid JSON"),
        (json.dumps({"prompt": "a", "chosen": "b"}) + "\n", "missing 'rejected'"),
        (
            json.dumps({"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"}) + "\n",
            "'chosen' must be a non-empty list of messages",
        ),  # fmt: skip
        (
            json.dumps(conv("a", "b", "c"))
            + "\n"
            + json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"})
            + "\n",
            "line 2: a standard row in a file of conversational rows",
        ),  # fmt: skip
        (
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": "a"}],
                    "chosen": [{"role": "user", "content": "b"}],
                    "rejected": [{"role": "assistant", "content": "c"}],
                }
            )
            + "\n",
            "has role 'user'",
        ),  # fmt: skip
        (json.dumps(conv("a", "  ", "c")) + "\n", "'chosen' is empty"),
        (json.dumps({"messages": []}) + "\n", "missing 'prompt', 'chosen', 'rejected'"),
    ],
)
def test_bad_pairs_files(content, match, tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(content)
    with pytest.raises(PairsError, match=match):
        read_pairs_file(path)


def test_cli_bad_pairs_file(tmp_path, capsys):
    assert cli(["train", "--pairs", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_standard_format_accepted(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c", "id": 3}) + "\n")
    pairs = read_pairs_file(path)
    assert pairs.format == "standard" and pairs.rows == [{"prompt": "a", "chosen": "b", "rejected": "c"}]


def test_train_refuses_to_replace_an_earlier_model(pairs_file, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"earlier model")
    assert cli(["train", "--pairs", str(pairs_file), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already holds files" in err and "--overwrite" in err
    assert (out / "model.safetensors").read_bytes() == b"earlier model"


@pytest.mark.parametrize(
    ("env", "value"),
    [("RETMASK_CPU_PATH", "gemm"), ("RETMASK_CPU_SPEEDUPS", "fast"), ("RETMASK_CPU_ISA", "sse9")],
)
def test_bad_cpu_override_fails_before_training(
    tiny_dir, pairs_file, tmp_path, monkeypatch, capsys, env, value
):
    monkeypatch.setenv(env, value)
    argv = ["train", "--pairs", str(pairs_file), "--model", str(tiny_dir), "--out", str(tmp_path / "out"),
            "--max-steps", "1"]  # fmt: skip
    assert cli(argv) != 0 and env in capsys.readouterr().err
    assert not (tmp_path / "out" / "retmask_train.json").exists()


def test_drop_unfinished_pairs(tiny_dir, tmp_path, capsys):
    """--drop-unfinished trains only on pairs whose responses ended by themselves (DPO: both sides; --sft:
    the chosen one); files without the flags, or with nothing left, are clear errors."""
    from retmask.methods.retmask.pairs import drop_unfinished

    flags = [(True, True), (True, False), (False, True), (True, True)]
    path = tmp_path / "pairs.jsonl"
    rows = [
        conv(*r, id=f"p{i}", metadata={"chosen_finished": c, "rejected_finished": rj})
        for i, (r, (c, rj)) in enumerate(zip(ROWS, flags, strict=True))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = read_pairs_file(path)
    kept, dropped = drop_unfinished(pairs)
    assert dropped == 2 and [r["chosen"][0]["content"] for r in kept.rows] == [ROWS[0][1], ROWS[3][1]]
    kept, dropped = drop_unfinished(pairs, ("chosen",))
    assert dropped == 1 and len(kept.rows) == 3
    out = tmp_path / "out"
    argv = ["train", "--pairs", str(path), "--model", str(tiny_dir), "--out", str(out), "--max-steps", "1",
            "--batch-size", "2", "--grad-accum", "1", "--max-length", "128", "--drop-unfinished"]  # fmt: skip
    assert cli(argv) == 0
    assert "dropped 2 pair(s)" in capsys.readouterr().out
    summary = json.loads((out / "retmask_train.json").read_text())
    assert (
        summary["examples"] == 2
        and summary["dropped_unfinished"] == 2
        and summary["config"]["drop_unfinished"]
    )

    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps(conv(*r)) + "\n" for r in ROWS))
    with pytest.raises(PairsError, match="row 1 does not record whether"):
        drop_unfinished(read_pairs_file(bare))
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(json.dumps(conv(*r, metadata={"chosen_finished": False, "rejected_finished": True})) + "\n"
                           for r in ROWS))  # fmt: skip
    with pytest.raises(PairsError, match="every one of the 4 pairs"):
        drop_unfinished(read_pairs_file(cut))


def _train_one_step(pairs_file, model_folder, out, sft: bool) -> int:
    """`retmask train` (DPO, or SFT with ``sft``) for one optimisation step of two pairs; its exit code."""
    argv = ["train", "--pairs", str(pairs_file), "--model", str(model_folder), "--out", str(out), "--max-steps",
            "1", "--batch-size", "2", "--grad-accum", "1", "--max-length", "128"]  # fmt: skip
    return cli(argv + (["--sft"] if sft else []))


@pytest.mark.parametrize("sft", [False, True], ids=["dpo", "sft"])
def test_model_with_attention_dropout_trains_without_it(tokenizer, pairs_file, tmp_path, capsys, sft):
    """A model whose config asks for attention dropout (GPT-2's attn_pdrop is 0.1) is loaded for training
    with it set to 0, which retmask attention computes; it used to stop at the first step with
    NotImplementedError and a traceback (TRL's DPO zeroes nn.Dropout modules, not Llama's float)."""
    from tests.tiny import tiny_llama_for

    folder = tmp_path / "dropout-model"
    model = tiny_llama_for(tokenizer, init=0.02)
    model.config.attention_dropout = 0.1
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    assert _train_one_step(pairs_file, folder, out, sft) == 0
    assert "attention dropout attention_dropout 0.1 -> 0" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["attention_dropout"] == 0.0  # as trained


@pytest.mark.parametrize("sft", [False, True], ids=["dpo", "sft"])
def test_mixture_of_experts_model_trains_on_the_loss_alone(tokenizer, pairs_file, tmp_path, sft):
    """The loss is DPO's / SFT's alone on a mixture-of-experts model too: TRL's router load-balancing loss
    is off. With it, TRL read config.num_experts, which GraniteMoe's config lacks (num_local_experts):
    training stopped with AttributeError. DPO's first loss, policy = reference, is then exactly log 2."""
    import math

    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "granitemoe", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    folder = tmp_path / "moe"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    assert _train_one_step(pairs_file, folder, out, sft) == 0
    losses = json.loads((out / "retmask_train.json").read_text())["losses"]
    assert len(losses) == 1 and math.isfinite(losses[0])
    if not sft:
        assert losses[0] == pytest.approx(math.log(2), abs=1e-6)


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory, tokenizer):
    """The tiny Llama with a tokenizer that has no chat template (a base model), and an image processor's
    config as a vision-language model's folder holds one."""
    from tests.tiny import tiny_llama_for

    folder = tmp_path_factory.mktemp("base-model")
    tiny_llama_for(tokenizer, init=0.02).save_pretrained(folder)
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    plain.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "made-up"}))
    return folder


def test_base_model_pairs_are_plain_text_and_train(base_model_dir, pairs_file, tmp_path, capsys):
    """`retmask generate` on a model without a chat template samples from the plain prompt and writes plain
    text rows, which `retmask train` takes (DPO and SFT); chat-message rows are refused for such a model
    with the fix, not with the trainer's error. The checkpoint keeps the folder's processor config."""
    prompts = tmp_path / "inst.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"q{k}", "prompt": r[0]}) + "\n" for k, r in enumerate(ROWS))
    )
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"heads": [[0, 1], [1, 3]]}))
    pairs = tmp_path / "plain.jsonl"
    argv = ["generate", "--model", str(base_model_dir), "--instructions", str(prompts), "--heads", str(heads),
            "--out", str(pairs), "--max-new-tokens", "5", "--batch-size", "2", "--no-progress"]  # fmt: skip
    assert cli(argv) == 0
    capsys.readouterr()
    written = read_pairs_file(pairs)
    assert written.format == "standard" and len(written.rows) >= 2
    assert {r["prompt"] for r in written.rows} <= {r[0] for r in ROWS}
    for sft in (False, True):
        out = tmp_path / f"out-{sft}"
        assert _train_one_step(pairs, base_model_dir, out, sft) == 0
        assert json.loads((out / "preprocessor_config.json").read_text()) == {
            "image_processor_type": "made-up"
        }
    assert "the one step is the warmup's first, at learning rate 0" in capsys.readouterr().err
    assert _train_one_step(pairs_file, base_model_dir, tmp_path / "refused", sft=False) == 2
    err = capsys.readouterr().err
    assert "the rows are chat messages, and the model's tokenizer has no chat template" in err
    assert "give the rows as plain text" in err and "Traceback" not in err


def test_a_schedule_that_trains_nothing_is_named():
    """The warmup starts at learning rate 0: one step with any warmup leaves the weights as they were."""
    import warnings

    with pytest.warns(UserWarning, match="saved model equals the base model; take 2 or more steps"):
        TrainConfig(max_steps=1).warn_if_nothing_trains()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainConfig(max_steps=1, warmup_ratio=0.0).warn_if_nothing_trains()
        TrainConfig(max_steps=2).warn_if_nothing_trains()
        TrainConfig().warn_if_nothing_trains()


@pytest.mark.parametrize("sft", [False, True], ids=["dpo", "sft"])
def test_gradient_checkpointing_trains_to_the_same_weights(tiny_dir, pairs_file, tmp_path, monkeypatch, sft):
    """--gradient-checkpointing recomputes each layer's forward (retmask attention included) in the backward
    pass: less memory, the same gradients, so the same trained weights as without it."""
    import transformers.modeling_utils as modeling

    real, checkpointed = (
        modeling.checkpoint,
        [],
    )  # torch.utils.checkpoint.checkpoint, as transformers calls it
    monkeypatch.setattr(modeling, "checkpoint", lambda *a, **k: checkpointed.append(1) or real(*a, **k))
    argv = ["train", "--pairs", str(pairs_file), "--model", str(tiny_dir), "--max-steps", "2", "--batch-size",
            "2", "--grad-accum", "1", "--lr", "1e-2", "--max-length", "128", *(["--sft"] if sft else [])]  # fmt: skip
    assert cli([*argv, "--out", str(tmp_path / "plain")]) == 0
    assert not checkpointed
    assert cli([*argv, "--out", str(tmp_path / "ckpt"), "--gradient-checkpointing"]) == 0
    assert checkpointed  # the decoder layers ran under torch's activation checkpointing
    record = json.loads((tmp_path / "ckpt" / "retmask_train.json").read_text())
    assert record["config"]["gradient_checkpointing"] is True
    plain, ckpt, base = weights(tmp_path / "plain"), weights(tmp_path / "ckpt"), weights(tiny_dir)
    assert any(not torch.equal(base[k], plain[k]) for k in plain)
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], rtol=1e-5, atol=1e-6, msg=k)
