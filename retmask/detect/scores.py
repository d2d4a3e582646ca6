"""Per-head scores: the published JSON format, the printed summary, and the --until-stable rule."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BINS = ("0", "(0, 0.1)", "[0.1, 0.5)", ">= 0.5")


def head_scores(copies: Sequence[np.ndarray], answer_lens: Sequence[int], shape: tuple[int, int]) -> dict:
    """``{"<layer>-<head>": [copies / len(answer_ids) of each counted test]}`` in layer-major order.

    copies: one int [L, Hq] array per counted test (in the canonical test order).
    """
    num_layers, num_heads = shape
    out: dict[str, list[float]] = {
        f"{layer}-{h}": [] for layer in range(num_layers) for h in range(num_heads)
    }
    for c, n in zip(copies, answer_lens, strict=True):
        c = np.asarray(c)
        for layer in range(num_layers):
            for h in range(num_heads):
                out[f"{layer}-{h}"].append(int(c[layer, h]) / n)
    return out


def mean_matrix(scores: dict, shape: tuple[int, int]) -> np.ndarray:
    """float64 [L, Hq] mean score per head (0 for heads without counted tests)."""
    m = np.zeros(shape, dtype=np.float64)
    for key, vals in scores.items():
        layer, h = (int(x) for x in key.split("-"))
        m[layer, h] = float(np.mean(vals)) if len(vals) else 0.0
    return m


def ranking(mean: np.ndarray) -> list[tuple[int, int]]:
    """Heads by decreasing mean score; ties by (layer, head) so the order is deterministic."""
    flat = [
        (-float(mean[layer, h]), layer, h) for layer in range(mean.shape[0]) for h in range(mean.shape[1])
    ]
    return [(layer, h) for _, layer, h in sorted(flat)]


def summarize(scores: dict, shape: tuple[int, int], top: int = 20) -> dict:
    """Top heads, the sparsity histogram (shares of heads in ``BINS``) and the retrieval-head counts."""
    mean = mean_matrix(scores, shape)
    flat = mean.ravel()
    total = flat.size
    hist = {
        BINS[0]: float(np.sum(flat == 0) / total),
        BINS[1]: float(np.sum((flat > 0) & (flat < 0.1)) / total),
        BINS[2]: float(np.sum((flat >= 0.1) & (flat < 0.5)) / total),
        BINS[3]: float(np.sum(flat >= 0.5) / total),
    }
    order = ranking(mean)
    counted = max((len(v) for v in scores.values()), default=0)
    return {
        "counted_tests": counted,
        "num_heads": total,
        "top": [{"head": f"{layer}-{h}", "score": float(mean[layer, h])} for layer, h in order[:top]],
        "histogram": hist,
        "retrieval_heads_tau_0.1": int(np.sum(flat >= 0.1)),
        "retrieval_heads_tau_0.05": int(np.sum(flat >= 0.05)),
    }


def format_summary(summary: dict, top: int = 10, total_tests: int | None = None) -> str:
    """The console summary; ``total_tests``: how many tests were answered (the first line then reads
    "51 of 96 tests passed the ROUGE-1 filter (counted)")."""
    counted = summary["counted_tests"]
    of = f" of {total_tests}" if total_tests is not None else ""
    lines = [
        f"{counted}{of} tests passed the ROUGE-1 filter (counted: only they score heads)   "
        f"heads: {summary['num_heads']}"
    ]
    lines.append("top heads (layer-head: mean score):")
    lines += [f"  {t['head']:>7}: {t['score']:.3f}" for t in summary["top"][:top]]
    lines.append("sparsity: " + "   ".join(f"{k}: {100 * v:.1f}%" for k, v in summary["histogram"].items()))
    lines.append(
        f"retrieval heads: {summary['retrieval_heads_tau_0.1']} with score >= 0.1, "
        f"{summary['retrieval_heads_tau_0.05']} with score >= 0.05"
    )
    return "\n".join(lines)


class StabilityTracker:
    """--until-stable: stable once the τ-set and the top-k ranking (ordered) have not changed for
    ``patience`` consecutive counted tests. Feed the running sum of per-test scores after each counted test.
    """

    def __init__(self, shape: tuple[int, int], tau: float = 0.1, top_k: int = 10, patience: int = 20):
        self.shape, self.tau, self.top_k, self.patience = shape, tau, top_k, patience
        self.sum = np.zeros(shape, dtype=np.float64)
        self.count = 0
        self.unchanged = 0
        self._state: tuple | None = None

    def update(self, test_scores: np.ndarray) -> bool:
        """Add one counted test's [L, Hq] scores; returns True when stable."""
        self.sum += test_scores
        self.count += 1
        mean = self.sum / self.count
        state = (
            tuple(ranking(mean)[: self.top_k]),
            tuple(map(tuple, np.argwhere(mean >= self.tau).tolist())),
        )
        self.unchanged = self.unchanged + 1 if state == self._state else 0
        self._state = state
        return self.stable

    @property
    def stable(self) -> bool:
        return self.unchanged >= self.patience
