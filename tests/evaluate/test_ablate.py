"""``run_ablation`` / ``retmask ablate`` / ``retmask niah``: the configurations and their heads, each point
equal to a direct evaluation, resume (skips finished configurations, refuses other settings), clear errors
before any work, outputs of the commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import retmask.evaluate.ablate as ablate_mod
import retmask.evaluate.niah as niah_eval
from retmask.cli import main
from retmask.evaluate.ablate import AblationError, parse_ks, plan, plot_ablation, run_ablation
from retmask.evaluate.niah import evaluate_niah
from retmask.niah import load_needles

GRID = dict(lengths=[300], depths=[0, 100], max_new_tokens=6)
# 2 layers x 4 heads; ranking: (1,2) > (0,3) > (1,0) > rest (ties by (layer, head))
SCORES = {(1, 2): 0.9, (0, 3): 0.5, (1, 0): 0.2, (0, 0): 0.0, (1, 1): 0.05}


def _run(tiny, tok, out_dir=None, **kw):
    args = dict(
        ks=[0, 1, 2], seeds=2, needles=load_needles()[:1], progress=False, log=lambda *a: None, **GRID
    )
    args.update(kw)
    return run_ablation(tiny, tok, SCORES, out_dir=out_dir, **args)


@pytest.fixture(scope="module")
def first(tiny, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("ablate")
    return out, _run(tiny, tokenizer, out)


def test_plan_and_parse():
    assert parse_ks("20, 0,5,5") == [0, 5, 20]
    names = [c.name for c in plan([0, 5, 10], seeds=2, base_seed=7)]
    assert names == [
        "none-k0",
        "top-k5",
        "top-k10",
        "random-k5-s7",
        "random-k10-s7",
        "random-k5-s8",
        "random-k10-s8",
    ]
    with pytest.raises(AblationError, match="integers"):
        parse_ks("1,x")
    with pytest.raises(AblationError, match=">= 0"):
        parse_ks("-1")
    with pytest.raises(AblationError, match="seeds"):
        plan([1], seeds=0)


def test_points_equal_direct_evaluations(first, tiny, tokenizer):
    out, res = first
    assert [c.name for c in res.configs] == [
        "none-k0", "top-k1", "top-k2", "random-k1-s0", "random-k2-s0", "random-k1-s1", "random-k2-s1",
    ]  # fmt: skip
    assert res.heads["top-k2"] == [(1, 2), (0, 3)]
    assert len(res.heads["random-k2-s0"]) == 2 and res.heads["random-k2-s0"] != res.heads["random-k2-s1"]
    for name in ("top-k2", "random-k1-s1"):
        direct = evaluate_niah(
            tiny, tokenizer, needles=load_needles()[:1], heads=res.heads[name], progress=False, **GRID
        )
        assert [e["tokens"] for e in res.results[name].entries] == [e["tokens"] for e in direct.entries]
        assert res.results[name].meta["heads"] == sorted(list(h) for h in res.heads[name])
    rows = {r["k"]: r for r in res.rows()}
    assert rows[0]["top"] == res.results["none-k0"].mean == rows[0]["random_mean"]
    assert rows[2]["top"] == res.results["top-k2"].mean
    vals = [res.results["random-k2-s0"].mean, res.results["random-k2-s1"].mean]
    assert rows[2]["random_values"] == vals and rows[2]["random_n"] == 2
    assert rows[2]["random_mean"] == pytest.approx(sum(vals) / 2)
    summary = json.loads((out / "ablate.json").read_text())
    assert [c["name"] for c in summary["configs"]] == [c.name for c in res.configs]
    assert summary["rows"] == json.loads(json.dumps(res.rows()))
    assert (out / "ablate.md").read_text().startswith("| K | top-K")
    assert len(list((out / "ablate.configs").glob("*.json"))) == 7
    plot_ablation(res, out / "a.png", "t")
    assert (out / "a.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_skips_done_and_refuses_other_settings(first, tiny, tokenizer, monkeypatch):
    out, res = first
    (out / "ablate.configs" / "random-k2-s1.json").unlink()  # as if killed before the last one finished
    calls = []
    real = ablate_mod.evaluate_niah
    monkeypatch.setattr(ablate_mod, "evaluate_niah", lambda *a, **k: calls.append(k["desc"]) or real(*a, **k))
    again = _run(tiny, tokenizer, out, resume=True)
    assert calls == ["random-k2-s1"]
    assert again.rows() == res.rows()
    with pytest.raises(AblationError, match="--resume"):  # results present, neither resume nor overwrite
        _run(tiny, tokenizer, out)
    with pytest.raises(AblationError, match="other settings"):
        _run(tiny, tokenizer, out, resume=True, max_new_tokens=5)
    with pytest.raises(AblationError, match="other settings"):  # another seed -> other random heads
        _run(tiny, tokenizer, out, resume=True, base_seed=3)


def test_resume_inside_a_configuration_skips_its_answered_tests(
    first, tiny, tokenizer, tmp_path, monkeypatch
):
    """2 tests per configuration; Ctrl-C while the 6th test is scored: 2 configurations are saved and the
    third keeps its one answered test, which the resume does not run again."""
    _, res = first
    real_classify, scored = niah_eval.classify_answer, []

    def classify(*args, **kwargs):
        scored.append(1)
        if len(scored) > 5:
            raise KeyboardInterrupt
        return real_classify(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(niah_eval, "classify_answer", classify)
        with pytest.raises(KeyboardInterrupt):
            _run(tiny, tokenizer, tmp_path)
    folder = tmp_path / "ablate.configs"
    assert sorted(p.name for p in folder.iterdir()) == [
        "none-k0.json",
        "top-k1.json",
        "top-k2.json.progress.json",
    ]
    with pytest.raises(AblationError, match="and the finished tests of 1 unfinished ones; pass --resume"):
        _run(tiny, tokenizer, tmp_path)

    real_answer, handed = niah_eval.answer_tests, []

    def answer_tests(detector, tok, tests, *args, **kwargs):
        handed.append(len(tests))
        return real_answer(detector, tok, tests, *args, **kwargs)

    monkeypatch.setattr(niah_eval, "answer_tests", answer_tests)
    again = _run(tiny, tokenizer, tmp_path, resume=True)
    assert handed == [1, 2, 2, 2, 2]  # top-k2's unanswered test, then the 4 configurations not started
    assert again.rows() == res.rows() and again.results["top-k2"].meta["resumed_tests"] == 1
    assert not list(folder.glob("*.progress.json"))
    _run(tiny, tokenizer, tmp_path, overwrite=True, ks=[0])  # --overwrite clears the folder first
    assert sorted(p.name for p in folder.iterdir()) == ["none-k0.json"]


def test_clear_errors_before_any_work(tiny, tokenizer, monkeypatch):
    monkeypatch.setattr(ablate_mod, "evaluate_niah", lambda *a, **k: pytest.fail("ran before validating"))
    with pytest.raises(AblationError, match="only 8 heads"):
        _run(tiny, tokenizer, ks=[0, 9])
    with pytest.raises(AblationError, match="does not exist"):
        run_ablation(tiny, tokenizer, {(5, 0): 1.0}, ks=[1], lengths=[300], depths=[0], progress=False)
    with pytest.raises(AblationError, match="score below"):  # 6 of 8 heads score < 0.1
        _run(tiny, tokenizer, ks=[7], random_from="non-retrieval")


def test_non_retrieval_pool_follows_tau():
    """RetMask's τ is 0.05 for some models: the non-retrieval pool is the heads scoring below the τ given."""
    scores = {(0, 0): 0.3, (0, 1): 0.07, (0, 2): 0.04, (0, 3): 0.0}
    assert ablate_mod.random_pool(scores, "non-retrieval") == [(0, 1), (0, 2), (0, 3)]
    assert ablate_mod.random_pool(scores, "non-retrieval", tau=0.05) == [(0, 2), (0, 3)]
    assert ablate_mod.random_pool(scores, "all", tau=0.05) == sorted(scores)


@pytest.fixture(scope="module")
def tiny_dir(tiny, tokenizer, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    tiny.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_commands_write_outputs(tiny_dir, tmp_path, capsys):
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({f"{a}-{b}": [v] for (a, b), v in SCORES.items()}))
    grid = ["--min-len", "300", "--max-len", "400", "--num-lengths", "2", "--num-depths", "2",
            "--num-needles", "1", "--max-new-tokens", "5", "--no-progress"]  # fmt: skip
    out = tmp_path / "abl"
    argv = ["ablate", "--model", str(tiny_dir), "--scores", str(scores), "--k", "0,2", "--seeds", "2"]
    assert main([*argv, *grid, "--out-dir", str(out), "--limit", "2"]) == 0  # 2 of 4 configurations
    assert "2 configurations left" in capsys.readouterr().out
    assert main([*argv, *grid, "--out-dir", str(out)]) == 2  # no --resume: refuses to mix runs
    assert "--resume" in capsys.readouterr().err
    assert main([*argv, *grid, "--out-dir", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "| 2 |" in printed and "± " in printed and "left" not in printed
    assert (
        "| configuration | heads masked | NIAH | complete | cut short | partial | none | empty |" in printed
    )
    assert "| configuration |" in (out / "ablate.md").read_text() and "| random-k2-s1 |" in printed
    assert {p.name for p in out.iterdir()} >= {"ablate.json", "ablate.md", "ablate.png", "ablate.configs"}
    meta = json.loads((out / "ablate.json").read_text())["meta"]
    assert meta["tests_per_config"] == 4 and meta["configs_done"] == meta["configs_total"] == 4
    assert (meta["dtype"], meta["device"]) == ("float32", "cpu")
    assert main([*argv[:-4], "--k", "0,20", *grid, "--out-dir", str(tmp_path / "x")]) == 2
    assert "only 8 heads" in capsys.readouterr().err

    res = tmp_path / "n.json"
    png = tmp_path / "n.png"
    niah = ["niah", "--model", str(tiny_dir), "--mask-top", "2", "--scores", str(scores), *grid]
    assert main([*niah, "--out", str(res), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "depth \\ len" in printed and "mean ROUGE-1 recall" in printed and "top-2 heads" in printed
    data = json.loads(res.read_text())
    assert data["meta"]["heads"] == [[0, 3], [1, 2]] and len(data["entries"]) == 4
    assert png.read_bytes()[:4] == b"\x89PNG"
    heads = tmp_path / "h.json"
    heads.write_text(json.dumps({"heads": [[1, 2], [0, 3]]}))
    assert (
        main(
            [
                "niah",
                "--model",
                str(tiny_dir),
                "--mask-file",
                str(heads),
                *grid,
                "--out",
                str(res),
                "--overwrite",
            ]
        )
        == 0
    )
    assert json.loads(res.read_text())["entries"] == data["entries"]  # same heads, same answers
    assert main(["niah", "--model", str(tiny_dir), "--mask-top", "2", *grid]) == 2
    assert "--scores" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"heads": [[9, 0]]}))
    assert main(["niah", "--model", str(tiny_dir), "--mask-file", str(bad), *grid]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.embedded
def test_embedded_ablation_top_heads_hurt_more_than_random(tmp_path):
    """On SmolLM2 with the committed detection scores: masking the top 10 retrieval heads lowers the NIAH
    score more than 10 random heads (one seed, a 2-test grid: a smoke test of the real result)."""
    scores = Path(__file__).resolve().parents[2] / "bench" / "results" / "smollm2_scores.json"
    grid = ["--min-len", "800", "--max-len", "800", "--num-lengths", "1", "--num-depths", "2",
            "--num-needles", "1", "--max-new-tokens", "30", "--no-progress"]  # fmt: skip
    out = tmp_path / "abl"
    assert (
        main(["ablate", "--scores", str(scores), "--k", "0,10", "--seeds", "1", *grid, "--out-dir", str(out)])
        == 0
    )
    rows = {r["k"]: r for r in json.loads((out / "ablate.json").read_text())["rows"]}
    assert rows[0]["top"] > 0.6
    assert rows[10]["top"] < rows[10]["random_mean"]


def test_each_head_alone_equals_direct_evaluations_and_resumes(tiny, tokenizer, tiny_dir, tmp_path, capsys):
    from retmask.evaluate.single_heads import sweep_single_heads, sweep_table
    from retmask.niah import default_haystack_text

    needles = load_needles()[:1]
    kw = dict(needles=needles, haystack_text=default_haystack_text(), progress=False, log=lambda *a: None)
    heads = [(1, 2), (0, 0)]
    out = tmp_path / "each.json"
    sweep = sweep_single_heads(tiny, tokenizer, heads, scores=SCORES, out=out, **GRID, **kw)
    base = evaluate_niah(tiny, tokenizer, needles=needles, progress=False, **GRID)
    assert sweep["baseline"]["mean"] == base.mean
    for row, head in zip(sweep["heads"], heads, strict=True):
        direct = evaluate_niah(tiny, tokenizer, needles=needles, heads=[head], progress=False, **GRID)
        assert row["head"] == list(head) and row["mean"] == direct.mean
        assert row["drop"] == pytest.approx(base.mean - direct.mean) and row["score"] == SCORES[head]
        assert row["kinds"] == direct.answer_kinds() and sum(row["kinds"].values()) == len(direct.entries)
    base_answers = [e["response"] for e in base.entries[:3]]
    assert any(r["examples"] != base_answers for r in sweep["heads"]), "a masked head must change answers"
    assert "| none |" in sweep_table(sweep) and "| 1-2 |" in sweep_table(sweep)
    assert "complete / cut short / partial / none / empty" in sweep_table(sweep)
    with pytest.raises(ValueError, match="--resume"):
        sweep_single_heads(tiny, tokenizer, heads, out=out, **GRID, **kw)
    with pytest.raises(ValueError, match="other settings"):
        sweep_single_heads(
            tiny, tokenizer, heads, out=out, resume=True, **{**GRID, "max_new_tokens": 3}, **kw
        )
    # resume with one more head: only that one runs
    calls = []
    real = sweep_single_heads.__globals__["evaluate_niah"]
    sweep_single_heads.__globals__["evaluate_niah"] = lambda *a, **k: (
        calls.append(k["heads"]) or real(*a, **k)
    )
    try:
        more = sweep_single_heads(tiny, tokenizer, [*heads, (1, 3)], out=out, resume=True, **GRID, **kw)
    finally:
        sweep_single_heads.__globals__["evaluate_niah"] = real
    assert calls == [[(1, 3)]] and [r["name"] for r in more["heads"]] == ["1-2", "0-0", "1-3"]
    # resume with another list: its heads first, and the finished ones it does not list are kept
    other_list = sweep_single_heads(tiny, tokenizer, [(0, 0)], out=out, resume=True, **GRID, **kw)
    assert [r["name"] for r in other_list["heads"]] == ["0-0", "1-2", "1-3"]
    assert [r["name"] for r in json.loads(out.read_text())["heads"]] == ["0-0", "1-2", "1-3"]

    grid = ["--min-len", "300", "--max-len", "300", "--num-lengths", "1", "--num-depths", "2",
            "--num-needles", "1", "--max-new-tokens", "6", "--no-progress"]  # fmt: skip
    cli_out = tmp_path / "cli"
    assert (
        main(["ablate", "--model", str(tiny_dir), "--each", "1-2,0-0", *grid, "--out-dir", str(cli_out)]) == 0
    )
    printed = capsys.readouterr().out
    assert (
        "| 1-2 |" in printed
        and (cli_out / "ablate.each.json").exists()
        and (cli_out / "ablate.each.md").exists()
    )
    assert main(["ablate", "--model", str(tiny_dir), "--each", "1-2", *grid, "--out-dir", str(cli_out)]) == 2
    assert "--resume to continue or --overwrite" in capsys.readouterr().err  # the sweep is not replaced
    other = tmp_path / "cli2"
    assert main(["ablate", "--model", str(tiny_dir), "--each", "1-9", *grid, "--out-dir", str(other)]) == 2
    assert "do not exist" in capsys.readouterr().err
    assert main(["ablate", "--model", str(tiny_dir), *grid]) == 2
    assert "--scores is required" in capsys.readouterr().err
