"""Shipped instruction set and the instruction loader."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from retmask.methods.retmask.instruction_data import (
    CATEGORIES,
    SHIPPED,
    generate_instructions,
)
from retmask.methods.retmask.instructions import BUILTIN_PATH, InstructionError, load_instructions
from retmask.runfiles import jsonl_text


def _records():
    return [json.loads(line) for line in SHIPPED.read_text(encoding="utf-8").splitlines()]


def test_shipped_file_is_the_generators_output():
    assert BUILTIN_PATH == SHIPPED
    assert SHIPPED.read_text(encoding="utf-8") == jsonl_text(generate_instructions()), (
        "regenerate with: python -m retmask.methods.retmask.instruction_data"
    )


def test_shipped_set_size_categories_uniqueness():
    recs = _records()
    assert len(recs) >= 300
    assert SHIPPED.stat().st_size < 300_000
    assert set(Counter(r["category"] for r in recs)) == set(CATEGORIES)
    assert min(Counter(r["category"] for r in recs).values()) >= 40
    assert len({r["id"] for r in recs}) == len(recs)
    assert len({r["prompt"] for r in recs}) == len(recs)
    for r in recs:
        assert set(r) <= {"id", "category", "prompt", "reference"}
        assert (
            isinstance(r["prompt"], str) and 20 < len(r["prompt"]) < 600
        )  # short, like RetMask's published inputs
        assert isinstance(r.get("reference", ""), str)


def test_references_are_consistent_with_prompts():
    for r in _records():
        ref = r.get("reference")
        if ref is None:
            continue
        if r["category"] == "multiple_choice":
            assert ref in "ABCD" and f"\n{ref}. " in r["prompt"]
        elif r["category"] == "json_format":
            json.loads(ref)
        elif r["category"] in ("entity_copy", "address_copy"):
            # the answer is copied from the prompt: every line of it is in the prompt
            for line in ref.split("\n"):
                for part in line.split(" | "):
                    assert part.split(": ", 1)[-1] in r["prompt"], (r["id"], part)


def test_generator_is_deterministic_and_seeded():
    assert generate_instructions(seed=1, per_category=5) == generate_instructions(seed=1, per_category=5)
    assert generate_instructions(seed=1, per_category=5) != generate_instructions(seed=2, per_category=5)


def test_load_builtin():
    insts = load_instructions()
    assert len(insts) == len(_records())
    assert insts[0].id == _records()[0]["id"] and insts[0].category
    assert len(load_instructions("builtin", limit=7)) == 7
    with pytest.raises(InstructionError, match="limit"):
        load_instructions("builtin", limit=0)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_local_formats(tmp_path):
    rows = [{"instruction": "Say hi."}, {"instruction": "Say bye.", "id": "b"}]
    j = tmp_path / "a.json"
    j.write_text(json.dumps(rows))
    got = load_instructions(j)
    assert [i.prompt for i in got] == ["Say hi.", "Say bye."] and got[1].id == "b" and got[0].id == "a-0"
    j.write_text(json.dumps({"data": rows}))
    assert len(load_instructions(j)) == 2

    chats = [
        {
            "messages": [
                {"role": "system", "content": "Be kind."},
                {"role": "user", "content": "First?"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "Second?"},
            ]
        },
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Parts"}]}]},
    ]
    assert [i.prompt for i in load_instructions(_write_jsonl(tmp_path / "c.jsonl", chats))] == [
        "First?",
        "Parts",
    ]
    share = [{"conversation": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "Hi"}]}]
    assert load_instructions(_write_jsonl(tmp_path / "s.jsonl", share))[0].prompt == "Hello there"

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["Why?", "How?"], "other": [1, 2]}), tmp_path / "q.parquet")
    assert [i.prompt for i in load_instructions(tmp_path / "q.parquet")] == ["Why?", "How?"]
    assert [i.prompt for i in load_instructions(tmp_path / "q.parquet", column="question", limit=1)] == [
        "Why?"
    ]


def test_saved_dataset_folder(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"prompt": ["One.", "Two."]}).save_to_disk(str(tmp_path / "ds"))
    assert [i.prompt for i in load_instructions(tmp_path / "ds")] == ["One.", "Two."]


def test_loader_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(InstructionError, match="empty.jsonl: no instructions"):
        load_instructions(empty)
    ej = tmp_path / "empty.json"
    ej.write_text("[]")
    with pytest.raises(InstructionError, match="no instructions"):
        load_instructions(ej)
    with pytest.raises(InstructionError, match="does not exist"):
        load_instructions(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("prompt\nhi\n")
    with pytest.raises(InstructionError, match="unknown file type"):
        load_instructions(tmp_path / "x.csv")

    f = _write_jsonl(tmp_path / "a.jsonl", [{"prompt": "ok"}, {"text": "no prompt column"}])
    with pytest.raises(InstructionError, match=r"a.jsonl line 2: missing column 'prompt'"):
        load_instructions(f)
    f = _write_jsonl(tmp_path / "b.jsonl", [{"text": "x"}])
    with pytest.raises(InstructionError, match=r"line 1: no instruction column.*found \['text'\]"):
        load_instructions(f)
    f = tmp_path / "c.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(InstructionError, match="c.jsonl line 2: not valid JSON"):
        load_instructions(f)
    f = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"prompt": "   "}])
    with pytest.raises(InstructionError, match="line 2: column 'prompt' is empty"):
        load_instructions(f)
    f = _write_jsonl(tmp_path / "e.jsonl", [{"messages": [{"role": "assistant", "content": "x"}]}])
    with pytest.raises(InstructionError, match="line 1: column 'messages' has no user message"):
        load_instructions(f)
    f = _write_jsonl(tmp_path / "f.jsonl", [{"prompt": 3}])
    with pytest.raises(InstructionError, match="line 1: column 'prompt' must be a string"):
        load_instructions(f)
    with pytest.raises(InstructionError, match="g.jsonl line 1: missing column 'question'"):
        load_instructions(_write_jsonl(tmp_path / "g.jsonl", [{"prompt": "x"}]), column="question")


class WordTokenizer:
    """A whitespace tokenizer with the call signature of an HF tokenizer (enough for length checks)."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(range(len(text.split())))}


def test_too_long_instructions(tmp_path):
    f = _write_jsonl(tmp_path / "long.jsonl", [{"prompt": "short one"}, {"prompt": "w " * 50}])
    assert len(load_instructions(f, tokenizer=WordTokenizer(), max_tokens=50)) == 2
    with pytest.raises(
        InstructionError, match="long.jsonl line 2: instruction has 50 tokens, more than the limit of 10"
    ):
        load_instructions(f, tokenizer=WordTokenizer(), max_tokens=10)
    with pytest.raises(InstructionError, match="both"):
        load_instructions(f, tokenizer=WordTokenizer())
