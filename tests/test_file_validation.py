"""Hostile input (issue 47): files that parse as JSON but do not hold what their reader needs.

Progress, state, result and cache files are read as truth when a run resumes or a command reads them, so
each reader checks their *shape*, not just their syntax: a wrong-shaped or inconsistent file is an error
naming the file and the way out (``retmask <command>: error: ...``, exit 2) -- or, for a cache, is ignored
with a warning naming it and rebuilt. Files here are small and hand-written or edited; models are the
tiny random Llama of ``tests/commands/conftest.py``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from pathlib import Path

import pytest

from retmask.cli import main
from retmask.errors import UsageError
from retmask.runfiles import JsonFile, RunFileError, read_json
from tests.tiny import tiny_llama_for


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny random Llama with the embedded model's tokenizer, saved as a model folder (it retrieves no
    needle: a detection counts nothing, which keeps its progress file)."""
    import transformers

    import retmask

    tok = transformers.AutoTokenizer.from_pretrained(retmask.default_model_path())
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama_for(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def one_needle(tmp_path_factory) -> Path:
    """A needles file with the first shipped needle only."""
    from retmask.niah import DEFAULT_NEEDLES_PATH

    path = tmp_path_factory.mktemp("needles") / "needles.jsonl"
    path.write_text(DEFAULT_NEEDLES_PATH.read_text().splitlines()[0] + "\n")
    return path


# --------------------------------------------------------------------------------------------------
# read_json: what json.loads reads silently or crashes on
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data,message",
    [
        (b'{"a": 1, "b": {"x": 1, "x": 2}}', "holds key 'x' twice in one object"),
        (b"[" * 100_000, "nested too deeply"),
        (b"\xff\xfe{}", "is not UTF-8 text"),
        (b"[" + b"9" * 5000 + b"]", "holds an integer of 5000 digits"),
        (b'{"a": ', "is not valid JSON"),
    ],
    ids=["duplicate-key", "deep", "not-utf8", "long-int", "truncated"],
)
def test_read_json_refuses_what_json_loads_would_misread(tmp_path, data, message):
    path = tmp_path / "f.json"
    path.write_bytes(data)
    with pytest.raises(RunFileError, match=message) as err:
        read_json(path, what="progress file", fix="delete it")
    assert str(path) in str(err.value) and str(err.value).endswith("; delete it")


def test_read_json_folder_and_error_type(tmp_path):
    with pytest.raises(RunFileError, match=rf"results file {tmp_path} is a folder, not a file"):
        read_json(tmp_path)

    class Mine(ValueError):
        pass

    (tmp_path / "x.json").write_text("{oops")
    with pytest.raises(Mine, match="not valid JSON"):
        read_json(tmp_path / "x.json", error=Mine)


def test_json_file_checks_name_file_place_and_fix(tmp_path):
    f = JsonFile(tmp_path / "p.json", "state file", "pass --overwrite")
    prefix = f"state file {tmp_path / 'p.json'}: "
    cases = [
        (lambda: f.expect([], dict, "the file"), "the file must be an object, not a list ([])"),
        (lambda: f.expect(True, int, "order"), "order must be an integer, not true or false (True)"),
        (lambda: f.expect("1", float, "x"), "x must be a number, not a string ('1')"),
        (lambda: f.key({}, "stages", dict), "the file lacks the entry 'stages'"),
        (lambda: f.number(float("nan"), "x"), "x is nan; it must be a finite number"),
        (lambda: f.number(-1, "x", integer=True, lo=0), "x is -1; it must be >= 0"),
        (lambda: f.index_key("１", "results"), "results: key '１' is not a non-negative integer written"),
        (lambda: f.index_key("٣", "results"), "digits 0-9"),
        (lambda: f.index_key(str(10**30), "results"), "is out of range (at most 999999)"),
    ]
    for call, message in cases:
        with pytest.raises(RunFileError) as err:
            call()
        assert str(err.value) == prefix + message + "; pass --overwrite" or (
            str(err.value).startswith(prefix) and message in str(err.value)
        ), str(err.value)
    assert f.expect(3, float, "x") == 3 and f.index_key("007", "results") == 7
    assert issubclass(RunFileError, UsageError)  # the command line prints it and exits 2


# --------------------------------------------------------------------------------------------------
# Scores files (retmask detect's {"L-H": [...]}): every command that reads one
# --------------------------------------------------------------------------------------------------


def _mask(scores: Path, capsys) -> tuple[int, str]:
    rc = main(["mask", "--scores", str(scores), "--top-k", "1"])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"0-0": [0.5], "0-1": [0.1], "0-0": [0.0]}', "holds key '0-0' twice in one object"),
        ('{"0-0": [0.5], "0-1": [-0.1]}', "value 0 of '0-1' is -0.1; retrieval scores are >= 0"),
        ('{"0-0": [0.5], "１-２": [0.1]}', "key '１-２' is not '<layer>-<head>' written with the digits 0-9"),
        ('{"0-0": [0.5], "٣-4": [0.1]}', "key '٣-4' is not '<layer>-<head>' written with the digits 0-9"),
        ('{"0-0": [0.5], "²-1": [0.1]}', "written with the digits 0-9"),  # int("²") would raise
        ('{"0-0": [0.5], "1000000000000000000000000000000-0": [0.1]}', "beyond any model"),
        ('{"0-0": [], "0-1": []}', "every head has an empty score list"),
        ('{"0-0": [0.5], "0-1": "0.1"}', "must be a list of per-test scores"),
        ("[" * 100_000, "nested too deeply"),
    ],
    ids=["duplicate", "negative", "fullwidth", "arabic-indic", "superscript", "huge", "empty", "str", "deep"],
)
def test_bad_scores_files_are_named_errors(tmp_path, capsys, text, message):
    path = tmp_path / "scores.json"
    path.write_text(text, encoding="utf-8")
    rc, err = _mask(path, capsys)
    assert rc == 2 and err.startswith("retmask mask: error: ") and "Traceback" not in err
    assert f"scores file {path}" in err and message in err, err


def test_scores_file_that_is_a_folder_or_not_utf8(tmp_path, capsys):
    rc, err = _mask(tmp_path, capsys)
    assert rc == 2 and f"scores file {tmp_path} is a folder, not a file" in err
    path = tmp_path / "s.json"
    path.write_bytes(b'{"0-0": [0.5, \xff]}')
    rc, err = _mask(path, capsys)
    assert rc == 2 and f"scores file {path} is not UTF-8 text" in err


def test_scores_above_one_load_with_a_warning_beyond_rounding(tmp_path):
    from retmask.heads.selection import ScoreAboveOneWarning, load_scores

    path = tmp_path / "s.json"
    # the published llama-2-7b-80k file holds 1.0000000000000002 (sums of 1/n): no warning
    path.write_text(json.dumps({"0-0": [1.0000000000000002, 1.0], "0-1": [0.2, 0.2]}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_scores(path)[(0, 0)] == pytest.approx(1.0)
    path.write_text(json.dumps({"0-0": [1.5, 1.0], "0-1": [0.2, 0.2], "1-3": [1.25, 0.5]}))
    above = r"2 score\(s\) above 1 in 2 head\(s\) \(largest 1.5 for head '0-0'; heads: 0-0, 1-3\)"
    with pytest.warns(ScoreAboveOneWarning, match=above) as w:
        scores = load_scores(path)
    assert f"scores file {path}" in str(w[0].message)
    assert scores[(0, 0)] == 1.25  # used as it is


def test_heads_files_get_the_same_checks(tmp_path):
    from retmask.heads.selection import SelectionError, read_heads

    path = tmp_path / "h.json"
    path.write_text('{"heads": [[0, 1]], "heads": [[0, 2]]}')
    with pytest.raises(SelectionError, match=rf"heads file {path} holds key 'heads' twice"):
        read_heads(path)
    for text, message in [
        ('{"heads": [[0, 1]], "scores": 5}', "'scores' must be a list of numbers"),
        ('{"heads": [[0, 1]], "model_shape": "2x4"}', "'model_shape' must be"),
        ('{"heads": [[0, 1]], "retrieval_heads": 3}', "'retrieval_heads' must be a list"),
    ]:
        path.write_text(text)
        with pytest.raises(SelectionError, match=message):
            read_heads(path)


# --------------------------------------------------------------------------------------------------
# Detection progress (<out>.progress.json): checked against the grid and the model on --resume
# --------------------------------------------------------------------------------------------------

DETECT_GRID = ["--min-len", "300", "--max-len", "300", "--num-lengths", "1", "--num-depths", "2"]


def _detect(model: Path, needles: Path, out: Path, *extra: str) -> list[str]:
    return ["detect", "--model", str(model), "--needles", str(needles), *DETECT_GRID, "--max-new-tokens",
            "4", "--out", str(out), "--no-progress", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def detect_progress(tmp_path_factory, tiny_dir, one_needle) -> tuple[Path, dict]:
    """(needles file, progress of a finished 2-test detection): the tiny model counts no test, so the run
    fails with "no test counted" and keeps its progress file, which is what resuming reads."""
    needles = one_needle
    out = tmp_path_factory.mktemp("detect") / "s.json"
    assert main(_detect(tiny_dir, needles, out)) == 2
    progress = json.loads(out.with_name("s.json.progress.json").read_text())
    assert sorted(progress["results"]) == ["0", "1"]
    return needles, progress


def _extra_entry(p: dict) -> None:  # the probe: a 7th entry for a 6-test grid resumed to 7 values per head
    p["results"]["2"] = dict(p["results"]["0"], index=2)


def _foreign_entry(p: dict) -> None:  # as many entries as tests, one of them not a test of the grid
    p["results"]["5"] = dict(p["results"].pop("1"), index=5)


def _wrong_layers(p: dict) -> None:
    p["results"]["0"]["copies"].append(p["results"]["0"]["copies"][0])


def _copies_above_tokens(p: dict) -> None:
    p["results"]["1"]["copies"][0][0] = 99  # at most one copy per generated token (4 at most here)


PROGRESS_EDITS = {
    "extra-entry": (_extra_entry, "it holds 3 finished tests, but the grid has 2 runnable tests"),
    "foreign-entry": (_foreign_entry, "results holds test 5, which is not a runnable test of this grid"),
    "results-list": (lambda p: p.update(results=list(p["results"].values())), "'results' must be an object"),
    "no-results": (lambda p: p.pop("results"), "the file lacks the entry 'results'"),
    "fullwidth-key": (
        lambda p: p["results"].update({"１": p["results"].pop("1")}),
        "key '１' is not a non-negative integer written in the digits 0-9",
    ),
    "swapped": (
        lambda p: p["results"].update({"0": p["results"]["1"], "1": p["results"]["0"]}),
        "results['0'] is test 1",
    ),
    "wrong-layers": (_wrong_layers, "results['0'].copies must be 2 lists (layers) of 4 counts"),
    "copies-above-tokens": (_copies_above_tokens, "results['1'].copies[0][0] is 99; it must be >= 0 and <= "),
    "recall-string": (
        lambda p: p["results"]["0"].update(rouge1_recall="0.0"),
        "results['0'].rouge1_recall must be a number, not a string",
    ),
    "recall-above-1": (lambda p: p["results"]["0"].update(rouge1_recall=1.5), "rouge1_recall is 1.5"),
    "counted-flipped": (lambda p: p["results"]["0"].update(counted=True), "counted is True but its recall"),
    "entry-a-list": (
        lambda p: p["results"].update({"0": [1, 2]}),
        "results['0'] must be an object, not a list",
    ),
    "fingerprint-list": (lambda p: p.update(fingerprint=[1]), "'fingerprint' must be an object or null"),
    "answer-tokens": (
        lambda p: p["results"]["0"].update(answer_tokens=99),
        "answer_tokens is 99, but the test's answer has",
    ),
}


@pytest.mark.parametrize("edit", list(PROGRESS_EDITS))
def test_edited_detect_progress_is_refused_on_resume(tmp_path, capsys, tiny_dir, detect_progress, edit):
    needles, progress = detect_progress
    change, message = PROGRESS_EDITS[edit]
    state = json.loads(json.dumps(progress))
    change(state)
    out = tmp_path / "s.json"
    path = out.with_name("s.json.progress.json")
    path.write_text(json.dumps(state), encoding="utf-8")
    capsys.readouterr()
    assert main(_detect(tiny_dir, needles, out, "--resume")) == 2
    err = capsys.readouterr().err
    assert f"retmask detect: error: detect progress file {path}: " in err and message in err, err
    assert "delete it to start over, or pass --overwrite" in err and "Traceback" not in err


def test_sound_detect_progress_still_resumes(tmp_path, capsys, tiny_dir, detect_progress):
    needles, progress = detect_progress
    out = tmp_path / "s.json"
    out.with_name("s.json.progress.json").write_text(json.dumps(progress))
    capsys.readouterr()
    assert main(_detect(tiny_dir, needles, out, "--resume")) == 2  # nothing counted, as before
    err = capsys.readouterr().err
    assert "resuming: 2 of 2 tests already done" in err and "no test counted" in err


def test_detect_resume_on_a_model_folder_changed_since_is_refused(tmp_path, capsys, tiny_dir, one_needle):
    """The model folder's weights rewritten between the run and its resume (trained again into it): another
    model, whose answers must not be mixed with the first one's. Same bytes, new modification time here."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    out = tmp_path / "s.json"
    assert main(_detect(model, one_needle, out)) == 2  # nothing counted: the progress file stays
    capsys.readouterr()
    assert main(_detect(model, one_needle, out, "--resume")) == 2
    assert "resuming: 2 of 2 tests already done" in capsys.readouterr().err
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes())
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert main(_detect(model, one_needle, out, "--resume")) == 2
    err = capsys.readouterr().err
    assert "was written by a run with other settings (model_files: " in err and "resuming" not in err, err


# --------------------------------------------------------------------------------------------------
# Pipeline state, generation progress, ablation and sweep results, eval cache
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "state,message",
    [
        ([], "the file must be an object, not a list"),
        ({"version": 1}, "the file lacks the entry 'stages'"),
        ({"stages": []}, "'stages' must be an object, not a list"),
        ({"stages": {"detect": "done"}}, "stages.detect must be an object, not a string"),
        ({"stages": {"detect": {"status": "done"}}}, "stages.detect lacks the entry 'fingerprint'"),
        (
            {"stages": {"detect": {"status": "done", "fingerprint": 7}}},
            "stages.detect.fingerprint must be a string",
        ),
        ({"stages": {"train2": {}}}, "stages holds 'train2', which is not a stage"),
        ({"stages": {"mask": {"status": "done", "fingerprint": "x", "seconds": "2"}}}, "stages.mask.seconds"),
    ],
)
def test_pipeline_state_shape(tmp_path, state, message):
    from retmask.methods.retmask.pipeline import read_state

    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(state))
    with pytest.raises(RunFileError) as err:
        read_state(path)
    assert str(err.value).startswith(f"pipeline state {path}: ") and message in str(err.value)
    assert str(err.value).endswith("pass --overwrite to start over")


def test_pipeline_command_names_a_wrong_shaped_state(tmp_path, capsys, tiny_dir):
    state = tmp_path / "run" / "pipeline.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"version": 1, "stages": {"detect": ["done"]}}))
    assert main(["pipeline", "--model", str(tiny_dir), "--run-dir", str(state.parent)]) == 2
    err = capsys.readouterr().err
    assert (
        f"pipeline state {state}: stages.detect must be an object, not a list" in err and "--overwrite" in err
    )


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda p: p.update(offset="12"), "'offset' must be an integer, not a string"),
        (lambda p: p.update(offset=-1), "'offset' is -1; it must be >= 0"),
        (lambda p: p.update(done="a,b"), "'done' must be a list"),
        (lambda p: p.update(done=[1]), "done[0] must be a string"),
        (lambda p: p.update(dropped={"empty": "x"}), "dropped['empty'] must be an integer"),
        (lambda p: p.update(complete="yes"), "'complete' must be true or false"),
        (lambda p: p.pop("fingerprint"), "the file lacks the entry 'fingerprint'"),
        (lambda p: p.update(extra=1), "it holds entries a progress file has not ('extra')"),
    ],
)
def test_generation_progress_shape(tmp_path, change, message):
    from retmask.methods.retmask.pair_file import PairWriter, progress_path, unfinished_generation

    out = tmp_path / "pairs.jsonl"
    out.write_text("")
    state = {"fingerprint": {"seed": 0}, "offset": 0, "done": [], "dropped": {"empty": 0}, "seconds": 0.0,
             "generated_tokens": 0, "complete": False}  # fmt: skip
    change(state)
    path = progress_path(out)
    path.write_text(json.dumps(state))
    with pytest.raises(RunFileError) as err:
        PairWriter(out, {"seed": 0}, resume=True)
    assert str(err.value).startswith(f"generation progress file {path}: ") and message in str(err.value)
    assert "pass --overwrite" in str(err.value)
    with pytest.raises(RunFileError, match="finish the run with generate --resume"):
        unfinished_generation(out)


def _ablate(model: Path, needles: Path, scores: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["ablate", "--model", str(model), "--needles", str(needles), "--min-len", "300", "--max-len",
            "300", "--num-lengths", "1", "--num-depths", "1", "--max-new-tokens", "3", "--out-dir", str(out_dir),
            "--no-progress", *extra]  # fmt: skip


@pytest.fixture
def tiny_scores(tmp_path) -> Path:
    path = tmp_path / "scores.json"
    path.write_text(json.dumps({f"{ly}-{h}": [0.1 * (ly + h)] for ly in range(2) for h in range(4)}))
    return path


def test_edited_ablation_results_are_named_on_resume(tmp_path, capsys, tiny_dir, one_needle, tiny_scores):
    out_dir = tmp_path / "ab"
    curve = ["--scores", str(tiny_scores), "--k", "1", "--seeds", "1"]
    assert main(_ablate(tiny_dir, one_needle, tiny_scores, out_dir, *curve)) == 0
    config = out_dir / "ablate.configs" / "top-k1.json"
    good = json.loads(config.read_text())
    edits = [
        (lambda d: d.update(name=["top-k1"]), "'name' must be a string, not a list"),
        (lambda d: d.update(result=[]), "'result' must be an object, not a list"),
        (lambda d: d["result"].update(entries=[{"index": 0}]), "'result' is not a NIAH result"),
        (lambda d: d["result"]["entries"][0].update(rouge1_recall="1"), "rouge1_recall must be a number"),
        (lambda d: d["result"]["entries"][0].update(length=999), "outside the grid"),
    ]
    for change, message in edits:
        data = json.loads(json.dumps(good))
        change(data)
        config.write_text(json.dumps(data))
        capsys.readouterr()
        assert main(_ablate(tiny_dir, one_needle, tiny_scores, out_dir, *curve, "--resume")) == 2
        err = capsys.readouterr().err
        assert f"ablation result {config}: " in err and message in err, err
        assert "delete it to recompute that configuration" in err


def test_edited_single_head_sweep_is_named_on_resume(tmp_path, capsys, tiny_dir, one_needle, tiny_scores):
    out_dir = tmp_path / "each"
    each = ["--each", "0-1"]
    assert main(_ablate(tiny_dir, one_needle, tiny_scores, out_dir, *each)) == 0
    sweep = out_dir / "ablate.each.json"
    good = json.loads(sweep.read_text())
    edits = [
        (lambda d: d.update(heads={}), "'heads' must be a list, not an object"),
        (lambda d: d.update(baseline=[0.5]), "'baseline' must be an object or null"),
        (lambda d: d["baseline"].pop("mean"), "baseline lacks the entry 'mean'"),
        (lambda d: d["heads"][0].update(drop="0.1"), "heads[0].drop must be a number"),
        (lambda d: d["heads"][0].pop("name"), "heads[0] lacks the entry 'name'"),
        (lambda d: d["heads"][0]["kinds"].pop("complete"), "heads[0].kinds must count complete"),
    ]
    for change, message in edits:
        data = json.loads(json.dumps(good))
        change(data)
        sweep.write_text(json.dumps(data))
        capsys.readouterr()
        assert main(_ablate(tiny_dir, one_needle, tiny_scores, out_dir, *each, "--resume")) == 2
        err = capsys.readouterr().err
        assert f"single-head sweep {sweep}: " in err and message in err, err


def test_eval_cache_entry_of_the_wrong_shape_is_evaluated_again(tmp_path):
    from retmask.evaluate.config import EvalConfig
    from retmask.evaluate.suite import _cached_result

    cfg = EvalConfig(tasks=["kv"])
    path = tmp_path / "0123456789abcdef.json"
    good = {"fingerprint": "fp", "tasks": {"kv": 0.5}, "kv": {"by_length": {"300": 0.5}}, "seconds": 1.0}
    path.write_text(json.dumps(good))
    logs: list[str] = []
    assert _cached_result(path, "fp", cfg, logs.append) == good and logs == []
    assert _cached_result(path, "other", cfg, logs.append) is None and logs == []  # other settings: silent
    for bad, message in [
        ("[1]", "the file must be an object, not a list"),
        ('{"fingerprint": "fp", "fingerprint": "fp"}', "holds key 'fingerprint' twice"),
        (json.dumps({**good, "tasks": []}), "'tasks' must be an object"),
        (json.dumps({**good, "tasks": {"kv": "0.5"}}), "tasks.kv must be a number or null"),
        (json.dumps({**good, "kv": {"score": 1}}), "kv lacks the entry 'by_length'"),
        ("{trunc", "is not valid JSON"),
    ]:
        path.write_text(bad)
        logs.clear()
        assert _cached_result(path, "fp", cfg, logs.append) is None
        assert len(logs) == 1 and f"[eval] ignoring eval cache entry {path}" in logs[0] and message in logs[0]
        assert logs[0].endswith("evaluating the model again (the entry is rewritten)")
    niah = EvalConfig(tasks=["niah"])
    entry = {"fingerprint": "fp", "tasks": {"niah": 0.0}, "niah": {"version": 0}, "shape": [2, 4],
             "scores": {"mean": [[0.0] * 4] * 2, "counted": 0, "tests": 1}}  # fmt: skip
    path.write_text(json.dumps(entry))
    logs.clear()
    assert _cached_result(path, "fp", niah, logs.append) is None and "'niah' is not a NIAH result" in logs[0]


# --------------------------------------------------------------------------------------------------
# Caches: CPU decisions and converted models
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        "[1, 2]",
        '{"format": 1, "machines": []}',
        '{"format": 1, "machines": {"k": []}}',
        '{"format": 1, "machines": {"k": {"cases": []}}}',
        '{"format": 1, "machines": {"k": {"cases": {"c": "onednn"}}}}',
        '{"format": 1, "format": 1, "machines": {}}',
    ],
)
def test_wrong_shaped_decision_cache_is_ignored_once_and_rewritten(tmp_path, monkeypatch, caplog, content):
    from retmask.cpu_speedups.decisions import DecisionCache, DecisionStore

    monkeypatch.setenv("RETMASK_CACHE", str(tmp_path))
    cache = DecisionCache(
        "cpu_test.json", 1, valid=lambda d: d.get("backend") in ("a", "b"), what="the test cache"
    )
    cache.path().write_text(content)
    store = DecisionStore(cache, lambda: {"cpu": "x"})
    measured = []
    with caplog.at_level(logging.WARNING, logger="retmask.kernels"):
        assert store.get("c", lambda: measured.append(1) or {"backend": "a"}) == {"backend": "a"}
    assert measured == [1]
    warned = [r.getMessage() for r in caplog.records if "ignoring the test cache" in r.getMessage()]
    assert len(warned) == 1 and str(cache.path()) in warned[0]
    data = json.loads(cache.path().read_text())  # rewritten in the right shape
    assert data["machines"][store.machine_key()]["cases"]["c"] == {"backend": "a"}


def test_decision_whose_check_fails_is_measured_again(tmp_path, monkeypatch):
    from retmask.cpu_speedups.decisions import DecisionCache, DecisionStore

    monkeypatch.setenv("RETMASK_CACHE", str(tmp_path))
    # the check of a decision meets a list where it expects a string: not usable, no TypeError
    cache = DecisionCache("cpu_test.json", 1, valid=lambda d: d["backend"] in {"a"}, what="the test cache")
    store = DecisionStore(cache, lambda: {"cpu": "x"})
    cases = {
        "format": 1,
        "machines": {store.machine_key(): {"machine": {}, "cases": {"c": {"backend": ["a"]}}}},
    }
    cache.path().write_text(json.dumps(cases))
    assert store.get("c", lambda: {"backend": "a"}) == {"backend": "a"}


def test_damaged_conversion_marker_converts_again(tmp_path, monkeypatch):
    from retmask.hf import loading

    monkeypatch.setenv("RETMASK_CACHE", str(tmp_path / "cache"))
    calls = []

    def convert(gguf, out_dir):
        calls.append(gguf)
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        (out_dir / loading._COMPLETE_MARKER).write_text(json.dumps({"source": str(gguf)}))

    monkeypatch.setattr(loading, "_convert_gguf", convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    folder = loading.converted_gguf_path(gguf)
    assert len(calls) == 1 and loading.converted_gguf_path(gguf) == folder and len(calls) == 1
    for marker in ("[]", '{"source": 3}', "{oops"):
        (folder / loading._COMPLETE_MARKER).write_text(marker)
        with pytest.warns(
            loading.StaleConversionWarning, match=rf"converted-model cache {folder}: .*converting"
        ):
            assert loading.converted_gguf_path(gguf) == folder
        assert json.loads((folder / loading._COMPLETE_MARKER).read_text()) == {"source": str(gguf.resolve())}
    assert len(calls) == 4


@pytest.mark.parametrize("config", ["[]", "{}", '{"model_type": 5}', "{oops"])
def test_damaged_converted_config_says_delete_the_folder(tmp_path, config):
    import retmask
    from retmask.hf import loading

    folder = tmp_path / "m-hf"
    folder.mkdir()
    shutil.copy(retmask.default_model_path() / "tokenizer.json", folder)
    (folder / loading._COMPLETE_MARKER).write_text('{"source": "m.gguf"}')
    (folder / "config.json").write_text(config)
    with pytest.raises(loading.ModelLoadError) as err:
        retmask.load_model(str(folder))
    assert f"converted-model cache {folder} is damaged: its config.json" in str(err.value)
    assert f"delete the folder (rm -r {folder})" in str(err.value)
