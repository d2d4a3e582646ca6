"""The plot of a KV-budget run: accuracy against KV memory held, one line per policy."""

from __future__ import annotations

from pathlib import Path

from retmask.evaluate.kv_budget.plan import POLICIES, ROW_ORDER
from retmask.evaluate.kv_budget.results import TASK_LABELS, KVBudgetResult

# Different line styles and sizes keep policies that score the same (all at 0, say) visible on each other.
STYLE = {
    "retrieval": ("#d62728", "o", "-", 7),
    "random": ("#1f77b4", "s", "--", 6),
    "non-retrieval": ("#9467bd", "^", "-.", 6),
    "streaming": ("#7f7f7f", "X", "", 8),
    "full": ("#000000", "*", "", 11),
}


def plot_kv_budget(result: KVBudgetResult, path: str | Path, title: str = "") -> None:
    """Accuracy against KV memory ratio, one panel per task: one line (marker set) per policy over its
    budgets, the random draws' mean with a bar over their min-max, streaming and the full cache (ratio 1,
    also a dotted level) as single points. The legend sits below the panels."""
    from retmask.plotting import pyplot, save_figure

    plt = pyplot()
    tasks = result.tasks()
    rows = result.rows()
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.4 * len(tasks), 4.6), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for policy in sorted(POLICIES, key=ROW_ORDER.__getitem__):
            pts = [r for r in rows if r["policy"] == policy and r["tasks"][task]["mean"] is not None]
            if not pts:
                continue
            color, marker, line, size = STYLE[policy]
            x = [r["memory_ratio"] for r in pts]
            y = [r["tasks"][task]["mean"] for r in pts]
            style = {"color": color, "marker": marker, "linestyle": line, "markersize": size}
            if policy == "random":
                n = max(r["n"] for r in pts)
                lo = [m - r["tasks"][task]["min"] for m, r in zip(y, pts, strict=True)]
                hi = [r["tasks"][task]["max"] - m for m, r in zip(y, pts, strict=True)]
                ax.errorbar(x, y, yerr=[lo, hi], capsize=3, label=f"random (mean; bar: min-max of {n} seeds)",
                            **style)  # fmt: skip
                continue
            label = {"full": "full cache", "streaming": "streaming (budget 0)"}.get(policy, policy)
            if policy == "full":
                ax.axhline(y[0], color=color, lw=0.7, ls=":")
            ax.plot(x, y, label=label, zorder=3 if policy == "retrieval" else 2, **style)
            if policy == "retrieval":  # the budgets, once: the other policies share them
                for r, xi, yi in zip(pts, x, y, strict=True):
                    ax.annotate(f"{r['budget']:g}", (xi, yi), fontsize=7, xytext=(3, 4),
                                textcoords="offset points", color=color)  # fmt: skip
        ax.set_xlabel("KV memory held / full cache (after generation)")
        ax.set_ylabel(TASK_LABELS[task])
        ax.set_xlim(0, 1.05)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=min(3, max(1, len(labels))),
               frameon=False)  # fmt: skip
    if title:
        fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    save_figure(fig, path, tight=True)  # the legend sits below the axes
