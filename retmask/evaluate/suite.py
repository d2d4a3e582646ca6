"""``retmask eval``: before/after comparison of models on a synthetic long-context suite.

Per model (each loaded with ``retmask.load_model``, retmask attention, no head masked):

* **NIAH grid** (ROUGE-1 recall per length × depth; ``retmask.evaluate.niah.NiahResult``) and the
  **retrieval scores** of every head (Wu et al.) come from one pass of the detection fast path over the
  NIAH tests (``retmask.evaluate.shift.probe_scores``): the greedy answers are those of
  ``evaluate_niah`` (same tests, same decoder; tested), and the argmax capture of that pass scores the
  heads, so the grid and the scores cost one run, not two. (Tests whose needle span the span rule cannot
  locate cannot be scored; if there are any, the NIAH grid is run separately with ``evaluate_niah``.)
* **multi-needle recall** and **key–value retrieval** (``retmask.evaluate.synthetic``).

Across models: the **retrieval-score shift** — mean score of the masked heads (``--heads``) and of the
other heads for each model, and their change from the first model (RetMask §5.3).

Per-model results are cached in ``<cache>/<fingerprint>.json`` (fingerprint = evaluation settings + the
model's weights), written atomically when a model finishes: an interrupted run resumes with the next
model, and comparisons sharing a model (the original "before" of several runs) evaluate it once.

Outputs in ``out_dir``: ``eval.json``, ``report.md``, ``niah.png`` (heatmaps side by side),
``tasks.png`` (task scores), ``shift.png`` (score shift).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from retmask.niah import depth_grid, length_grid

DEFAULT_MAX_LEN = 4000  # cap on CPUs: the embedded model's retrieval already fades by 4K
RESULT_VERSION = 1
TASK_LABELS = {
    "niah": "NIAH (ROUGE-1 recall)",
    "multi_needle": "multi-needle recall",
    "kv": "key-value exact match",
}


@dataclass
class EvalConfig:
    """Settings that determine a model's results (part of the cache fingerprint)."""

    min_len: int = 1000
    max_len: int | None = None  # None: min(DEFAULT_MAX_LEN, the model's maximum - answer budget)
    num_lengths: int = 3
    num_depths: int = 3  # NIAH depths evenly in [0, 100]
    niah_needles: int = 3  # the first N shipped needles
    mn_needles: int = 4  # needles per multi-needle context
    kv_depths: list[int] = field(default_factory=lambda: [10, 50, 90])
    max_new_tokens: int = 32
    seed: int = 0
    tasks: list[str] = field(default_factory=lambda: ["niah", "multi_needle", "kv"])

    def lengths(self, model: Any) -> list[int]:
        from retmask.detect.run import max_context

        limit = max_context(model)
        hi = self.max_len
        if hi is None:
            hi = DEFAULT_MAX_LEN if limit is None else min(DEFAULT_MAX_LEN, limit - self.max_new_tokens)
        elif limit is not None and hi + self.max_new_tokens > limit:
            raise ValueError(
                f"--max-len {hi} (+{self.max_new_tokens} answer tokens) exceeds the model's maximum of {limit} "
                f"tokens; use --max-len {limit - self.max_new_tokens} or less"
            )
        if self.num_lengths < 1 or self.num_depths < 1 or hi < self.min_len:
            raise ValueError(
                f"empty grid: lengths {self.min_len}..{hi} x {self.num_lengths}; check the flags"
            )
        return length_grid(self.min_len, hi, self.num_lengths)

    def check(self) -> None:
        bad = [t for t in self.tasks if t not in TASK_LABELS]
        if bad or not self.tasks:
            raise ValueError(f"unknown task(s) {bad}; choose from {list(TASK_LABELS)}")
        if self.niah_needles < 1 or self.mn_needles < 1 or self.max_new_tokens < 1:
            raise ValueError("needle counts and max_new_tokens must be >= 1")


# --- model identity --------------------------------------------------------------------------------------


def model_identity(spec: str | None) -> str:
    """What makes two evaluations of ``spec`` the same model: the sha256 of its weight files for a local
    folder or file, else the spec itself (hub id; the embedded model's cached conversion)."""
    import retmask

    path = Path(spec) if spec is not None else retmask.default_model_path()
    if path.exists():
        files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")) if path.is_dir() else [path]
        if files:
            h = hashlib.sha256()
            for f in files:
                with open(f, "rb") as fh:
                    for block in iter(lambda fh=fh: fh.read(1 << 24), b""):
                        h.update(block)
            return "sha256:" + h.hexdigest()
    return f"spec:{spec}"


def default_label(spec: str | None) -> str:
    if spec is None or spec in ("embedded", "default"):
        return "original"
    p = Path(spec)
    return p.name if p.name not in ("model", "") else f"{p.parent.name}"


# --- one model -----------------------------------------------------------------------------------------


def evaluate_model(model: Any, tokenizer: Any, cfg: EvalConfig, *, progress: bool = True) -> dict:
    """Every task of ``cfg`` on one loaded model; a JSON-ready dict (see the module docstring)."""
    from retmask.detect.core import _layout

    from .niah import NiahResult, evaluate_niah
    from .shift import build_probe, probe_scores
    from .synthetic import run_task

    cfg.check()
    model.eval()
    lengths = cfg.lengths(model)
    depths = depth_grid(cfg.num_depths)
    out: dict[str, Any] = {"lengths": lengths, "shape": list(_layout(model)), "tasks": {}, "timings": {}}
    if "niah" in cfg.tasks:
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
        if any("span" in s for s in probe.skipped):  # not scorable -> run the grid for the NIAH answers alone
            niah = evaluate_niah(model, tokenizer, lengths=lengths, depths=depths,
                                 needles=probe.needles, max_new_tokens=cfg.max_new_tokens, progress=progress)  # fmt: skip
        out["niah"] = niah.to_json()
        out["tasks"]["niah"] = niah.mean
        out["scores"] = {"mean": ps.mean.round(6).tolist(), "counted": ps.counted, "tests": len(ps.entries)}
        out["timings"]["niah_s"] = round(time.perf_counter() - start, 2)
    for task in ("multi_needle", "kv"):
        if task in cfg.tasks:
            res = run_task(model, tokenizer, task, lengths, seed=cfg.seed, num_needles=cfg.mn_needles,
                           kv_depths=cfg.kv_depths, max_new_tokens=cfg.max_new_tokens, progress=progress)  # fmt: skip
            out[task] = res.to_json()
            out["tasks"][task] = res.score
            out["timings"][f"{task}_s"] = round(res.seconds, 2)
    return out


# --- several models --------------------------------------------------------------------------------------


def _fingerprint(cfg: EvalConfig, identity: str) -> str:
    blob = json.dumps({"version": RESULT_VERSION, "config": asdict(cfg), "model": identity}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _atomic_json(path: Path, obj: Any) -> None:
    from retmask.detect.run import atomic_write_json

    atomic_write_json(path, obj)


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
) -> dict:
    """Evaluate ``models`` (specs for ``retmask.load_model``; None = the embedded model), write the report.
    The first model is the baseline of every "change" column. Returns the ``eval.json`` content."""
    import retmask
    from retmask.selection import read_heads

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
    out_dir = Path(out_dir)
    cache = Path(cache_dir) if cache_dir is not None else out_dir / "models"
    results = []
    for spec, label in zip(models, labels, strict=True):
        spec = None if spec in ("embedded", "default") else spec
        identity = model_identity(spec)
        fp = _fingerprint(cfg, identity)
        path = cache / f"{fp[:16]}.json"
        if path.is_file() and json.loads(path.read_text()).get("fingerprint") == fp:
            res = json.loads(path.read_text())
            log(f"[eval] {label}: cached ({path})")
        else:
            log(f"[eval] {label}: evaluating {spec or 'the embedded model'}")
            start = time.perf_counter()
            model, tok = retmask.load_model(spec)
            res = evaluate_model(model, tok, cfg, progress=progress)
            del model
            res.update({"fingerprint": fp, "model": spec or "embedded", "identity": identity,
                        "seconds": round(time.perf_counter() - start, 2)})  # fmt: skip
            _atomic_json(path, res)
        results.append({**res, "label": label})
    for hs in heads_sets:
        hs["shift"] = shift_rows(results, hs["heads"])
    data = {"version": RESULT_VERSION, "config": asdict(cfg), "command": command, "models": results,
            "heads": heads_sets}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    _atomic_json(out_dir / "eval.json", data)
    plot_niah_side_by_side(results, out_dir / "niah.png")
    plot_tasks(results, out_dir / "tasks.png")
    if heads_sets and "niah" in cfg.tasks:
        plot_shift(results, heads_sets, out_dir / "shift.png")
    (out_dir / "report.md").write_text(render_report(data), encoding="utf-8")
    log(f"[eval] report -> {out_dir / 'report.md'}")
    return data


def _heads_name(sel: Any, path: str | Path) -> str:
    if sel.baseline:
        return f"{sel.baseline} mask ({len(sel.heads)} heads)"
    rule = (
        f"score >= {sel.threshold:g}"
        if sel.threshold is not None
        else (f"top {sel.top_k}" if sel.top_k else "explicit")
    )
    return f"{Path(path).stem}: {rule} ({len(sel.heads)} heads)"


def shift_rows(results: Sequence[dict], heads: Sequence[Sequence[int]]) -> list[dict]:
    """Per model: mean retrieval score of ``heads`` and of the other heads, and the change from model 0."""
    from .shift import split_means

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


# --- figures -------------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_niah_side_by_side(results: Sequence[dict], path: Path) -> Path | None:
    """One NIAH heatmap per model (same colours as ``plot_niah``), side by side."""
    from matplotlib.colors import LinearSegmentedColormap

    from .niah import NiahResult

    have = [r for r in results if "niah" in r]
    if not have:
        return None
    plt = _plt()
    cmap = LinearSegmentedColormap.from_list("niah", ["#F0496E", "#EBB839", "#0CD79F"]).with_extremes(
        bad="#d0d0d0"
    )
    fig, axes = plt.subplots(1, len(have), figsize=(3.4 * len(have) + 0.8, 3.2), squeeze=False)
    im = None
    for ax, r in zip(axes[0], have, strict=True):
        res = NiahResult.from_json(r["niah"])
        grid = res.grid()
        im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=1, aspect="auto")
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                if not math.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(res.lengths)), [str(n) for n in res.lengths], fontsize=7)
        ax.set_yticks(range(len(res.depths)), [f"{d}%" for d in res.depths], fontsize=7)
        ax.set_xlabel("context length (tokens)", fontsize=8)
        ax.set_title(f"{r['label']}\nmean {res.mean:.3f}", fontsize=8)
    axes[0][0].set_ylabel("needle depth", fontsize=8)
    fig.colorbar(im, ax=list(axes[0]), label="ROUGE-1 recall", shrink=0.9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_tasks(results: Sequence[dict], path: Path) -> Path:
    """Grouped bars: one group per task, one bar per model."""
    plt = _plt()
    tasks = [t for t in TASK_LABELS if any(t in r["tasks"] for r in results)]
    fig, ax = plt.subplots(figsize=(1.6 + 1.7 * len(tasks), 3.4))
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        vals = [r["tasks"].get(t, float("nan")) for t in tasks]
        xs = np.arange(len(tasks)) + (i - (len(results) - 1) / 2) * width
        bars = ax.bar(xs, vals, width, label=r["label"])
        for b, v in zip(bars, vals, strict=True):
            if not math.isnan(v):
                ax.text(b.get_x() + b.get_width() / 2, v + 0.01, f"{v:.2f}", ha="center", fontsize=6)
    ax.set_xticks(range(len(tasks)), [TASK_LABELS[t] for t in tasks], fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("score")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_shift(results: Sequence[dict], heads_sets: Sequence[dict], path: Path) -> Path:
    """Left: mean score of each heads set vs the other heads, per model. Right: per-head change from the
    first model against its score there, the first heads set highlighted (RetMask Fig. 5's view)."""
    plt = _plt()
    scored = [r for r in results if "scores" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    labels = [r["label"] for r in scored]
    n = len(heads_sets) + 1
    width = 0.8 / n
    for k, hs in enumerate(heads_sets):
        vals = [row["masked_mean"] for row in hs["shift"]]
        ax1.bar(np.arange(len(labels)) + (k - (n - 1) / 2) * width, vals, width, label=hs["name"])
    others = [row["other_mean"] for row in heads_sets[0]["shift"]]
    ax1.bar(
        np.arange(len(labels)) + (n - 1 - (n - 1) / 2) * width,
        others,
        width,
        label="other heads",
        color="grey",
    )
    ax1.set_xticks(range(len(labels)), labels, fontsize=7, rotation=15)
    ax1.set_ylabel("mean retrieval score (eval probe)")
    ax1.legend(fontsize=6)
    base = np.asarray(scored[0]["scores"]["mean"])
    mask = np.zeros(base.shape, bool)
    for a, b in heads_sets[0]["heads"]:
        mask[a, b] = True
    for r in scored[1:]:
        diff = np.asarray(r["scores"]["mean"]) - base
        ax2.scatter(base[~mask], diff[~mask], s=6, alpha=0.5, label=f"{r['label']}: other")
        ax2.scatter(base[mask], diff[mask], s=22, marker="^", label=f"{r['label']}: {heads_sets[0]['name']}")
    ax2.axhline(0, color="black", lw=0.6)
    ax2.set_xlabel(f"score of {scored[0]['label']}")
    ax2.set_ylabel(f"change from {scored[0]['label']}")
    ax2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- report ------------------------------------------------------------------------------------------


def _f(v: float | None, digits: int = 3, signed: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:+.{digits}f}" if signed else f"{v:.{digits}f}"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render_report(data: dict) -> str:
    """The markdown report of an ``eval.json``."""
    from .niah import NiahResult

    cfg, results = data["config"], data["models"]
    out = ["# Long-context evaluation", ""]
    if data.get("command"):
        out += ["```", data["command"], "```", ""]
    lengths = results[0].get("lengths", [])
    out += [f"Lengths {lengths} tokens; NIAH depths {depth_grid(cfg['num_depths'])} × {cfg['niah_needles']} needles; "
            f"multi-needle: {cfg['mn_needles']} needles per context; key-value: queries at {cfg['kv_depths']}% of the "
            f"list; greedy, ≤ {cfg['max_new_tokens']} new tokens; seed {cfg['seed']}.", ""]  # fmt: skip
    tasks = [t for t in TASK_LABELS if any(t in r["tasks"] for r in results)]
    base = results[0]["tasks"]
    rows = []
    for r in results:
        cells = [r["label"]]
        for t in tasks:
            v = r["tasks"].get(t)
            d = "" if r is results[0] or v is None else f" ({_f(v - base.get(t, float('nan')), 3, True)})"
            cells.append(_f(v) + d)
        cells.append(_f(r.get("seconds"), 0))
        rows.append(cells)
    out += ["## Task scores", "", "(change from the first model in brackets)", "",
            _table(["model", *[TASK_LABELS[t] for t in tasks], "eval seconds"], rows), "", "![tasks](tasks.png)", ""]  # fmt: skip
    if "niah" in tasks:
        out += [
            "## NIAH grids (mean ROUGE-1 recall; rows = depth, columns = length)",
            "",
            "![niah](niah.png)",
            "",
        ]
        for r in results:
            res = NiahResult.from_json(r["niah"])
            g = res.grid()
            rows = [[f"{d}%"] + [_f(v, 2) for v in g[i]] for i, d in enumerate(res.depths)]
            out += [
                f"**{r['label']}** (mean {_f(res.mean)})",
                "",
                _table(["depth", *map(str, res.lengths)], rows),
                "",
            ]
    for task in ("multi_needle", "kv"):
        if task in tasks:
            rows = [[r["label"]] + [_f(v, 2) for v in r[task]["by_length"].values()] for r in results]
            out += [f"## {TASK_LABELS[task]} by length", "", _table(["model", *map(str, lengths)], rows), ""]
    for hs in data.get("heads", []):
        rows = [[s["label"], _f(s["masked_mean"], 4), _f(s["masked_change"], 4, True), _f(s["other_mean"], 4),
                 _f(s["other_change"], 4, True), f"{s['counted']}/{s['tests']}"] for s in hs["shift"]]  # fmt: skip
        out += [f"## Retrieval-score shift: {hs['name']}", "",
                f"Mean retrieval score (Wu et al., on the NIAH tests above that pass the ROUGE-1 > 0.5 filter) of the "
                f"heads in `{hs['file']}` vs all other heads.", "",
                _table(["model", "masked heads", "change", "other heads", "change", "counted tests"], rows), ""]  # fmt: skip
    if data.get("heads"):
        out += ["![shift](shift.png)", ""]
    return "\n".join(out)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "model"
