"""The ``retmask detect`` driver: grid -> tests -> fast path in prefix order -> scores, record, resume."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from retmask.niah import (
    PROTOCOLS,
    NiahTest,
    build_tests,
    depth_grid,
    length_grid,
    load_haystack,
    load_needles,
    rouge1_recall,
)

from .core import FastDetector, _layout
from .scores import StabilityTracker, format_summary, head_scores, mean_matrix, summarize
from .shard import dist_context, gather_results, shard
from .stopping import stop_token_ids

RECALL_THRESHOLD = 0.5  # a test counts when ROUGE-1 recall > 50% (reference: score * 100 > 50)
PROGRESS_VERSION = 1


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
    chunk: int = 256  # prefill chunk = granularity of KV-prefix reuse
    prefill_impl: str = "retmask"  # attention for the prefill (no argmax needed there): "retmask" or "sdpa"
    # Drafts may reuse the model's earlier answers to the same needle (speed only: answers stay greedy).
    # Processes then shard whole needles, so every test sees the same earlier answers in any launch.
    draft_history: bool = True
    until_stable: bool = False
    patience: int = 20  # --until-stable: consecutive counted tests without change of the τ-set and top-10
    seed: int = 0

    def grid(self) -> tuple[list[int], list[int]]:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {self.protocol!r}; choose one of {sorted(PROTOCOLS)}")
        p = PROTOCOLS[self.protocol]
        lo = p.min_len if self.min_len is None else self.min_len
        hi = p.max_len if self.max_len is None else self.max_len
        nl = p.num_lengths if self.num_lengths is None else self.num_lengths
        nd = p.num_depths if self.num_depths is None else self.num_depths
        if nl < 1 or nd < 1 or hi < lo:
            raise ValueError(f"empty grid: lengths {lo}..{hi} x {nl}, depths x {nd}; check the grid flags")
        return length_grid(lo, hi, nl), depth_grid(nd)


@dataclass
class DetectResult:
    scores: dict  # {"<layer>-<head>": [per counted test]}
    summary: dict
    record: dict
    results: dict[int, dict] = field(default_factory=dict)  # per test index


def _dtype(name: str) -> torch.dtype:
    table = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float64": torch.float64,
    }
    if name not in table:
        raise ValueError(f"--dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


def max_context(model) -> int | None:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(cfg, "max_position_embeddings", None)


def check_context_limit(model, lengths: list[int], max_new_tokens: int) -> None:
    """Refuse a grid whose longest test cannot fit the model, before any test is built or run."""
    limit = max_context(model)
    if limit is not None and max(lengths) + max_new_tokens > limit:
        raise ValueError(
            f"context length {max(lengths)} (+{max_new_tokens} new tokens) exceeds the model's maximum of "
            f"{limit} tokens (max_position_embeddings); lower --max-len to at most {limit - max_new_tokens} "
            "or use a long-context model"
        )


def atomic_write_json(path: Path, obj) -> None:
    """Write JSON so that a crash (kill -9) leaves either the old or the new file, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fingerprint(cfg: DetectConfig, model, needles, haystack_text: str, lengths, depths) -> dict:
    return {
        "model": cfg.model or "embedded:SmolLM2-135M-Instruct",
        "gguf_file": cfg.gguf_file,
        "dtype": cfg.dtype,
        "model_name_or_path": str(getattr(model.config, "_name_or_path", "")),
        "needles": [n.to_dict() for n in needles],
        "haystack_sha256": hashlib.sha256(haystack_text.encode("utf-8")).hexdigest(),
        "lengths": lengths,
        "depths": depths,
        "max_new_tokens": cfg.max_new_tokens,
        "chunk": cfg.chunk,
        "draft_history": cfg.draft_history,
    }


def prefix_order(tests: list[NiahTest]) -> list[NiahTest]:
    """Tests sorted by their prompt ids, lexicographically: neighbours share the longest prefixes, so the
    carried KV cache computes every distinct prefix (trie node) about once."""
    return sorted(tests, key=lambda t: (t.prompt_ids.astype(">u4").tobytes(), t.index))


HistoryFn = Callable[[NiahTest], list[list[int]]]


def earlier_answers(ordered: list[NiahTest], done: dict[int, dict]) -> HistoryFn:
    """``history_of(t)``: the answers (token lists) of the tests of ``t``'s needle that come before ``t`` in
    ``ordered`` (the prefix order of all runnable tests), read from ``done`` when asked.

    Tests run in that order and processes get whole needles (``shard(..., by_needle=True)``), so when a
    test runs, every earlier test of its needle is done -- in this process or in the run being resumed --
    and the history, hence every verification pass's shape, is the same for any process count or resume
    point. (A missing earlier answer would only shorten the history: the answer stays the greedy one.)"""
    seen: dict[int, list[int]] = {}  # needle -> indices of its tests so far in ``ordered``
    before: dict[int, list[int]] = {}  # test index -> indices of the earlier tests of its needle
    for t in ordered:
        earlier = seen.setdefault(t.needle_index, [])
        before[t.index] = list(earlier)
        earlier.append(t.index)

    def history_of(t: NiahTest) -> list[list[int]]:
        return [done[i]["tokens"] for i in before.get(t.index, []) if i in done]

    return history_of


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
    }


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
    counts this process's tests, done ones included."""
    from tqdm import tqdm

    todo = [t for t in tests if t.index not in done]
    bar = tqdm(
        total=len(tests), initial=len(tests) - len(todo), desc="detect", unit="test", disable=not progress_bar
    )
    for t in todo:
        if tracker is not None and tracker.stable:
            break
        nd = needles[t.needle_index]
        out = detector.run(t.prompt_ids, t.span, history_of(t) if history_of is not None else ())
        response = tokenizer.decode(out.tokens, skip_special_tokens=True).strip()
        recall = rouge1_recall(nd.real_needle, response)
        counted = recall > RECALL_THRESHOLD
        entry = _test_entry(t, needles) | {
            "order": len(done),
            "response": response,
            "tokens": out.tokens,
            "rouge1_recall": recall,
            "counted": counted,
            "copies": out.copies.astype(int).tolist(),
            "passes": out.passes,
            "prefill_tokens_computed": out.prefill_tokens,
            **{k: round(v, 4) for k, v in out.timings.items()},
        }
        done[t.index] = entry
        if tracker is not None and counted:
            tracker.update(out.copies / len(t.answer_ids))
        if on_result is not None:
            on_result(done)
        bar.update(1)
        bar.set_postfix(counted=sum(e["counted"] for e in done.values()), L=t.length, d=t.depth)
    bar.close()
    return done


def run_detect(
    cfg: DetectConfig,
    out: str | Path | None = None,
    *,
    plot: str | Path | None = None,
    resume: bool = False,
    model=None,
    tokenizer=None,
    progress_bar: bool = True,
    log=print,
) -> DetectResult:
    """Run a detection end to end. Writes ``out`` (scores JSON), ``<out stem>.run.json`` (run record),
    ``<out>.progress.json`` (progress, atomically after each test) and ``plot`` (heatmap PNG) if given."""
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    lengths, depths = cfg.grid()
    needles = load_needles(cfg.needles)
    haystack_text = load_haystack(cfg.haystack)
    if model is None:
        from retmask.models import load_model

        model, tokenizer = load_model(
            cfg.model, gguf_file=cfg.gguf_file, dtype=_dtype(cfg.dtype), device=cfg.device
        )
    check_context_limit(model, lengths, cfg.max_new_tokens)
    shape = _layout(model)

    rank, world = dist_context()
    if world > 1 and cfg.until_stable:
        raise ValueError(
            "--until-stable needs one process (the order of tests matters); drop it or run without torchrun"
        )
    out = Path(out) if out is not None else None
    suffix = ".progress.json" if world == 1 else f".progress.rank{rank}.json"
    progress_path = out.with_name(out.name + suffix) if out is not None else None
    fingerprint = _fingerprint(cfg, model, needles, haystack_text, lengths, depths)

    t0 = time.perf_counter()
    tests = build_tests(tokenizer, needles, haystack_text, lengths, depths)
    build_s = time.perf_counter() - t0
    skipped = [t for t in tests if t.skip_reason]
    for t in skipped:
        log(
            f"skipped test {t.key} (needle {t.needle_index}, length {t.length}, depth {t.depth}): {t.skip_reason}",
            file=sys.stderr,
        )
    runnable = [t for t in tests if not t.skip_reason]

    done: dict[int, dict] = {}
    # Progress of earlier runs, single- or multi-process (one file per rank).
    for path in sorted(out.parent.glob(out.name + ".progress*.json")) if (resume and out is not None) else []:
        state = json.loads(path.read_text())
        if state.get("version") != PROGRESS_VERSION or state.get("fingerprint") != fingerprint:
            raise ValueError(
                f"--resume: {path} was written by a run with other settings (model, needles, haystack, "
                "grid or max-new-tokens differ); rerun with the same flags, or drop --resume to start over"
            )
        done.update({int(k): v for k, v in state["results"].items()})
    if done:
        log(f"resuming: {len(done)} of {len(runnable)} tests already done", file=sys.stderr)

    tracker = None
    if cfg.until_stable:
        tracker = StabilityTracker(shape, patience=cfg.patience)
        by_index = {t.index: t for t in runnable}
        for e in sorted(done.values(), key=lambda e: e["order"]):  # replay in processing order
            if e["counted"]:
                tracker.update(np.asarray(e["copies"]) / len(by_index[e["index"]].answer_ids))

    def save(d):
        if progress_path is not None:
            atomic_write_json(
                progress_path, {"version": PROGRESS_VERSION, "fingerprint": fingerprint, "results": d}
            )

    detector = FastDetector(
        model, stop_token_ids(tokenizer, model), cfg.max_new_tokens, cfg.chunk, prefill_impl=cfg.prefill_impl
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
    record = {
        "config": asdict(cfg),
        "model": fingerprint["model"],
        "model_name_or_path": fingerprint["model_name_or_path"],
        "layers": shape[0],
        "query_heads": shape[1],
        "protocol": cfg.protocol,
        "grid": {"lengths": lengths, "depths": depths, "needles": len(needles), "tests": len(tests)},
        "needles": [n.to_dict() for n in needles],
        "haystack_sha256": fingerprint["haystack_sha256"],
        "skipped": [
            {
                "key": t.key,
                "length": t.length,
                "depth": t.depth,
                "needle_index": t.needle_index,
                "reason": t.skip_reason,
            }
            for t in skipped
        ],
        "tests_run": len(done),
        "tests_counted": len(counted),
        "until_stable": None
        if tracker is None
        else {"stable": tracker.stable, "patience": tracker.patience, "counted_tests_used": tracker.count},
        "summary": summary,
        "timings": {
            "build_tests_s": round(build_s, 3),
            "tests_s": round(run_s, 3),
            "total_s": round(time.perf_counter() - t_start, 3),
        },
        "tests": [
            {k: v for k, v in e.items() if k != "copies"}
            for e in sorted(done.values(), key=lambda e: e["index"])
        ],
    }
    record["processes"] = world
    if rank != 0:  # rank 0 writes the outputs
        return DetectResult(scores, summary, record, done)
    if out is not None:
        atomic_write_json(out, scores)
        atomic_write_json(out.with_name(out.stem + ".run.json"), record)
    if plot is not None:
        from retmask.plotting import head_heatmap

        head_heatmap(
            mean_matrix(scores, shape),
            plot,
            title=f"retrieval scores: {fingerprint['model']} ({len(counted)} tests)",
        )
    log(format_summary(summary))
    return DetectResult(scores, summary, record, done)
