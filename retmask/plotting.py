"""Shared plotting helpers (matplotlib, Agg backend: works without a display)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def head_heatmap(
    values: np.ndarray, path: str | Path, title: str = "", cbar_label: str = "retrieval score"
) -> Path:
    """Layers × heads heatmap of ``values`` (float [L, Hq]) written as a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
