"""``run_kv_budget``: every configuration of a plan, resumable, with the summary files."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from retmask.evaluate.config_runs import ConfigFolder, remaining
from retmask.evaluate.kv_budget.answers import KV_TASK_SEED, build_items, run_config
from retmask.evaluate.kv_budget.plan import (
    BUDGET_POLICIES,
    POLICIES,
    SCORED_POLICIES,
    TASKS,
    KVBudgetError,
    check_window,
    full_heads_for,
    kv_layout,
    kv_scores_for,
    parse_names,
    plan,
)
from retmask.evaluate.kv_budget.results import (
    CONFIG_VERSION,
    ConfigResult,
    KVBudgetResult,
    check_kv_entry,
    read_config,
)
from retmask.runfiles import atomic_write_json, atomic_write_text


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
    prefill: str = "windowed",
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
    from retmask.detect.run import check_context_limit
    from retmask.detect.stopping import stop_token_ids
    from retmask.evaluate.niah import grid_fingerprint, model_precision
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
        # only when not the default, so runs begun before the option still resume
        **({"prefill": prefill} if prefill != "windowed" else {}),
        "kv_task_seed": KV_TASK_SEED, "decoding": "model.generate, greedy",
    }  # fmt: skip

    folder = ConfigFolder(out_dir, prefix, KVBudgetError)
    results: dict[str, ConfigResult] = {}
    other = 0
    for path in folder.saved(resume=resume, overwrite=overwrite):
        res = read_config(path, fingerprint, planned, item_keys, candidates)
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
    for c in remaining(configs, results, limit=limit, desc="kv", progress=progress):
        heads = planned[c.name][1]
        # the running configuration's answered tests, so an interrupt loses no answered test
        settings = {**fingerprint, "full_heads": None if heads is None else [list(h) for h in heads]}
        done, save = folder.running(c.name, settings, resume=resume, check_entry=check_kv_entry)
        start = time.perf_counter()
        entries = run_config(
            model, tokenizer, items, heads, window=window, sink_tokens=sink_tokens, prefill=prefill,
            max_new_tokens=max_new_tokens, stop_ids=stop_ids, progress=progress, desc=c.name,
            done=done, on_entry=save,
        )  # fmt: skip
        res = ConfigResult(c, heads, entries, candidates, time.perf_counter() - start)
        results[c.name] = res
        folder.save(c.name, {"version": CONFIG_VERSION, "fingerprint": fingerprint, **res.to_json()})
    meta = {
        **{k: v for k, v in fingerprint.items() if k != "needles"},
        **model_precision(model),  # also where the fingerprint leaves the defaults out
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
