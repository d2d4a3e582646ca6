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
refuses files written with other settings (the ``retmask ablate`` rules, ``retmask.runfiles``).

Importing this module loads neither torch nor matplotlib (the command's argument checks use its parsers).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retmask.errors import UsageError
from retmask.runfiles import JsonFile, atomic_write_json, atomic_write_text, check_same_settings

POLICIES = ("retrieval", "random", "non-retrieval", "streaming", "full")
BUDGET_POLICIES = ("retrieval", "random", "non-retrieval")  # one configuration (or draw) per budget
SCORED_POLICIES = ("retrieval", "non-retrieval")  # need the retrieval scores
# table and plot order: the references, then at each budget the three choices of heads
ROW_ORDER = {"full": 0, "streaming": 1, "retrieval": 2, "random": 3, "non-retrieval": 4}
TASKS = ("niah", "kv")
TASK_LABELS = {"niah": "NIAH (ROUGE-1 recall)", "kv": "key-value (exact match)"}
KV_TASK_SEED = 0  # the key-value lists of `retmask eval`'s default seed: every configuration sees the same
SUMMARY_VERSION = 1
CONFIG_VERSION = 1

# Plot style per policy: colour, marker; the line joins a policy's budgets.
# Different line styles and sizes keep policies that score the same (all at 0, say) visible on each other.
STYLE = {
    "retrieval": ("#d62728", "o", "-", 7),
    "random": ("#1f77b4", "s", "--", 6),
    "non-retrieval": ("#9467bd", "^", "-.", 6),
    "streaming": ("#7f7f7f", "X", "", 8),
    "full": ("#000000", "*", "", 11),
}


class KVBudgetError(UsageError):
    """Settings or files the KV-budget evaluation cannot use; the message says what to change."""


# --- what to run ---------------------------------------------------------------------------------------


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
    from retmask.hf.sparse_kv.layer import HeadSparseLayer
    from retmask.hf.sparse_kv.policy import KVLayout

    try:
        cache = retmask.head_sparse_cache(model, full_heads=[], window=1, sink_tokens=0)
    except (ValueError, TypeError) as err:
        raise KVBudgetError(str(err)) from None
    config = model.config.get_text_config(decoder=True)
    num_q = int(config.num_attention_heads)
    num_kv = int(getattr(config, "num_key_value_heads", None) or num_q)
    global_layers = tuple(i for i, layer in enumerate(cache.layers) if isinstance(layer, HeadSparseLayer))
    return KVLayout(int(config.num_hidden_layers), num_q, num_kv, global_layers)


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


# --- the tests ----------------------------------------------------------------------------------------


@dataclass
class Item:
    """One question: ``prompt_ids`` int64 [n]; ``target`` the needle sentence (NIAH, scored by ROUGE-1
    recall) or the value (key–value, exact match of the first number)."""

    task: str
    key: str
    length: int
    depth: int
    prompt_ids: Any
    target: str

    def score(self, response: str) -> float:
        """In [0, 1]: the NIAH ROUGE-1 recall of the needle, or 1.0 / 0.0 for the key–value answer."""
        if self.task == "niah":
            from retmask.niah import rouge1_recall

            return float(rouge1_recall(self.target, response))
        from retmask.evaluate.synthetic import exact_number

        return 1.0 if exact_number(self.target, response) else 0.0


def build_items(
    tokenizer: Any,
    tasks: Sequence[str],
    *,
    lengths: Sequence[int],
    depths: Sequence[int],
    needles: Sequence[Any],
    haystack_text: str,
    prompt_style: str,
) -> tuple[list[Item], list[dict]]:
    """(items, skipped NIAH tests): the NIAH grid (``retmask.niah.build_tests``, the detection protocol's
    prompts) and/or the key–value lists of ``retmask eval`` at the same lengths, asked at the same depths
    (percent of the list). ``prompt_style``: the resolved one, "chat" or "base"."""
    from retmask.evaluate.synthetic import kv_items
    from retmask.niah import build_tests

    items: list[Item] = []
    skipped: list[dict] = []
    if "niah" in tasks:
        tests = build_tests(tokenizer, needles, haystack_text, lengths, depths, chat=prompt_style == "chat")
        for t in tests:
            if t.insertion < 0:
                skipped.append({"key": t.key, "reason": t.skip_reason})
                continue
            items.append(
                Item("niah", t.key, t.length, t.depth, t.prompt_ids, needles[t.needle_index].real_needle)
            )
        if not any(i.task == "niah" for i in items):
            raise KVBudgetError(
                f"no NIAH test can run: all {len(tests)} contexts are too short for the needle and its buffer "
                f"(e.g. {tests[-1].skip_reason}); raise --min-len/--max-len"
            )
    if "kv" in tasks:
        try:
            kv = kv_items(tokenizer, lengths, depths, seed=KV_TASK_SEED)
        except ValueError as err:
            raise KVBudgetError(f"key-value task: {err}") from None
        items += [Item("kv", k.key, k.length, k.depth, k.prompt_ids, k.answer) for k in kv]
    return items, skipped


# --- one configuration --------------------------------------------------------------------------------


def cache_bytes(cache: Any) -> int:
    """Bytes a cache holds: ``memory_bytes()`` of a head-sparse cache (allocated buffers), else the K and
    V tensors of every initialised layer (a ``DynamicCache``)."""
    if hasattr(cache, "memory_bytes"):
        return int(cache.memory_bytes())
    total = 0
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)
    return total


def run_config(
    model: Any,
    tokenizer: Any,
    items: Sequence[Item],
    full_heads: list[tuple[int, int]] | None,
    *,
    window: int,
    sink_tokens: int,
    max_new_tokens: int,
    stop_ids: Iterable[int],
    progress: bool = False,
    desc: str = "kv",
) -> list[dict]:
    """Answer every item with ``model.generate`` (greedy, at most ``max_new_tokens``, stopping after a
    newline / EOS token) on a new cache per item: a ``DynamicCache`` when ``full_heads`` is None, else a
    head-sparse cache keeping ``full_heads`` whole. Returns one entry per item with its response, score
    and the bytes the cache held after generation (and what the full cache holds for the same tokens)."""
    import torch
    from tqdm import tqdm
    from transformers import DynamicCache, GenerationConfig

    import retmask
    from retmask.hf.generation import _only_config
    from retmask.hf.kv_cache import cache_kwargs

    eos = sorted(int(i) for i in stop_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad, use_cache=True
    )
    device = next(model.parameters()).device
    entries = []
    # the model's own generation defaults (repetition penalty, ...) set aside: the answer is the argmax
    with (
        torch.no_grad(),
        _only_config(model),
        tqdm(total=len(items), desc=desc, unit="test", disable=not progress, leave=False) as bar,
    ):
        for it in items:
            ids = torch.as_tensor(it.prompt_ids, dtype=torch.long, device=device)[None]
            if full_heads is None:
                cache = DynamicCache(config=model.config)
            else:
                # reserved at prompt + new tokens: the full heads' buffers are allocated once, at most
                # max_new_tokens positions more than they end up holding (not grown by 1/8 past the prompt)
                cache = retmask.head_sparse_cache(
                    model, full_heads=full_heads, window=window, sink_tokens=sink_tokens,
                    max_length=ids.shape[1] + max_new_tokens,
                )  # fmt: skip
            t0 = time.perf_counter()
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                **cache_kwargs(model, cache),
            )  # fmt: skip
            seconds = time.perf_counter() - t0
            tokens = out[0, ids.shape[1] :].tolist()
            response = tokenizer.decode(tokens, skip_special_tokens=True).strip()
            held = cache_bytes(cache)
            full = held if full_heads is None else int(cache.full_cache_bytes())
            entries.append(
                {
                    "task": it.task, "key": it.key, "length": it.length, "depth": it.depth,
                    "prompt_tokens": int(ids.shape[1]), "new_tokens": len(tokens), "response": response,
                    "recall": it.score(response), "memory_bytes": held, "full_cache_bytes": full,
                    "seconds": round(seconds, 3),
                }
            )  # fmt: skip
            del cache, out
            bar.update(1)
    return entries


@dataclass
class ConfigResult:
    """A configuration's answers. ``full_heads``: the KV heads kept whole (None: the normal cache);
    ``entries``: per test ``{task, key, length, depth, response, recall, memory_bytes, full_cache_bytes,
    ...}``; ``candidates``: the KV heads a budget counts."""

    config: KVConfig
    full_heads: list[tuple[int, int]] | None
    entries: list[dict]
    candidates: int
    run_s: float = 0.0

    @property
    def memory_ratio(self) -> float:
        """Bytes held over the full cache's bytes, summed over the tests (weighted by their size)."""
        full = sum(e["full_cache_bytes"] for e in self.entries)
        return sum(e["memory_bytes"] for e in self.entries) / full if full else float("nan")

    @property
    def full_kv_count(self) -> int:
        """KV heads keeping every key (all candidates for the normal cache)."""
        return self.candidates if self.full_heads is None else len(self.full_heads)

    @property
    def memory_bytes(self) -> int:
        """The largest cache of the configuration's tests (the longest context), bytes held."""
        return max((e["memory_bytes"] for e in self.entries), default=0)

    @property
    def full_cache_bytes(self) -> int:
        """The full cache's bytes at the same test (the largest)."""
        return max((e["full_cache_bytes"] for e in self.entries), default=0)

    def task_means(self) -> dict[str, float]:
        """Mean score per task run."""
        out: dict[str, float] = {}
        for task in TASKS:
            values = [e["recall"] for e in self.entries if e["task"] == task]
            if values:
                out[task] = math.fsum(values) / len(values)
        return out

    @property
    def mean(self) -> float:
        """Mean score over every test (tasks pooled)."""
        if not self.entries:
            return float("nan")
        return math.fsum(e["recall"] for e in self.entries) / len(self.entries)

    def to_json(self) -> dict:
        c = self.config
        return {
            "name": c.name, "policy": c.policy, "budget": c.budget, "seed": c.seed,
            "full_heads": None if self.full_heads is None else [list(h) for h in self.full_heads],
            "full_kv_heads": self.full_kv_count,
            "candidate_kv_heads": self.candidates, "memory_bytes": self.memory_bytes,
            "full_cache_bytes": self.full_cache_bytes, "memory_ratio": self.memory_ratio,
            "means": self.task_means(), "mean": self.mean, "run_s": round(self.run_s, 3),
            "entries": self.entries,
        }  # fmt: skip


# --- the whole run ------------------------------------------------------------------------------------


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    return {
        "mean": statistics.fmean(values) if values else None,
        "std": statistics.stdev(values) if len(values) > 1 else (0.0 if values else None),
        "min": min(values) if values else None,
        "max": max(values) if values else None,
    }


@dataclass
class KVBudgetResult:
    """configs: the plan in run order; results: per configuration name, its answers (those done)."""

    configs: list[KVConfig]
    results: dict[str, ConfigResult]
    meta: dict = field(default_factory=dict)

    def tasks(self) -> list[str]:
        return [t for t in TASKS if t in self.meta.get("tasks", TASKS)]

    def rows(self) -> list[dict]:
        """One row per (policy, budget) with results (full, streaming, then by budget: retrieval, random,
        non-retrieval): the full KV heads kept, the memory ratio (mean over the draws) and per task the
        mean, std, min and max over the draws (``n``; one for every policy but random)."""
        groups: dict[tuple[str, float | None], list[ConfigResult]] = {}
        for c in self.configs:
            if c.name in self.results:
                groups.setdefault((c.policy, c.budget), []).append(self.results[c.name])
        rows = []
        for (policy, budget), done in groups.items():
            row = {
                "policy": policy,
                "budget": budget,
                "n": len(done),
                "seeds": [r.config.seed for r in done if r.config.seed is not None],
                "full_kv_heads": done[0].full_kv_count,
                "candidate_kv_heads": done[0].candidates,
                "memory_ratio": statistics.fmean(r.memory_ratio for r in done),
                "memory_bytes": max(r.memory_bytes for r in done),
                "full_cache_bytes": max(r.full_cache_bytes for r in done),
                "tasks": {},
            }
            for task in self.tasks():
                values = [r.task_means()[task] for r in done if task in r.task_means()]
                row["tasks"][task] = {**_spread(values), "values": values}
            rows.append(row)
        return sorted(rows, key=lambda r: (r["budget"] or 0.0, ROW_ORDER[r["policy"]]))

    def table(self) -> str:
        """Markdown: policy x budget -> KV heads kept, memory ratio, each task's mean (± std over seeds)."""
        tasks = self.tasks()
        lines = [
            "| policy | budget | full KV heads | KV memory ratio | "
            + " | ".join(TASK_LABELS[t] for t in tasks)
            + " |",
            "|---|---|---|---|" + "---|" * len(tasks),
        ]
        for r in self.rows():
            budget = "-" if r["budget"] is None else f"{r['budget']:g}"
            cells = []
            for t in tasks:
                s = r["tasks"][t]
                if s["mean"] is None:
                    cells.append("-")
                elif r["policy"] == "random":
                    cells.append(f"{s['mean']:.3f} ± {s['std']:.3f} ({r['n']} seeds)")
                else:
                    cells.append(f"{s['mean']:.3f}")
            lines.append(
                f"| {r['policy']} | {budget} | {r['full_kv_heads']}/{r['candidate_kv_heads']} | "
                f"{r['memory_ratio']:.3f} | " + " | ".join(cells) + " |"
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        configs = [self.results[c.name].to_json() for c in self.configs if c.name in self.results]
        return {"version": SUMMARY_VERSION, "meta": self.meta, "rows": self.rows(), "configs": configs}


def _read_config(
    path: Path,
    fingerprint: dict,
    planned: Mapping[str, tuple[KVConfig, list | None]],
    item_keys: list[tuple[str, str]],
    candidates: int,
) -> ConfigResult | None:
    """A saved configuration of this run (None: one the current plan does not hold); written with other
    settings, other heads or edited entries -> :class:`KVBudgetError` naming the file."""
    fix = "rerun with the same flags, or --overwrite to start over"
    f = JsonFile(path, "KV-budget result", "delete it to recompute that configuration", KVBudgetError)
    saved = f.expect(f.read(), dict, "the file")
    if saved.get("version") != CONFIG_VERSION:
        f.fail(f"version {saved.get('version')!r} is not {CONFIG_VERSION}")
    check_same_settings(saved.get("fingerprint"), fingerprint, path=path, fix=fix, error=KVBudgetError)
    name = f.key(saved, "name", str)
    if name not in planned:
        return None
    cfg, heads = planned[name]
    want = None if heads is None else [list(h) for h in heads]
    if saved.get("full_heads") != want:
        raise KVBudgetError(
            f"--resume: {path} was written by a run with other settings (its full KV heads differ: scores, "
            f"seeds or budgets changed); {fix}"
        )
    entries = f.key(saved, "entries", list)
    for i, e in enumerate(entries):
        at = f"entries[{i}]"
        f.expect(e, dict, at)
        f.number(f.key(e, "recall", float, at), f"{at}.recall", lo=0, hi=1)
        for k in ("memory_bytes", "full_cache_bytes"):
            f.number(f.key(e, k, int, at), f"{at}.{k}", integer=True, lo=0)
        f.key(e, "task", str, at)
        f.key(e, "key", str, at)
    if [(e["task"], e["key"]) for e in entries] != item_keys:
        f.fail("its tests are not this run's tests (edited, or written by another version)")
    run_s = f.number(saved.get("run_s", 0.0), "run_s", lo=0)
    return ConfigResult(cfg, heads, entries, candidates, run_s)


def run_kv_budget(
    model: Any,
    tokenizer: Any,
    *,
    scores: Any = None,
    policies: Sequence[str] = POLICIES,
    budgets: Sequence[float] = (0.1, 0.2, 0.3),
    seeds: int = 3,
    base_seed: int = 0,
    window: int = 256,
    sink_tokens: int = 4,
    tasks: Sequence[str] = ("niah",),
    lengths: Sequence[int],
    depths: Sequence[int],
    needles: Any = None,
    haystack_text: str | None = None,
    max_new_tokens: int = 50,
    prompt_style: str = "auto",
    out_dir: str | Path | None = None,
    prefix: str = "kv",
    resume: bool = False,
    overwrite: bool = False,
    limit: int | None = None,
    model_name: str | None = None,
    progress: bool = True,
    log: Callable[[str], Any] = print,
) -> KVBudgetResult:
    """Run every configuration of :func:`plan` (resuming finished ones with ``resume``) and, with
    ``out_dir``, write ``<prefix>.json`` (every configuration and its tests) and ``<prefix>.md`` (the
    table); the plot is :func:`plot_kv_budget`'s.

    scores: a scores JSON path, a ``{"layer-head": [scores]}`` mapping or ``{(layer, head): mean}`` covering
    the model's [L, Hq] heads; needed by the retrieval and non-retrieval policies. ``limit``: run at most
    that many new configurations, then stop (the result holds what is done).
    """
    from tqdm import tqdm

    from retmask.detect.run import check_context_limit
    from retmask.detect.stopping import stop_token_ids
    from retmask.evaluate.niah import grid_fingerprint
    from retmask.niah import load_haystack, load_needles, resolve_prompt_style

    policies = parse_names(policies, POLICIES, "policy")
    tasks = parse_names(tasks, TASKS, "task")
    configs = plan(policies, budgets, seeds, base_seed)
    lengths, depths = [int(x) for x in lengths], [int(x) for x in depths]
    check_window(window, sink_tokens, lengths)
    if max_new_tokens < 1:
        raise KVBudgetError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if resume and overwrite:
        raise KVBudgetError("--resume and --overwrite exclude each other; pick one")
    if limit is not None and limit < 1:
        raise KVBudgetError(f"--limit must be >= 1, got {limit}")
    try:
        check_context_limit(model, lengths, max_new_tokens)
    except ValueError as err:
        raise KVBudgetError(str(err)) from None

    layout = kv_layout(model)
    candidates = len(layout.candidates())
    needs_scores = any(p in SCORED_POLICIES for p in policies)
    if needs_scores and scores is None:
        raise KVBudgetError(
            "the retrieval and non-retrieval policies rank KV heads by retrieval score: pass --scores (the "
            "scores JSON `retmask detect` wrote for this model), or leave them out of --policies"
        )
    kv_scores, means_digest = kv_scores_for(scores, layout) if scores is not None else (None, None)
    planned = {c.name: (c, full_heads_for(c, layout, kv_scores)) for c in configs}
    counts: dict[int, list[float]] = {}
    for c, heads in planned.values():
        if c.policy in BUDGET_POLICIES and c.budget not in counts.get(len(heads), []):
            counts.setdefault(len(heads), []).append(c.budget)
    for n, same in counts.items():
        if len(same) > 1:  # rounding up to whole heads on a model with few KV heads
            log(f"note: budgets {', '.join(f'{b:g}' for b in same)} all keep {n} of {candidates} KV heads")

    needle_list = (
        load_needles(needles) if needles is None or isinstance(needles, (str, Path)) else list(needles)
    )
    text = load_haystack(None) if haystack_text is None else haystack_text
    style = resolve_prompt_style(tokenizer, prompt_style)
    items, skipped = build_items(
        tokenizer, tasks, lengths=lengths, depths=depths, needles=needle_list, haystack_text=text,
        prompt_style=style,
    )  # fmt: skip
    for s in skipped:
        log(f"skipped NIAH test {s['key']}: {s['reason']}")
    shortest = min(items, key=lambda i: len(i.prompt_ids))
    if window + sink_tokens >= len(shortest.prompt_ids):
        # the grid check above compares the nominal lengths; a NIAH prompt is ~140 tokens shorter (its
        # 200-token buffer), so the prompts themselves are checked too
        raise KVBudgetError(
            f"--window {window} + --sink-tokens {sink_tokens} covers the shortest prompt ({shortest.task} test "
            f"{shortest.key}: {len(shortest.prompt_ids)} tokens): its windowed heads would keep every key; use "
            f"a window below {len(shortest.prompt_ids) - sink_tokens} or longer contexts (--min-len)"
        )
    item_keys = [(i.task, i.key) for i in items]
    fingerprint = grid_fingerprint(
        model, model_name, lengths, depths, needle_list, text, max_new_tokens, style
    ) | {
        "kv_layout": {
            "layers": layout.num_layers, "q_heads": layout.num_q_heads, "kv_heads": layout.num_kv_heads,
            "global_layers": list(layout.global_layers),
        },
        "scores_sha256": means_digest, "window": window, "sink_tokens": sink_tokens, "tasks": tasks,
        "kv_task_seed": KV_TASK_SEED, "decoding": "model.generate, greedy",
    }  # fmt: skip

    cdir = Path(out_dir) / f"{prefix}.configs" if out_dir is not None else None
    results: dict[str, ConfigResult] = {}
    if cdir is not None and cdir.is_dir():
        existing = sorted(cdir.glob("*.json"))
        if existing and not (resume or overwrite):
            raise KVBudgetError(
                f"{cdir} already holds {len(existing)} configuration results; pass --resume to continue that "
                "run, --overwrite to start over, or another --out-dir"
            )
        if overwrite:  # only now: every check above passed, so a refused run deletes nothing
            for path in existing:
                path.unlink(missing_ok=True)
        other = 0
        for path in existing if resume else []:
            res = _read_config(path, fingerprint, planned, item_keys, candidates)
            if res is None:
                other += 1
            else:
                results[res.config.name] = res
        if results or other:
            log(
                f"resuming: {len(results)} of {len(configs)} configurations already done"
                + (f" ({other} saved ones are not in this plan and are left out)" if other else "")
            )

    stop_ids = stop_token_ids(tokenizer, model)
    t0 = time.perf_counter()
    bar = tqdm(total=len(configs), initial=len(results), desc="kv", unit="config", disable=not progress)
    ran = 0
    for c in configs:
        if c.name in results:
            continue
        if limit is not None and ran >= limit:
            break
        ran += 1
        bar.set_postfix_str(c.name)
        heads = planned[c.name][1]
        start = time.perf_counter()
        entries = run_config(
            model, tokenizer, items, heads, window=window, sink_tokens=sink_tokens,
            max_new_tokens=max_new_tokens, stop_ids=stop_ids, progress=progress, desc=c.name,
        )  # fmt: skip
        res = ConfigResult(c, heads, entries, candidates, time.perf_counter() - start)
        results[c.name] = res
        if cdir is not None:
            atomic_write_json(
                cdir / f"{c.name}.json",
                {"version": CONFIG_VERSION, "fingerprint": fingerprint, **res.to_json()},
            )
        bar.update(1)
    bar.close()
    meta = {
        **{k: v for k, v in fingerprint.items() if k != "needles"},
        "needles": len(needle_list),
        "policies": policies,
        "budgets": sorted({c.budget for c in configs if c.policy in BUDGET_POLICIES}),
        "seeds": seeds,
        "base_seed": base_seed,
        "candidate_kv_heads": candidates,
        "tests_per_config": len(items),
        "skipped": skipped,
        "configs_done": len(results),
        "configs_total": len(configs),
        "run_s_this_process": round(time.perf_counter() - t0, 1),
    }
    out = KVBudgetResult(configs, results, meta)
    if out_dir is not None:
        out_dir = Path(out_dir)
        atomic_write_json(out_dir / f"{prefix}.json", out.to_json())
        atomic_write_text(out_dir / f"{prefix}.md", out.table() + "\n")
    return out


# --- the plot -----------------------------------------------------------------------------------------


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
