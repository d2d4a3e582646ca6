"""The Win-Lose-Pair baseline: the judge, two unmasked samples per instruction, ordering, ties, errors,
and the pipeline's `--baseline win-lose`."""

from __future__ import annotations

import json

import pytest

from retmask.methods.retmask import generate as C
from retmask.methods.retmask.instructions import Instruction
from retmask.methods.retmask.pipeline import PipelineConfig, run_pipeline
from retmask.methods.retmask.win_lose import JUDGE, JudgedPair, judge_pair, quality
from tests.methods.retmask.test_pipeline import TINY


def done(text: str) -> C.Completion:
    return C.Completion(text, len(text.split()), True)


def test_quality_rewards_the_answer_and_little_else():
    ref = "Brahild Novwick"
    exact, verbose, wrong = (
        "Brahild Novwick",
        "The head archivist is Brahild Novwick, I believe.",
        "Valrick Yarridge",
    )
    assert quality(ref, exact) == 1.0
    assert 0.0 < quality(ref, verbose) < 1.0
    assert quality(ref, wrong) == 0.0
    assert quality("two sunny mornings", "Two sunny morning.") == 1.0  # stemmed, case and punctuation ignored


def test_judge_orders_either_way_and_drops_ties():
    good, bad = done("Brahild Novwick."), done("It is Valrick.")
    for first, second in ((good, bad), (bad, good)):
        judged = judge_pair("Brahild Novwick", first, second)
        assert judged.chosen is good and judged.rejected is bad
        assert judged.chosen_quality == 1.0 and judged.rejected_quality == 0.0
    assert judge_pair("Brahild Novwick", done("No idea."), done("Not sure at all.")) is None


def test_same_model_samples_are_the_unmasked_rows_with_each_sides_seed(tiny):
    model, tok = tiny
    insts = [Instruction(id=f"w{k}", prompt=f"Say a word (#{k}).", reference="word") for k in range(3)]
    sampling = C.SamplingConfig(temperature=1.0, max_new_tokens=8, seed=5)
    pairs = C.contrast_batch(insts, model, tok, sampling, same_model=True)
    for inst, (first, second) in zip(insts, pairs, strict=True):
        for side, got in (("chosen", first), ("rejected", second)):
            alone = C.generate_rows(model, tok, [inst.prompt], [C.row_seed(5, inst.id, side)], sampling)[0]
            assert (got.text, got.num_tokens, got.finished) == (alone.text, alone.num_tokens, alone.finished)
    assert any(a.text != b.text for a, b in pairs)  # two different samples, not one twice


def test_generate_pairs_puts_the_better_sample_first(tmp_path, monkeypatch, tokenizer):
    ref = "the blue gate"
    texts = {
        "a": ("A red door.", "The blue gate."),  # second is better: swapped
        "b": ("The blue gate.", "A gate."),  # first is better: kept
        "c": ("Nothing here.", "Nor here."),  # both 0: tied, dropped
        "d": ("Same.", "Same."),  # identical, dropped before judging
    }

    def contrast(batch, *args, same_model=False, **kwargs):
        assert same_model and not kwargs.get("heads")
        return [(done(texts[i.id][0]), done(texts[i.id][1])) for i in batch]

    monkeypatch.setattr(C, "contrast_batch", contrast)
    insts = [Instruction(id=k, prompt=f"Where do we meet? ({k})", reference=ref) for k in texts]
    out = tmp_path / "pairs.jsonl"
    stats = C.generate_pairs(insts, None, tokenizer, out, C.SamplingConfig(), batch_size=3, progress_bar=False,
                             win_lose=True)  # fmt: skip
    rows = C.read_pairs(out)
    assert [r["id"] for r in rows] == ["a", "b"]
    assert [r["chosen"][0]["content"] for r in rows] == ["The blue gate.", "The blue gate."]
    assert [r["rejected"][0]["content"] for r in rows] == ["A red door.", "A gate."]
    for r in rows:
        meta = r["metadata"]
        assert meta["rejected_by"] == "win-lose" and meta["judge"] == JUDGE
        assert meta["quality"]["chosen"] > meta["quality"]["rejected"]
    assert stats.dropped == {"empty": 0, "identical": 1, "tied": 1} and stats.instructions == 4
    assert "dropped (tied" in stats.table()
    settings = json.loads(C.stats_path(out).read_text())["settings"]
    assert settings["judge"] == JUDGE and settings["heads"] == []


def test_generate_pairs_refuses_what_the_judge_cannot_do(tmp_path, tokenizer):
    with_ref = Instruction(id="x", prompt="Name it.", reference="it")
    no_ref = Instruction(id="y", prompt="Write a poem.")
    with pytest.raises(
        C.GenerateError, match=r"needs a reference answer per instruction; 1 have none \(first: 'y'\)"
    ):
        C.generate_pairs([with_ref, no_ref], None, tokenizer, tmp_path / "p.jsonl", C.SamplingConfig(),
                         progress_bar=False, win_lose=True)  # fmt: skip
    for extra in (dict(heads=[(0, 1)]), dict(rejected_model=object())):
        with pytest.raises(C.GenerateError, match="samples the one model twice and masks no head"):
            C.generate_pairs([with_ref], None, tokenizer, tmp_path / "p.jsonl", C.SamplingConfig(),
                             progress_bar=False, win_lose=True, **extra)  # fmt: skip


def test_pipeline_win_lose_masks_nothing_and_uses_referenced_instructions(tiny_dir, tmp_path, monkeypatch):
    import retmask.methods.retmask.pipeline as P
    from retmask.methods.retmask.instructions import load_instructions

    monkeypatch.setattr("retmask.detect.run.RECALL_THRESHOLD", -1.0)
    used = []

    def recording(insts, *args, **kwargs):
        used.extend(insts)
        assert kwargs["win_lose"] and kwargs["heads"] == []
        return C.generate_pairs(insts, *args, **kwargs)

    monkeypatch.setattr(P, "generate_pairs", recording)
    # the tiny random model's samples all score 0 against any reference; a judge that ties every third
    # pair still shows the top-up
    calls = []

    def every_third_tied(reference, first, second):
        calls.append(1)
        return None if len(calls) % 3 == 0 else JudgedPair(first, second, 1.0, 0.0)

    monkeypatch.setattr(C, "judge_pair", every_third_tied)
    run_dir = tmp_path / "run"
    cfg = PipelineConfig(model=str(tiny_dir), **{**TINY, "baseline": "win-lose", "temperature": 1.0})
    run_pipeline(cfg, run_dir, progress=False, log=lambda *a: None, stop_after="generate")
    heads = json.loads((run_dir / "mask" / "heads.json").read_text())
    retrieval = json.loads((run_dir / "mask" / "retrieval_heads.json").read_text())
    assert heads["heads"] == [] and heads["baseline"] == "win-lose" and heads["method"] == "none"
    assert heads["retrieval_heads"] == retrieval["heads"] and len(retrieval["heads"]) == 2
    # every instruction with a reference answer is offered, one per category first; the first
    # num_instructions of that order are the stratified draw the other variants would make of the same pool
    referenced = [i for i in load_instructions("builtin") if i.reference]
    n = TINY["num_instructions"]
    assert sorted(i.id for i in used) == sorted(i.id for i in referenced)
    assert [i.id for i in used[:n]] == [i.id for i in P.stratified(referenced, n)]
    assert len({i.id.split("-")[0] for i in used[:n]}) == n
    stats = json.loads((run_dir / "generate" / "pairs.stats.json").read_text())
    assert stats["pairs"] == n  # ties and drops are made up by further instructions
    assert stats["instructions"] == n + sum(stats["dropped"].values())
    assert stats["dropped"]["tied"] >= 1 and stats["settings"]["judge"] == JUDGE
    assert stats["settings"]["target_pairs"] == n


def scripted_contrast(texts: dict[str, tuple[str, str]]):
    def contrast(batch, *args, **kwargs):
        return [(done(texts[i.id][0]), done(texts[i.id][1])) for i in batch]

    return contrast


# t: tied, w: a pair; pairs come from instructions 0, 2, 3, 5, 6
PATTERN = "wtwwtwwww"


def patterned(ref: str = "the blue gate") -> tuple[list[Instruction], dict[str, tuple[str, str]]]:
    texts = {
        f"i{k}": ("The blue gate.", "A red door.") if c == "w" else ("Nothing.", "Nor this.")
        for k, c in enumerate(PATTERN)
    }
    return [Instruction(id=k, prompt=f"Where? ({k})", reference=ref) for k in texts], texts


@pytest.mark.parametrize("batch_size", [1, 2, 4, 16])
def test_target_pairs_takes_instructions_only_as_far_as_needed(tmp_path, monkeypatch, tokenizer, batch_size):
    insts, texts = patterned()
    monkeypatch.setattr(C, "contrast_batch", scripted_contrast(texts))
    out = tmp_path / "pairs.jsonl"
    stats = C.generate_pairs(insts, None, tokenizer, out, C.SamplingConfig(), batch_size=batch_size,
                             progress_bar=False, win_lose=True, target_pairs=5)  # fmt: skip
    assert [r["id"] for r in C.read_pairs(out)] == ["i0", "i2", "i3", "i5", "i6"]
    # handled: up to the instruction that completed the target, whatever the batch size
    progress = json.loads(C.progress_path(out).read_text())
    assert progress["done"] == [f"i{k}" for k in range(7)] and progress["complete"]
    assert stats.pairs == 5 and stats.dropped["tied"] == 2 and stats.instructions == 7
    assert json.loads(C.stats_path(out).read_text())["settings"]["target_pairs"] == 5


def test_target_pairs_resumes_to_the_same_file_and_runs_short_when_instructions_run_out(
    tmp_path, monkeypatch, tokenizer
):
    insts, texts = patterned()
    monkeypatch.setattr(C, "contrast_batch", scripted_contrast(texts))
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    kw = dict(progress_bar=False, win_lose=True, target_pairs=5, batch_size=2)
    C.generate_pairs(insts, None, tokenizer, whole, C.SamplingConfig(), **kw)

    class Interrupt(Exception):
        pass

    def stop_after_second(i):
        if i == 1:
            raise Interrupt

    with pytest.raises(Interrupt):
        C.generate_pairs(insts, None, tokenizer, cut, C.SamplingConfig(), on_batch=stop_after_second, **kw)
    assert [r["id"] for r in C.read_pairs(cut)] == ["i0", "i2", "i3"]  # of the first four instructions
    with pytest.raises(C.GenerateError, match="different settings"):  # the target is part of the settings
        C.generate_pairs(insts, None, tokenizer, cut, C.SamplingConfig(), resume=True,
                         **{**kw, "target_pairs": 6})  # fmt: skip
    C.generate_pairs(insts, None, tokenizer, cut, C.SamplingConfig(), resume=True, **kw)
    assert cut.read_bytes() == whole.read_bytes()

    short = tmp_path / "short.jsonl"
    stats = C.generate_pairs(insts, None, tokenizer, short, C.SamplingConfig(),
                             **{**kw, "target_pairs": 50})  # fmt: skip
    assert stats.pairs == PATTERN.count("w") and stats.instructions == len(PATTERN)
    with pytest.raises(C.GenerateError, match="target number of pairs must be positive, got 0"):
        C.generate_pairs(insts, None, tokenizer, tmp_path / "z.jsonl", C.SamplingConfig(),
                         **{**kw, "target_pairs": 0})  # fmt: skip
