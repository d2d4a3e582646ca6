"""Which KV heads a head-sparse cache keeps whole ("full"), from per-query-head retrieval scores.

Scores are per *query* head (``{"layer-head": [scores]}``, what ``retmask detect`` writes), but a cache
keeps or prunes *KV* heads: with GQA, the ``g = Hq / Hkv`` query heads ``kv * g .. kv * g + g - 1`` (the
``repeat_kv`` order transformers and the kernel use) all read the keys of KV head ``kv``. Pruning a KV head
cuts every one of its query heads off the long context, so a KV head is ranked by its *best* query head:

* ``tau=τ``: a KV head is full when any of its query heads scores ≥ τ (retrieval heads are usually
  taken as those with a mean score ≥ 0.1, ``retmask.heads.keys.RETRIEVAL_TAU``). The number of full heads
  then follows the model: use it to keep exactly the detected retrieval heads' keys.
* ``budget=``: the top KV heads by that best score (ties by (layer, kv_head)), a fraction in (0, 1] of
  the candidate KV heads (rounded up, so a small fraction keeps at least one) or an int count. Use it to
  fix the memory: the cache's size then depends on the budget, not on how many heads pass a threshold.
* ``full_heads=[(layer, kv_head), ...]``: an explicit set (random or other baselines; ``[]`` =
  StreamingLLM on every head).

Candidates are the KV heads of the model's global (full-attention) layers only: local sliding-window layers
(Gemma 2/3, Cohere 2, OLMo 3, ...) already bound their cache (transformers' sliding-window cache keeps
their last ``window - 1`` keys for every head), so the policy leaves them as they are and a budget fraction
counts global KV heads only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retmask.heads.keys import Head, SelectionError, parse_head_pair
from retmask.heads.layout import check_heads
from retmask.heads.selection import load_scores, mean_scores

KVHead = tuple[int, int]
"""``(layer, kv_head)``, both 0-based."""


@dataclass(frozen=True)
class KVLayout:
    """Head geometry for the policy: ``num_layers`` L, ``num_q_heads`` Hq, ``num_kv_heads`` Hkv and the
    layers whose cache the policy may prune (``global_layers``, full attention)."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    global_layers: tuple[int, ...]

    @property
    def groups(self) -> int:
        """g = Hq / Hkv query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    def candidates(self) -> list[KVHead]:
        """Every KV head of the global layers, in (layer, kv_head) order."""
        return [(layer, kv) for layer in self.global_layers for kv in range(self.num_kv_heads)]


def read_scores(scores: str | Path | Mapping[Any, Any], layout: KVLayout) -> dict[Head, float]:
    """Mean score per (layer, query head) of ``scores`` (a scores file path, a raw ``{"layer-head":
    [scores]}`` mapping or ``{(layer, head): mean}``), checked to cover exactly the model's [L, Hq] heads."""
    if isinstance(scores, (str, Path)):
        means = load_scores(scores)
        source = f"scores file {scores}"
    elif isinstance(scores, Mapping) and scores and all(isinstance(k, str) for k in scores):
        means = mean_scores(scores)
        source = "scores"
    elif isinstance(scores, Mapping) and scores:
        means = {parse_head_pair(k, "scores key"): float(v) for k, v in scores.items()}
        source = "scores"
    else:
        raise SelectionError(
            "scores must be a scores JSON path, a {'layer-head': [scores]} mapping or {(layer, head): mean} "
            f"(non-empty), got {type(scores).__name__}{' (empty)' if isinstance(scores, Mapping) else ''}"
        )
    shape = (layout.num_layers, layout.num_q_heads)
    check_heads(list(means), shape, source=source)  # a head beyond the model: a file of another model
    expected = layout.num_layers * layout.num_q_heads
    if len(means) != expected:
        missing = next(
            (layer, h) for layer in range(shape[0]) for h in range(shape[1]) if (layer, h) not in means
        )
        raise SelectionError(
            f"{source}: scores for {len(means)} heads, but the model has [L, Hq] = {list(shape)} = {expected} "
            f"query heads (e.g. head [{missing[0]}, {missing[1]}] has none); the scores were made for another "
            "model: pass the scores file `retmask detect` wrote for this model"
        )
    return means


def kv_head_scores(means: Mapping[Head, float], layout: KVLayout) -> dict[KVHead, float]:
    """The score of every candidate KV head: the best score among its ``g`` query heads."""
    g = layout.groups
    return {
        (layer, kv): max(means[(layer, kv * g + i)] for i in range(g)) for layer, kv in layout.candidates()
    }


def budget_count(budget: Any, candidates: int) -> int:
    """How many KV heads ``budget`` keeps full: an int count in [1, candidates] or a fraction in (0, 1]
    (rounded up)."""
    fix = (
        f"pass budget as a fraction in (0, 1] or a count from 1 to {candidates} (the KV heads of the "
        "model's global layers); for no full head at all pass full_heads=[] (StreamingLLM)"
    )
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise SelectionError(f"budget={budget!r} is not a number; {fix}")
    if isinstance(budget, int):
        if not 1 <= budget <= candidates:
            raise SelectionError(f"budget={budget} KV heads is outside [1, {candidates}]; {fix}")
        return budget
    if not (math.isfinite(budget) and 0 < budget <= 1):
        raise SelectionError(f"budget={budget!r} is not a fraction in (0, 1]; {fix}")
    # ceil with a little slack, so that e.g. 0.3 of 10 heads (3.0000000000000004 in floats) is 3, not 4
    return max(1, math.ceil(budget * candidates - 1e-9))


def _explicit(full_heads: Iterable[Any], layout: KVLayout) -> list[KVHead]:
    if isinstance(full_heads, (str, bytes)) or not isinstance(full_heads, Iterable):
        raise SelectionError(
            f"full_heads must be a list of (layer, kv_head) pairs, got {type(full_heads).__name__}"
        )
    heads: list[KVHead] = []
    for i, item in enumerate(full_heads):
        layer, kv = parse_head_pair(item, f"full_heads[{i}]")
        if layer >= layout.num_layers or kv >= layout.num_kv_heads:
            raise SelectionError(
                f"full_heads[{i}] = ({layer}, {kv}) does not exist: the model has {layout.num_layers} layers of "
                f"{layout.num_kv_heads} KV heads (pairs are (layer, kv_head), not query heads)"
            )
        if layer not in layout.global_layers:
            raise SelectionError(
                f"full_heads[{i}] = ({layer}, {kv}) is in layer {layer}, a sliding-window layer whose cache "
                "keeps its own window for every head; name KV heads of the global layers "
                f"{list(layout.global_layers)} only"
            )
        if (layer, kv) in heads:
            raise SelectionError(f"full_heads[{i}] = ({layer}, {kv}) appears twice")
        heads.append((layer, kv))
    return sorted(heads)


def full_kv_heads(
    layout: KVLayout,
    *,
    scores: str | Path | Mapping[Any, Any] | None = None,
    budget: int | float | None = None,
    tau: float | None = None,
    full_heads: Iterable[Any] | None = None,
) -> list[KVHead]:
    """The (layer, kv_head) pairs kept whole, sorted: exactly one of ``budget``, ``tau`` (both with
    ``scores``) or ``full_heads`` (without scores). See the module docstring for the rules."""
    chosen = [
        name
        for name, value in (("budget", budget), ("tau", tau), ("full_heads", full_heads))
        if value is not None
    ]
    if len(chosen) != 1:
        raise SelectionError(
            "pass exactly one of budget= (fraction or count of KV heads), tau= (score threshold) or "
            f"full_heads= (explicit (layer, kv_head) pairs); got {chosen or 'none'}"
        )
    if full_heads is not None:
        if scores is not None:
            raise SelectionError("full_heads= names the heads itself: pass scores= only with budget= or tau=")
        return _explicit(full_heads, layout)
    if scores is None:
        raise SelectionError(
            f"{chosen[0]}= ranks heads by retrieval score: pass scores= (a scores file or mapping)"
        )
    if not layout.global_layers:
        raise SelectionError(
            "the model has no global (full-attention) layer whose cache the policy could prune"
        )
    kv_scores = kv_head_scores(read_scores(scores, layout), layout)
    ranked = sorted(kv_scores, key=lambda kv: (-kv_scores[kv], kv))
    if budget is not None:
        return sorted(ranked[: budget_count(budget, len(ranked))])
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau):
        raise SelectionError(f"tau must be a finite number (a retrieval score threshold), got {tau!r}")
    kept = [kv for kv in ranked if kv_scores[kv] >= tau]
    if not kept:
        raise SelectionError(
            f"no KV head has a query head with score >= tau={tau} (the best is {kv_scores[ranked[0]]:.4g}); "
            "lower tau, use budget=, or pass full_heads=[] for StreamingLLM on every head"
        )
    return sorted(kept)
