"""Are retrieval heads the right KV heads to keep? Accuracy against KV memory under head-sparse caches.

Each configuration answers the same tests (the NIAH grid, optionally the key–value retrieval task of
``retmask eval``) with ``model.generate`` and one KV-cache policy (``retmask.head_sparse_cache``):

* ``retrieval``      the top KV heads by retrieval score keep every key (a fraction ``budget`` of them);
* ``random``         as many random KV heads (one draw per seed: the spread a lucky pick reaches);
* ``non-retrieval``  as many of the lowest-scoring KV heads (the opposite choice);
* ``streaming``      no full head: every KV head keeps its sink + window only (StreamingLLM, budget 0);
* ``full``           transformers' ``DynamicCache`` (the reference at memory ratio 1).

The other KV heads keep their first ``sink_tokens`` keys and the last ``window``. The budget counts KV
heads of the global layers, not query heads: with GQA (g query heads per KV head) a KV head is ranked by
its best query head (``retmask.hf.sparse_kv.policy``), so budget b keeps ``ceil(b x KV heads)`` KV heads
whole, i.e. their g query heads each. The memory a configuration holds follows from it: about
``b + (1 - b) (S + W) / N`` of the full cache at N tokens; it is measured from the cache after each
generation (``memory_bytes``), not computed.

Every configuration is written atomically to ``<out_dir>/<prefix>.configs/<name>.json`` when it completes,
with the fingerprint of the settings that determine it, so ``resume=True`` continues an interrupted run and
refuses files written with other settings (the ``retmask ablate`` rules, ``retmask.runfiles``). While a
configuration runs, its answered tests wait in ``<name>.json.progress.json``
(``retmask.evaluate.niah_progress``), so a resume does not answer them again either.

Importing this module loads neither torch nor matplotlib (the command's argument checks use its parsers).

plan.py     policies, budgets, the configurations in run order and the KV heads each keeps whole
answers.py  the tests (NIAH grid, key-value lists) and one configuration's answers (``run_config``)
results.py  per-configuration results, the table over policies and budgets, saved files read back
run.py      ``run_kv_budget``: the whole resumable run
plot.py     accuracy against KV memory held
"""

from retmask.evaluate.kv_budget.answers import KV_TASK_SEED, Item, build_items, cache_bytes, run_config
from retmask.evaluate.kv_budget.plan import (
    BUDGET_POLICIES,
    POLICIES,
    SCORED_POLICIES,
    TASKS,
    KVBudgetError,
    KVConfig,
    check_window,
    full_heads_for,
    kv_layout,
    kv_scores_for,
    parse_budgets,
    parse_names,
    plan,
)
from retmask.evaluate.kv_budget.plot import plot_kv_budget
from retmask.evaluate.kv_budget.results import TASK_LABELS, ConfigResult, KVBudgetResult
from retmask.evaluate.kv_budget.run import run_kv_budget

__all__ = [
    "BUDGET_POLICIES",
    "KV_TASK_SEED",
    "POLICIES",
    "SCORED_POLICIES",
    "TASKS",
    "TASK_LABELS",
    "ConfigResult",
    "Item",
    "KVBudgetError",
    "KVBudgetResult",
    "KVConfig",
    "build_items",
    "cache_bytes",
    "check_window",
    "full_heads_for",
    "kv_layout",
    "kv_scores_for",
    "parse_budgets",
    "parse_names",
    "plan",
    "plot_kv_budget",
    "run_config",
    "run_kv_budget",
]
