"""MuDAF training on a tiny Llama: where L_CON's gradient goes, the two-golden rule, vanilla SFT = plain
CLM, the losses fall and the selected heads' golden-passage attention rises, resume, the command."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from retmask.cli import main as cli_main
from retmask.heads.selection import read_heads
from retmask.methods.mudaf import train as mudaf_mod
from retmask.methods.mudaf.loss import _contrastive_logits_terms
from retmask.methods.mudaf.mdqa import MDQAError, write_mdqa
from retmask.methods.mudaf.score import score_mdqa
from retmask.methods.mudaf.train import (
    MuDAFConfig,
    clm_loss,
    collate,
    encode,
    mudaf_losses,
    read_record,
    train_mudaf,
)
from retmask.runfiles import RunFileError
from tests.tiny import tiny_llama_for

D = 16  # head dim of the tiny model; 4 query heads over 2 KV heads (group of 2)


def _batch(examples, tokenizer, n=3):
    return collate(encode(examples[:n], tokenizer, None), tokenizer.pad_token_id)


def _rows(weight: torch.Tensor, i: int) -> torch.Tensor:
    return weight[i * D : (i + 1) * D]


@pytest.mark.parametrize("similarity", ["concat", "per-head"])
def test_con_gradient_reaches_selected_heads_only(mdqa_examples, bpe_tokenizer, similarity):
    model = tiny_llama_for(bpe_tokenizer)
    heads = [(1, 0), (1, 1), (0, 3)]  # layer 1: both in KV group 0; layer 0: head 3 in KV group 1
    cfg = MuDAFConfig(heads=heads, similarity=similarity)
    _, _, con = mudaf_losses(model, _batch(mdqa_examples, bpe_tokenizer), cfg)
    con.backward()  # L_CON alone
    top, bottom = model.model.layers[1].self_attn, model.model.layers[0].self_attn
    for h in (0, 1):  # selected in the deepest selected layer
        assert _rows(top.q_proj.weight.grad, h).abs().sum() > 0
    for h in (2, 3):  # not selected there: their q cannot influence layer-1 q/k
        assert _rows(top.q_proj.weight.grad, h).abs().sum() == 0
    assert _rows(top.k_proj.weight.grad, 0).abs().sum() > 0  # KV group of heads 0 and 1
    assert _rows(top.k_proj.weight.grad, 1).abs().sum() == 0
    assert (
        _rows(bottom.q_proj.weight.grad, 3).abs().sum() > 0
        and _rows(bottom.k_proj.weight.grad, 1).abs().sum() > 0
    )
    # Nothing after the deepest selected layer's q/k takes part.
    for p in (
        top.v_proj.weight,
        top.o_proj.weight,
        model.lm_head.weight,
        model.model.layers[1].mlp.up_proj.weight,
    ):
        assert p.grad is None or p.grad.abs().sum() == 0


def test_two_golden_passages_each_against_the_negatives():
    logits = torch.tensor([1.0, 0.2, -0.5, 0.7], requires_grad=True)
    got = _contrastive_logits_terms(logits, [0, 2])
    e = [math.exp(x) for x in logits.tolist()]
    want = 0.5 * (-math.log(e[0] / (e[0] + e[1] + e[3])) - math.log(e[2] / (e[2] + e[1] + e[3])))
    assert got.item() == pytest.approx(want, rel=1e-6)
    single = _contrastive_logits_terms(logits, [3])  # one golden: plain cross-entropy
    assert single.item() == pytest.approx(
        torch.nn.functional.cross_entropy(logits[None], torch.tensor([3])).item()
    )


def test_vanilla_sft_equals_plain_clm(mdqa_examples, bpe_tokenizer):
    model = tiny_llama_for(bpe_tokenizer)
    batch = _batch(mdqa_examples, bpe_tokenizer)
    cfg = MuDAFConfig(heads=[(1, 0), (0, 1)], vanilla_sft=True)
    loss, clm, con = mudaf_losses(model, batch, cfg)
    assert loss is clm and con is not None and not con.requires_grad
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # Plain CLM (equal to transformers' own loss over full logits: test_clm_loss_projects_only_the_answer_rows).
    plain = clm_loss(model, batch["input_ids"], batch["attention_mask"], batch["labels"])
    assert plain.item() == pytest.approx(loss.item(), abs=0)
    plain.backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, got[n]), n
    # Labels cover exactly the answer tokens (answer + EOS) of each example.
    for b, ex in enumerate(mdqa_examples[:3]):
        answer = batch["labels"][b][batch["labels"][b] != -100].tolist()
        assert bpe_tokenizer.decode(answer).strip() == ex.answer + "<eos>"


def test_training_lowers_losses_and_focuses_selected_heads(tmp_path, mdqa_examples, bpe_tokenizer):
    data = mdqa_examples[:8]
    heads = [(1, 0), (1, 3)]
    model = tiny_llama_for(bpe_tokenizer)
    before = score_mdqa(model, bpe_tokenizer, data, progress=False).mean("golden_mass")
    cfg = MuDAFConfig(heads=heads, learning_rate=3e-3, max_steps=24, batch_size=4, seed=1)
    result = train_mudaf(model, bpe_tokenizer, data, tmp_path / "m", cfg, progress=False)
    after = score_mdqa(model, bpe_tokenizer, data, progress=False).mean("golden_mass")
    first, last = result.log[:3], result.log[-3:]
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "con") < 0.7 * mean(first, "con")
    assert mean(last, "clm") < mean(first, "clm")
    for ly, h in heads:  # the trained heads attend more to the golden passages
        assert after[ly, h] > before[ly, h] + 0.05, (ly, h, before[ly, h], after[ly, h])
    rec = read_record(tmp_path / "m")
    assert rec["steps"] == 24 and rec["mode"] == "mudaf" and rec["config"]["heads"] == [[1, 0], [1, 3]]
    assert (tmp_path / "m" / "model.safetensors").is_file() and not (tmp_path / "m" / "resume.pt").exists()


def test_resume_continues_identically(tmp_path, mdqa_examples, bpe_tokenizer, monkeypatch):
    data = mdqa_examples[:6]
    cfg = MuDAFConfig(heads=[(1, 2)], learning_rate=1e-3, max_steps=4, batch_size=2, save_every=2)
    straight = tiny_llama_for(bpe_tokenizer)
    train_mudaf(straight, bpe_tokenizer, data, tmp_path / "a", cfg, progress=False)
    _crash_at_call(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train_mudaf(tiny_llama_for(bpe_tokenizer), bpe_tokenizer, data, tmp_path / "b", cfg, progress=False)
    assert (tmp_path / "b" / "resume.pt").is_file()
    monkeypatch.undo()
    resumed = tiny_llama_for(bpe_tokenizer)
    result = train_mudaf(resumed, bpe_tokenizer, data, tmp_path / "b", cfg, resume=True, progress=False)
    assert [r["step"] for r in result.log] == [1, 2, 3, 4]
    for (n, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)


@pytest.mark.parametrize("vanilla", [False, True], ids=["mudaf", "vanilla-sft"])
def test_gradient_checkpointing_trains_identically(
    tmp_path, mdqa_examples, bpe_tokenizer, monkeypatch, vanilla
):
    """With activation checkpointing each decoder layer runs again in the backward pass; L_CON's tapped q / k
    keep their gradient path, so the losses and the trained weights equal those without it, and the
    model comes back with checkpointing off (it is trained in place)."""
    import transformers.modeling_utils as modeling

    real, checkpointed = (
        modeling.checkpoint,
        [],
    )  # torch.utils.checkpoint.checkpoint, as transformers calls it
    monkeypatch.setattr(modeling, "checkpoint", lambda *a, **k: checkpointed.append(1) or real(*a, **k))
    data = mdqa_examples[:4]
    cfg = MuDAFConfig(
        heads=[(1, 0), (0, 3)], vanilla_sft=vanilla, learning_rate=3e-3, max_steps=3, batch_size=2
    )
    plain, ckpt = tiny_llama_for(bpe_tokenizer), tiny_llama_for(bpe_tokenizer)
    a = train_mudaf(plain, bpe_tokenizer, data, tmp_path / "a", cfg, progress=False)
    assert not checkpointed
    ckpt_cfg = MuDAFConfig(**{**cfg.__dict__, "gradient_checkpointing": True})
    b = train_mudaf(ckpt, bpe_tokenizer, data, tmp_path / "b", ckpt_cfg, progress=False)
    assert len(checkpointed) == 3 * 2  # every step, both layers of the tiny model
    assert not ckpt.is_activation_checkpointing
    for x, y in zip(a.log, b.log, strict=True):
        assert x.keys() == y.keys() and "con" in x
        assert all(y[k] == pytest.approx(x[k], rel=1e-5) for k in x)
    for (n, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)


def test_resume_checkpoint_damaged_or_of_other_settings_is_named(tmp_path, mdqa_examples, bpe_tokenizer):
    from retmask.runfiles import RunFileError

    data = mdqa_examples[:4]
    cfg = MuDAFConfig(heads=[(1, 2)], learning_rate=1e-3, max_steps=2, batch_size=2, save_every=1)
    out = tmp_path / "c"
    out.mkdir()
    resume = out / "resume.pt"
    resume.write_bytes(b"PK\x03\x04torn")  # a checkpoint cut short
    with pytest.raises(RunFileError, match=rf"resume checkpoint {resume} cannot be read .*delete it"):
        train_mudaf(tiny_llama_for(bpe_tokenizer), bpe_tokenizer, data, out, cfg, resume=True, progress=False)
    settings = mudaf_mod._resume_settings(cfg, len(data)) | {"learning_rate": 5e-6}
    torch.save(
        {"model": {}, "optimizer": {}, "step": 1, "log": [], "seconds": 0.0, "settings": settings}, resume
    )
    with pytest.raises(RunFileError, match=r"other settings \(learning_rate: 5e-06 -> 0.001\).*--overwrite"):
        train_mudaf(tiny_llama_for(bpe_tokenizer), bpe_tokenizer, data, out, cfg, resume=True, progress=False)


class _Payload:
    """Unpickling this object runs code (writes a file): what a planted resume.pt could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def test_resume_checkpoint_that_would_run_code_is_refused(tmp_path, mdqa_examples, bpe_tokenizer):
    """A resume.pt holding a pickled object whose loading runs code is read as data only: refused with the
    damaged-checkpoint message, and the code never runs."""
    from retmask.runfiles import RunFileError

    data = mdqa_examples[:4]
    cfg = MuDAFConfig(heads=[(1, 2)], learning_rate=1e-3, max_steps=2, batch_size=2, save_every=1)
    out = tmp_path / "d"
    out.mkdir()
    marker = tmp_path / "payload-ran"
    torch.save(
        {"model": {}, "optimizer": {}, "step": 1, "log": [_Payload(marker)], "seconds": 0.0},
        out / "resume.pt",
    )
    with pytest.raises(RunFileError, match="cannot be read"):
        train_mudaf(tiny_llama_for(bpe_tokenizer), bpe_tokenizer, data, out, cfg, resume=True, progress=False)
    assert not marker.exists()


def test_command_samples_heads_and_errors(tmp_path, mdqa_examples, bpe_tokenizer, capsys):
    folder = tmp_path / "tiny"
    tiny_llama_for(bpe_tokenizer).save_pretrained(folder)
    bpe_tokenizer.save_pretrained(folder)
    data = write_mdqa(mdqa_examples[:4], tmp_path / "train.jsonl")
    scores = tmp_path / "scores.json"
    assert cli_main(["mdqa-score", "--data", str(data), "--model", str(folder), "--out", str(scores)]) == 0
    out = tmp_path / "run"
    rc = cli_main(["mudaf-train", "--data", str(data), "--model", str(folder), "--out", str(out), "--scores",
                   str(scores), "--num-heads", "3", "--steps", "2", "--batch-size", "2", "--lr", "1e-4",
                   "--gradient-checkpointing"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    assert read_record(out)["config"]["gradient_checkpointing"] is True
    sel = read_heads(out / "heads.json")
    assert len(sel.heads) == 3 and sel.method == "mudaf-sample" and sel.temperature == 0.05
    assert read_record(out)["config"]["heads"] == [list(h) for h in sel.heads]
    capsys.readouterr()
    other = tmp_path / "other"
    assert cli_main(["mudaf-train", "--data", str(data), "--model", str(folder), "--out", str(other)]) == 2
    assert "needs target heads" in capsys.readouterr().err
    rc = cli_main(["mudaf-train", "--data", str(data), "--model", str(folder), "--out", str(other), "--heads",
                   str(out / "heads.json"), "--vanilla-sft", "--alpha", "0.3"])  # fmt: skip
    assert rc == 2 and "drop --alpha" in capsys.readouterr().err
    # the finished run in `out` is not replaced by accident
    assert cli_main(["mudaf-train", "--data", str(data), "--model", str(folder), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err

    assert read_record(out)["kernels"]["attention"]["cpu float32 backward"]["path"] == "kernel"


def test_bad_cpu_setting_fails_before_loading(tmp_path, mdqa_examples, monkeypatch, capsys):
    monkeypatch.setenv("RETMASK_CPU_PATH", "gemm")
    data = write_mdqa(mdqa_examples[:2], tmp_path / "train.jsonl")
    rc = cli_main(["mudaf-train", "--data", str(data), "--model", str(tmp_path / "no-model"), "--out",
                   str(tmp_path / "run"), "--vanilla-sft"])  # fmt: skip
    assert rc == 2 and "RETMASK_CPU_PATH" in capsys.readouterr().err  # the model path was never read


def test_bf16_autocast_tracks_float32(tmp_path, mdqa_examples, bpe_tokenizer):
    """--dtype bfloat16: bf16 matmuls under autocast, float32 master weights, a loss curve that follows
    float32's over a few steps (same initial weights, same batches)."""
    data = mdqa_examples[:6]
    logs, models = {}, {}
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        model = tiny_llama_for(bpe_tokenizer)
        seen = []
        model.model.layers[1].self_attn.k_proj.register_forward_hook(
            lambda m, i, o, s=seen: s.append(o.dtype)
        )
        cfg = MuDAFConfig(heads=[(1, 0)], learning_rate=1e-3, max_steps=4, batch_size=2, seed=1, dtype=dtype)
        logs[dtype] = train_mudaf(model, bpe_tokenizer, data, tmp_path / dtype, cfg, progress=False).log
        models[dtype] = model
        assert set(seen) == {torch.float32 if dtype == "float32" else torch.bfloat16}
        assert read_record(tmp_path / dtype)["config"]["dtype"] == dtype
    assert all(p.dtype == torch.float32 for p in models["bfloat16"].parameters())
    for key in ("clm", "con"):
        a = torch.tensor([r[key] for r in logs["float32"]])
        b = torch.tensor([r[key] for r in logs["bfloat16"]])
        assert not torch.equal(a, b)  # bf16 really changed the arithmetic
        torch.testing.assert_close(b, a, rtol=0.03, atol=0.02)
    with pytest.raises(MDQAError, match="dtype must be float32 or bfloat16"):
        MuDAFConfig(heads=[(1, 0)], dtype="float16").check()


def test_clm_loss_projects_only_the_answer_rows(mdqa_examples, bpe_tokenizer):
    """L_CLM on a right-padded batch of 3 MDQA examples: the value and every gradient of transformers' own
    causal-LM loss over full logits, with the LM head run on the answer positions only."""
    model = tiny_llama_for(bpe_tokenizer).train()
    batch = _batch(mdqa_examples, bpe_tokenizer)
    kwargs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    scored = int((batch["labels"][:, 1:] != -100).sum())
    rows: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1].numel()))
    try:
        model.zero_grad()
        ours = clm_loss(model, **kwargs)
        ours.backward()
        ours_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        theirs = model(**kwargs, use_cache=False).loss
        theirs.backward()
    finally:
        hook.remove()
    assert rows == [scored, batch["input_ids"].numel()] and scored < batch["input_ids"].numel() / 4
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours_grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_resume_of_a_finished_run_is_refused_before_any_work(tmp_path, mdqa_examples, bpe_tokenizer, capsys):
    """--resume on a finished run used to retrain from the base model and replace the result (exit 0)."""
    from retmask.runfiles import RunFileError

    data = mdqa_examples[:4]
    out = tmp_path / "done"
    cfg = MuDAFConfig(heads=[(1, 2)], learning_rate=1e-3, max_steps=3, batch_size=2, save_every=1)
    train_mudaf(tiny_llama_for(bpe_tokenizer), bpe_tokenizer, data, out, cfg, progress=False)
    weights = (out / "model.safetensors").read_bytes()
    heads = tmp_path / "heads.json"
    heads.write_text("[[1, 2]]")
    jsonl = write_mdqa(data, tmp_path / "train.jsonl")
    argv = ["mudaf-train", "--data", str(jsonl), "--heads", str(heads), "--out", str(out), "--steps", "1",
            "--batch-size", "2", "--resume", "--model", str(tmp_path / "never-loaded")]  # fmt: skip
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert f"the training in {out} already finished (3 steps)" in err and "--overwrite" in err, err
    assert "another --out" in err and "never-loaded" not in err  # refused before the model loads
    with pytest.raises(RunFileError, match="already finished"):  # the API refuses too
        train_mudaf(tiny_llama_for(bpe_tokenizer), bpe_tokenizer, data, out, cfg, resume=True, progress=False)
    assert (out / "model.safetensors").read_bytes() == weights and read_record(out)["steps"] == 3


def _crash_at_call(monkeypatch, n: int) -> None:
    """mudaf_losses raises KeyboardInterrupt on its n-th call (a run interrupted mid-training)."""
    real, calls = mudaf_mod.mudaf_losses, {"n": 0}

    def crash(*a, **k):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt("simulated crash")
        return real(*a, **k)

    monkeypatch.setattr(mudaf_mod, "mudaf_losses", crash)


def _interrupted_at_step_2(monkeypatch, tokenizer, data, out) -> MuDAFConfig:
    """A 2-step run on ``out`` interrupted after step 1's resume.pt; returns its settings."""
    cfg = MuDAFConfig(heads=[(1, 2)], learning_rate=1e-3, max_steps=2, batch_size=2, save_every=1)
    _crash_at_call(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        train_mudaf(tiny_llama_for(tokenizer), tokenizer, data, out, cfg, progress=False)
    return cfg


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused(
    tmp_path, mdqa_examples, bpe_tokenizer, monkeypatch
):
    """A 3-step run stopped after step 2, resumed with --steps 1, would have saved 2 steps' weights as the
    result of a 1-step run."""
    data = mdqa_examples[:6]
    cfg = MuDAFConfig(heads=[(1, 2)], learning_rate=1e-3, max_steps=3, batch_size=2, save_every=1)
    _crash_at_call(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train_mudaf(tiny_llama_for(bpe_tokenizer), bpe_tokenizer, data, tmp_path / "b", cfg, progress=False)
    monkeypatch.undo()
    fewer = MuDAFConfig(heads=[(1, 2)], learning_rate=1e-3, max_steps=1, batch_size=2, save_every=1)
    with pytest.raises(
        RunFileError, match=r"resume.pt is at step 2, past --steps 1; resume with --steps 2 or more"
    ):
        train_mudaf(tiny_llama_for(bpe_tokenizer), bpe_tokenizer, data, tmp_path / "b", fewer, resume=True,
                    progress=False)  # fmt: skip


def test_resume_may_switch_gradient_checkpointing(tmp_path, mdqa_examples, bpe_tokenizer, monkeypatch):
    """Activation checkpointing does not change the result, so a resumed run may turn it on (or off)."""
    data, out = mdqa_examples[:4], tmp_path / "run"
    cfg = _interrupted_at_step_2(monkeypatch, bpe_tokenizer, data, out)
    monkeypatch.undo()
    on = MuDAFConfig(**{**cfg.__dict__, "gradient_checkpointing": True})
    result = train_mudaf(
        tiny_llama_for(bpe_tokenizer), bpe_tokenizer, data, out, on, resume=True, progress=False
    )
    assert [r["step"] for r in result.log] == [1, 2]


def test_resume_with_another_data_file_is_refused(
    tmp_path, mdqa_examples, bpe_tokenizer, monkeypatch, capsys
):
    """The resume settings held only the example count: another --data file of the same size was accepted
    (the first steps trained on the old data, the rest on the new)."""
    folder = tmp_path / "tiny"
    tiny_llama_for(bpe_tokenizer).save_pretrained(folder)
    bpe_tokenizer.save_pretrained(folder)
    first = write_mdqa(mdqa_examples[:4], tmp_path / "a.jsonl")
    second = write_mdqa(mdqa_examples[4:8], tmp_path / "b.jsonl")  # the same number of examples
    out = tmp_path / "run"
    argv = ["mudaf-train", "--model", str(folder), "--out", str(out), "--vanilla-sft", "--steps", "3",
            "--batch-size", "2", "--save-every", "1", "--no-progress"]  # fmt: skip
    _crash_at_call(monkeypatch, 2)
    assert cli_main([*argv, "--data", str(first)]) == 130
    assert (out / "resume.pt").is_file()
    monkeypatch.undo()
    assert cli_main([*argv, "--data", str(second), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "other settings (data_sha256: " in err and "--overwrite" in err, err
    assert not (out / "model.safetensors").exists()
    assert cli_main([*argv, "--data", str(first), "--resume"]) == 0, capsys.readouterr().err
    assert [r["step"] for r in read_record(out)["log"]] == [1, 2, 3]


def test_resume_checkpoint_without_identity_keys_still_resumes(
    tmp_path, mdqa_examples, bpe_tokenizer, monkeypatch
):
    """A resume.pt written before the data digest and model joined the fingerprint is not a mismatch."""
    data, out = mdqa_examples[:4], tmp_path / "old"
    cfg = _interrupted_at_step_2(monkeypatch, bpe_tokenizer, data, out)
    saved = torch.load(out / "resume.pt", weights_only=True)["settings"]
    assert "data_sha256" not in saved and "model" not in saved
    monkeypatch.undo()
    identity = {"data_sha256": "0" * 64, "model": "tiny"}
    result = train_mudaf(tiny_llama_for(bpe_tokenizer), bpe_tokenizer, data, out, cfg, resume=True,
                         progress=False, identity=identity)  # fmt: skip
    assert [r["step"] for r in result.log] == [1, 2]


def test_stale_temporary_files_of_a_killed_write_are_removed(
    tmp_path, mdqa_examples, bpe_tokenizer, monkeypatch, capsys
):
    """A kill -9 while resume.pt was written left a model-sized .resume.pt.tmpNNN after the resumed run
    succeeded. Removed at the start of a run: the writers' own temporary names only."""
    data, out = mdqa_examples[:4], tmp_path / "k"
    cfg = _interrupted_at_step_2(monkeypatch, bpe_tokenizer, data, out)
    monkeypatch.undo()
    torn = [out / ".resume.pt.tmp4242", out / ".heads.json.tmp17"]
    for p in torn:
        p.write_bytes(b"PK\x03\x04torn")
    kept = [
        out / n for n in (".resume.pt.tmp", "resume.pt.tmp5", ".resume.pt.tmp5.bak", ".notes.tmp5", "x.tmp1")
    ]
    for p in kept:
        p.write_text("not ours")
    (out / ".resume.pt.tmp6").mkdir()  # a folder is never one of the writers' files
    capsys.readouterr()
    train_mudaf(tiny_llama_for(bpe_tokenizer), bpe_tokenizer, data, out, cfg, resume=True, progress=False)
    err = capsys.readouterr().err
    assert not any(p.exists() for p in torn) and all(p.read_text() == "not ours" for p in kept)
    assert (out / ".resume.pt.tmp6").is_dir()
    line = f"retmask: removed 2 temporary file(s) an interrupted write left in {out}: .heads.json.tmp17, .resume.pt.tmp4242"
    assert line in err.splitlines(), err


def test_command_trains_a_model_with_attention_dropout(tmp_path, mdqa_examples, bpe_tokenizer, capsys):
    """mudaf-train loads the model with its attention dropout set to 0 (retmask attention computes none);
    a model whose config asks for some (GPT-2: attn_pdrop 0.1) used to stop at the first step with
    NotImplementedError and a traceback."""
    folder = tmp_path / "tiny"
    model = tiny_llama_for(bpe_tokenizer)
    model.config.attention_dropout = 0.1
    model.save_pretrained(folder)
    bpe_tokenizer.save_pretrained(folder)
    data = write_mdqa(mdqa_examples[:2], tmp_path / "train.jsonl")
    heads = tmp_path / "heads.json"
    heads.write_text("[[1, 2]]")
    out = tmp_path / "run"
    rc = cli_main(["mudaf-train", "--data", str(data), "--model", str(folder), "--out", str(out), "--heads",
                   str(heads), "--steps", "1", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "attention dropout attention_dropout 0.1 -> 0" in err
    assert read_record(out)["steps"] == 1
