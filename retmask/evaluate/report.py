"""The ``retmask eval`` report: figures (NIAH heatmaps side by side, task scores, retrieval-score shift)
and ``report.md`` rendered from the ``eval.json`` content that ``run_suite`` writes."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from retmask.evaluate.config import TASK_LABELS
from retmask.evaluate.niah import NiahResult
from retmask.niah import depth_grid
from retmask.plotting import niah_cmap, pyplot, save_figure

# --- figures -------------------------------------------------------------------------------------------


def plot_niah_side_by_side(results: Sequence[dict], path: Path) -> Path | None:
    """One NIAH heatmap per model (same colours as ``plot_niah``), side by side."""
    have = [r for r in results if "niah" in r]
    if not have:
        return None
    plt = pyplot()
    cmap = niah_cmap()
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
    return save_figure(fig, path, tight=True)


def plot_tasks(results: Sequence[dict], path: Path) -> Path:
    """Grouped bars: one group per task, one bar per model."""
    plt = pyplot()
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
    return save_figure(fig, path)


def plot_shift(results: Sequence[dict], heads_sets: Sequence[dict], path: Path) -> Path:
    """Left: mean score of each heads set vs the other heads, per model. Right: per-head change from the
    first model against its score there, the first heads set highlighted."""
    plt = pyplot()
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
    if len(scored) > 1:
        ax2.axhline(0, color="black", lw=0.6)
        ax2.set_xlabel(f"score of {scored[0]['label']}")
        ax2.set_ylabel(f"change from {scored[0]['label']}")
        ax2.legend(fontsize=6)
    else:  # one model evaluated: no change to draw (an empty panel and matplotlib's empty-legend warning)
        ax2.text(0.5, 0.5, "one model: no change to show", ha="center", va="center", transform=ax2.transAxes)
        ax2.set_axis_off()
    fig.tight_layout()
    return save_figure(fig, path)


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

    cfg, results = data["config"], data["models"]
    out = ["# Long-context evaluation", ""]
    if data.get("command"):
        out += ["```", data["command"], "```", ""]
    lengths = results[0].get("lengths", [])
    out += [f"Lengths {lengths} tokens; NIAH depths {depth_grid(cfg['num_depths'])} × {cfg['niah_needles']} needles; "
            f"multi-needle: {cfg['mn_needles']} needles per context (right when the asked password is the first of "
            f"them named); key-value: queries at {cfg['kv_depths']}% of the list (right when the first number is); greedy, ≤ {cfg['max_new_tokens']} new tokens; seed {cfg['seed']}.", ""]  # fmt: skip
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
        if not hs.get("shift"):  # no NIAH scores (the niah task was off): nothing to compare
            continue
        rows = [[s["label"], _f(s["masked_mean"], 4), _f(s["masked_change"], 4, True), _f(s["other_mean"], 4),
                 _f(s["other_change"], 4, True), f"{s['counted']}/{s['tests']}"] for s in hs["shift"]]  # fmt: skip
        out += [f"## Retrieval-score shift: {hs['name']}", "",
                f"Mean retrieval score (on the NIAH tests above that pass the ROUGE-1 > 0.5 filter) of the "
                f"heads in `{hs['file']}` vs all other heads.", "",
                _table(["model", "masked heads", "change", "other heads", "change", "counted tests"], rows), ""]  # fmt: skip
    # plotted only with NIAH scores (suite.run_suite's rule)
    if data.get("heads") and "niah" in data.get("config", {}).get("tasks", ()):
        out += ["![shift](shift.png)", ""]
    return "\n".join(out)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "model"
