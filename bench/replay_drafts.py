"""Replay a detection's verification passes from its run record: draft rules compared without the model.

Usage:  python bench/replay_drafts.py [--run runs/detect/smollm2.run.json] [--out DIR]

Detection's answer is the greedy one whatever the drafts (a draft only decides how many tokens one
verification pass accepts), so a run record, which holds every test's greedy answer, lets any draft rule
be replayed exactly: the prompts are rebuilt from the record's configuration (and the haystack whose hash
it holds), the tests run in the detector's order with the same history of earlier answers, and each pass
accepts the longest draft prefix equal to the recorded answer plus one token. The replay of the rule the
run used (the record's ``draft_rule``; "fixed-order" for records from before that field) must give every
test's recorded pass count: the script checks it and stops if not.

The time of a pass is then fitted on the record by least squares over its tests,
``decode_s = a * passes + b * rows + c * passes * (cached tokens / 1000)``, and each rule's passes and
rows are priced with it. Rules compared: the shipped "longest-match" rule (the continuation after the
longest suffix n-gram found in any source) at several ``min_draft`` values (the draft cap after a
rejection), and the "fixed-order" rule it replaced (sources tried one after the other: earlier answers,
the prompt, the answer's own loops). Writes bench/results/draft_replay_<run>_<cpu kind>.{md,json,png}
(the cost model is the recording machine's; the pass counts hold on any machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_kind, machine_description, markdown_table, page_tail, save_figure, write_page  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_RUN = Path(__file__).resolve().parents[1] / "runs" / "detect" / "smollm2.run.json"
DraftFn = Callable[[np.ndarray, tuple[int, int], list[int], int, Sequence[list[int]]], list[int]]


def rebuild_tests(record: dict) -> list:
    """The record's runnable tests in the detector's processing order (prompts rebuilt from its config)."""
    from dataclasses import fields

    from transformers import AutoTokenizer

    from retmask.detect.answers import prefix_order
    from retmask.detect.run import DetectConfig
    from retmask.niah import build_tests, load_haystack, load_needles, split_runnable

    known = {f.name for f in fields(DetectConfig)}
    cfg = DetectConfig(**{k: v for k, v in record["config"].items() if k in known})
    tokenizer = AutoTokenizer.from_pretrained(record["model_name_or_path"])
    lengths, depths = cfg.grid()
    # The default haystack changed once (pydoc text -> shipped essays): take the text whose hash the record has.
    want = record.get("haystack_sha256")
    candidates = [cfg.haystack] if cfg.haystack is not None else [None, "pydoc"]
    texts = [load_haystack(c) for c in candidates]
    matching = [t for t in texts if want is None or hashlib.sha256(t.encode("utf-8")).hexdigest() == want]
    if not matching:
        sys.exit(
            f"none of the haystacks {candidates} has the record's sha256 {want}: its prompts cannot be rebuilt"
        )
    tests = build_tests(
        tokenizer, load_needles(cfg.needles), matching[0], lengths, depths,
        chat=record["prompt_style"] == "chat", span_rule=cfg.span_rule,
    )  # fmt: skip
    runnable, _ = split_runnable(tests, cfg.span_miss)
    return prefix_order(runnable)


def replay(
    tests: list, answers: dict[int, list[int]], draft_fn: DraftFn, *, max_new_tokens: int,
    max_draft: int = 64, min_draft: int = 8, history: bool = True,
) -> dict[int, dict]:  # fmt: skip
    """{test index: {"passes", "rows", "cached"}}: FastDetector.run's loop with ``answers`` as the model."""
    from retmask.detect.drafts import next_draft_cap

    out: dict[int, dict] = {}
    earlier: dict[int, list[int]] = {}
    for t in tests:
        hist = [answers[i] for i in earlier.get(t.needle_index, [])] if history else []
        answer = answers[t.index]
        prompt = np.asarray(t.prompt_ids, dtype=np.int64)
        tokens: list[int] = []
        cap, passes, rows = max_draft, 0, 0
        while len(tokens) < len(answer):
            limit = min(max_new_tokens - len(tokens) - 1, cap)
            draft = draft_fn(prompt, t.span, list(tokens), limit, hist)[:limit]
            truth = answer[len(tokens) :]
            accepted = 0
            # the last token of the answer is the pass's own greedy token, never a draft's
            while accepted < len(draft) and accepted < len(truth) - 1 and draft[accepted] == truth[accepted]:
                accepted += 1
            cap = next_draft_cap(accepted, len(draft), max_draft, min_draft)
            tokens += truth[: accepted + 1]
            passes += 1
            rows += 1 + len(draft)
        out[t.index] = {"passes": passes, "rows": rows, "cached": len(prompt)}
        earlier.setdefault(t.needle_index, []).append(t.index)
    return out


def features(per_test: dict[int, dict]) -> np.ndarray:
    """[tests, 3]: passes, rows, passes x cached thousands of tokens."""
    return np.array(
        [[r["passes"], r["rows"], r["passes"] * r["cached"] / 1000] for r in per_test.values()], float
    )


def fixed_order_draft(
    prompt: np.ndarray, span: tuple[int, int], generated: list[int], max_len: int,
    history: Sequence[list[int]] = (), max_ngram: int = 3,
) -> list[int]:  # fmt: skip
    """The rule before "longest-match" (run records without ``draft_rule``): past the shipped rule's first
    choices, the sources in a fixed order, each from its longest n-gram down: earlier answers, then the
    needle's neighbourhood and the prompt, then the answer's own loops."""
    from retmask.detect.drafts import NEIGHBOURHOOD, _find, continue_earlier_answer, propose_draft

    # the first choices are the same: an earlier answer's continuation, or the needle itself at the start
    if max_len <= 0 or not generated or continue_earlier_answer(generated, history):
        return propose_draft(prompt, span, generated, max_len, history)
    s, e = span
    gen = np.asarray(generated, dtype=np.int64)
    for n in range(min(max_ngram, len(gen)), 0, -1):
        for answer in reversed(history):
            pos = _find(np.asarray(answer, dtype=np.int64), gen[-n:])
            if pos >= 0:
                return list(answer[pos + n :])[:max_len]
    seq = np.concatenate([prompt, gen])
    lo, hi = max(0, s - NEIGHBOURHOOD), min(len(prompt), e + NEIGHBOURHOOD)
    for n in range(min(max_ngram, len(seq)), 0, -1):
        for start, stop in ((lo, hi), (0, len(prompt))):
            pos = _find(prompt[start:stop], seq[-n:])
            if pos >= 0:
                return prompt[start + pos + n : start + pos + n + max_len].tolist()
    for n in range(min(max_ngram, len(gen) - 1), 0, -1):
        pos = _find(gen[:-1], gen[-n:])
        if pos >= 0:
            return gen[pos + n : pos + n + max_len].tolist()
    return []


def main() -> None:
    from retmask.detect.drafts import DRAFT_RULE, propose_draft

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=DEFAULT_RUN, help="a detection's run record (*.run.json)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not args.run.exists():
        ap.error(f"--run {args.run}: no such run record; `make detect` writes {DEFAULT_RUN}")
    record = json.loads(args.run.read_text())
    if not record["config"].get("draft_history", True):
        ap.error("the run was made with --no-draft-history; replay a run with draft history")
    tests = rebuild_tests(record)
    by_index = {t["index"]: t for t in record["tests"]}
    answers = {i: t["tokens"] for i, t in by_index.items()}
    max_new = record["config"]["max_new_tokens"]

    rule_fns: dict[str, DraftFn] = {DRAFT_RULE: propose_draft, "fixed-order": fixed_order_draft}
    recorded_rule = record.get("draft_rule", "fixed-order")
    if recorded_rule not in rule_fns:
        sys.exit(
            f"the record's draft rule {recorded_rule!r} is not one this script knows ({sorted(rule_fns)})"
        )
    as_recorded = replay(tests, answers, rule_fns[recorded_rule], max_new_tokens=max_new)
    differ = [i for i, r in as_recorded.items() if r["passes"] != by_index[i]["passes"]]
    if differ:
        sys.exit(
            f"the replay of the record's rule differs from the record on {len(differ)} tests: not comparable"
        )
    x = features(as_recorded)
    y = np.array([by_index[i]["decode_s"] for i in as_recorded], float)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    r2 = 1 - float(((y - x @ coef) ** 2).sum() / ((y - y.mean()) ** 2).sum())

    rules = {f"{DRAFT_RULE} (shipped), min_draft {m}": (propose_draft, m) for m in (2, 4, 6, 8, 16, 24)}
    rules["fixed-order (before), min_draft 8"] = (fixed_order_draft, 8)
    shipped_name = f"{DRAFT_RULE} (shipped), min_draft 8"
    results = {}
    for name, (fn, min_draft) in rules.items():
        f = features(replay(tests, answers, fn, max_new_tokens=max_new, min_draft=min_draft))
        cost = float((f @ coef).sum())
        results[name] = {"passes": int(f[:, 0].sum()), "rows": int(f[:, 1].sum()), "predicted_decode_s": cost}
    base = results[shipped_name]["predicted_decode_s"]
    rows = [
        [name, str(r["passes"]), str(r["rows"]), f"{r['predicted_decode_s']:.1f}", f"{r['predicted_decode_s'] / base:.2f}x"]
        for name, r in results.items()
    ]  # fmt: skip

    machine = machine_description()
    args.out.mkdir(parents=True, exist_ok=True)
    run_name = args.run.name.removesuffix(".run.json")
    stem = args.out / f"draft_replay_{run_name}_{cpu_kind(machine)}"
    title = f"Draft rules replayed on {args.run.name}'s recorded answers ({len(tests)} tests)"
    lines = [
        f"# {title}",
        "",
        f"The record was made with the {recorded_rule!r} draft rule; its replay gives every test's recorded pass "
        f"count ({int(x[:, 0].sum())} passes). "
        f"Pass cost fitted on the record: {coef[0] * 1e3:.1f} ms a pass + {coef[1] * 1e3:.2f} ms a row + "
        f"{coef[2] * 1e3:.1f} ms a pass per 1K cached tokens (R² {r2:.3f}, recorded decode "
        f"{y.sum():.1f} s). Ratios to the shipped rule at min_draft 8; the cost model is the recording "
        "machine's, the pass counts hold on any machine.",
        "",
        markdown_table(["rule", "passes", "rows", "predicted decode s", "vs shipped"], rows),
    ]
    plot(results, stem.with_suffix(".png"), title)
    payload = {"run": str(args.run), "recorded_rule": recorded_rule, "cost_model_s": {"per_pass": coef[0], "per_row": coef[1],
               "per_pass_per_1k_cached": coef[2], "r2": r2}, "rules": results}  # fmt: skip
    write_page(stem, lines + page_tail(stem, machine), payload)


def plot(results: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.barh(names, [results[n]["passes"] for n in names])
    ax1.set_xlabel("verification passes")
    ax2.barh(names, [results[n]["predicted_decode_s"] for n in names])
    ax2.set_xlabel("predicted decode time (s)")
    ax2.set_yticks([])
    ax1.tick_params(axis="y", labelsize=7)
    save_figure(fig, path, title)


if __name__ == "__main__":
    main()
