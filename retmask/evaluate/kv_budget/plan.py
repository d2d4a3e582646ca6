"""What a KV-budget run runs: policies, budgets, configurations, and the KV heads each keeps whole."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from retmask.errors import UsageError

POLICIES = ("retrieval", "random", "non-retrieval", "streaming", "full")
BUDGET_POLICIES = ("retrieval", "random", "non-retrieval")  # one configuration (or draw) per budget
SCORED_POLICIES = ("retrieval", "non-retrieval")  # need the retrieval scores
# table and plot order: the references, then at each budget the three choices of heads
ROW_ORDER = {"full": 0, "streaming": 1, "retrieval": 2, "random": 3, "non-retrieval": 4}
TASKS = ("niah", "kv")


class KVBudgetError(UsageError):
    """Settings or files the KV-budget evaluation cannot use; the message says what to change."""


@dataclass(frozen=True)
class KVConfig:
    """One configuration: a ``policy`` at a ``budget`` (fraction of KV heads kept full; None for ``full``,
    0 for ``streaming``) and, for ``random``, the ``seed`` of the draw."""

    policy: str
    budget: float | None
    seed: int | None = None

    @property
    def name(self) -> str:
        """File-name-safe and unique: ``full``, ``streaming``, ``retrieval-b0.1``, ``random-b0.1-s2``."""
        if self.policy in ("full", "streaming"):
            return self.policy
        seed = f"-s{self.seed}" if self.policy == "random" else ""
        return f"{self.policy}-b{self.budget:g}{seed}"


def parse_budgets(text: str | Sequence[float]) -> list[float]:
    """``"0.1,0.2,0.3"`` or numbers -> sorted unique fractions in (0, 1]."""
    items = text.split(",") if isinstance(text, str) else list(text)
    budgets: list[float] = []
    for item in items:
        raw = str(item).strip()
        try:
            b = float(raw)
        except ValueError:
            raise KVBudgetError(f"budgets must be numbers like '0.1,0.2,0.3', got {raw!r}") from None
        if not (math.isfinite(b) and 0 < b <= 1):
            raise KVBudgetError(
                f"budget {raw} is not in (0, 1]: a budget is the fraction of KV heads kept full (budget 0, "
                "no full head, is the streaming policy; 1 keeps every head)"
            )
        budgets.append(b)
    if not budgets:
        raise KVBudgetError("no budget given; pass e.g. --budgets 0.1,0.2,0.3")
    return sorted(set(budgets))


def parse_names(text: str | Sequence[str], choices: Sequence[str], what: str) -> list[str]:
    """``"a,b"`` or names -> the names in ``choices`` order, each once; an unknown name is an error."""
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text)]
    bad = [s for s in items if s not in choices]
    if bad or not [s for s in items if s]:
        shown = ", ".join(repr(s) for s in bad) or "nothing"
        raise KVBudgetError(f"unknown {what} {shown}; choose from {','.join(choices)} (comma-separated)")
    return [c for c in choices if c in items]


def plan(
    policies: Sequence[str], budgets: Sequence[float], seeds: int = 3, base_seed: int = 0
) -> list[KVConfig]:
    """The configurations in run order: the reference points (full, streaming) first, then retrieval and
    non-retrieval at every budget, then one random sweep over the budgets per seed (an interrupted run
    already holds whole curves)."""
    policies = parse_names(policies, POLICIES, "policy")
    if seeds < 1:
        raise KVBudgetError(f"seeds must be >= 1, got {seeds}")
    if any(p in BUDGET_POLICIES for p in policies):
        budgets = parse_budgets(budgets)
    out = [KVConfig(p, None if p == "full" else 0.0) for p in ("full", "streaming") if p in policies]
    out += [KVConfig(p, b) for b in budgets for p in ("retrieval", "non-retrieval") if p in policies]
    if "random" in policies:
        out += [KVConfig("random", b, base_seed + s) for s in range(seeds) for b in budgets]
    return out


def check_window(window: int, sink_tokens: int, lengths: Sequence[int]) -> None:
    """Sink + window must leave some of the shortest context out, or every policy is the full cache."""
    if window < 1 or sink_tokens < 0:
        raise KVBudgetError(f"the window must be >= 1 and sink tokens >= 0, got {window} and {sink_tokens}")
    shortest = min(lengths)
    if window + sink_tokens >= shortest:
        raise KVBudgetError(
            f"--window {window} + --sink-tokens {sink_tokens} covers the shortest context ({shortest} "
            "tokens): the windowed heads would keep every key and every policy would be the full cache; "
            f"use a window below {shortest - sink_tokens} or longer contexts (--min-len)"
        )


def kv_layout(model: Any):
    """The model's ``KVLayout`` (layers, query / KV heads, the global layers the policies prune), read from
    an empty head-sparse cache so that it is exactly the one ``head_sparse_cache`` uses (it also refuses
    a model not on retmask attention, or without a global layer, here rather than mid-run)."""
    import retmask
    from retmask.hf.layers import head_layout
    from retmask.hf.sparse_kv.layer import HeadSparseLayer
    from retmask.hf.sparse_kv.policy import KVLayout

    try:
        cache = retmask.head_sparse_cache(model, full_heads=[], window=1, sink_tokens=0)
    except (ValueError, TypeError) as err:
        raise KVBudgetError(str(err)) from None
    heads = head_layout(model)
    global_layers = tuple(i for i, layer in enumerate(cache.layers) if isinstance(layer, HeadSparseLayer))
    return KVLayout(heads.num_layers, heads.num_heads, heads.kv_heads, global_layers)


def kv_scores_for(scores: Any, layout: Any) -> tuple[dict[tuple[int, int], float], str]:
    """(``{(layer, kv_head): best score of its query heads}`` over the global layers, sha256 of the query
    heads' mean scores); a scores file of another model (other [L, Hq]) is a :class:`KVBudgetError`
    naming it."""
    from retmask.evaluate.ablate import scores_digest
    from retmask.heads.keys import SelectionError
    from retmask.hf.sparse_kv.policy import kv_head_scores, read_scores

    try:
        means = read_scores(scores, layout)
    except SelectionError as err:
        raise KVBudgetError(str(err)) from None
    return kv_head_scores(means, layout), scores_digest(means)


def full_heads_for(
    cfg: KVConfig, layout: Any, kv_scores: Mapping[tuple[int, int], float] | None
) -> list[tuple[int, int]] | None:
    """The (layer, kv_head) pairs ``cfg`` keeps whole, sorted; None for ``full`` (the normal cache)."""
    from retmask.heads.selection import sample_random
    from retmask.hf.sparse_kv.policy import budget_count

    if cfg.policy == "full":
        return None
    if cfg.policy == "streaming":
        return []
    candidates = layout.candidates()
    count = budget_count(float(cfg.budget), len(candidates))
    if cfg.policy == "random":
        return sample_random(count, candidates, int(cfg.seed))
    if kv_scores is None:
        raise KVBudgetError(f"the {cfg.policy} policy ranks KV heads by retrieval score: pass --scores")
    # ties by (layer, kv_head), as the policy module ranks them, so both ends are deterministic
    if cfg.policy == "retrieval":
        order = sorted(kv_scores, key=lambda kv: (-kv_scores[kv], kv))
    else:
        order = sorted(kv_scores, key=lambda kv: (kv_scores[kv], kv))
    return sorted(order[:count])
