"""End to end: the driver's outputs, resume after kill -9, determinism, clear errors before any work."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time

import pytest
import torch

from retmask.cli import main
from retmask.detect import DetectConfig, run_detect
from retmask.detect.run import DetectError

from .small_grid import GRID, grid_config, needles_file


@pytest.mark.embedded
def test_resume_after_kill_gives_identical_output(tmp_path, embedded, embedded_detection):
    model, tok = embedded
    needles, ref_path, ref = embedded_detection
    assert ref.record["tests_counted"] >= 4
    assert len(ref.scores) == 30 * 9 and all(
        len(v) == ref.record["tests_counted"] for v in ref.scores.values()
    )
    # same settings, fresh run: same result (determinism)
    again = run_detect(
        grid_config(needles),
        tmp_path / "again" / "s.json",
        model=model,
        tokenizer=tok,
        progress_bar=False,
        log=lambda *a, **k: None,
    )
    assert again.scores == ref.scores

    out = tmp_path / "killed" / "s.json"
    progress = out.with_name(out.name + ".progress.json")
    cmd = [
        sys.executable,
        "-m",
        "retmask",
        "detect",
        "--needles",
        str(needles),
        *GRID,
        "--chunk",
        "128",
        "--out",
        str(out),
        "--no-progress",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:
        if progress.exists() and len(json.loads(progress.read_text())["results"]) >= 2:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert progress.exists() and not out.exists(), "the run must be interrupted mid-way"
    done_before = len(json.loads(progress.read_text())["results"])
    assert 2 <= done_before < 8

    # resuming with other settings is refused, naming the problem
    other = grid_config(needles)
    other.max_new_tokens = 20
    with pytest.raises(ValueError, match="other settings"):
        run_detect(
            other, out, resume=True, model=model, tokenizer=tok, progress_bar=False, log=lambda *a, **k: None
        )

    resumed = run_detect(
        grid_config(needles),
        out,
        resume=True,
        model=model,
        tokenizer=tok,
        progress_bar=False,
        log=lambda *a, **k: None,
    )
    assert json.loads(out.read_text()) == json.loads(ref_path.read_text())
    # passes too: the resumed tests drafted from the same earlier answers as in the uninterrupted run
    key = lambda r: [(t["key"], t["response"], t["rouge1_recall"], t["passes"]) for t in r.record["tests"]]  # noqa: E731
    assert key(resumed) == key(ref)
    record = json.loads(out.with_name("s.run.json").read_text())
    assert record["grid"]["lengths"] == [350, 600] and record["tests_run"] == 8
    # the versions that decide the numbers besides the config (a haystack or tokenizer can change with them)
    assert record["environment"]["python"] == platform.python_version()
    assert record["environment"]["torch"] == torch.__version__

    # the finished run deleted its progress file; resuming it again says there is nothing to resume
    assert not progress.exists()
    with pytest.raises(ValueError, match="already finished"):
        run_detect(
            grid_config(needles), out, resume=True, model=model, tokenizer=tok, progress_bar=False,
            log=lambda *a, **k: None,
        )  # fmt: skip


@pytest.mark.embedded
@pytest.mark.parametrize("option", ["draft_history", "static_passes"])
def test_speed_options_change_speed_not_results(option, tmp_path, embedded, embedded_detection):
    """Drafts from earlier answers (on by default) and fixed-shape verification passes (CUDA graphs on a
    GPU; off by default): each run both ways gives the same scores and answers."""
    model, tok = embedded
    needles = embedded_detection[0] if option == "draft_history" else needles_file(tmp_path, n=1)
    runs = {True: embedded_detection[2]} if option == "draft_history" else {}  # the default run, shared
    for value in (True, False):
        if value not in runs:
            cfg = grid_config(needles)
            setattr(cfg, option, value)
            runs[value] = run_detect(
                cfg, tmp_path / str(value) / "s.json", model=model, tokenizer=tok, progress_bar=False,
                log=lambda *a, **k: None,
            )  # fmt: skip
        assert runs[value].record["config"][option] is value
    assert runs[True].scores == runs[False].scores
    tests = {h: runs[h].record["tests"] for h in runs}
    assert [t["tokens"] for t in tests[True]] == [t["tokens"] for t in tests[False]]
    if option == "draft_history":
        passes = {h: sum(t["passes"] for t in tests[h]) for h in tests}
        assert passes[True] < passes[False], passes


@pytest.mark.embedded
def test_cpu_linears_are_decided_before_the_first_test(tmp_path, embedded, monkeypatch):
    """No test's time (nor the ETA) includes deciding a CPU linear case: every case the model's linears
    can take is decided (read from the cache or measured) before the first test runs."""
    from retmask.cpu_speedups import linear as linear_cpu
    from retmask.detect.core import FastDetector

    model, tok = embedded
    events = []
    run, choose = FastDetector.run, linear_cpu.choose
    monkeypatch.setattr(
        FastDetector, "run", lambda self, *a, **k: events.append("test") or run(self, *a, **k)
    )
    monkeypatch.setattr(linear_cpu, "choose", lambda case: events.append(case.kind) or choose(case))
    linear_cpu.clear_memory()  # the decisions held in memory: each is asked for again (the disk cache stays)
    cfg = DetectConfig(needles=str(needles_file(tmp_path, 1)), min_len=350, max_len=350, num_lengths=1,
                       num_depths=1, chunk=128)  # fmt: skip
    try:
        run_detect(
            cfg, tmp_path / "s.json", model=model, tokenizer=tok, progress_bar=False, log=lambda *a, **k: None
        )
    finally:
        linear_cpu.clear_memory()
    assert "test" in events
    first = events.index("test")
    assert {"gemv", "few", "gemm"} <= set(events[:first])
    assert set(events[first:]) == {"test"}, events[first:]


@pytest.mark.embedded
def test_context_longer_than_model_fails_before_work(tmp_path, embedded, capsys):
    model, tok = embedded
    cfg = DetectConfig(protocol="wu2024")
    with pytest.raises(ValueError, match="exceeds the model's maximum of 8192"):
        run_detect(cfg, tmp_path / "s.json", model=model, tokenizer=tok, progress_bar=False)
    assert not any(tmp_path.iterdir())


def test_cli_errors_are_clear(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"needle": "x"}\n')
    assert main(["detect", "--needles", str(bad), "--out", str(tmp_path / "s.json")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:1" in err and "missing key" in err


def test_cli_lists_detect():
    out = subprocess.run(
        [sys.executable, "-m", "retmask", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "detect" in out


def test_span_rule_tolerant_runs_tests_the_reference_skips(tmp_path, monkeypatch):
    """A short answer whose first word SmolLM2 splits differently alone ("ze" "bra") than mid-sentence
    (" zebra"): with --span-miss skip the reference rule skips every test and says to try --span-rule
    tolerant (or --span-miss zeros, the default, below); the tolerant rule
    runs them, records the answer form per test and the rule in the config. The record describes the
    machine and the path each kind of call took (``retmask.kernels.describe``)."""
    from transformers import AutoTokenizer

    import retmask
    from retmask.detect.run import DetectError
    from tests.tiny import tiny_llama_for

    tok = AutoTokenizer.from_pretrained(str(retmask.default_model_path()))  # from the converted model
    # the run's CPU decisions go to a cache of its own (set after the tokenizer: a new cache would
    # convert the embedded model again, a minute of work for its tokenizer)
    monkeypatch.setenv("RETMASK_CACHE", str(tmp_path / "cache"))
    model = tiny_llama_for(tok)
    needles = tmp_path / "needles.jsonl"
    needles.write_text(
        json.dumps(
            {
                "needle": "The birds in the old barn are zebra finches.",
                "question": "What birds live in the old barn?",
                "real_needle": "zebra finches",
            }
        )
        + "\n"
    )
    kw = dict(needles=str(needles), min_len=400, max_len=400, num_lengths=1, num_depths=2, max_new_tokens=4)
    quiet = dict(model=model, tokenizer=tok, progress_bar=False, log=lambda *a, **k: None)
    with pytest.raises(
        DetectError, match="no test could run.*span rule; try --span-rule tolerant; --span-miss"
    ):
        run_detect(DetectConfig(**kw, span_miss="skip"), tmp_path / "ref" / "s.json", **quiet)
    # a random tiny model answers nothing useful, so no test counts; the record still shows what ran
    out = tmp_path / "tol" / "s.json"
    with pytest.raises(DetectError, match="no test counted"):
        run_detect(DetectConfig(**kw, span_rule="tolerant"), out, **quiet)
    record = json.loads(out.with_name("s.run.json").read_text())
    assert record["config"]["span_rule"] == "tolerant" and record["skipped"] == []
    assert record["config"]["chunk"] == 256  # DetectConfig's None resolved to the CPU's default and recorded
    assert [t["answer_form"] for t in record["tests"]] == ["mid-sentence", "mid-sentence"]
    assert all(t["answer_tokens"] == 3 for t in record["tests"])
    kernels = record["kernels"]
    assert kernels["machine"]["torch"] == torch.__version__ and kernels["machine"]["kernel_build_used"]
    assert kernels["attention"]["cpu float32 decode (M = 1)"]["path"] == "cpp"
    assert kernels["cpu_speedups"]["enabled"] is True


ZEBRA = {
    "needle": "The birds in the old barn are zebra finches.",
    "question": "What birds live in the old barn?",
    "real_needle": "zebra finches",
}


@pytest.mark.embedded
def test_span_missed_tests_count_as_zeros_like_the_published_script(tmp_path, embedded):
    """The published script scores a test whose span search fails (it returns (-1, -1)) with 0 for every
    head, counted when the answer passes the filter. SmolLM2 answers "zebra finches" but the reference rule
    cannot locate it (the first word splits differently alone): by default these tests run and count with
    zeros; the tolerant rule locates the span and the same answers then score heads; --span-miss skip
    leaves them out."""
    model, tok = embedded
    needles = tmp_path / "needles.jsonl"
    needles.write_text(json.dumps(ZEBRA) + "\n")
    kw = dict(needles=str(needles), min_len=400, max_len=400, num_lengths=1, num_depths=2, max_new_tokens=16)
    quiet = dict(model=model, tokenizer=tok, progress_bar=False, log=lambda *a, **k: None)
    zeros = run_detect(DetectConfig(**kw), tmp_path / "zeros" / "s.json", **quiet)
    assert zeros.record["skipped"] == [] and zeros.record["span_missed"] == ["n0-L400-d0", "n0-L400-d100"]
    counted = [e for e in zeros.results.values() if e["counted"]]
    assert counted, "SmolLM2 should answer this needle at 400 tokens"
    assert all(e["span"] is None and not any(map(any, e["copies"])) for e in zeros.results.values())
    assert all(len(v) == len(counted) and not any(v) for v in zeros.scores.values())

    tolerant = run_detect(DetectConfig(**kw, span_rule="tolerant"), tmp_path / "tol" / "s.json", **quiet)
    assert tolerant.record["span_missed"] == []
    by_key = {e["key"]: e for e in tolerant.results.values()}
    for e in zeros.results.values():  # the span never changes an answer
        assert by_key[e["key"]]["response"] == e["response"]
    assert max(max(v) for v in tolerant.scores.values()) > 0  # located, the same answers score heads

    with pytest.raises(DetectError, match="no test could run.*--span-miss zeros runs them"):
        run_detect(DetectConfig(**kw, span_miss="skip"), tmp_path / "skip" / "s.json", **quiet)


@pytest.mark.embedded
def test_a_run_stopped_while_plotting_resumes_to_the_plot(tmp_path, embedded, monkeypatch):
    """The progress file goes last: a run that fails (full disk, kill) while writing its heatmap resumes
    without running any test again (it used to delete the progress first, so --resume said "already
    finished" and only --overwrite, a rerun of every test, got the plot)."""
    import retmask.detect.run as detect_run
    from retmask.runfiles import OutputWriteError

    model, tok = embedded
    needles = tmp_path / "needles.jsonl"
    needles.write_text(json.dumps(ZEBRA) + "\n")
    cfg = DetectConfig(
        needles=str(needles), min_len=400, max_len=400, num_lengths=1, num_depths=2, max_new_tokens=16
    )
    quiet = dict(model=model, tokenizer=tok, progress_bar=False, log=lambda *a, **k: None)
    out, plot = tmp_path / "s.json", tmp_path / "s.png"

    def full_disk(matrix, path, **kw):
        raise OutputWriteError(f"cannot write {path}: No space left on device")

    with monkeypatch.context() as m:
        m.setattr(detect_run, "head_heatmap", full_disk)
        with pytest.raises(OutputWriteError):
            run_detect(cfg, out, plot=plot, **quiet)
    assert out.exists() and not plot.exists() and list(tmp_path.glob("s.json.progress*.json"))
    scores = out.read_text()

    def no_test(*args, **kwargs):
        raise AssertionError("a test ran again")

    monkeypatch.setattr(model, "forward", no_test)
    run_detect(cfg, out, plot=plot, resume=True, **quiet)
    assert plot.exists() and out.read_text() == scores and not list(tmp_path.glob("s.json.progress*.json"))


def test_hybrid_model_detects_end_to_end(tmp_path, monkeypatch):
    """A hybrid model (LFM2: convolution layers 0 and 2, attention layers 1 and 3) through the whole driver:
    scores for its 2 attention layers x 4 heads, the run record saying where those layers sit, and the
    heatmap labelled with them. A random model answers nothing, so every test is counted here
    (RECALL_THRESHOLD below 0) to reach the outputs of a counted run."""
    import transformers
    from transformers import AutoTokenizer

    import retmask
    import retmask.detect.run as detect_run
    from tests.hf.conftest import tiny_config
    from tests.hf.test_architectures import HYBRIDS

    tok = AutoTokenizer.from_pretrained(str(retmask.default_model_path()))
    monkeypatch.setenv("RETMASK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(detect_run, "RECALL_THRESHOLD", -1.0)
    torch.manual_seed(0)
    config = tiny_config(
        "lfm2", vocab_size=len(tok), max_position_embeddings=1024, pad_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, **HYBRIDS["lfm2"],
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="retmask").eval()
    cfg = DetectConfig(
        needles=str(needles_file(tmp_path, 1)), min_len=400, max_len=400, num_lengths=1, num_depths=2,
        max_new_tokens=4,
    )  # fmt: skip
    out, plot = tmp_path / "s.json", tmp_path / "heads.png"
    result = run_detect(
        cfg, out, plot=plot, model=model, tokenizer=tok, progress_bar=False, log=lambda *a: None
    )
    record = json.loads(out.with_name("s.run.json").read_text())
    assert record["attention_layers"] == [1, 3] and (record["layers"], record["query_heads"]) == (2, 4)
    assert sorted(json.loads(out.read_text())) == sorted(
        f"{layer}-{h}" for layer in range(2) for h in range(4)
    )
    assert record["tests_counted"] == 2 and all(len(s) == 2 for s in result.scores.values())
    assert plot.stat().st_size > 0
