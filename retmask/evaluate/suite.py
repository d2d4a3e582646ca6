"""``retmask eval``: before/after comparison of models on a synthetic long-context suite.

Per model (each loaded with ``retmask.load_model``, retmask attention, no head masked):

* **NIAH grid** (ROUGE-1 recall per length × depth; ``retmask.evaluate.niah.NiahResult``) and the
  **retrieval scores** of every head come from one pass of the detection fast path over the
  NIAH tests (``retmask.evaluate.shift.probe_scores``): the greedy answers are those of
  ``evaluate_niah`` (same tests, same decoder; tested), and the argmax capture of that pass scores the
  heads, so the grid and the scores cost one run, not two. (A test whose needle span the span rule cannot
  locate runs too: its answer is in the grid and it scores 0 for every head, as in detection.)
* **multi-needle recall** and **key–value retrieval** (``retmask.evaluate.synthetic``).

Across models: the **retrieval-score shift** — mean score of the masked heads (``--heads``) and of the
other heads for each model, and their change from the first model.

Per-model results are cached in ``<cache>/<fingerprint>.json`` (fingerprint = evaluation settings + the
model's weights), written atomically when a model finishes, and comparisons sharing a model (the original
"before" of several runs) evaluate it once. While a model is being evaluated, its finished tasks are kept in
``<cache>/<fingerprint>.partial.json`` (rewritten after every task, deleted when the model finishes): an
interrupted run resumes with the next task of the model it was evaluating.

Outputs in ``out_dir``: ``eval.json`` and, from ``retmask.evaluate.report``, ``report.md``, ``niah.png``
(heatmaps side by side), ``tasks.png`` (task scores), ``shift.png`` (score shift).
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from retmask.evaluate.config import EvalConfig
from retmask.evaluate.niah import NiahResult
from retmask.evaluate.report import plot_niah_side_by_side, plot_shift, plot_tasks, render_report
from retmask.evaluate.shift import build_probe, probe_scores, split_means
from retmask.evaluate.synthetic import run_task
from retmask.heads import model_shape
from retmask.heads.selection import read_heads
from retmask.hf.loading import DTYPES, check_model_spec, default_model_path, load_model
from retmask.model_files import content_identity
from retmask.niah import depth_grid, load_haystack, load_needles
from retmask.runfiles import (
    JsonFile,
    RunFileError,
    atomic_write_json,
    atomic_write_text,
    digest,
    without_default_dtype,
)

RESULT_VERSION = 1

# --- model identity --------------------------------------------------------------------------------------


def model_identity(spec: str | None) -> str:
    """What makes two evaluations of ``spec`` the same model: the sha256 of its weight files and of the
    files that shape its prompts and context (config, tokenizer, chat template) for a local folder or file
    (``retmask.model_files``), else the spec itself (hub id; the embedded model's cached conversion)."""
    path = Path(spec) if spec is not None else default_model_path()
    return content_identity(path) or f"spec:{spec}"


def default_label(spec: str | None) -> str:
    if spec is None or spec in ("embedded", "default"):
        return "original"
    p = Path(spec)
    return p.name if p.name not in ("model", "") else f"{p.parent.name}"


# --- one model -----------------------------------------------------------------------------------------


def evaluate_model(
    model: Any,
    tokenizer: Any,
    cfg: EvalConfig,
    *,
    progress: bool = True,
    done: dict | None = None,
    on_task: Callable[[dict], None] | None = None,
) -> dict:
    """Every task of ``cfg`` on one loaded model; a JSON-ready dict (see the module docstring).

    done: the dict an interrupted evaluation of this model returned so far (its finished tasks are not run
    again); on_task(result so far): called after every task."""

    cfg.check()
    model.eval()
    lengths = cfg.lengths(model)
    depths = depth_grid(cfg.num_depths)
    out: dict[str, Any] = done or {
        "lengths": lengths,
        "shape": list(model_shape(model)),
        "tasks": {},
        "timings": {},
    }
    finished = set(out["tasks"])
    if "niah" in cfg.tasks and "niah" not in finished:
        start = time.perf_counter()
        probe = build_probe(tokenizer, lengths, depths, num_needles=cfg.niah_needles)
        ps = probe_scores(model, tokenizer, probe, max_new_tokens=cfg.max_new_tokens, progress=progress)
        keep = (
            "index",
            "key",
            "needle_index",
            "length",
            "depth",
            "response",
            "rouge1_recall",
            "counted",
            "prompt_tokens",
        )
        entries = [{k: e[k] for k in keep} for e in ps.entries]
        meta = {"grid": {"lengths": lengths, "depths": depths, "needles": cfg.niah_needles}, "heads": [],
                "max_new_tokens": cfg.max_new_tokens, "source": "detection fast path (shared with the scores)"}  # fmt: skip
        niah = NiahResult(entries, lengths, depths, meta)
        out["niah"] = niah.to_json()
        out["tasks"]["niah"] = niah.mean
        out["scores"] = {"mean": ps.mean.round(6).tolist(), "counted": ps.counted, "tests": len(ps.entries)}
        out["timings"]["niah_s"] = round(time.perf_counter() - start, 2)
        if on_task is not None:
            on_task(out)
    for task in ("multi_needle", "kv"):
        if task in cfg.tasks and task not in finished:
            res = run_task(model, tokenizer, task, lengths, seed=cfg.seed, num_needles=cfg.mn_needles,
                           kv_depths=cfg.kv_depths, max_new_tokens=cfg.max_new_tokens, progress=progress)  # fmt: skip
            out[task] = res.to_json()
            out["tasks"][task] = res.score
            out["timings"][f"{task}_s"] = round(res.seconds, 2)
            if on_task is not None:
                on_task(out)
    return out


# --- several models --------------------------------------------------------------------------------------


def _fingerprint(cfg: EvalConfig, identity: str, device: str = "cpu") -> str:
    """The cache key of one model's results: settings, weights, device, and the shipped texts the tasks are
    built from (the NIAH haystack and needles: a new release of either must not serve old results)."""
    config = without_default_dtype(asdict(cfg))
    # the device only off the CPU
    where = {"device": device} if device != "cpu" else {}
    texts = {
        "haystack_sha256": hashlib.sha256(load_haystack(None).encode("utf-8")).hexdigest(),
        "needles": [n.to_dict() for n in load_needles()[: cfg.niah_needles]],
    }
    if "multi_needle" in cfg.tasks:
        # the scoring rule changed once (another needle's value named first no longer counts): results
        # scored the old way must not be served; a key without multi-needle stays as it was
        texts["multi_needle_rule"] = "asked value named first"
    return digest({"version": RESULT_VERSION, "config": config, "model": identity, **where, **texts})


def run_suite(
    models: Sequence[str | None],
    out_dir: str | Path,
    cfg: EvalConfig | None = None,
    *,
    labels: Sequence[str] | None = None,
    heads_files: Sequence[str | Path] = (),
    cache_dir: str | Path | None = None,
    progress: bool = True,
    command: str | None = None,
    log=print,
    device: str = "cpu",
) -> dict:
    """Evaluate ``models`` (specs for ``retmask.load_model``; None = the embedded model) on ``device``, write
    the report.
    The first model is the baseline of every "change" column. Returns the ``eval.json`` content."""

    cfg = cfg or EvalConfig()
    cfg.check()
    if not models:
        raise ValueError("give at least one --model")
    labels = list(labels) if labels else [default_label(m) for m in models]
    if len(labels) != len(models):
        raise ValueError(f"{len(labels)} labels for {len(models)} models; give one --label per --model")
    if len(set(labels)) != len(labels):
        labels = [f"{i}:{lab}" for i, lab in enumerate(labels)]
    heads_sets = []
    for f in heads_files:
        sel = read_heads(f)
        heads_sets.append(
            {"file": str(f), "name": _heads_name(sel, f), "heads": [list(h) for h in sel.heads]}
        )
    for spec in models:  # every model's path before the first one's evaluation
        check_model_spec(None if spec in ("embedded", "default") else spec)
    out_dir = Path(out_dir)
    cache = Path(cache_dir) if cache_dir is not None else out_dir / "models"
    results = []
    for spec, label in zip(models, labels, strict=True):
        spec = None if spec in ("embedded", "default") else spec
        identity = model_identity(spec)
        fp = _fingerprint(cfg, identity, device)
        path = cache / f"{fp[:16]}.json"
        cached = _cached_result(path, fp, cfg, log) if path.exists() else None
        if cached is not None:
            res = cached
            log(f"[eval] {label}: cached ({path})")
        else:
            partial = partial_path(path)
            done = _cached_result(partial, fp, cfg, log, finished_only=True) if partial.exists() else None
            if done is not None:
                log(f"[eval] {label}: {', '.join(done['tasks'])} cached ({partial}); evaluating the rest")
            else:
                log(f"[eval] {label}: evaluating {spec or 'the embedded model'}")
            start = time.perf_counter()
            model, tok = load_model(spec, dtype=DTYPES[cfg.dtype], device=device)
            res = evaluate_model(
                model, tok, cfg, progress=progress, done=done,
                on_task=functools.partial(_save_partial, partial, fp),
            )  # fmt: skip
            del model
            res.update({"fingerprint": fp, "model": spec or "embedded", "identity": identity,
                        "seconds": round(time.perf_counter() - start, 2)})  # fmt: skip
            atomic_write_json(path, res)
            partial.unlink(missing_ok=True)
        results.append({**res, "label": label})
    for hs in heads_sets:
        hs["shift"] = shift_rows(results, hs["heads"])
    data = {"version": RESULT_VERSION, "config": asdict(cfg), "device": device, "command": command,
            "models": results, "heads": heads_sets}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "eval.json", data)
    plot_niah_side_by_side(results, out_dir / "niah.png")
    plot_tasks(results, out_dir / "tasks.png")
    if heads_sets and "niah" in cfg.tasks:
        plot_shift(results, heads_sets, out_dir / "shift.png")
    atomic_write_text(out_dir / "report.md", render_report(data))
    log(f"[eval] report -> {out_dir / 'report.md'}")
    return data


def _save_partial(path: Path, fp: str, so_far: dict) -> None:
    """Keep the finished tasks of the model being evaluated (``partial_path``), atomically."""
    atomic_write_json(path, {**so_far, "fingerprint": fp})


def partial_path(path: Path) -> Path:
    """``<fingerprint>.partial.json``: the finished tasks of a model whose evaluation was interrupted."""
    return path.with_name(path.stem + ".partial.json")


def _cached_result(path: Path, fp: str, cfg: EvalConfig, log, *, finished_only: bool = False) -> dict | None:
    """The cached results of one model at ``path`` when they are this model's (same fingerprint) and hold
    what the report reads; else None: the model is evaluated again and the entry rewritten. With
    ``finished_only`` (a partial entry), only the tasks it holds are checked, and it needs at least one.

    A cache, not a user's result: an unreadable or wrong-shaped entry (torn, edited, a folder, another
    tool's file) is reproduced by evaluating again, so it is skipped with one line naming the file rather
    than refused (an error would only make the user delete it by hand). An entry of other settings is
    skipped silently, as before (its name is a 16-hex prefix of the fingerprint)."""
    f = JsonFile(path, "eval cache entry")
    try:
        data = f.expect(f.read(), dict, "the file")
        if data.get("fingerprint") != fp:
            return None
        if finished_only:
            tasks = f.key(data, "tasks", dict)
            f.key(data, "timings", dict)
            f.key(data, "lengths", list)
            cfg = replace(cfg, tasks=[t for t in cfg.tasks if t in tasks])
            if not cfg.tasks:
                f.fail("it holds no finished task")
        _check_result(f, data, cfg)
    except RunFileError as err:
        log(f"[eval] ignoring {err}; evaluating the model again (the entry is rewritten)")
        return None
    return data


def _check_result(f: JsonFile, r: dict, cfg: EvalConfig) -> None:
    """What the report, the plots and the score shift read from one model's results (evaluate_model)."""
    tasks = f.key(r, "tasks", dict)
    for task in cfg.tasks:
        f.key(tasks, task, (float, type(None)), "tasks")
    f.expect(r.get("seconds"), (float, type(None)), "'seconds'")
    if "niah" in cfg.tasks:
        try:
            NiahResult.from_json(f.key(r, "niah", dict))
        except (ValueError, TypeError) as err:  # NiahResult's messages name no file
            f.fail(f"'niah' is not a NIAH result ({err})")
        scores = f.key(r, "scores", dict)
        shape = f.key(r, "shape", list)
        if len(shape) != 2:
            f.fail(f"'shape' must be [layers, query heads], not {shape!r}")
        for i, n in enumerate(shape):
            f.number(n, f"shape[{i}]", integer=True, lo=1)
        mean = f.key(scores, "mean", list, "scores")
        if len(mean) != shape[0] or any(not isinstance(row, list) or len(row) != shape[1] for row in mean):
            f.fail(f"scores.mean must be {shape[0]} lists of {shape[1]} numbers ('shape')")
        for layer, row in enumerate(mean):
            for h, v in enumerate(row):
                f.number(v, f"scores.mean[{layer}][{h}]", lo=0)
        f.number(f.key(scores, "counted", int, "scores"), "scores.counted", integer=True, lo=0)
        f.number(f.key(scores, "tests", int, "scores"), "scores.tests", integer=True, lo=0)
    for task in ("multi_needle", "kv"):
        if task in cfg.tasks:
            f.key(f.key(r, task, dict), "by_length", dict, task)


def _heads_name(sel: Any, path: str | Path) -> str:
    if sel.baseline:
        return f"{sel.baseline} mask ({len(sel.heads)} heads)"
    if sel.method == "mudaf-sample":
        rule = f"sampled, temperature {sel.temperature:g}"
    elif sel.threshold is not None:
        rule = f"score >= {sel.threshold:g}"
    else:
        rule = f"top {sel.top_k}" if sel.top_k else "explicit"
    return f"{Path(path).stem}: {rule} ({len(sel.heads)} heads)"


def shift_rows(results: Sequence[dict], heads: Sequence[Sequence[int]]) -> list[dict]:
    """Per model: mean retrieval score of ``heads`` and of the other heads, and the change from model 0."""

    rows = []
    base = None
    for r in results:
        if "scores" not in r:
            continue
        masked, other = split_means(np.asarray(r["scores"]["mean"]), [tuple(h) for h in heads])
        if base is None:
            base = (masked, other)
        rows.append({"label": r["label"], "masked_mean": masked, "other_mean": other,
                     "masked_change": masked - base[0], "other_change": other - base[1],
                     "counted": r["scores"]["counted"], "tests": r["scores"]["tests"]})  # fmt: skip
    return rows
