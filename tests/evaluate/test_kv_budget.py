"""``retmask kv`` / ``retmask.evaluate.kv_budget``: the policies' KV heads, memory measured from the cache
(ordered streaming < budgets < full = 1, equal to the buffers' sizes), the full policy's answers equal to
the NIAH evaluation's, the three outputs, resume (skips done configurations, refuses other settings) and
the promised errors, before the model loads where they can be.

Tiny model (``tests.tiny``): 2 layers x 4 query heads over 2 KV heads (g = 2), head dim 16, so 4 candidate
KV heads; budgets 0.25 / 0.5 keep 1 / 2 of them. The scores below rank the KV heads (0,0) 0.9 > (1,0) 0.3 >
(0,1) 0.1 > (1,1) 0.02 (a KV head scores as its best query head: query heads 2kv and 2kv + 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import retmask
import retmask.evaluate.kv_budget as kvb
from retmask.cli import main
from retmask.evaluate.kv_budget import (
    KVBudgetError,
    KVConfig,
    check_window,
    full_heads_for,
    parse_budgets,
    parse_names,
    plan,
    run_kv_budget,
)
from retmask.hf.sparse_kv.policy import KVLayout
from tests.tiny import tiny_llama_for

QUERY_SCORES = {
    (0, 0): 0.9,
    (0, 1): 0.0,
    (0, 2): 0.1,
    (0, 3): 0.05,
    (1, 0): 0.0,
    (1, 1): 0.3,
    (1, 2): 0.02,
    (1, 3): 0.0,
}
LAYOUT = KVLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, global_layers=(0, 1))
KV_SCORES = {(0, 0): 0.9, (0, 1): 0.1, (1, 0): 0.3, (1, 1): 0.02}
W, S, NEW = 32, 4, 4
# one 300-token NIAH test (a ~160-token prompt: the context keeps its 200-token buffer out) per task
GRID = [
    "--min-len",
    "300",
    "--max-len",
    "300",
    "--num-lengths",
    "1",
    "--num-depths",
    "1",
    "--num-needles",
    "1",
]


def _scores_file(path: Path, scores: dict = QUERY_SCORES) -> Path:
    path.write_text(json.dumps({f"{a}-{b}": [v] for (a, b), v in scores.items()}))
    return path


@pytest.fixture(scope="module")
def tiny_dir(tokenizer, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-kv")
    tiny_llama_for(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def scores(tmp_path_factory) -> Path:
    return _scores_file(tmp_path_factory.mktemp("scores") / "scores.json")


def _argv(tiny_dir: Path, scores: Path | None, out: Path, *extra: str) -> list[str]:
    argv = ["kv", "--model", str(tiny_dir), "--window", str(W), "--sink-tokens", str(S), "--max-new-tokens",
            str(NEW), "--out-dir", str(out), "--no-progress", *GRID, *extra]  # fmt: skip
    return argv + (["--scores", str(scores)] if scores is not None else [])


# -- what runs -------------------------------------------------------------------------------------------


def test_parsers_and_plan():
    assert parse_budgets("0.3, 0.1,0.1,1") == [0.1, 0.3, 1.0]
    for bad in ("0", "1.5", "-0.1", "nan", "x", ""):
        with pytest.raises(KVBudgetError, match="not in \\(0, 1\\]|numbers like"):
            parse_budgets(bad)
    assert parse_names("full,retrieval", kvb.POLICIES, "policy") == ["retrieval", "full"]
    with pytest.raises(KVBudgetError, match="unknown policy 'oracle'"):
        parse_names("oracle", kvb.POLICIES, "policy")
    names = [c.name for c in plan(kvb.POLICIES, [0.5, 0.25], seeds=2, base_seed=7)]
    assert names == [
        "full", "streaming", "retrieval-b0.25", "non-retrieval-b0.25", "retrieval-b0.5", "non-retrieval-b0.5",
        "random-b0.25-s7", "random-b0.5-s7", "random-b0.25-s8", "random-b0.5-s8",
    ]  # fmt: skip
    assert [c.name for c in plan(["streaming", "full"], [], seeds=1)] == ["full", "streaming"]


def test_full_heads_of_each_policy():
    def heads(policy, budget=0.5, seed=None):
        return full_heads_for(KVConfig(policy, budget, seed), LAYOUT, KV_SCORES)

    assert heads("full", None) is None and heads("streaming", 0.0) == []
    assert heads("retrieval", 0.25) == [(0, 0)] and heads("retrieval") == [(0, 0), (1, 0)]
    assert heads("non-retrieval", 0.25) == [(1, 1)] and heads("non-retrieval") == [(0, 1), (1, 1)]
    draws = [heads("random", 0.5, s) for s in range(6)]
    assert all(len(d) == 2 and set(d) <= set(KV_SCORES) for d in draws) and len({tuple(d) for d in draws}) > 1
    assert heads("random", 0.5, 3) == heads("random", 0.5, 3)  # seeded
    assert heads("retrieval", 0.3) == [(0, 0), (1, 0)]  # 0.3 of 4 heads rounds up to 2
    with pytest.raises(KVBudgetError, match="pass --scores"):
        full_heads_for(KVConfig("retrieval", 0.5), LAYOUT, None)


def test_window_must_leave_part_of_the_context_out():
    check_window(32, 4, [300, 500])
    with pytest.raises(KVBudgetError, match="covers the shortest context \\(300 tokens\\)"):
        check_window(296, 4, [300, 500])


# -- runs ------------------------------------------------------------------------------------------------


def test_memory_is_what_the_cache_holds_and_full_answers_equal_the_niah_evaluation(tiny, tokenizer, tmp_path):
    """Streaming holds exactly S + W keys (+ slot positions) per KV head; retrieval at 0.25 adds one full
    head's buffer of prompt + max_new_tokens positions; the full cache's answers are the greedy ones of the
    fast NIAH evaluation (same tests, other decoding path)."""
    from retmask.evaluate.niah import evaluate_niah
    from retmask.niah import load_needles

    needles = load_needles()[:1]
    res = run_kv_budget(
        tiny, tokenizer, scores=QUERY_SCORES | {}, policies=["retrieval", "streaming", "full"], budgets=[0.25],
        window=W, sink_tokens=S, lengths=[300], depths=[50], needles=needles, max_new_tokens=NEW,
        progress=False, log=lambda *a: None,
    )  # fmt: skip
    full, streaming, top = (res.results[n] for n in ("full", "streaming", "retrieval-b0.25"))
    (e_full,), (e_stream,), (e_top,) = full.entries, streaming.entries, top.entries
    n, d, f4 = e_full["prompt_tokens"], 16, 4  # head dim, float32 bytes
    kv_bytes = 2 * d * f4  # K and V of one position of one KV head
    window_layer = 2 * (S + W) * kv_bytes + (S + W) * 8  # 2 windowed KV heads + int64 slot positions
    assert e_stream["memory_bytes"] == 2 * window_layer
    one_full = (n + NEW) * kv_bytes  # reserved at prompt + new tokens
    assert e_top["memory_bytes"] == window_layer + (S + W) * kv_bytes + (S + W) * 8 + one_full
    seen = n + e_full["new_tokens"] - 1  # the last token is never fed back
    assert e_full["memory_bytes"] == e_full["full_cache_bytes"] == 2 * 2 * seen * kv_bytes
    assert streaming.memory_ratio < top.memory_ratio < full.memory_ratio == 1.0
    want = evaluate_niah(tiny, tokenizer, lengths=[300], depths=[50], needles=needles, max_new_tokens=NEW,
                         progress=False)  # fmt: skip
    assert e_full["response"] == want.entries[0]["response"]
    assert e_full["recall"] == want.entries[0]["rouge1_recall"]


def test_command_writes_the_three_files(tiny_dir, scores, tmp_path, capsys):
    out = tmp_path / "kv"
    argv = _argv(tiny_dir, scores, out, "--budgets", "0.25,0.5", "--seeds", "2", "--tasks", "niah,kv")
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "| policy | budget | full KV heads | KV memory ratio | NIAH (ROUGE-1 recall) | key-value" in stdout
    assert (out / "kv.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "kv.md").read_text().startswith("| policy | budget |")
    data = json.loads((out / "kv.json").read_text())
    configs = {c["name"]: c for c in data["configs"]}
    assert len(configs) == 10 == data["meta"]["configs_total"] == data["meta"]["configs_done"]
    for c in configs.values():
        assert [e["task"] for e in c["entries"]] == ["niah", "kv"]
        assert all(0 <= e["recall"] <= 1 and 0 < e["memory_bytes"] <= e["full_cache_bytes"] or c["name"] == "full"
                   for e in c["entries"])  # fmt: skip
        assert set(c["means"]) == {"niah", "kv"}
    assert configs["retrieval-b0.25"]["full_heads"] == [[0, 0]]
    assert configs["non-retrieval-b0.5"]["full_heads"] == [[0, 1], [1, 1]]
    assert configs["full"]["full_heads"] is None and configs["streaming"]["full_heads"] == []
    # memory: streaming < 0.25 < 0.5 < full = 1; every policy of a budget holds the same
    ratio = {n: c["memory_ratio"] for n, c in configs.items()}
    assert ratio["full"] == 1.0
    for b in ("0.25", "0.5"):
        same = [
            ratio[f"retrieval-b{b}"],
            ratio[f"non-retrieval-b{b}"],
            ratio[f"random-b{b}-s0"],
            ratio[f"random-b{b}-s1"],
        ]
        assert max(same) - min(same) < 1e-9, same
    assert ratio["streaming"] < ratio["retrieval-b0.25"] < ratio["retrieval-b0.5"] < 1.0
    # random: the requested seeds at every budget, their spread in the rows
    rows = {(r["policy"], r["budget"]): r for r in data["rows"]}
    for b in (0.25, 0.5):
        assert sorted(
            c["seed"] for c in configs.values() if c["policy"] == "random" and c["budget"] == b
        ) == [0, 1]
        assert rows[("random", b)]["n"] == 2 and len(rows[("random", b)]["tasks"]["niah"]["values"]) == 2
    assert "± 0.000 (2 seeds)" in (out / "kv.md").read_text()


def test_resume_skips_done_configurations_and_refuses_other_settings(
    tiny_dir, scores, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "kv"
    argv = _argv(tiny_dir, scores, out, "--policies", "retrieval,streaming,full", "--budgets", "0.5")
    assert main([*argv, "--limit", "2"]) == 0
    assert "1 configurations left" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "kv.configs").iterdir()) == ["full.json", "streaming.json"]
    assert main(argv) == 2  # an earlier run, neither --resume nor --overwrite
    assert "pass --resume to continue or --overwrite" in capsys.readouterr().err

    ran: list[object] = []
    real = kvb.run.run_config
    monkeypatch.setattr(kvb.run, "run_config", lambda *a, **k: ran.append(a[3]) or real(*a, **k))
    assert main([*argv, "--resume"]) == 0
    assert ran == [[(0, 0), (1, 0)]]  # only retrieval-b0.5 ran (its full KV heads)
    assert "resuming: 2 of 3 configurations already done" in capsys.readouterr().err
    assert len(json.loads((out / "kv.json").read_text())["configs"]) == 3

    ran.clear()
    assert main([*argv, "--resume"]) == 0 and ran == []  # all done: nothing runs
    capsys.readouterr()
    assert main([*argv[:4], "48", *argv[5:], "--resume"]) == 2  # another --window
    assert "was written by a run with other settings (window: 32 -> 48" in capsys.readouterr().err
    assert main([*argv, "--prefill", "full", "--resume"]) == 2  # another prefill
    assert "was written by a run with other settings (prefill: None -> 'full'" in capsys.readouterr().err

    saved = out / "kv.configs" / "streaming.json"
    data = json.loads(saved.read_text())
    data["fingerprint"]["max_new_tokens"] = 99  # an edited settings fingerprint
    saved.write_text(json.dumps(data))
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: {saved} was written by a run with other settings (max_new_tokens: 99 -> {NEW})" in err
    assert ran == []

    assert main([*argv, "--overwrite"]) == 0  # starts over: every configuration runs again
    assert len(ran) == 3

    prefills: list[str] = []
    real_cache = retmask.head_sparse_cache
    monkeypatch.setattr(
        retmask, "head_sparse_cache", lambda *a, **k: prefills.append(k.get("prefill")) or real_cache(*a, **k)
    )
    assert main([*argv, "--prefill", "full", "--overwrite"]) == 0
    # kv_layout's probe (no prefill given), then streaming's and retrieval's caches (full: a DynamicCache)
    assert prefills == [None, "full", "full"]
    assert json.loads((out / "kv.json").read_text())["meta"]["prefill"] == "full"


def _without_times(res) -> dict:
    """The configurations' entries, less their wall times (the only field that differs between runs)."""
    return {
        name: [{k: v for k, v in e.items() if k != "seconds"} for e in r.entries]
        for name, r in res.results.items()
    }


def test_resume_inside_a_configuration_skips_its_answered_tests(tiny, tokenizer, tmp_path, monkeypatch):
    """2 tests per configuration (a NIAH test and a key-value list); Ctrl-C while the 4th answer is scored:
    the first configuration (full) is saved, the second (streaming) keeps its one answered test, which the
    resume does not answer again; the result equals an uninterrupted run's."""
    from retmask.niah import load_needles

    kw = dict(
        policies=["streaming", "full"], budgets=[], window=W, sink_tokens=S, tasks=["niah", "kv"],
        lengths=[300], depths=[50], needles=load_needles()[:1], max_new_tokens=NEW, progress=False,
        log=lambda *a: None,
    )  # fmt: skip
    whole = run_kv_budget(tiny, tokenizer, **kw)
    real_score, scored = kvb.answers.Item.score, []

    def score(item, response):
        scored.append(item.key)
        if len(scored) == 4:
            raise KeyboardInterrupt
        return real_score(item, response)

    with monkeypatch.context() as m:
        m.setattr(kvb.answers.Item, "score", score)
        with pytest.raises(KeyboardInterrupt):
            run_kv_budget(tiny, tokenizer, out_dir=tmp_path, **kw)
    folder = tmp_path / "kv.configs"
    assert sorted(p.name for p in folder.iterdir()) == ["full.json", "streaming.json.progress.json"]
    with pytest.raises(KVBudgetError, match="and the finished tests of 1 unfinished ones; pass --resume"):
        run_kv_budget(tiny, tokenizer, out_dir=tmp_path, **kw)
    with pytest.raises(ValueError, match="other settings"):  # another window: other answers
        run_kv_budget(tiny, tokenizer, out_dir=tmp_path, resume=True, **(kw | {"window": W + 8}))

    scored.clear()
    with monkeypatch.context() as m:
        m.setattr(
            kvb.answers.Item,
            "score",
            lambda item, response: scored.append(item.key) or real_score(item, response),
        )
        again = run_kv_budget(tiny, tokenizer, out_dir=tmp_path, resume=True, **kw)
    assert scored == [whole.results["streaming"].entries[1]["key"]]  # only its unanswered key-value test
    assert _without_times(again) == _without_times(whole)
    assert sorted(p.name for p in folder.iterdir()) == ["full.json", "streaming.json"]


# -- errors ----------------------------------------------------------------------------------------------


def test_errors_before_the_model_loads(tmp_path, scores, capsys):
    missing = tmp_path / "no-model"  # loading it would be the error if the checks came after
    cases = [
        ([], "--scores is required by the retrieval and non-retrieval policies"),
        (["--scores", str(scores), "--window", "296"], "covers the shortest context (300 tokens)"),
        (["--scores", str(tmp_path / "nope.json")], "scores file"),
        (["--scores", str(scores), "--resume", "--overwrite"], "exclude each other"),
    ]
    for extra, message in cases:
        rc = main(["kv", "--model", str(missing), *GRID, "--out-dir", str(tmp_path / "o"), "--no-progress",
                   "--window", "32", *extra])  # fmt: skip
        err = capsys.readouterr().err
        assert rc == 2 and message in err and "no-model" not in err, (extra, err)
        assert err.startswith("retmask kv: error: "), err
    for flag, value, message in (
        ("--budgets", "0.1,1.5", "budget 1.5 is not in (0, 1]"),
        ("--budgets", "0", "budget 0 is not in (0, 1]"),
        ("--policies", "retrieval,oracle", "unknown policy 'oracle'"),
        ("--tasks", "mdqa", "unknown task 'mdqa'"),
        ("--window", "0", "out of range"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["kv", "--model", str(missing), flag, value])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, (flag, value)


def test_errors_that_need_the_model(tiny_dir, tmp_path, capsys):
    other = _scores_file(tmp_path / "other.json", {(a, b): 0.1 for a in range(3) for b in range(4)})
    rc = main(_argv(tiny_dir, other, tmp_path / "o1"))
    err = capsys.readouterr().err
    assert rc == 2 and "head [2, 0] does not exist" in err and "another model" in err, err
    fewer = _scores_file(tmp_path / "fewer.json", {(0, b): 0.1 for b in range(4)})
    rc = main(_argv(tiny_dir, fewer, tmp_path / "o2"))
    err = capsys.readouterr().err
    assert rc == 2 and "scores for 4 heads, but the model has [L, Hq] = [2, 4]" in err, err
    # 300 nominal tokens pass the grid check, but the NIAH prompt is ~160 tokens: the window covers it
    argv = _argv(tiny_dir, None, tmp_path / "o3", "--policies", "streaming,full")
    argv[argv.index("--window") + 1] = "250"
    assert main(argv) == 2
    assert "covers the shortest prompt (niah test" in capsys.readouterr().err
