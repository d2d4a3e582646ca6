"""MDQA generator answerability, the validated loader, and the prompt builder's passage spans."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from retmask.methods.mudaf.mdqa import (
    KINDS,
    TEMPLATE,
    MDQAError,
    build_prompt,
    generate_mdqa,
    load_mdqa,
    write_mdqa,
)
from retmask.methods.mudaf.mdqa.prompt import passage_block

N = 220  # 20 of each question kind


@pytest.fixture(scope="module")
def examples():
    return generate_mdqa(N, seed=0, num_distractors=8)


def test_answerable_only_from_golden(examples):
    assert set(Counter(e.kind for e in examples)) == set(KINDS)
    for e in examples:
        golden = [p for p in e.passages if p.id in e.golden_ids]
        distractors = [p for p in e.passages if p.id not in e.golden_ids]
        assert len(golden) == len(e.golden_ids) in (1, 2)
        assert len(distractors) == 8
        assert any(e.answer in p.text for p in golden), e.id
        assert not any(e.answer in p.text for p in distractors), e.id
        if e.kind.startswith(("bridge", "comparison")):
            assert len(golden) == 2
        if e.kind.startswith("bridge"):
            first = next(p for p in e.passages if p.id == e.golden_ids[0])
            assert e.answer not in first.text  # the second hop is needed
            second_title = next(p.title for p in e.passages if p.id == e.golden_ids[1])
            assert second_title in first.text  # the first passage names the bridge entity
        # the entity the question asks about is described only by a golden passage
        for p in distractors:
            assert p.title not in e.question
        assert len({p.id for p in e.passages}) == len(e.passages)


def test_order_is_random_and_seeded(examples):
    first_golden_pos = Counter(e.golden_indices[0] for e in examples)
    assert len(first_golden_pos) >= 8  # golden passages land all over the prompt
    again = generate_mdqa(12, seed=0, num_distractors=8)
    assert [e.to_json() for e in again] == [e.to_json() for e in examples[:12]]
    assert generate_mdqa(3, seed=1)[0].to_json() != examples[0].to_json()
    assert len(generate_mdqa(2, num_distractors=3)[0].passages) in (4, 5)


def test_round_trip(tmp_path, examples):
    path = write_mdqa(examples[:30], tmp_path / "sub" / "mdqa.jsonl")
    back = load_mdqa(path)
    assert [e.to_json() for e in back] == [e.to_json() for e in examples[:30]]
    assert len(load_mdqa(path, limit=4)) == 4


def _write(tmp_path, rec, name="user.jsonl"):
    path = tmp_path / name
    path.write_text(json.dumps(rec) + "\n")
    return path


def _good():
    return {
        "passages": [
            {"id": "a", "title": "A", "text": "Alpha is red."},
            {"id": "b", "title": "B", "text": "Beta."},
        ],
        "golden_ids": ["a"],
        "question": "What colour is Alpha?",
        "answer": "red",
    }


def test_loader_errors(tmp_path):
    ex = load_mdqa(_write(tmp_path, _good()))[0]
    assert ex.golden_indices == [0] and ex.id == "user-1"
    numeric = _good() | {"passages": [{"id": 1, "text": "x y"}, {"id": 2, "text": "z"}], "golden_ids": [2]}
    assert load_mdqa(_write(tmp_path, numeric))[0].golden_ids == ["2"]

    cases = [
        (
            _good() | {"golden_ids": ["a", "zz"]},
            r"\.jsonl:1: golden ids \['zz'\] are not among the passage ids",
        ),
        (_good() | {"golden_ids": []}, "golden_ids"),
        (_good() | {"golden_ids": ["a", "b"]}, "at least one distractor"),
        (
            _good() | {"passages": [{"id": "a", "text": "  "}, {"id": "b", "text": "x"}]},
            r"passages\[0\] \(id 'a'\) has empty text",
        ),
        (_good() | {"passages": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]}, "used more than once"),
        (_good() | {"passages": []}, "non-empty list"),
        (_good() | {"passages": [{"title": "t", "text": "x"}]}, r"passages\[0\]: 'id'"),
        ({k: v for k, v in _good().items() if k != "question"}, "missing field 'question'"),
        (_good() | {"answer": ""}, "field 'answer' is empty"),
        ([1, 2], "expected a JSON object"),
    ]
    for rec, msg in cases:
        with pytest.raises(MDQAError, match=msg):
            load_mdqa(_write(tmp_path, rec))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_good()) + "\n{broken\n")
    with pytest.raises(MDQAError, match="bad.jsonl:2: not valid JSON"):
        load_mdqa(bad)
    bad.write_text("")
    with pytest.raises(MDQAError, match="empty"):
        load_mdqa(bad)
    with pytest.raises(MDQAError, match="does not exist"):
        load_mdqa(tmp_path / "none.jsonl")


def test_prompt_text_and_char_spans(examples):
    e = examples[7]
    pr = build_prompt(e)
    body = "\n\n".join(passage_block(i + 1, p.title, p.text) for i, p in enumerate(e.passages))
    assert pr.text == TEMPLATE.format(body=body, question=e.question, answer=e.answer)
    assert pr.prompt_text.endswith(f" Question: {e.question}\nAnswer:")
    for (a, b), p in zip(pr.passage_char_spans, e.passages, strict=True):
        assert pr.text[a:b].endswith(p.text) and pr.text[a:b].startswith("Passage ")
    assert pr.text[slice(*pr.question_char_span)] == e.question
    assert build_prompt(e, include_answer=False).text == pr.prompt_text
    assert pr.golden_indices == e.golden_indices


@pytest.fixture(scope="module")
def bpe_tokenizer(examples):
    """A byte-level BPE (the GPT-2/SmolLM2 family's scheme) trained on the examples in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # trim_offsets=False: offsets of " word" tokens include the space, the case that bit real tokenizers
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([build_prompt(e).text for e in examples[:40]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _check_spans(pr, e, decode, eos):
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(pr.passage_spans, pr.passage_spans[1:], strict=False))
    for (a, b), p in zip(pr.passage_spans, e.passages, strict=True):
        text = decode(pr.input_ids[a:b]).strip()
        assert text.startswith("Passage ") and text.endswith(p.text)
    qa, qb = pr.question_span
    assert decode(pr.input_ids[qa:qb]).strip() == e.question
    assert decode(pr.input_ids[: pr.prompt_length]).endswith("Answer:")
    aa, ab = pr.answer_span
    assert pr.input_ids[ab - 1] == eos and decode(pr.input_ids[aa : ab - 1]).strip() == e.answer
    assert ab == len(pr.input_ids)


def test_token_spans_fast_tokenizer(examples, bpe_tokenizer):
    tok = bpe_tokenizer
    for e in examples[:: N // 22]:
        pr = build_prompt(e, tok)
        _check_spans(pr, e, tok.decode, tok.eos_token_id)
        assert pr.input_ids[:-1] == tok(pr.text)["input_ids"]  # the natural tokenization, plus EOS
        short = build_prompt(e, tok, include_answer=False)
        assert short.input_ids == pr.input_ids[: pr.prompt_length] and short.answer_span is None
        assert short.passage_spans == pr.passage_spans


class CharTokenizer:
    """A slow (offset-less) tokenizer: one id per character, a BOS in front."""

    is_fast = False
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) + 2 for c in text]}

    def decode(self, ids):
        return "".join(chr(i - 2) for i in ids if i > 1)


def test_token_spans_slow_tokenizer(examples):
    tok = CharTokenizer()
    e = examples[9]
    pr = build_prompt(e, tok)
    assert pr.input_ids[0] == 1
    _check_spans(pr, e, tok.decode, 0)


def test_length_limits(examples, bpe_tokenizer):
    e = examples[0]
    n_q = len(bpe_tokenizer(e.question, add_special_tokens=False)["input_ids"])
    build_prompt(e, bpe_tokenizer, max_question_tokens=n_q)
    with pytest.raises(
        MDQAError, match=f"example {e.id}: the question has {n_q} tokens, more than the limit of {n_q - 1}"
    ):
        build_prompt(e, bpe_tokenizer, max_question_tokens=n_q - 1)
    with pytest.raises(MDQAError, match="longer than the context limit of 16"):
        build_prompt(e, bpe_tokenizer, max_length=16)
    with pytest.raises(MDQAError, match="pass a tokenizer"):
        build_prompt(e, max_length=16)


def test_command_line(tmp_path, capsys):
    from retmask.methods.mudaf.mdqa.__main__ import main

    assert main(["--n", "3", "--distractors", "4", "--out", str(tmp_path / "m.jsonl")]) == 0
    got = load_mdqa(tmp_path / "m.jsonl")
    assert len(got) == 3 and all(len(e.passages) - len(e.golden_ids) == 4 for e in got)
    with pytest.raises(SystemExit):
        main(["--n", "0", "--out", str(tmp_path / "x.jsonl")])
    assert "must be >= 1" in capsys.readouterr().err
