"""Comparing two per-head score tables of the same model: do they find the same retrieval heads?

The questions a researcher asks of two detections (float32 against bfloat16, CPU against GPU, one haystack
against another, a model before and after training, ``retmask detect`` against a published
``head_score/*.json`` file):

* **rank agreement**: Spearman's ρ over all heads (ties get average ranks), and Pearson's r of the scores;
* **the retrieval-head sets**: the heads with mean score ≥ τ on each side, what both share, what only one
  has, and their Jaccard index;
* **the top K**: how many of each side's K best heads (ties by (layer, head)) the other side also has;
* **what moved most**: the heads with the largest score difference.

Scores come as ``{(layer, head): mean score}`` (what :func:`retmask.heads.load_scores` returns). Both
tables must describe one model: the head grid ``[L, Hq]`` is read from the highest layer and head each
file names, and a head one file lacks inside that grid counts as 0 there (the published files list every
head; a file cut down to its best heads still compares, and the result says how many heads were filled).

Only numpy is needed (no scipy), so ``retmask compare`` runs wherever ``retmask mask`` does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from retmask.heads.keys import RETRIEVAL_TAU, Head, SelectionError, head_key
from retmask.heads.selection import complete_scores, ranked


def average_ranks(values: np.ndarray) -> np.ndarray:
    """float64 [n] ranks 1..n of ``values`` (float [n]); tied values share the mean of their ranks."""
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, kind="mergesort")
    ordered = values[order]
    starts_group = np.r_[True, ordered[1:] != ordered[:-1]]
    group = np.cumsum(starts_group) - 1
    starts = np.flatnonzero(starts_group)
    ends = np.r_[starts[1:], len(values)]  # exclusive
    mean_rank = (starts + ends + 1) / 2.0  # mean of 1-based ranks starts+1 .. ends
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = mean_rank[group]
    return ranks


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson's r of two float [n] vectors; NaN when either is constant (r is undefined then)."""
    a = np.asarray(a, dtype=np.float64) - np.mean(a)
    b = np.asarray(b, dtype=np.float64) - np.mean(b)
    denominator = math.sqrt(float(a @ a) * float(b @ b))
    return float(a @ b) / denominator if denominator > 0 else math.nan


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's ρ of two float [n] vectors: Pearson's r of their average ranks (NaN if one is constant)."""
    return pearson(average_ranks(a), average_ranks(b))


def grid_of(scores: Mapping[Head, float]) -> tuple[int, int]:
    """``(layers, heads)`` spanned by a score table: one past the highest layer and head it names."""
    if not scores:
        raise SelectionError("a score table without heads cannot be compared")
    return max(ly for ly, _ in scores) + 1, max(h for _, h in scores) + 1


@dataclass(frozen=True)
class ScoreComparison:
    """How two score tables of one model agree. ``base`` / ``other`` are their labels."""

    base: str
    other: str
    grid: tuple[int, int]
    heads_filled: tuple[int, int]  # heads of the grid absent from (base, other), counted as 0 there
    spearman: float
    pearson: float
    max_abs_difference: float
    mean_abs_difference: float
    tau: float
    tau_base: tuple[Head, ...]
    tau_other: tuple[Head, ...]
    top_k: int
    top_overlap: int
    largest_changes: tuple[tuple[Head, float, float], ...]  # (head, base score, other score)

    @property
    def tau_shared(self) -> tuple[Head, ...]:
        return tuple(sorted(set(self.tau_base) & set(self.tau_other)))

    @property
    def only_base(self) -> tuple[Head, ...]:
        return tuple(sorted(set(self.tau_base) - set(self.tau_other)))

    @property
    def only_other(self) -> tuple[Head, ...]:
        return tuple(sorted(set(self.tau_other) - set(self.tau_base)))

    @property
    def jaccard(self) -> float:
        """|shared| / |union| of the τ sets; 1.0 when both are empty (they agree: no retrieval head)."""
        union = set(self.tau_base) | set(self.tau_other)
        return len(self.tau_shared) / len(union) if union else 1.0

    def to_json(self) -> dict:
        """JSON-ready summary; heads as ``"layer-head"`` keys, NaN correlations as ``None``."""

        def keys(heads: Sequence[Head]) -> list[str]:
            return [head_key(*h) for h in heads]

        def number(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {
            "base": self.base,
            "other": self.other,
            "grid": list(self.grid),
            "heads_filled_with_zero": {"base": self.heads_filled[0], "other": self.heads_filled[1]},
            "spearman": number(self.spearman),
            "pearson": number(self.pearson),
            "max_abs_difference": self.max_abs_difference,
            "mean_abs_difference": self.mean_abs_difference,
            "tau": self.tau,
            "tau_sets": {"base": keys(self.tau_base), "other": keys(self.tau_other)},
            "tau_shared": keys(self.tau_shared),
            "only_base": keys(self.only_base),
            "only_other": keys(self.only_other),
            "tau_jaccard": self.jaccard,
            "tau_sets_equal": set(self.tau_base) == set(self.tau_other),
            "top_k": self.top_k,
            "top_k_overlap": self.top_overlap,
            "largest_changes": [
                {"head": head_key(*h), "base": a, "other": b, "difference": b - a}
                for h, a, b in self.largest_changes
            ],
        }


def compare_scores(
    base: Mapping[Head, float],
    other: Mapping[Head, float],
    *,
    labels: tuple[str, str] = ("base", "other"),
    tau: float = RETRIEVAL_TAU,
    top_k: int = 10,
    changes: int = 10,
) -> ScoreComparison:
    """Compare two ``{(layer, head): mean score}`` tables of the same model (see the module docstring).

    Raises :class:`SelectionError` when the tables span different head grids (different models: scores
    compare head by head only within one architecture) or when ``top_k`` / ``changes`` is below 1.
    """
    if top_k < 1 or changes < 1:
        raise SelectionError(f"top_k and changes must be >= 1, got top_k={top_k}, changes={changes}")
    grid_base, grid_other = grid_of(base), grid_of(other)
    if grid_base != grid_other:
        raise SelectionError(
            f"{labels[0]} spans {grid_base[0]} layers x {grid_base[1]} heads but {labels[1]} spans "
            f"{grid_other[0]} x {grid_other[1]}: these are scores of different models, and retrieval scores "
            "compare head by head only within one model; compare files of the same model"
        )
    full_a, full_b = complete_scores(base, grid_base), complete_scores(other, grid_base)  # absent heads: 0
    heads = list(full_a)  # layer-major
    a = np.array([full_a[h] for h in heads])
    b = np.array([full_b[h] for h in heads])
    difference = np.abs(b - a)
    # Largest changes first; equal changes by (layer, head) so the list never depends on float noise order.
    moved = sorted(range(len(heads)), key=lambda i: (-difference[i], heads[i]))[:changes]
    k = min(top_k, len(heads))
    return ScoreComparison(
        base=labels[0],
        other=labels[1],
        grid=grid_base,
        heads_filled=(len(heads) - len(base), len(heads) - len(other)),
        spearman=spearman(a, b),
        pearson=pearson(a, b),
        max_abs_difference=float(difference.max()),
        mean_abs_difference=float(difference.mean()),
        tau=tau,
        tau_base=tuple(h for h in heads if full_a[h] >= tau),
        tau_other=tuple(h for h in heads if full_b[h] >= tau),
        top_k=k,
        top_overlap=len(set(ranked(full_a)[:k]) & set(ranked(full_b)[:k])),
        largest_changes=tuple(
            (heads[i], full_a[heads[i]], full_b[heads[i]]) for i in moved if difference[i] > 0
        ),
    )


def score_matrix(scores: Mapping[Head, float], grid: tuple[int, int]) -> np.ndarray:
    """float64 [L, Hq] of a score table on ``grid`` (absent heads 0)."""
    matrix = np.zeros(grid, dtype=np.float64)
    for (ly, h), value in scores.items():
        matrix[ly, h] = value
    return matrix


def score_table(matrix: np.ndarray) -> dict[Head, float]:
    """``{(layer, head): score}`` of a float [L, Hq] score matrix (the inverse of :func:`score_matrix`)."""
    matrix = np.asarray(matrix, dtype=np.float64)
    return {(ly, h): float(matrix[ly, h]) for ly in range(matrix.shape[0]) for h in range(matrix.shape[1])}


def format_comparison(cmp: ScoreComparison) -> str:
    """A plain-text report of one comparison, for the terminal."""

    def heads(hs: Sequence[Head]) -> str:
        return ", ".join(head_key(*h) for h in hs) if hs else "-"

    def corr(x: float) -> str:
        return "undefined (one side is constant)" if math.isnan(x) else f"{x:.4f}"

    rows = [
        ("Spearman over heads", corr(cmp.spearman)),
        ("Pearson over heads", corr(cmp.pearson)),
        ("|score difference|", f"max {cmp.max_abs_difference:.4f}, mean {cmp.mean_abs_difference:.4f}"),
        (f"heads >= {cmp.tau:g}", f"{len(cmp.tau_base)} vs {len(cmp.tau_other)}: {len(cmp.tau_shared)} shared, "
                                  f"Jaccard {cmp.jaccard:.2f}"),
        (f"top-{cmp.top_k} overlap", f"{cmp.top_overlap}/{cmp.top_k}"),
        ("largest changes", ", ".join(f"{head_key(*h)} {a:.3f} -> {b:.3f}" for h, a, b in cmp.largest_changes)
                            or "none: every head scores the same"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"{cmp.other} against {cmp.base} ({cmp.grid[0]} layers x {cmp.grid[1]} heads)"]
    lines += [f"  {name.ljust(width)}{value}" for name, value in rows]
    at = 4  # the one-sided heads go under the τ row (labels may be long paths: no column for them)
    lines[at + 1 : at + 1] = [f"    only in {cmp.base}: {heads(cmp.only_base)}",
                              f"    only in {cmp.other}: {heads(cmp.only_other)}"]  # fmt: skip
    filled = [
        f"{n} heads absent from {label}"
        for n, label in zip(cmp.heads_filled, (cmp.base, cmp.other), strict=True)
        if n
    ]
    if filled:
        lines.append(f"  note: {'; '.join(filled)}, counted as 0 there")
    return "\n".join(lines)
