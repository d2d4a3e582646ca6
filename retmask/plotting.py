"""The one plotting setup of the package: matplotlib on the Agg backend (works without a display), the
shared colour maps, and saving a figure (folders created, figure closed).

matplotlib is imported on first use, so importing a module that can plot costs nothing until it does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

NIAH_COLORS = ("#F0496E", "#EBB839", "#0CD79F")  # recall 0 (red) → 1 (green), the classic NIAH heatmap
MISSING_COLOR = "#d0d0d0"  # cells without tests


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def niah_cmap():
    """Red → yellow → green colour map for recall in [0, 1]; NaN cells grey."""
    from matplotlib.colors import LinearSegmentedColormap

    return LinearSegmentedColormap.from_list("niah", list(NIAH_COLORS)).with_extremes(bad=MISSING_COLOR)


def save_figure(fig, path: str | Path, *, dpi: int = 110, tight: bool = False) -> Path:
    """Write ``fig`` as a PNG to ``path`` atomically (parent folders created) and close it; returns the path.

    Rendered in memory first, so a full disk leaves the old file (or none), never a torn PNG."""
    import io

    from retmask.runfiles import atomic_write_bytes

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight" if tight else None)
    finally:
        pyplot().close(fig)
    return atomic_write_bytes(path, buffer.getvalue())


def short_name(name: str) -> str:
    """A model or file name for a plot title: the last path component of a path ("runs/x/model/" ->
    "model"), a hub id or ``embedded:...`` label as it is."""
    if name.startswith("embedded:"):
        return name.removeprefix("embedded:")
    parts = [p for p in name.replace("\\", "/").split("/") if p]
    if len(parts) == 2 and not name.startswith((".", "/", "~")):
        return name  # a hub id (owner/name)
    return parts[-1] if parts else name


def head_heatmap(
    values: np.ndarray,
    path: str | Path,
    title: str = "",
    cbar_label: str = "retrieval score",
    layer_ids: Sequence[int] | None = None,
) -> Path:
    """Layers × heads heatmap of ``values`` (float [L, Hq]) written as a PNG to ``path``. ``layer_ids``: the
    decoder layer of each row, for a hybrid model whose rows are its attention layers only."""
    plt = pyplot()
    values = np.asarray(values, dtype=float)
    num_layers, num_heads = values.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * num_heads + 2), max(4.0, 0.22 * num_layers + 1.5)))
    im = ax.imshow(
        values,
        aspect="auto",
        cmap="viridis",
        vmin=0.0,
        vmax=max(0.5, float(values.max(initial=0))),
        origin="lower",
    )
    ax.set_xlabel("head")
    ax.set_xticks(range(num_heads))
    step = max(1, num_layers // 16)
    ax.set_yticks(range(0, num_layers, step))
    if layer_ids is None:
        ax.set_ylabel("layer")
    else:  # hybrid: rows are attention layers, labelled with the decoder layer they sit in
        ax.set_ylabel("attention layer (decoder layer number)")
        ax.set_yticklabels([str(layer_ids[i]) for i in range(0, num_layers, step)])
    if title:
        ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label=cbar_label)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def score_comparison_plot(
    rows: list[tuple[np.ndarray, np.ndarray, str, str, float]], path: str | Path, title: str = ""
) -> Path:
    """One row per comparison: a scatter of the two sides' scores and a heatmap of their difference.

    rows: ``(base [L, Hq], other [L, Hq], base label, other label, τ)`` per comparison (float score
    matrices of one model). In the scatter, heads on the retrieval side of τ for one side only are
    labelled ``layer-head``; in the heatmap (other - base, red = higher in other) they are marked ``+``
    (retrieval head only in other) or ``x`` (only in base).
    """
    plt = pyplot()
    num_layers, num_heads = rows[0][0].shape
    heat_w = max(3.5, 0.3 * num_heads + 1.8)
    height = max(3.8, 0.17 * num_layers + 1.4)
    fig, axes = plt.subplots(
        len(rows), 2, figsize=(4.2 + heat_w, height * len(rows)), squeeze=False,
        gridspec_kw={"width_ratios": [4.2, heat_w]},
    )  # fmt: skip
    for (base, other, base_label, other_label, tau), (scatter, heat) in zip(rows, axes, strict=True):
        only_other = (other >= tau) & (base < tau)
        only_base = (base >= tau) & (other < tau)
        crossed = only_other | only_base
        scatter.scatter(base[~crossed], other[~crossed], s=9, color="#4c72b0", label="same side of τ")
        scatter.scatter(base[crossed], other[crossed], s=14, color="#dd8452", label="crosses τ")
        for ly, h in zip(*np.nonzero(crossed), strict=True):
            scatter.annotate(f"{ly}-{h}", (base[ly, h], other[ly, h]), fontsize=6, xytext=(2, 2),
                             textcoords="offset points")  # fmt: skip
        top = max(float(base.max(initial=0)), float(other.max(initial=0)), tau) * 1.05
        scatter.plot([0, top], [0, top], color="grey", lw=0.7)
        scatter.axvline(tau, color="red", lw=0.6, ls="--")
        scatter.axhline(tau, color="red", lw=0.6, ls="--")
        scatter.set_xlabel(f"retrieval score, {base_label}", fontsize=8)
        scatter.set_ylabel(f"retrieval score, {other_label}", fontsize=8)
        scatter.legend(fontsize=7, loc="upper left")
        difference = other - base
        bound = max(float(np.abs(difference).max(initial=0)), 1e-6)
        im = heat.imshow(difference, aspect="auto", cmap="RdBu_r", vmin=-bound, vmax=bound, origin="lower")
        for marks, symbol in ((only_other, "+"), (only_base, "x")):
            ys, xs = np.nonzero(marks)
            heat.scatter(xs, ys, marker=symbol, color="black", s=22, linewidths=0.9)
        heat.set_xlabel("head", fontsize=8)
        heat.set_ylabel("layer", fontsize=8)
        heat.set_xticks(range(num_heads))
        heat.set_yticks(range(0, num_layers, max(1, num_layers // 16)))
        heat.set_title(f"{other_label} - {base_label} (+: >= τ only in {other_label}, x: only in {base_label})",
                       fontsize=7)  # fmt: skip
        fig.colorbar(im, ax=heat, label="score difference")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)
