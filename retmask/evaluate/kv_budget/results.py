"""A KV-budget run's results: per configuration, the table over policies and budgets, saved files."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from retmask.evaluate.kv_budget.plan import ROW_ORDER, TASKS, KVBudgetError, KVConfig
from retmask.runfiles import JsonFile, check_same_settings

TASK_LABELS = {"niah": "NIAH (ROUGE-1 recall)", "kv": "key-value (exact match)"}
SUMMARY_VERSION = 1
CONFIG_VERSION = 1


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


def check_kv_entry(f: JsonFile, entry: dict, where: str) -> None:
    """Raise naming ``where`` unless ``entry`` has the fields of a :func:`run_config` entry that the
    results use (a saved configuration's or a progress file's)."""
    f.number(f.key(entry, "recall", float, where), f"{where}.recall", lo=0, hi=1)
    for k in ("memory_bytes", "full_cache_bytes"):
        f.number(f.key(entry, k, int, where), f"{where}.{k}", integer=True, lo=0)
    for k in ("task", "key"):
        f.key(entry, k, str, where)
    for k in ("length", "depth"):
        f.key(entry, k, int, where)


def read_config(
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
        check_kv_entry(f, e, at)
    if [(e["task"], e["key"]) for e in entries] != item_keys:
        f.fail("its tests are not this run's tests (edited, or written by another version)")
    run_s = f.number(saved.get("run_s", 0.0), "run_s", lo=0)
    return ConfigResult(cfg, heads, entries, candidates, run_s)
