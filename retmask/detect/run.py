"""The ``retmask detect`` driver: grid -> tests -> fast path in prefix order -> scores, record, resume."""

from __future__ import annotations

import hashlib
import itertools
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from retmask import kernels
from retmask.detect.answers import HistoryFn, answer_tests, earlier_answers, prefix_order
from retmask.detect.core import FastDetector
from retmask.detect.drafts import DRAFT_RULE
from retmask.detect.prefill_chunk import resolve_prefill_chunk
from retmask.detect.scores import StabilityTracker, format_summary, head_scores, mean_matrix, summarize
from retmask.detect.shard import cpu_oversubscription, dist_context, gather_results, shard
from retmask.detect.stopping import stop_token_ids
from retmask.errors import UsageError
from retmask.heads import model_shape
from retmask.hf.layers import head_layout
from retmask.hf.linears import decide_linears
from retmask.hf.loading import load_model, max_context, parse_dtype, peek_config
from retmask.model_files import files_stamp
from retmask.niah import (
    NiahTest,
    build_tests,
    load_haystack,
    load_needles,
    resolve_grid,
    resolve_prompt_style,
    split_runnable,
)
from retmask.plotting import head_heatmap
from retmask.runfiles import (
    JsonFile,
    RunLock,
    atomic_write_json,
    check_distinct_paths,
    check_fresh_or_resume,
    check_same_settings,
    check_writable,
)

RECALL_THRESHOLD = 0.5  # a test counts when ROUGE-1 recall > 50% (reference: score * 100 > 50)
PROGRESS_VERSION = 1


class DetectError(UsageError):
    """A detection that cannot give scores (no test counted), with the counts and what to change."""


@dataclass
class DetectConfig:
    """Everything that determines the result of a run (written into the run record)."""

    model: str | None = None  # hub id / folder / .gguf; None = the embedded SmolLM2-135M-Instruct
    gguf_file: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    needles: str | None = None  # JSONL; None = retmask/data/needles.jsonl
    haystack: str | None = None  # file or directory; None = the default prose haystack
    protocol: str = "default"
    min_len: int | None = None  # overrides of the protocol's grid
    max_len: int | None = None
    num_lengths: int | None = None
    num_depths: int | None = None
    max_new_tokens: int = 50
    # prefill chunk = granularity of KV-prefix reuse; None: the device's default (256 on a CPU, 4096 on a
    # GPU), resolved when the model is loaded, so the run record and the resume check hold the number
    chunk: int | None = None
    prefill_impl: str = "retmask"  # attention for the prefill (no argmax needed there): "retmask" or "sdpa"
    # fixed-shape verification passes, replayed from CUDA graphs on a GPU (speed only; detect/static_passes.py)
    static_passes: bool = False
    # Drafts may reuse the model's earlier answers to the same needle (speed only: answers stay greedy).
    # Processes then shard whole needles, so every test sees the same earlier answers in any launch.
    draft_history: bool = True
    until_stable: bool = False
    patience: int = 20  # --until-stable: consecutive counted tests without change of the τ-set and top-10
    seed: int = 0
    prompt_style: str = "auto"  # "auto" | "base" | "chat"; the run record holds the resolved one
    # "reference" (the published rule) or "tolerant" (also the answer tokenised mid-sentence when the
    # reference misses; same span and scores wherever the reference finds one)
    span_rule: str = "reference"
    # a test whose needle span is not found: "zeros" (runs; every head scores 0 on it when its answer
    # passes the filter, as in the published script) or "skip" (left out of the means)
    span_miss: str = "zeros"

    def grid(self) -> tuple[list[int], list[int]]:
        return resolve_grid(
            self.protocol, min_len=self.min_len, max_len=self.max_len,
            num_lengths=self.num_lengths, num_depths=self.num_depths,
        )  # fmt: skip


@dataclass
class DetectResult:
    scores: dict  # {"<layer>-<head>": [per counted test]}
    summary: dict
    record: dict
    results: dict[int, dict] = field(default_factory=dict)  # per test index


def check_context_limit(model, lengths: list[int], max_new_tokens: int) -> None:
    """Refuse a grid whose longest test cannot fit the model (a model or its config), before any test is
    built or run."""
    limit = max_context(model)
    if limit is not None and max(lengths) + max_new_tokens > limit:
        raise ValueError(
            f"context length {max(lengths)} (+{max_new_tokens} new tokens) exceeds the model's maximum of "
            f"{limit} tokens (max_position_embeddings); lower --max-len to at most {limit - max_new_tokens} "
            "or use a long-context model"
        )


def _fingerprint(
    cfg: DetectConfig, model, needles, haystack_text: str, lengths, depths, prompt_style: str
) -> dict:
    return {
        "model": cfg.model or "embedded:SmolLM2-135M-Instruct",
        "gguf_file": cfg.gguf_file,
        "dtype": cfg.dtype,
        "model_name_or_path": str(getattr(model.config, "name_or_path", "")),
        **files_stamp(
            cfg.model, cfg.gguf_file
        ),  # a model folder changed since the run began is another model
        "needles": [n.to_dict() for n in needles],
        "haystack_sha256": hashlib.sha256(haystack_text.encode("utf-8")).hexdigest(),
        "lengths": lengths,
        "depths": depths,
        "max_new_tokens": cfg.max_new_tokens,
        "chunk": cfg.chunk,
        "draft_history": cfg.draft_history,
        "prompt_style": prompt_style,  # resolved: "base" or "chat"
        # only when not the default, so progress files of runs started before the option still resume
        **({"span_rule": cfg.span_rule} if cfg.span_rule != "reference" else {}),
        **({"span_miss": cfg.span_miss} if cfg.span_miss != "zeros" else {}),
    }


def _test_entry(t: NiahTest, needles) -> dict:
    return {
        "index": t.index,
        "key": t.key,
        "needle_index": t.needle_index,
        "needle": needles[t.needle_index].needle,
        "length": t.length,
        "depth": t.depth,
        "insertion": t.insertion,
        "prompt_tokens": int(len(t.prompt_ids)),
        "span": list(t.span) if t.span else None,
        "answer_tokens": len(t.answer_ids),
        **({"answer_form": t.meta["answer_form"]} if "answer_form" in t.meta else {}),
    }


class DetectEta:
    """Time left in a detection. Tests run in prefix order, so a test computes only the part of its prompt
    past the (chunk-aligned) prefix it shares with the previous test: the first test pays a whole prefill,
    most later ones a fraction. Left = (prompt tokens still to compute) x (prefill seconds per token so far)
    + (tests left) x (mean decode seconds so far). A per-test average would be several times too high at the
    start. (``--until-stable`` may stop before the end.)"""

    def __init__(self, todo: list[NiahTest], chunk: int):
        self.estimate: dict[int, int] = {}
        prev = None
        for t in todo:
            prefix = np.asarray(t.prompt_ids[:-1])
            keep = 0
            if prev is not None:
                m = min(len(prev), len(prefix))
                diff = np.flatnonzero(prev[:m] != prefix[:m])
                keep = ((int(diff[0]) if diff.size else m) // chunk) * chunk
            self.estimate[t.index] = len(prefix) - keep
            prev = prefix
        self.tokens_left = sum(self.estimate.values())
        self.tests_left = len(todo)
        self.prefill_tokens = self.prefill_s = self.decode_s = 0.0
        self.tests = 0

    def update(self, test: NiahTest, outcome) -> None:
        self.tokens_left -= self.estimate.get(test.index, 0)
        self.tests_left -= 1
        self.tests += 1
        self.prefill_tokens += outcome.prefill_tokens
        self.prefill_s += outcome.timings.get("prefill_s", 0.0)
        self.decode_s += outcome.timings.get("decode_s", 0.0)

    def seconds(self) -> float | None:
        """Estimated seconds left (None before the first test)."""
        if not self.tests:
            return None
        per_token = self.prefill_s / max(self.prefill_tokens, 1.0)
        return max(0.0, self.tokens_left) * per_token + self.tests_left * self.decode_s / self.tests


def run_tests(
    detector: FastDetector,
    tokenizer,
    tests: list[NiahTest],
    needles,
    done: dict[int, dict],
    on_result=None,
    tracker: StabilityTracker | None = None,
    progress_bar: bool = True,
    history_of: HistoryFn | None = None,
) -> dict[int, dict]:
    """Run ``tests`` (already in prefix order) that are not in ``done``; ``on_result(done)`` after each
    (progress writing); ``history_of(t)``: earlier answers for the drafts (``earlier_answers``). The bar
    counts this process's tests, done ones included; ``passed_filter`` = tests whose answer passed the
    ROUGE-1 filter so far (only those are counted in the scores); ``eta`` = :class:`DetectEta`."""
    todo = [t for t in tests if t.index not in done]
    bar = tqdm(
        total=len(tests), initial=len(tests) - len(todo), desc="detect", unit="test", disable=not progress_bar,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} tests [{elapsed}{postfix}]",
    )  # fmt: skip
    eta = DetectEta(todo, detector.chunk)
    # Lazy: the stability check runs before each next test is answered.
    unstable = itertools.takewhile(lambda _: tracker is None or not tracker.stable, todo)
    for ans in answer_tests(detector, tokenizer, unstable, needles, history_of):
        t, out = ans.test, ans.outcome
        counted = ans.recall > RECALL_THRESHOLD
        done[t.index] = _test_entry(t, needles) | {
            "order": len(done),
            "response": ans.response,
            "tokens": out.tokens,
            "rouge1_recall": ans.recall,
            "counted": counted,
            "copies": out.copies.astype(int).tolist(),
            "passes": out.passes,
            "prefill_tokens_computed": out.prefill_tokens,
            **{k: round(v, 4) for k, v in out.timings.items()},
        }
        if tracker is not None and counted:
            tracker.update(out.copies / len(t.answer_ids))
        if on_result is not None:
            on_result(done)
        eta.update(t, out)
        left = eta.seconds()
        bar.set_postfix_str(
            (f"eta {tqdm.format_interval(left)}, " if left is not None and eta.tests_left else "")
            + f"passed_filter={sum(e['counted'] for e in done.values())}, L={t.length}, d={t.depth}",
            refresh=False,
        )
        bar.update(1)
    bar.close()
    return done


def _progress_entry(
    f: JsonFile, key: str, entry: object, test: NiahTest, shape: tuple[int, int], max_new_tokens: int
) -> dict:
    """One finished test of a progress file, checked against the test it claims to be: what the scores,
    the run record, the drafts and ``--until-stable`` read from it must be there and consistent, so an
    edited entry is refused here instead of resuming to wrong scores."""
    at = f"results[{key!r}]"
    e = f.expect(entry, dict, at)
    if f.key(e, "index", int, at) != test.index or f.key(e, "key", str, at) != test.key:
        f.fail(f"{at} is test {e['index']} ({e['key']!r}), not test {test.index} ({test.key!r})")
    if f.key(e, "answer_tokens", int, at) != len(test.answer_ids):
        f.fail(
            f"{at}.answer_tokens is {e['answer_tokens']}, but the test's answer has {len(test.answer_ids)} tokens"
        )
    f.number(f.key(e, "order", int, at), f"{at}.order", integer=True, lo=0)
    f.key(e, "response", str, at)
    recall = f.number(f.key(e, "rouge1_recall", float, at), f"{at}.rouge1_recall", lo=0, hi=1)
    if f.key(e, "counted", bool, at) != (recall > RECALL_THRESHOLD):
        f.fail(f"{at}.counted is {e['counted']} but its recall {recall} says otherwise")
    tokens = f.key(e, "tokens", list, at)
    if not 1 <= len(tokens) <= max_new_tokens:
        f.fail(
            f"{at}.tokens holds {len(tokens)} tokens; an answer has 1 to {max_new_tokens} (--max-new-tokens)"
        )
    for i, t in enumerate(tokens):
        f.number(t, f"{at}.tokens[{i}]", integer=True, lo=0)
    # copies: one count per [layer][head], at most one per answer token (the per-head score's numerator)
    rows = f.key(e, "copies", list, at)
    if len(rows) != shape[0] or any(not isinstance(r, list) or len(r) != shape[1] for r in rows):
        f.fail(
            f"{at}.copies must be {shape[0]} lists (layers) of {shape[1]} counts (query heads) for this model"
        )
    for layer, row in enumerate(rows):
        for h, c in enumerate(row):
            f.number(c, f"{at}.copies[{layer}][{h}]", integer=True, lo=0, hi=len(tokens))
    return e


def _resumed_results(
    out: Path, fingerprint: dict, runnable: list[NiahTest], shape: tuple[int, int], max_new_tokens: int
) -> dict[int, dict]:
    """Finished tests of earlier runs on ``out``, single- or multi-process (one progress file per rank);
    refuses progress written with other settings, and progress that does not fit this grid and model
    (keys that are not runnable tests, entries of the wrong shape: :func:`_progress_entry`)."""
    done: dict[int, dict] = {}
    source: dict[int, Path] = {}
    by_index = {t.index: t for t in runnable}
    for path in sorted(out.parent.glob(out.name + ".progress*.json")):
        f = JsonFile(path, "detect progress file", "delete it to start over, or pass --overwrite")
        state = f.expect(f.read(), dict, "the file")
        saved = f.expect(state.get("fingerprint"), (dict, type(None)), "'fingerprint'")
        check_same_settings(
            {"version": state.get("version"), **(saved or {})},
            {"version": PROGRESS_VERSION, **fingerprint},
            path=path,
        )
        results = f.key(state, "results", dict)
        if len(results) > len(by_index):
            f.fail(f"it holds {len(results)} finished tests, but the grid has {len(by_index)} runnable tests")
        for key, entry in results.items():
            index = f.index_key(key, "results")
            if index not in by_index:
                f.fail(
                    f"results holds test {index}, which is not a runnable test of this grid (indices "
                    f"{min(by_index, default=0)}..{max(by_index, default=-1)}, skipped tests excluded)"
                )
            e = _progress_entry(f, key, entry, by_index[index], shape, max_new_tokens)
            if index in done and done[index] != e:  # one test in two ranks' files, differently
                f.fail(f"test {index} is also in {source[index]}, with other results")
            done[index], source[index] = e, path
    return done


def _stability_tracker(
    cfg: DetectConfig, shape: tuple[int, int], runnable: list[NiahTest], done: dict[int, dict]
) -> StabilityTracker | None:
    """``--until-stable``: a tracker with the resumed tests replayed in their processing order."""
    if not cfg.until_stable:
        return None
    tracker = StabilityTracker(shape, patience=cfg.patience)
    by_index = {t.index: t for t in runnable}
    for e in sorted(done.values(), key=lambda e: e["order"]):
        if e["counted"]:
            tracker.update(np.asarray(e["copies"]) / len(by_index[e["index"]].answer_ids))
    return tracker


def environment() -> dict[str, str]:
    """Versions that decide a run's numbers besides its config: Python, the libraries that tokenise and
    compute, retmask itself, and the GPU where one ran."""
    import platform

    from retmask.requirements import installed_version

    env = {"python": platform.python_version()}
    for name in ("retmask", "torch", "transformers", "tokenizers", "triton"):
        if (version := installed_version(name)) is not None:
            env[name] = version
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def _run_record(
    cfg: DetectConfig,
    fingerprint: dict,
    shape: tuple[int, int],
    tests: list[NiahTest],
    done: dict[int, dict],
    summary: dict,
    tracker: StabilityTracker | None,
    timings: dict[str, float],
) -> dict:
    """The run record (``<out stem>.run.json``): settings, grid, skipped tests, summary, timings and every
    test's response and recall (the per-head copies are in the scores file)."""
    runnable, skipped = split_runnable(tests, cfg.span_miss)
    return {
        "config": asdict(cfg),
        "model": fingerprint["model"],
        "model_name_or_path": fingerprint["model_name_or_path"],
        "layers": shape[0],
        "query_heads": shape[1],
        "protocol": cfg.protocol,
        "prompt_style": fingerprint["prompt_style"],  # resolved ("base" / "chat"); config has the request
        "grid": {
            "lengths": fingerprint["lengths"],
            "depths": fingerprint["depths"],
            "needles": len(fingerprint["needles"]),
            "tests": len(tests),
        },
        "needles": fingerprint["needles"],
        "haystack_sha256": fingerprint["haystack_sha256"],
        "environment": environment(),
        "skipped": [
            {
                "key": t.key,
                "length": t.length,
                "depth": t.depth,
                "needle_index": t.needle_index,
                "reason": t.skip_reason,
            }
            for t in skipped
        ],  # fmt: skip
        # tests that ran although their needle span was not found (--span-miss zeros): 0 for every head
        "span_missed": [t.key for t in runnable if t.span_missed],
        "tests_run": len(done),
        "tests_counted": sum(bool(e["counted"]) for e in done.values()),
        # how drafts were proposed: it decides each test's passes (not its answer), see bench/replay_drafts.py
        "draft_rule": DRAFT_RULE,
        "until_stable": None
        if tracker is None
        else {"stable": tracker.stable, "patience": tracker.patience, "counted_tests_used": tracker.count},
        "summary": summary,
        "timings": {k: round(v, 3) for k, v in timings.items()},
        # the machine, and the path each kind of call took on it (CPU speed-ups and their decisions included)
        "kernels": kernels.describe(),
        "tests": [
            {k: v for k, v in e.items() if k != "copies"}
            for e in sorted(done.values(), key=lambda e: e["index"])
        ],
    }


def record_path(out: Path) -> Path:
    """``<out stem>.run.json``: the run record next to the scores file."""
    return out.with_name(out.stem + ".run.json")


def progress_path(out: Path, rank: int = 0, world: int = 1) -> Path:
    """``<out>.progress.json`` (one process) or ``<out>.progress.rank<N>.json`` (process N of several)."""
    return out.with_name(out.name + (".progress.json" if world == 1 else f".progress.rank{rank}.json"))


def _progress_files(out: Path) -> list[Path]:
    """The progress files of an unfinished run on ``out`` (one per process); a finished run deletes them."""
    return sorted(out.parent.glob(out.name + ".progress*.json"))


def _earlier_run_files(out: Path) -> list[Path]:
    """What an earlier detection on ``out`` left: scores, run record, progress of any process count."""
    return [out, record_path(out), *sorted(out.parent.glob(out.name + ".progress*.json"))]


# the flags of `retmask detect` that the no-test messages suggest; a caller with other names (the pipeline's
# --detect-max-len) passes its own, and None for a setting it has no flag for (the suggestion is left out)
DETECT_FLAGS = {"min_len": "--min-len", "max_len": "--max-len", "max_new_tokens": "--max-new-tokens",
                "needles": "--needles", "span_rule": "--span-rule", "span_miss": "--span-miss"}  # fmt: skip


def _nothing_counted(
    tests: list[NiahTest],
    runnable: list[NiahTest],
    done: dict[int, dict],
    record: str,
    span_rule: str = "reference",
    span_miss: str = "zeros",
    flags: Mapping[str, str | None] | None = None,
) -> str:
    """Why a detection has no counted test, with the counts and what to change (``flags``: the caller's
    names for ``DETECT_FLAGS``' settings)."""
    flag = {**DETECT_FLAGS, **(flags or {})}
    if not runnable:
        short = [t for t in tests if t.insertion < 0]
        parts = []
        if short:
            parts.append(
                f"{len(short)} with a context too short for the needle and its buffer (e.g. {short[-1].skip_reason})"
            )
        if len(short) < len(tests):
            parts.append(
                f"{len(tests) - len(short)} whose needle answer is not found in the prompt (span rule"
                + (f"; try {flag['span_rule']} tolerant" if span_rule == "reference" and flag["span_rule"] else "")
                + (f"; {flag['span_miss']} zeros runs them)" if span_miss == "skip" and flag["span_miss"] else ")")
            )  # fmt: skip
        fixes = [f"raise {flag['min_len']}/{flag['max_len']}"]
        if flag["needles"]:
            fixes.append(f"check {flag['needles']}")
        return f"no test could run: all {len(tests)} tests were skipped: {'; '.join(parts)}; {' or '.join(fixes)}"
    best = max((e["rouge1_recall"] for e in done.values()), default=0.0)
    skipped = len(tests) - len(runnable)
    return (
        f"no test counted: none of the {len(done)} answers passed the ROUGE-1 filter (recall > "
        f"{RECALL_THRESHOLD}; best recall {best:.2f})"
        + (f", and {skipped} of {len(tests)} tests were skipped" if skipped else "")
        + f"; the model does not retrieve the needles at lengths {sorted({t.length for t in runnable})}: try "
        f"shorter contexts ({flag['max_len']}), "
        + (f"more {flag['max_new_tokens']}, " if flag["max_new_tokens"] else "")
        + f"or another model (answers: {record})"
    )


def run_detect(
    cfg: DetectConfig,
    out: str | Path | None = None,
    *,
    plot: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    model=None,
    tokenizer=None,
    progress_bar: bool = True,
    log=print,
    flags: Mapping[str, str | None] | None = None,
) -> DetectResult:
    """Run a detection end to end. Writes ``out`` (scores JSON), ``<out stem>.run.json`` (run record),
    ``<out>.progress.json`` (progress, atomically after each test; deleted when the run completes, so only
    an unfinished run leaves one) and ``plot`` (heatmap PNG) if given.

    Before any work: the outputs must be writable; files of an earlier run on ``out`` are continued
    (``resume``), deleted (``overwrite``) or refused; one process at a time writes ``out`` (a lock; with
    several processes, rank 0 holds the one on ``out`` and every other rank one on its progress file). A
    detection in which no test counted raises :class:`DetectError` (the run record is still written), whose
    message suggests the flags of ``DETECT_FLAGS`` under the caller's names in ``flags``."""
    if out is None:
        return _run_detect(cfg, None, plot, resume, model, tokenizer, progress_bar, log, flags)
    out = Path(out)
    check_distinct_paths({"the scores file": out, "the run record": record_path(out), "the plot": plot})
    for path, what in ((out, "scores file"), (record_path(out), "run record")):
        check_writable(path, what=what)
    if plot is not None:
        check_writable(plot, what="plot")
    if resume and overwrite:
        check_fresh_or_resume([], resume=resume, overwrite=overwrite)
    rank, world = dist_context()
    with RunLock(out if rank == 0 else progress_path(out, rank, world)):
        if resume and out.exists() and record_path(out).exists() and not _progress_files(out):
            raise DetectError(
                f"the detection on {out} already finished ({out.name} and {record_path(out).name} exist, no "
                "progress file): nothing to resume; pass --overwrite to run it again"
            )
        check_fresh_or_resume(
            _earlier_run_files(out), resume=resume, overwrite=overwrite, remove=rank == 0,
            what=f"an earlier detection on {out.name}",
        )  # fmt: skip
        if world > 1:
            import torch.distributed as dist

            # every rank has checked (and rank 0, with --overwrite, removed) the earlier files before any
            # rank writes progress: a fast rank 0 must not make a slow rank see "an earlier run"
            dist.barrier()
        return _run_detect(cfg, out, plot, resume, model, tokenizer, progress_bar, log, flags)


def _run_detect(cfg, out, plot, resume, model, tokenizer, progress_bar, log, flags) -> DetectResult:
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    lengths, depths = cfg.grid()
    needles = load_needles(cfg.needles)
    haystack_text = load_haystack(cfg.haystack)
    if model is None:
        config = peek_config(cfg.model, cfg.gguf_file)
        if config is not None:  # a grid too long for the model fails before its weights load
            check_context_limit(config, lengths, cfg.max_new_tokens)
        model, tokenizer = load_model(
            cfg.model, gguf_file=cfg.gguf_file, dtype=parse_dtype(cfg.dtype, cfg.device), device=cfg.device
        )
    check_context_limit(model, lengths, cfg.max_new_tokens)
    shape = model_shape(model)
    cfg = replace(cfg, chunk=resolve_prefill_chunk(cfg.chunk, model.device))

    rank, world = dist_context()
    if world > 1 and model.device.type == "cpu" and rank == 0:
        warning = cpu_oversubscription(torch.get_num_threads())
        if warning:
            log(warning, file=sys.stderr)
    if world > 1 and cfg.until_stable:
        raise ValueError(
            "--until-stable needs one process (the order of tests matters); drop it or run without torchrun"
        )
    progress_file = progress_path(out, rank, world) if out is not None else None
    style = resolve_prompt_style(tokenizer, cfg.prompt_style)
    fingerprint = _fingerprint(cfg, model, needles, haystack_text, lengths, depths, style)

    t0 = time.perf_counter()
    tests = build_tests(
        tokenizer, needles, haystack_text, lengths, depths, chat=style == "chat", span_rule=cfg.span_rule
    )
    build_s = time.perf_counter() - t0
    runnable, skipped = split_runnable(tests, cfg.span_miss)
    for t in skipped:
        log(
            f"skipped test {t.key} (needle {t.needle_index}, length {t.length}, depth {t.depth}): {t.skip_reason}",
            file=sys.stderr,
        )
    missed = [t for t in runnable if t.span_missed]
    if missed:
        log(
            f"{len(missed)} test(s) whose needle answer is not found in the prompt (e.g. {missed[0].key}) run and "
            "score 0 for every head when their answer passes the filter, as in the published script; "
            "--span-miss skip leaves them out"
            + (
                ", --span-rule tolerant also tries the answer tokenised mid-sentence"
                if cfg.span_rule == "reference"
                else ""
            ),
            file=sys.stderr,
        )

    done = (
        _resumed_results(out, fingerprint, runnable, shape, cfg.max_new_tokens)
        if (resume and out is not None)
        else {}
    )
    if done:
        log(f"resuming: {len(done)} of {len(runnable)} tests already done", file=sys.stderr)
    tracker = _stability_tracker(cfg, shape, runnable, done)

    def save(d):
        if progress_file is not None:
            atomic_write_json(
                progress_file, {"version": PROGRESS_VERSION, "fingerprint": fingerprint, "results": d}
            )

    # Every case of the model's CPU linears decided now (read from this machine's cache, or measured once):
    # otherwise the first pass of each new row count measures one inside a test's time and the ETA.
    decide_linears(model)
    detector = FastDetector(
        model,
        stop_token_ids(tokenizer, model),
        cfg.max_new_tokens,
        cfg.chunk,
        prefill_impl=cfg.prefill_impl,
        static_passes=cfg.static_passes,
    )
    t0 = time.perf_counter()
    ordered = prefix_order(runnable)
    mine = shard([t for t in ordered if t.index not in done], rank, world, by_needle=cfg.draft_history)
    n_needles = len({t.needle_index for t in runnable})
    if world > 1 and cfg.draft_history and rank == 0 and world > n_needles:
        log(
            f"{world} processes but only {n_needles} needles: with draft "
            "history on, processes get whole needles and some will idle; pass --no-draft-history to shard "
            "single tests instead",
            file=sys.stderr,
        )
    history_of = earlier_answers(ordered, done) if cfg.draft_history else None
    done = run_tests(
        detector, tokenizer, mine, needles, done, save, tracker, progress_bar and rank == 0, history_of
    )
    run_s = time.perf_counter() - t0
    done = gather_results(done, world)

    counted = sorted((e for e in done.values() if e["counted"]), key=lambda e: e["index"])
    scores = head_scores(
        [np.asarray(e["copies"]) for e in counted], [e["answer_tokens"] for e in counted], shape
    )
    summary = summarize(scores, shape)
    timings = {"build_tests_s": build_s, "tests_s": run_s, "total_s": time.perf_counter() - t_start}
    record = _run_record(cfg, fingerprint, shape, tests, done, summary, tracker, timings)
    record["processes"] = world
    layout = head_layout(model)
    if layout.hybrid:  # the score rows are its attention layers; where they sit among all its layers
        record["attention_layers"] = list(layout.layer_ids)
    if not counted:
        if rank == 0 and out is not None:
            atomic_write_json(record_path(out), record)  # the answers show why nothing counted
        raise DetectError(
            _nothing_counted(
                tests,
                runnable,
                done,
                str(record_path(out)) if out else "the run record",
                cfg.span_rule,
                cfg.span_miss,
                flags,
            )
        )
    if rank != 0:  # rank 0 writes the outputs
        return DetectResult(scores, summary, record, done)
    if out is not None:
        atomic_write_json(out, scores)
        atomic_write_json(record_path(out), record)
    if plot is not None:
        head_heatmap(
            mean_matrix(scores, shape),
            plot,
            title=f"retrieval scores: {fingerprint['model']} ({len(counted)} tests)",
            layer_ids=layout.layer_ids if layout.hybrid else None,
        )
    if out is not None:  # last: a run killed (or out of disk) before this point resumes to write the rest
        for path in out.parent.glob(out.name + ".progress*.json"):  # every process's: the run is complete
            path.unlink(missing_ok=True)
    log(format_summary(summary, total_tests=len(done)))
    return DetectResult(scores, summary, record, done)
