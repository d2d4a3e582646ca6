"""Choosing which attention heads to mask (RetMask) or to train (MuDAF) from per-head retrieval scores.

Input is the published ``head_score`` format, ``{"<layer>-<head>": [score of each counted test, ...]}``
(what ``retmask detect`` writes). A head's retrieval score is the mean of its list; a detection gives every
head one score per counted test, so an empty list among full ones is a damaged file (an error).

Selections:

* ``threshold``: every head with score ≥ τ;
* ``top-k``: the k best heads (ties broken by (layer, head) so the choice is deterministic);
* baseline ``non-retrieval``: as many random heads as the retrieval set, none of them a retrieval head;
* baseline ``random``: as many random heads drawn from all heads (retrieval heads included).

MuDAF samples heads without replacement with ``P(h) ∝ exp(R_h / τ)``.

Every random choice takes a seed and uses :class:`random.Random`, whose stream is stable across Python
versions, so a heads file can be reproduced from its recorded seed.
"""

from __future__ import annotations

import json
import math
import random
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retmask.heads.keys import Head, SelectionError, parse_head_key, parse_head_pair
from retmask.heads.layout import check_heads, check_shape
from retmask.runfiles import MAX_INDEX, atomic_write_text, loads_strict, read_json

HEADS_FILE_VERSION = 1
METHODS = ("threshold", "top-k", "explicit", "mudaf-sample")
BASELINES = ("non-retrieval", "random")


# --------------------------------------------------------------------------------------------------
# Reading scores
# --------------------------------------------------------------------------------------------------

SCORE_ROUNDING = 1e-6
"""How far above 1 a score may be without a warning: adding 1/n n times in floating point can end just
above 1 (the published ``llama-2-7b-80k`` file holds 269 values of 1.0000000000000002)."""


class ScoreAboveOneWarning(UserWarning):
    """A scores file with values above 1 (beyond float rounding): used as it is, but worth a look."""


def _check_key_form(key: Any, source: str) -> None:
    """Refuse what :func:`parse_head_key` would read wrongly: digits other than 0-9 (``str.isdigit``
    accepts ``"１"``, ``"٣"`` and ``"²"``; ``int()`` reads the first two and fails on the third) and indices
    too large for any model (``"10000000000000000-0"``). Other malformed keys are parse_head_key's to name."""
    if not isinstance(key, str):
        return
    if not key.isascii():
        raise SelectionError(
            f"{source}: key {key!r} is not '<layer>-<head>' written with the digits 0-9 (e.g. '15-30'); the "
            "file was edited or converted by a tool that changed its characters"
        )
    parts = key.split("-")
    for part in parts if len(parts) == 2 and all(p.isdigit() for p in parts) else []:
        if len(part.lstrip("0")) > len(str(MAX_INDEX)) or int(part) >= MAX_INDEX:
            raise SelectionError(
                f"{source}: key {key!r} names layer or head {part}, beyond any model (at most "
                f"{MAX_INDEX - 1}); the file is damaged"
            )


def mean_scores(raw: Mapping[str, Any], *, source: str = "scores") -> dict[Head, float]:
    """Validate a ``{"<layer>-<head>": [scores]}`` mapping and return the mean score of every head.

    Values must be lists of finite numbers >= 0; an empty list is an error (all empty: no counted test).
    A bare number is also rejected: the published format always stores per-test lists, and silently
    accepting means would hide a wrong file. Keys are ASCII ``layer-head`` pairs below ``MAX_INDEX``.
    Scores above 1 + ``SCORE_ROUNDING`` are possible (a head that copied more tokens than the answer has)
    but unusual: one :class:`ScoreAboveOneWarning` names the heads.
    """
    if not isinstance(raw, Mapping):
        raise SelectionError(
            f'{source}: expected a JSON object {{"<layer>-<head>": [per-test scores]}}, got {type(raw).__name__}'
        )
    if not raw:
        raise SelectionError(f"{source}: the scores object is empty; run `retmask detect` to produce scores")
    if "heads" in raw and "version" in raw:
        raise SelectionError(
            f"{source}: this is a heads file (a selection written by `retmask mask`), not retrieval scores; "
            "pass the scores JSON written by `retmask detect`"
        )
    out: dict[Head, float] = {}
    above: list[tuple[float, str]] = []  # (score, key) above 1 beyond rounding
    for key, values in raw.items():
        _check_key_form(key, source)
        head = parse_head_key(key, source=source)
        if head in out:  # "01-2" and "1-2" name the same head
            raise SelectionError(f"{source}: head {key!r} appears twice (as layer {head[0]}, head {head[1]})")
        if not isinstance(values, list):
            raise SelectionError(
                f"{source}: value of {key!r} must be a list of per-test scores, got {type(values).__name__}"
            )
        for i, v in enumerate(values):
            # bool is an int subclass; a true/false in a score list is a corrupted file, not a score.
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise SelectionError(
                    f"{source}: value {i} of {key!r} is {v!r}; scores must be finite numbers"
                )
            if v < 0:
                raise SelectionError(
                    f"{source}: value {i} of {key!r} is {v!r}; retrieval scores are >= 0 (copies / answer "
                    "tokens), so the file is damaged or not a scores file"
                )
            if v > 1 + SCORE_ROUNDING:
                above.append((v, key))
        out[head] = math.fsum(values) / len(values) if values else 0.0
    empty = [key for key, values in raw.items() if not values]
    if len(empty) == len(raw):
        raise SelectionError(
            f"{source}: every head has an empty score list, i.e. the run counted no test (no answer passed "
            "the filter), so there is nothing to rank; run the detection again with other lengths or model"
        )
    if empty:
        # A detection scores every head on every counted test: one empty list among full ones is an edited
        # or damaged file, and reading it as 0 would rank that head silently.
        raise SelectionError(
            f"{source}: {len(empty)} head(s) have an empty score list (e.g. {empty[0]!r}) while others have "
            "scores; a detection gives every head one score per counted test, so the file is damaged or "
            "edited: run `retmask detect` again or fix the file"
        )
    lengths = {len(values) for values in raw.values()}
    if len(lengths) > 1:
        short = min(raw, key=lambda k: len(raw[k]))
        long = max(raw, key=lambda k: len(raw[k]))
        raise SelectionError(
            f"{source}: the heads have score lists of different lengths ({short!r}: {len(raw[short])}, "
            f"{long!r}: {len(raw[long])}); a detection gives every head one score per counted test, so the "
            "file is damaged, edited or merged from several runs: run `retmask detect` again or fix the file"
        )
    if above:
        worst: dict[str, float] = {}
        for v, k in above:
            worst[k] = max(v, worst.get(k, v))
        heads = sorted(worst, key=lambda k: -worst[k])
        top = max(above)
        warnings.warn(
            f"{source}: {len(above)} score(s) above 1 in {len(heads)} head(s) (largest {top[0]!r} for head "
            f"{top[1]!r}; heads: {', '.join(heads[:5])}{', ...' if len(heads) > 5 else ''}); a score is "
            "copies / answer tokens, so a head copied more tokens than the answer has (an answer repeating "
            "the needle) or the file was edited; it is used as it is",
            ScoreAboveOneWarning,
            stacklevel=2,
        )
    return out


def load_scores(path: str | Path) -> dict[Head, float]:
    """Read a scores JSON file and return ``{(layer, head): mean score}``."""
    # read_json: duplicated keys (json.loads keeps the last silently), folders, non-UTF-8 bytes, absurd
    # nesting are errors naming the file, of the type every command reports for a scores file
    raw = read_json(
        path,
        what="scores file",
        fix="pass the scores JSON written by `retmask detect` (run it first)",
        error=SelectionError,
    )
    return mean_scores(raw, source=f"scores file {path}")


# --------------------------------------------------------------------------------------------------
# Model shape
# --------------------------------------------------------------------------------------------------


def complete_scores(scores: Mapping[Head, float], model_shape: Sequence[int] | None) -> dict[Head, float]:
    """With a model shape, check every scored head exists and give absent heads score 0.

    Without one the universe of heads is the file's keys (the published files list every head).
    """
    if model_shape is None:
        return dict(scores)
    check_heads(scores, model_shape, source="scores")
    n_layers, n_heads = check_shape(model_shape)
    return {(ly, h): float(scores.get((ly, h), 0.0)) for ly in range(n_layers) for h in range(n_heads)}


def ranked(scores: Mapping[Head, float]) -> list[Head]:
    """Heads by descending score; ties by (layer, head) so the order never depends on dict order."""
    return sorted(scores, key=lambda hd: (-scores[hd], hd))


# --------------------------------------------------------------------------------------------------
# Selections
# --------------------------------------------------------------------------------------------------


def select_threshold(scores: Mapping[Head, float], threshold: float) -> list[Head]:
    """Heads with score ≥ ``threshold``, best first."""
    if not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise SelectionError(f"threshold must be a finite number, got {threshold!r}")
    heads = [hd for hd in ranked(scores) if scores[hd] >= threshold]
    if not heads:
        best = max(scores.values()) if scores else float("nan")
        raise SelectionError(
            f"no head has a retrieval score >= {threshold} (the best is {best:.4g}); "
            "lower --threshold or use --top-k"
        )
    return heads


def select_top_k(scores: Mapping[Head, float], k: int) -> list[Head]:
    """The ``k`` heads with the highest scores, best first."""
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise SelectionError(f"top-k must be a positive integer, got {k!r}")
    if k > len(scores):
        raise SelectionError(f"top-k = {k} but only {len(scores)} heads are known; lower --top-k")
    return ranked(scores)[:k]


def sample_non_retrieval(retrieval: Sequence[Head], universe: Iterable[Head], seed: int) -> list[Head]:
    """``len(retrieval)`` random heads from ``universe`` with no retrieval head among them."""
    excluded = set(retrieval)
    pool = sorted(set(universe) - excluded)  # sorted: the draw must not depend on set order
    if len(pool) < len(excluded):
        raise SelectionError(
            f"non-retrieval baseline needs {len(excluded)} non-retrieval heads but only {len(pool)} exist; "
            "select fewer retrieval heads"
        )
    return sorted(random.Random(seed).sample(pool, len(excluded)))


def sample_random(n: int, universe: Iterable[Head], seed: int) -> list[Head]:
    """``n`` random heads from ``universe`` (retrieval heads may be among them)."""
    pool = sorted(set(universe))
    if n > len(pool):
        raise SelectionError(f"random baseline needs {n} heads but only {len(pool)} exist")
    return sorted(random.Random(seed).sample(pool, n))


def stable_softmax(values: Sequence[float], temperature: float = 1.0) -> list[float]:
    """``softmax(values / temperature)`` computed with the max subtracted.

    With τ = 0.05 a score of 1.0 becomes exp(20) and the naive form overflows for scores near 36;
    subtracting the max keeps every exponent ≤ 0.
    """
    if not temperature > 0 or not math.isfinite(temperature):
        raise SelectionError(f"temperature must be a positive finite number, got {temperature!r}")
    if not values:
        raise SelectionError("softmax of an empty list")
    logits = [v / temperature for v in values]
    m = max(logits)
    exps = [math.exp(x - m) for x in logits]
    total = math.fsum(exps)
    return [e / total for e in exps]


def sample_softmax_heads(
    scores: Mapping[Head, float], n: int = 8, temperature: float = 0.05, seed: int = 0
) -> list[Head]:
    """MuDAF head selection: draw ``n`` heads without replacement, ``P(h) ∝ exp(R_h / τ)``.

    Sequential draws: at each step the softmax is renormalised over the heads still available, which is
    what "sampling without replacement" with these weights means. Returned in draw order.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise SelectionError(f"number of heads to sample must be a positive integer, got {n!r}")
    if n > len(scores):
        raise SelectionError(f"cannot sample {n} heads from {len(scores)} scored heads")
    rng = random.Random(seed)
    remaining = sorted(scores)
    chosen: list[Head] = []
    for _ in range(n):
        probs = stable_softmax([scores[hd] for hd in remaining], temperature)
        u = rng.random()
        acc = 0.0
        idx = len(remaining) - 1  # float round-off can leave acc just below u at the end
        for i, p in enumerate(probs):
            acc += p
            if u < acc:
                idx = i
                break
        chosen.append(remaining.pop(idx))
    return chosen


# --------------------------------------------------------------------------------------------------
# Heads files
# --------------------------------------------------------------------------------------------------


@dataclass
class HeadSelection:
    """A set of heads plus how they were chosen; serialised as the heads JSON.

    ``retrieval_heads`` records the retrieval set for baselines (whose ``heads`` are different heads), so
    a report can state what the baseline was matched against.
    """

    heads: list[Head]
    scores: list[float | None]
    method: str
    threshold: float | None = None
    top_k: int | None = None
    seed: int | None = None
    baseline: str | None = None
    source: str | None = None
    model_shape: list[int] | None = None
    temperature: float | None = None
    retrieval_heads: list[Head] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": HEADS_FILE_VERSION,
            "heads": [[ly, h] for ly, h in self.heads],
            "scores": list(self.scores),
            "num_heads": len(self.heads),
            "method": self.method,
            "threshold": self.threshold,
            "top_k": self.top_k,
            "temperature": self.temperature,
            "baseline": self.baseline,
            "seed": self.seed,
            "source": self.source,
            "model_shape": self.model_shape,
            "retrieval_heads": [[ly, h] for ly, h in self.retrieval_heads],
        }


def select_heads(
    scores: Mapping[Head, float],
    *,
    threshold: float | None = None,
    top_k: int | None = None,
    baseline: str | None = None,
    seed: int = 0,
    model_shape: Sequence[int] | None = None,
    source: str | None = None,
) -> HeadSelection:
    """The ``retmask mask`` selection: exactly one of ``threshold``/``top_k``, optionally a baseline."""
    if (threshold is None) == (top_k is None):
        raise SelectionError("give exactly one of threshold (--threshold) or top_k (--top-k)")
    if baseline is not None and baseline not in BASELINES:
        raise SelectionError(f"unknown baseline {baseline!r}; choose one of {', '.join(BASELINES)}")
    full = complete_scores(scores, model_shape)
    if threshold is not None:
        retrieval = select_threshold(full, threshold)
        method = "threshold"
    else:
        retrieval = select_top_k(full, top_k)  # type: ignore[arg-type]
        method = "top-k"
    if baseline == "non-retrieval":
        heads = sample_non_retrieval(retrieval, full, seed)
    elif baseline == "random":
        heads = sample_random(len(retrieval), full, seed)
    else:
        heads = retrieval
    return HeadSelection(
        heads=heads,
        scores=[full[hd] for hd in heads],
        method=method,
        threshold=float(threshold) if threshold is not None else None,
        top_k=top_k,
        seed=seed if baseline is not None else None,  # the retrieval set itself involves no randomness
        baseline=baseline,
        source=source,
        model_shape=list(check_shape(model_shape)) if model_shape is not None else None,
        retrieval_heads=list(retrieval) if baseline is not None else [],
    )


def mudaf_selection(
    scores: Mapping[Head, float],
    *,
    n: int = 8,
    temperature: float = 0.05,
    seed: int = 0,
    model_shape: Sequence[int] | None = None,
    source: str | None = None,
) -> HeadSelection:
    """MuDAF's sampled selection as a :class:`HeadSelection` (heads in draw order; ``top_k`` stays None:
    the heads are drawn with ``P(h) ∝ exp(R_h / temperature)``, not the ``n`` highest scores)."""
    full = complete_scores(scores, model_shape)
    heads = sample_softmax_heads(full, n=n, temperature=temperature, seed=seed)
    return HeadSelection(
        heads=heads,
        scores=[full[hd] for hd in heads],
        method="mudaf-sample",
        seed=seed,
        temperature=temperature,
        source=source,
        model_shape=list(check_shape(model_shape)) if model_shape is not None else None,
    )


def write_heads(selection: HeadSelection, path: str | Path) -> Path:
    """Write the heads JSON atomically (parent folders created): a full disk or a refused name leaves the
    old file (or none), never a torn or empty one, and raises ``OutputWriteError`` naming ``path``."""
    # One key per line with compact values: a 40-head list stays readable and diffs cleanly.
    body = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in selection.to_json().items())
    return atomic_write_text(path, "{\n" + body + "\n}\n")


def heads_from_json(
    data: Any, *, source: str = "heads", model_shape: Sequence[int] | None = None
) -> HeadSelection:
    """Parse a heads JSON object, or a bare list ``[[layer, head], ...]`` (an explicit list of heads)."""
    if isinstance(data, list):
        data = {"heads": data, "method": "explicit"}
    if not isinstance(data, dict) or "heads" not in data:
        raise SelectionError(
            f'{source}: expected {{"heads": [[layer, head], ...], ...}} or a list of [layer, head]; '
            "write one with `retmask mask`"
        )
    raw_heads = data["heads"]
    if not isinstance(raw_heads, list) or not raw_heads:
        raise SelectionError(f"{source}: 'heads' must be a non-empty list of [layer, head]")
    heads = [parse_head_pair(item, f"{source}: heads[{i}]") for i, item in enumerate(raw_heads)]
    seen: set[Head] = set()
    for hd in heads:
        if hd in seen:
            raise SelectionError(f"{source}: head [{hd[0]}, {hd[1]}] is listed twice")
        seen.add(hd)
    scores = data.get("scores") or [None] * len(heads)
    if not isinstance(scores, list) or not all(
        s is None or (isinstance(s, (int, float)) and not isinstance(s, bool)) for s in scores
    ):
        raise SelectionError(f"{source}: 'scores' must be a list of numbers (or null), one per head")
    if len(scores) != len(heads):
        raise SelectionError(f"{source}: {len(scores)} scores for {len(heads)} heads")
    file_shape = data.get("model_shape")
    if file_shape is not None and not isinstance(file_shape, list):
        raise SelectionError(
            f"{source}: 'model_shape' must be [num_layers, num_query_heads], got {file_shape!r}"
        )
    if not isinstance(data.get("retrieval_heads") or [], list):
        raise SelectionError(f"{source}: 'retrieval_heads' must be a list of [layer, head]")
    if model_shape is not None:
        check_heads(heads, model_shape, source=source)
    elif file_shape is not None:
        check_heads(heads, file_shape, source=source)
    retrieval = [parse_head_pair(x, f"{source}: retrieval_heads") for x in data.get("retrieval_heads") or []]
    return HeadSelection(
        heads=heads,
        scores=list(scores),
        method=str(data.get("method", "explicit")),
        threshold=data.get("threshold"),
        top_k=data.get("top_k"),
        seed=data.get("seed"),
        baseline=data.get("baseline"),
        source=data.get("source"),
        model_shape=list(model_shape) if model_shape is not None else file_shape,
        temperature=data.get("temperature"),
        retrieval_heads=retrieval,
    )


def read_heads(path: str | Path, model_shape: Sequence[int] | None = None) -> HeadSelection:
    """Read a heads JSON; with ``model_shape`` = ``[L, Hq]`` every head must exist in that model."""
    data = read_json(path, what="heads file", fix="write one with `retmask mask`", error=SelectionError)
    return heads_from_json(data, source=str(path), model_shape=model_shape)


def parse_heads_arg(text: str) -> list[Head]:
    """Parse an explicit head list from the command line: ``"15-30,16-1"`` or ``"[[15,30],[16,1]]"``."""
    text = text.strip()
    if text.startswith("["):
        try:
            data = loads_strict(text)  # a key given twice is an error, as in files
        except ValueError as e:
            raise SelectionError(f"head list {text!r} is not valid JSON: {e}") from None
        return heads_from_json(data, source="head list").heads
    heads = [parse_head_key(part.strip(), source="head list") for part in text.split(",") if part.strip()]
    if not heads:
        raise SelectionError("empty head list; give heads as '15-30,16-1'")
    return heads
