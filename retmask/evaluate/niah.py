"""Needle-in-a-Haystack evaluation: ROUGE-1 recall over a lengths × depths grid, optionally with heads masked.

The tests are the detection protocol's (``retmask.niah.build_tests``: same context rule, prompt and
needles); the answers come from the detection fast path (``FastDetector`` with ``count_copies=False``):
prompt-lookup verification and KV-prefix reuse across tests in prefix order, which give exactly the plain
step-by-step greedy answer (greedy, at most ``max_new_tokens``, stopping after a newline/EOS token). Masked
heads are switched off with ``retmask.head_mask`` for the whole evaluation (prefill and decoding), which
equals a checkpoint with their o_proj columns zeroed.

The grid score of a (depth, length) cell is the mean ROUGE-1 recall (in [0, 1]) of the response against
``real_needle`` over the needles; the overall score is the mean over every test run.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from retmask.detect.answers import answer_tests, earlier_answers, prefix_order
from retmask.detect.core import FastDetector
from retmask.detect.run import check_context_limit
from retmask.detect.stopping import stop_token_ids
from retmask.errors import UsageError
from retmask.heads import model_shape, normalize_head_mask
from retmask.hf.heads import head_mask
from retmask.hf.layers import head_layout
from retmask.model_files import files_stamp
from retmask.niah import Needle, build_tests, load_haystack, load_needles, resolve_prompt_style
from retmask.niah.answer_kind import classify_answer, count_kinds
from retmask.plotting import niah_cmap, pyplot, save_figure

RESULT_VERSION = 1
ENTRY_KEYS = ("index", "key", "needle_index", "length", "depth", "response", "rouge1_recall")


class NiahError(UsageError):
    """An evaluation that cannot give a score (every test skipped), with the counts and what to change."""


@dataclass
class NiahResult:
    """The outcome of one NIAH evaluation.

    entries: one dict per test run, in the canonical grid order (needle, length, depth), with at least
        ``ENTRY_KEYS``: ``rouge1_recall`` is a float in [0, 1].
    lengths, depths: the grid axes (tokens, percent).
    meta: model, masked heads (list of [layer, head]), grid, skipped tests, timings.
    """

    entries: list[dict]
    lengths: list[int]
    depths: list[int]
    meta: dict = field(default_factory=dict)

    def grid(self) -> np.ndarray:
        """float64 [len(depths), len(lengths)]: mean recall over the needles of each cell (NaN if none)."""
        total = np.zeros((len(self.depths), len(self.lengths)), dtype=np.float64)
        count = np.zeros_like(total)
        row = {d: i for i, d in enumerate(self.depths)}
        col = {n: j for j, n in enumerate(self.lengths)}
        for e in self.entries:
            if e["depth"] not in row or e["length"] not in col:
                raise ValueError(
                    f"entry {e.get('key')} has length {e['length']} / depth {e['depth']} outside the grid "
                    f"lengths {self.lengths} x depths {self.depths}; the result is corrupted"
                )
            i, j = row[e["depth"]], col[e["length"]]
            total[i, j] += float(e["rouge1_recall"])
            count[i, j] += 1
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(count > 0, total / np.maximum(count, 1), np.nan)

    @property
    def mean(self) -> float:
        """Mean recall over every test run (NaN when no test ran)."""
        if not self.entries:
            return float("nan")
        return math.fsum(float(e["rouge1_recall"]) for e in self.entries) / len(self.entries)

    def answer_kinds(self) -> dict[str, int]:
        """``{kind: tests}`` over ``retmask.niah.answer_kind.ANSWER_KINDS`` (complete, cut short, partial,
        none, empty). Entries written before the kind was recorded are classified from ``meta["needles"]``."""
        kinds = []
        for e in self.entries:
            if "answer_kind" in e:
                kinds.append(e["answer_kind"])
                continue
            try:
                real = self.meta["needles"][e["needle_index"]]["real_needle"]
            except (KeyError, IndexError, TypeError):
                raise ValueError(
                    f"entry {e.get('key')} has no answer_kind and meta has no needles to classify it; "
                    "rerun the evaluation"
                ) from None
            kinds.append(classify_answer(real, e["response"]))
        return count_kinds(kinds)

    def to_json(self) -> dict:
        """A JSON-ready dict (the grid and mean are included for readers; ``from_json`` recomputes them)."""
        grid = [[None if math.isnan(v) else round(float(v), 6) for v in row] for row in self.grid()]
        return {
            "version": RESULT_VERSION,
            "lengths": list(self.lengths),
            "depths": list(self.depths),
            "mean": None if math.isnan(self.mean) else self.mean,
            "grid": grid,
            "entries": self.entries,
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, d: dict) -> NiahResult:
        if not isinstance(d, dict) or d.get("version") != RESULT_VERSION:
            raise ValueError(
                f"not a NIAH result of version {RESULT_VERSION} (got version {d.get('version') if isinstance(d, dict) else d!r}); "
                "write it with NiahResult.to_json / `retmask niah --out`"
            )
        for k in ("lengths", "depths", "entries"):
            if not isinstance(d.get(k), list):
                raise ValueError(f"NIAH result: {k!r} must be a list")
        for i, e in enumerate(d["entries"]):
            missing = [k for k in ENTRY_KEYS if k not in e]
            if missing:
                raise ValueError(f"NIAH result: entry {i} lacks {missing}")
        return cls(list(d["entries"]), list(d["lengths"]), list(d["depths"]), dict(d.get("meta") or {}))


def _resolve_needles(needles) -> list[Needle]:
    if needles is None or isinstance(needles, (str, Path)):
        return load_needles(needles)
    out = list(needles)
    if not out or not all(isinstance(n, Needle) for n in out):
        raise TypeError("needles must be None, a JSONL path or a non-empty list of retmask.niah.Needle")
    return out


def _resolve_heads(model, heads) -> torch.Tensor | None:
    """bool [L, Hq] on the CPU, or None when nothing is masked."""
    if heads is None:
        return None

    if not isinstance(heads, torch.Tensor):
        heads = list(heads)
        if not heads:
            return None
    mask = normalize_head_mask(heads, *head_layout(model).shape, allow_per_row=False)
    return mask if bool(mask.any()) else None


def model_precision(model: torch.nn.Module) -> dict[str, str]:
    """``{"dtype": "bfloat16", "device": "cuda:0"}``: what the model's parameters are, as result files
    record it ({} for a model without parameters)."""
    param = next(model.parameters(), None)
    if param is None:
        return {}
    return {"dtype": str(param.dtype).removeprefix("torch."), "device": str(param.device)}


@torch.no_grad()
def grid_fingerprint(
    model,
    model_name: str | None,
    lengths,
    depths,
    needles: Sequence[Needle],
    haystack_text: str,
    max_new_tokens: int,
    prompt_style: str,
) -> dict:
    """Everything besides the mask that determines an :func:`evaluate_niah` result (for resume checks);
    ``prompt_style``: the resolved template, "base" or "chat". The model's parameter dtype and its device
    are in it only where they are not float32 / the CPU, so resume files of earlier runs still match."""
    import hashlib

    precision = model_precision(model)
    defaults = {"dtype": "float32", "device": "cpu"}
    return {
        **{k: v for k, v in precision.items() if v != defaults[k]},
        "model": model_name or str(getattr(model.config, "name_or_path", "")),
        **files_stamp(model_name),  # a model folder changed since the run began is another model
        "lengths": [int(x) for x in lengths],
        "depths": [int(x) for x in depths],
        "needles": [n.to_dict() for n in needles],
        "haystack_sha256": hashlib.sha256(haystack_text.encode("utf-8")).hexdigest(),
        "max_new_tokens": max_new_tokens,
        "prompt_style": prompt_style,
    }


def evaluate_niah(
    model,
    tokenizer,
    *,
    lengths: Sequence[int],
    depths: Sequence[int],
    needles=None,
    haystack_text: str | None = None,
    heads=None,
    max_new_tokens: int = 50,
    progress: bool = True,
    desc: str = "niah",
    chunk: int | None = None,
    prompt_style: str = "auto",
    done: Mapping[int, dict] | None = None,
    on_entry: Callable[[Mapping[int, dict]], None] | None = None,
) -> NiahResult:
    """Run the NIAH grid on ``model`` (retmask attention) with ``heads`` masked throughout.

    Args:
        lengths: context lengths in tokens (each > 200-token buffer + needle); depths: percent in [0, 100].
        needles: None (the shipped set), a JSONL path, or a list of :class:`retmask.niah.Needle`.
        haystack_text: None = the default prose haystack.
        heads: None, a list of (layer, head) or a bool [L, Hq] tensor (True = masked).
        chunk: prefill chunk = granularity of KV-prefix reuse (does not change the answers); None: the
            device's default (256 tokens on a CPU, 4096 on a GPU).
        prompt_style: "auto" | "base" | "chat" (``retmask.niah.resolve_prompt_style``; the resolved one is
            in ``meta["prompt_style"]``).
        done: entries of an earlier, interrupted evaluation with the same settings, by test index: kept as
            they are, and those tests are not run again (each must be a runnable test of this grid: same
            key, needle, length and depth, else ValueError). Greedy answers do not depend on which tests
            ran before, so the result equals an uninterrupted run's.
        on_entry: called after each answered test with every entry so far (by test index), e.g. to save
            progress.

    Tests whose context cannot be built (length too short for the buffer) are listed in
    ``meta["skipped"]``; when that is every test, :class:`NiahError` is raised before anything runs. A
    needle answer the span rule cannot locate does not matter here (the span only seeds the drafts), so
    those tests run.
    """
    from tqdm import tqdm

    lengths, depths = [int(x) for x in lengths], [int(x) for x in depths]
    if not lengths or not depths:
        raise ValueError(f"empty grid: lengths {lengths} x depths {depths}; give at least one of each")
    if any(not 0 <= d <= 100 for d in depths):
        raise ValueError(f"depths must be percentages in [0, 100], got {depths}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    needle_list = _resolve_needles(needles)
    text = load_haystack(None) if haystack_text is None else haystack_text
    mask = _resolve_heads(model, heads)
    check_context_limit(model, lengths, max_new_tokens)

    t0 = time.perf_counter()
    style = resolve_prompt_style(tokenizer, prompt_style)
    tests = build_tests(tokenizer, needle_list, text, lengths, depths, chat=style == "chat")
    build_s = time.perf_counter() - t0
    runnable = [t for t in tests if t.insertion >= 0]
    if not runnable:
        # a result with no entry has no mean ("mean": null) and an all-grey grid: an error, not a score
        short = tests[-1].skip_reason  # the longest length's reason: the nearest to running
        raise NiahError(
            f"no test could run: all {len(tests)} tests were skipped: every context is too short for the "
            f"needle and its buffer (e.g. {short}); raise --min-len/--max-len or check --needles"
        )
    skipped = [
        {
            "key": t.key,
            "needle_index": t.needle_index,
            "length": t.length,
            "depth": t.depth,
            "reason": t.skip_reason,
        }
        for t in tests
        if t.insertion < 0
    ]
    # The mask changes the KV of every layer after the first masked one: a detector (and its carried
    # cache) must never outlive one mask configuration, so each evaluation builds its own.
    entries = _checked_done(done or {}, runnable)
    detector = FastDetector(
        model,
        stop_token_ids(tokenizer, model),
        max_new_tokens,
        chunk,
        prefill_impl="retmask",
        count_copies=False,
    )
    resumed = len(entries)
    prefill_s = decode_s = 0.0
    t0 = time.perf_counter()
    ctx = head_mask(model, mask) if mask is not None else contextlib.nullcontext()
    bar = tqdm(
        total=len(runnable), initial=resumed, desc=desc, unit="test", disable=not progress, leave=False
    )
    with ctx, bar:
        ordered = prefix_order(runnable)
        todo = [t for t in ordered if t.index not in entries]
        # the drafts of a test come from the earlier answers to its needle, resumed ones included
        for ans in answer_tests(detector, tokenizer, todo, needle_list, earlier_answers(ordered, entries)):
            t = ans.test
            entries[t.index] = {
                "index": t.index,
                "key": t.key,
                "needle_index": t.needle_index,
                "length": t.length,
                "depth": t.depth,
                "response": ans.response,
                "rouge1_recall": ans.recall,
                "answer_kind": classify_answer(needle_list[t.needle_index].real_needle, ans.response),
                "prompt_tokens": int(len(t.prompt_ids)),
                "tokens": ans.outcome.tokens,
            }
            prefill_s += ans.outcome.timings["prefill_s"]
            decode_s += ans.outcome.timings["decode_s"]
            if on_entry is not None:
                on_entry(entries)
            bar.update(1)
    run_s = time.perf_counter() - t0
    heads_list = [] if mask is None else [[int(a), int(b)] for a, b in mask.nonzero().tolist()]
    meta = {
        "prompt_style": style,
        "model": str(getattr(model.config, "name_or_path", "")),
        **model_precision(model),
        "shape": list(model_shape(model)),
        "heads": heads_list,
        "grid": {"lengths": lengths, "depths": depths, "needles": len(needle_list), "tests": len(tests)},
        "needles": [n.to_dict() for n in needle_list],
        "max_new_tokens": max_new_tokens,
        "skipped": skipped,
        "timings": {
            "build_tests_s": round(build_s, 3),
            "run_s": round(run_s, 3),
            "prefill_s": round(prefill_s, 3),
            "decode_s": round(decode_s, 3),
        },
    }
    if resumed:
        meta["resumed_tests"] = resumed  # answered by the interrupted run; the timings are this run's
    return NiahResult([entries[i] for i in sorted(entries)], lengths, depths, meta)


def _checked_done(done: Mapping[int, dict], runnable: Sequence) -> dict[int, dict]:
    """``done`` as a new dict, after checking that every entry is the answer to a runnable test of this grid
    (same index, key, needle, length and depth)."""
    tests = {t.index: t for t in runnable}
    for index, entry in done.items():
        t = tests.get(index)
        saved = tuple(entry.get(k) for k in ("key", "needle_index", "length", "depth"))
        if t is None or saved != (t.key, t.needle_index, t.length, t.depth):
            raise ValueError(
                f"earlier entry for test {index} ({entry.get('key')!r}) is not a runnable test of this grid "
                "(another grid, needles or haystack wrote it); start the evaluation over"
            )
    return dict(done)


def format_grid(result: NiahResult, digits: int = 2) -> str:
    """The grid as a text table (rows = depth %, columns = context length) followed by the mean."""
    grid = result.grid()
    head = ["depth \\ len"] + [str(n) for n in result.lengths]
    rows = [
        [f"{d}%"] + ["-" if math.isnan(v) else f"{v:.{digits}f}" for v in grid[i]]
        for i, d in enumerate(result.depths)
    ]
    width = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, width, strict=True)) for r in [head, *rows]]
    lines.append(f"mean ROUGE-1 recall: {result.mean:.3f} over {len(result.entries)} tests")
    return "\n".join(lines)


def plot_niah(result: NiahResult, path: str | Path, title: str, subtitle: str | None = None) -> None:
    """The classic NIAH heatmap PNG: x = context length, y = needle depth (0% at the top), colour = score
    (red 0 → green 1), the score printed in each cell; cells without tests are grey. ``title`` (short: the
    model), then ``subtitle`` (e.g. the mask) and the mean, each wrapped to the figure's width."""
    plt = pyplot()
    grid = result.grid()
    cmap = niah_cmap()
    nl, nd = len(result.lengths), len(result.depths)
    fig, ax = plt.subplots(figsize=(max(4.5, 0.7 * nl + 2.5), max(3.0, 0.45 * nd + 1.6)))
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(nd):
        for j in range(nl):
            if not math.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7, color="black")
    ax.set_xticks(range(nl))
    ax.set_xticklabels([str(n) for n in result.lengths], rotation=45 if nl > 8 else 0, fontsize=8)
    ax.set_yticks(range(nd))
    ax.set_yticklabels([f"{d}%" for d in result.depths], fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    mean = f"mean ROUGE-1 recall {result.mean:.3f}"
    # wrap=True: matplotlib wraps each line to the room the figure leaves around the centred title
    ax.set_title("\n".join(x for x in (title, subtitle, mean) if x), fontsize=9, wrap=True)
    fig.colorbar(im, ax=ax, label="ROUGE-1 recall")
    fig.tight_layout()
    save_figure(fig, path)
