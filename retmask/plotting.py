"""The one plotting setup of the package: matplotlib on the Agg backend (works without a display), the
shared colour maps, and saving a figure (folders created, figure closed).

matplotlib is imported on first use, so importing a module that can plot costs nothing until it does.
"""

from __future__ import annotations

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
    """Write ``fig`` as a PNG to ``path`` (parent folders created) and close it; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight" if tight else None)
    pyplot().close(fig)
    return path


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
    values: np.ndarray, path: str | Path, title: str = "", cbar_label: str = "retrieval score"
) -> Path:
    """Layers × heads heatmap of ``values`` (float [L, Hq]) written as a PNG to ``path``."""
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
    ax.set_ylabel("layer")
    ax.set_xticks(range(num_heads))
    step = max(1, num_layers // 16)
    ax.set_yticks(range(0, num_layers, step))
    if title:
        ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label=cbar_label)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
