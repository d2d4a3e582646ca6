"""Contrastive generation: per-row masks = separate runs, per-row seeding, pairs format, dropping, resume."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import retmask
from retmask.cli import main as cli
from retmask.heads import normalize_head_mask
from retmask.hf.export import zero_heads_
from retmask.methods.retmask import generate as C
from retmask.methods.retmask.instructions import Instruction
from retmask.methods.retmask.pair_file import unfinished_generation

HEADS = [(0, 1), (1, 2), (1, 3)]
PROMPTS = ["Name a colour.", "Copy this address exactly: 12 Elm Road, Leeds LS2 7AB.", "What is 2 + 3?"]


def instructions(n: int = 3) -> list[Instruction]:
    return [Instruction(id=f"i{k}", prompt=PROMPTS[k % len(PROMPTS)] + f" (#{k})") for k in range(n)]


def run_rows(model, tok, prompts, seeds, sampling, mask=None):
    return [
        (c.text, c.num_tokens, c.finished)
        for c in C.generate_rows(model, tok, prompts, seeds, sampling, mask)
    ]


# Heads in layer 1 only: chosen and rejected rows share layer 0 of the prefill (retmask.hf.shared_prefill).
UPPER_HEADS = [(1, 0), (1, 3)]


@pytest.mark.parametrize("heads", [HEADS, UPPER_HEADS], ids=["from-layer-0", "layer-1-only"])
@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_per_row_masks_equal_separate_runs(peaked, temperature, top_p, heads):
    """Rows [chosen.., rejected..] with the mask on rejected rows only = each row generated alone.

    Equal up to tokens whose sampling decision lies within float rounding (see ``sampling``'s
    reproducibility note): the model's logits are peaked as a trained model's are, not near-uniform."""
    model, tok = peaked
    insts = instructions(3)
    sampling = C.SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=12, seed=7)
    batched = C.contrast_batch(insts, model, tok, sampling, heads=heads)
    shared = normalize_head_mask(heads, 2, 4)  # [L, Hq]
    for inst, (chosen, rejected) in zip(insts, batched, strict=True):
        seed_c = C.row_seed(7, inst.id, "chosen")
        seed_r = C.row_seed(7, inst.id, "rejected")
        alone_c = run_rows(model, tok, [inst.prompt], [seed_c], sampling)[0]
        alone_r = run_rows(model, tok, [inst.prompt], [seed_r], sampling, shared.unsqueeze(0))[0]
        assert (chosen.text, chosen.num_tokens, chosen.finished) == alone_c
        assert (rejected.text, rejected.num_tokens, rejected.finished) == alone_r
    # the mask really acts: masked rows differ from unmasked rows with the same seed
    seeds = [C.row_seed(7, i.id, "rejected") for i in insts]
    unmasked = run_rows(model, tok, [i.prompt for i in insts], seeds, sampling)
    assert [(r.text, r.num_tokens) for _, r in batched] != [(t, n) for t, n, _ in unmasked]


def test_mask_equals_zeroed_checkpoint(tiny, tiny_dir):
    """The runtime per-row mask gives what a checkpoint with the heads' o_proj columns zeroed gives."""
    model, tok = tiny
    zeroed, _ = retmask.load_model(str(tiny_dir))
    zero_heads_(zeroed, HEADS)
    sampling = C.SamplingConfig(temperature=0.0, max_new_tokens=10)
    pairs = C.contrast_batch(instructions(2), model, tok, sampling, heads=HEADS)
    ref = run_rows(zeroed, tok, [i.prompt for i in instructions(2)], [0, 0], sampling)
    assert [(r.text, r.num_tokens) for _, r in pairs] == [(t, n) for t, n, _ in ref]


def test_batch_size_does_not_change_samples(tiny):
    model, tok = tiny
    insts = instructions(4)
    sampling = C.SamplingConfig(temperature=1.0, max_new_tokens=8, seed=3)
    whole = C.contrast_batch(insts, model, tok, sampling, heads=HEADS)
    split = C.contrast_batch(insts[:1], model, tok, sampling, heads=HEADS)
    split += C.contrast_batch(insts[1:], model, tok, sampling, heads=HEADS)
    assert [(c.text, r.text) for c, r in whole] == [(c.text, r.text) for c, r in split]


def test_sampler_distribution_and_top_p():
    """Inverse-CDF sampling follows softmax(logits / T); top-p removes the tail."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gens = [torch.Generator().manual_seed(0)]
    full = C.PerRowSampler(gens, temperature=1.0)
    counts = Counter(int(full(None, logits.clone()).argmax()) for _ in range(4000))
    for tok, p in enumerate([0.5, 0.3, 0.15, 0.05]):
        assert abs(counts[tok] / 4000 - p) < 0.03, counts
    nucleus = C.PerRowSampler([torch.Generator().manual_seed(1)], temperature=1.0, top_p=0.8)
    counts = Counter(int(nucleus(None, logits.clone()).argmax()) for _ in range(2000))
    assert set(counts) == {0, 1}, counts  # 0.5 + 0.3 reaches 0.8: tokens 2 and 3 are cut
    assert abs(counts[0] / 2000 - 0.5 / 0.8) < 0.04


def test_row_seed_is_stable_and_distinct():
    assert C.row_seed(0, "a", "chosen") == C.row_seed(0, "a", "chosen")
    seeds = {C.row_seed(s, i, side) for s in (0, 1) for i in ("a", "b") for side in C.SIDES}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)


def fake_contrast(texts):
    """A stand-in for contrast_batch returning fixed (chosen, rejected) texts by instruction id."""

    def contrast(batch, *args, **kwargs):
        out = []
        for inst in batch:
            c, r = texts[inst.id]
            out.append((C.Completion(c, len(c.split()), True), C.Completion(r, len(r.split()), False)))
        return out

    return contrast


def test_pairs_format_and_dropping(tmp_path, monkeypatch, tokenizer):
    texts = {
        "i0": ("Blue.", "Seven."),
        "i1": ("", "Something."),  # empty chosen
        "i2": ("Same.", "Same."),  # identical
        "i3": ("Paris.", ""),  # empty rejected
        "i4": ("Four.", "Five or six."),
    }
    monkeypatch.setattr(C, "contrast_batch", fake_contrast(texts))
    out = tmp_path / "pairs.jsonl"
    stats = C.generate_pairs(instructions(5), None, tokenizer, out, C.SamplingConfig(), heads=HEADS,
                             batch_size=2, progress_bar=False)  # fmt: skip
    rows = C.read_pairs(out)
    assert [r["id"] for r in rows] == ["i0", "i4"]
    assert stats.pairs == 2 and stats.dropped == {"empty": 2, "identical": 1} and stats.instructions == 5
    r = rows[0]
    assert r["prompt"] == [{"role": "user", "content": instructions(1)[0].prompt}]
    assert r["chosen"] == [{"role": "assistant", "content": "Blue."}]
    assert r["rejected"] == [{"role": "assistant", "content": "Seven."}]
    assert r["metadata"]["rejected_tokens"] == 1 and r["metadata"]["rejected_finished"] is False
    assert (
        stats.truncated_rejected == 2
        and stats.mean_chosen_tokens == 1.0
        and stats.mean_rejected_tokens == 2.0
    )
    saved = json.loads(C.stats_path(out).read_text())
    assert saved["pairs"] == 2 and saved["dropped"] == {"empty": 2, "identical": 1}
    assert saved["mean_prompt_tokens"] > saved["mean_instruction_tokens"] > 3  # chat template tokens counted
    from trl.data_utils import is_conversational

    assert is_conversational(rows[0])


class Interrupt(Exception):
    pass


def test_resume_after_interrupt_no_duplicates(tiny, tmp_path):
    model, tok = tiny
    insts = instructions(5)
    sampling = C.SamplingConfig(temperature=1.0, max_new_tokens=6, seed=1)
    kw = dict(heads=HEADS, batch_size=2, progress_bar=False)
    ref = tmp_path / "ref.jsonl"
    C.generate_pairs(insts, model, tok, ref, sampling, **kw)
    out = tmp_path / "pairs.jsonl"

    def stop_after_first(i):
        raise Interrupt

    with pytest.raises(Interrupt):
        C.generate_pairs(insts, model, tok, out, sampling, on_batch=stop_after_first, **kw)
    assert len(C.read_pairs(out)) == 2
    assert "unfinished `retmask generate` run (2 instructions handled, 2 pairs" in unfinished_generation(out)
    # the run also died while writing the next batch: a partial line past the committed offset
    with out.open("ab") as f:
        f.write(b'{"id": "i2", "prompt": [{"role": "us')
    with pytest.raises(C.GenerateError, match="already exists"):
        C.generate_pairs(insts, model, tok, out, sampling, **kw)
    with pytest.raises(C.GenerateError, match="different settings"):
        C.generate_pairs(insts, model, tok, out, C.SamplingConfig(temperature=0.5, max_new_tokens=6, seed=1),
                         resume=True, **kw)  # fmt: skip
    stats = C.generate_pairs(insts, model, tok, out, sampling, resume=True, **kw)
    assert C.read_pairs(out) == C.read_pairs(ref)
    assert unfinished_generation(out) is None and unfinished_generation(ref) is None
    assert stats.instructions == 5
    # resuming a finished run adds nothing
    C.generate_pairs(insts, model, tok, out, sampling, resume=True, **kw)
    assert C.read_pairs(out) == C.read_pairs(ref)


def test_cli_generate_and_resume(tiny_dir, tmp_path, capsys, monkeypatch):
    from retmask.methods.retmask import instructions as instruction_sources

    reads = []  # the instruction file is parsed once per run: what is hashed is what is generated from
    records = instruction_sources._records
    monkeypatch.setattr(instruction_sources, "_records", lambda src: reads.append(src) or records(src))
    src = tmp_path / "inst.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{k}", "prompt": p}) + "\n" for k, p in enumerate(PROMPTS)))
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"heads": [list(h) for h in HEADS]}))
    out = tmp_path / "pairs.jsonl"
    base = ["generate", "--model", str(tiny_dir), "--instructions", str(src), "--heads", str(heads), "--out",
            str(out), "--max-new-tokens", "5", "--batch-size", "2", "--no-progress"]  # fmt: skip
    assert cli(base) == 0 and reads == [str(src)]
    text = capsys.readouterr().out
    assert "mean instruction tokens" in text and "pairs" in text
    first = out.read_text()
    assert cli(base) == 2 and "--resume" in capsys.readouterr().err
    assert cli([*base, "--resume"]) == 0 and out.read_text() == first
    # an edited instruction file under the same path is another run: old and new prompts must not mix
    src.write_text(src.read_text().replace(PROMPTS[-1], PROMPTS[-1] + " Briefly."))
    assert cli([*base, "--resume"]) == 2
    assert "instructions_sha256" in capsys.readouterr().err and out.read_text() == first


def write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "case,match",
    [
        ("bad-head", "does not exist in a model"),
        ("empty", "no instructions found"),
        ("too-long", "inst.jsonl line 1: instruction has"),
        ("dup-id", "appears twice"),
        ("bad-temp", "temperature"),
    ],
)
def test_cli_bad_inputs(case, match, tiny_dir, tmp_path, capsys):
    src = write(tmp_path / "inst.jsonl", json.dumps({"id": "a", "prompt": "Say hi."}) + "\n")
    heads = write(tmp_path / "heads.json", json.dumps({"heads": [[0, 1]]}))
    extra = []
    if case == "bad-head":
        write(heads, json.dumps({"heads": [[0, 1], [5, 0]]}))  # the tiny model has 2 layers
    elif case == "empty":
        write(src, "\n")
    elif case == "too-long":
        write(src, json.dumps({"id": "a", "prompt": "word " * 100}) + "\n")
        extra = ["--max-prompt-tokens", "50"]
    elif case == "dup-id":
        write(src, (json.dumps({"id": "a", "prompt": "Say hi."}) + "\n") * 2)
    elif case == "bad-temp":
        extra = ["--temperature", "-1"]
    out = tmp_path / "pairs.jsonl"
    argv = ["generate", "--model", str(tiny_dir), "--instructions", str(src), "--heads", str(heads),
            "--out", str(out), "--no-progress", *extra]  # fmt: skip
    try:
        rc = cli(argv)
    except SystemExit as e:  # a flag out of its range is refused by argparse, at parse time
        rc = e.code
    assert rc == 2
    assert match in capsys.readouterr().err
    assert not out.exists() or out.stat().st_size == 0


def test_rejected_model_baseline(tiny, tiny_dir, tmp_path, tokenizer):
    """--rejected-model (the Smaller-Model baseline): rejected rows come from the second model, unmasked."""
    from tests.tiny import tiny_llama_for

    model, tok = tiny
    other_dir = tmp_path / "other"
    tiny_llama_for(tokenizer, seed=1, init=0.02).save_pretrained(other_dir)
    tokenizer.save_pretrained(other_dir)
    other, other_tok = retmask.load_model(str(other_dir))
    insts = instructions(2)
    sampling = C.SamplingConfig(temperature=1.0, max_new_tokens=8, seed=5)
    pairs = C.contrast_batch(insts, model, tok, sampling, rejected_model=other, rejected_tokenizer=other_tok)
    seeds = [C.row_seed(5, i.id, "rejected") for i in insts]
    expected = run_rows(other, other_tok, [i.prompt for i in insts], seeds, sampling)
    assert [(r.text, r.num_tokens) for _, r in pairs] == [(t, n) for t, n, _ in expected]
    with pytest.raises(C.GenerateError, match="heads to mask"):
        C.contrast_batch(insts, model, tok, sampling)
