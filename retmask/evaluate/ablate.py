"""Head ablation: NIAH score vs K with the top-K retrieval heads masked, against K random heads masked
(several seeds; mean ± std).

Every mask configuration is one :func:`retmask.evaluate.niah.evaluate_niah` run on the same grid. Its
result is written atomically to ``<out_dir>/<prefix>.configs/<name>.json`` as soon as it completes
(``retmask.evaluate.config_runs``), with a fingerprint of everything that determines it (model, scores, grid,
needles, haystack, decoding, heads); ``resume=True`` loads the finished ones and refuses files written with
other settings. While a configuration runs, its answered tests wait in ``<name>.json.progress.json``
(``retmask.evaluate.niah_progress``), so a resume also skips the tests the interrupted one had answered.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from retmask.evaluate.config_runs import ConfigFolder, remaining
from retmask.evaluate.niah import NiahResult, evaluate_niah, grid_fingerprint, model_precision
from retmask.heads import model_shape
from retmask.heads.selection import (
    Head,
    SelectionError,
    complete_scores,
    ranked,
    sample_random,
    select_top_k,
)
from retmask.niah import load_haystack, load_needles, resolve_prompt_style
from retmask.plotting import pyplot, save_figure
from retmask.runfiles import JsonFile, atomic_write_json, atomic_write_text, check_same_settings

RANDOM_POOLS = ("all", "non-retrieval")
# random-from "non-retrieval": heads with a mean retrieval score below this (the published τ of retrieval
# heads, used by RetMask for Llama; RetMask uses 0.05 for Qwen3 and OLMo-3: pass tau to run_ablation / --tau)
NON_RETRIEVAL_TAU = 0.1
SUMMARY_VERSION = 1


class AblationError(ValueError):
    """Settings or files an ablation cannot use; the message says what to change."""


@dataclass(frozen=True)
class MaskConfig:
    """One point of the curve: ``kind`` "none" (K = 0), "top" (the K best heads) or "random" (seeded)."""

    kind: str
    k: int
    seed: int | None = None

    @property
    def name(self) -> str:
        return {"none": "none-k0", "top": f"top-k{self.k}"}.get(self.kind, f"random-k{self.k}-s{self.seed}")


def parse_ks(text: str | Sequence[int]) -> list[int]:
    """``"0,5,10"`` or a list -> sorted unique non-negative ints."""
    items = text.split(",") if isinstance(text, str) else list(text)
    ks: list[int] = []
    for item in items:
        try:
            k = int(str(item).strip())
        except ValueError:
            raise AblationError(f"K values must be integers like '0,5,10,20', got {item!r}") from None
        if k < 0:
            raise AblationError(f"K values must be >= 0, got {k}")
        ks.append(k)
    if not ks:
        raise AblationError("no K values given; pass e.g. --k 0,5,10,20")
    return sorted(set(ks))


def plan(ks: Sequence[int], seeds: int, base_seed: int = 0) -> list[MaskConfig]:
    """The configurations in run order: K = 0, then top-K for every K, then one random sweep over K per
    seed (an interrupted run already has whole curves)."""
    if seeds < 1:
        raise AblationError(f"--seeds must be >= 1, got {seeds}")
    out = [MaskConfig("none", 0)] if 0 in ks else []
    out += [MaskConfig("top", k) for k in ks if k > 0]
    out += [MaskConfig("random", k, base_seed + s) for s in range(seeds) for k in ks if k > 0]
    return out


def random_pool(scores: Mapping[Head, float], random_from: str, tau: float = NON_RETRIEVAL_TAU) -> list[Head]:
    """Heads random masks are drawn from: all heads, or those scoring below ``tau``."""
    if random_from not in RANDOM_POOLS:
        raise AblationError(f"random_from must be one of {RANDOM_POOLS}, got {random_from!r}")
    if random_from == "all":
        return sorted(scores)
    return sorted(h for h, v in scores.items() if v < tau)


def heads_for(cfg: MaskConfig, scores: Mapping[Head, float], pool: Sequence[Head]) -> list[Head]:
    """The heads ``cfg`` masks (``scores`` completed to the model's heads)."""
    if cfg.kind == "none":
        return []
    try:
        if cfg.kind == "top":
            return select_top_k(scores, cfg.k)
        return sample_random(cfg.k, pool, cfg.seed)
    except SelectionError as err:
        raise AblationError(f"{cfg.name}: {err}") from None


def check_ks(
    ks: Sequence[int],
    scores: Mapping[Head, float],
    pool: Sequence[Head],
    shape,
    tau: float = NON_RETRIEVAL_TAU,
) -> None:
    """K larger than the heads available -> a clear error before any work."""
    total = shape[0] * shape[1]
    big = max(ks)
    if big > total:
        raise AblationError(
            f"K = {big} but the model has only {total} heads ({shape[0]} layers x {shape[1]} query heads); "
            f"use K <= {total}"
        )
    if big > len(pool):
        raise AblationError(
            f"K = {big} but only {len(pool)} heads score below {tau} (--random-from non-retrieval); lower K, "
            "raise --tau or use --random-from all"
        )


def scores_digest(scores: Mapping[Head, float]) -> str:
    """sha256 of the mean scores (sorted, rounded to 12 digits): identifies the scores file's content."""
    text = json.dumps([[a, b, round(v, 12)] for (a, b), v in sorted(scores.items())])
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class AblationResult:
    """results: per configuration name, the NIAH result of that mask; configs in run order."""

    configs: list[MaskConfig]
    results: dict[str, NiahResult]
    heads: dict[str, list[Head]]
    meta: dict = field(default_factory=dict)

    def rows(self) -> list[dict]:
        """One row per K: the top-K mean and the random mean ± sample std over the seeds done (``random_n``).
        At K = 0 both curves start at the unmasked model's score."""
        out = []
        for k in sorted({c.k for c in self.configs}):
            if k == 0:
                base = self.results.get("none-k0")
                top = base.mean if base is not None else None
                rand = [] if base is None else [base.mean]
            else:
                top = self.results[f"top-k{k}"].mean if f"top-k{k}" in self.results else None
                rand = [
                    self.results[c.name].mean
                    for c in self.configs
                    if c.kind == "random" and c.k == k and c.name in self.results
                ]
            out.append(
                {
                    "k": k,
                    "top": top,
                    "random_mean": statistics.fmean(rand) if rand else None,
                    "random_std": statistics.stdev(rand) if len(rand) > 1 else (0.0 if rand else None),
                    "random_n": len(rand) if k > 0 else 0,
                    "random_values": rand if k > 0 else [],
                    "top_heads": [list(h) for h in self.heads.get(f"top-k{k}", [])],
                }
            )
        return out

    def table(self) -> str:
        """Markdown table of :meth:`rows` (scores = mean ROUGE-1 recall in [0, 1])."""

        def f(v):
            return "-" if v is None else f"{v:.3f}"

        lines = [
            "| K | top-K retrieval heads masked | K random heads masked (mean ± std) | seeds |",
            "|---|---|---|---|",
        ]
        for r in self.rows():
            if r["k"] == 0:
                rand = f(r["random_mean"])
            else:
                rand = (
                    f"{f(r['random_mean'])} ± {f(r['random_std'])}" if r["random_mean"] is not None else "-"
                )
            lines.append(f"| {r['k']} | {f(r['top'])} | {rand} | {r['random_n'] or '-'} |")
        return "\n".join(lines)

    def kinds_table(self) -> str:
        """Markdown table, one row per configuration run: its masked heads, NIAH score and how many answers
        are of each kind (:func:`answer_kinds_table`)."""
        return answer_kinds_table(
            (c.name, self.heads[c.name], self.results[c.name]) for c in self.configs if c.name in self.results
        )

    def to_json(self, keep_tokens: bool = False) -> dict:
        configs = []
        for c in self.configs:
            if c.name not in self.results:
                continue
            res = self.results[c.name].to_json()
            if not keep_tokens:
                res["entries"] = [{k: v for k, v in e.items() if k != "tokens"} for e in res["entries"]]
            configs.append(
                {
                    "name": c.name,
                    "kind": c.kind,
                    "k": c.k,
                    "seed": c.seed,
                    "heads": [list(h) for h in self.heads[c.name]],
                    "result": res,
                }
            )
        return {"version": SUMMARY_VERSION, "meta": self.meta, "rows": self.rows(), "configs": configs}


def answer_kinds_table(rows: Iterable[tuple[str, Sequence[Head], NiahResult]], max_heads: int = 8) -> str:
    """Markdown table of ``(configuration name, masked heads, NIAH result)`` rows: the heads (the first
    ``max_heads``, then the count), the NIAH score and the answers of each kind
    (``retmask.niah.answer_kind``: complete, cut short, partial, none, empty)."""
    from retmask.niah.answer_kind import ANSWER_KINDS

    lines = [
        "| configuration | heads masked | NIAH | " + " | ".join(ANSWER_KINDS) + " |",
        "|---|---|---|" + "---|" * len(ANSWER_KINDS),
    ]
    for name, heads, res in rows:
        shown = ", ".join(f"{a}-{b}" for a, b in list(heads)[:max_heads]) or "–"
        if len(heads) > max_heads:
            shown += f", … ({len(heads)} heads)"
        kinds = res.answer_kinds()
        cells = " | ".join(str(kinds[k]) for k in ANSWER_KINDS)
        lines.append(f"| {name} | {shown} | {res.mean:.3f} | {cells} |")
    return "\n".join(lines)


def run_ablation(
    model,
    tokenizer,
    scores: Mapping[Head, float],
    *,
    ks: Sequence[int],
    seeds: int = 3,
    lengths: Sequence[int],
    depths: Sequence[int],
    needles=None,
    haystack_text: str | None = None,
    out_dir: str | Path | None = None,
    prefix: str = "ablate",
    resume: bool = False,
    overwrite: bool = False,
    random_from: str = "all",
    tau: float = NON_RETRIEVAL_TAU,
    base_seed: int = 0,
    max_new_tokens: int = 50,
    model_name: str | None = None,
    progress: bool = True,
    limit: int | None = None,
    prompt_style: str = "auto",
    log=print,
) -> AblationResult:
    """Run every configuration of :func:`plan` (skipping finished ones with ``resume``) and return the curve.

    scores: ``{(layer, head): mean retrieval score}`` (``retmask.heads.selection.load_scores``); heads the
    model does not have -> error; heads absent from it count as 0.
    """
    shape = model_shape(model)
    try:
        full = complete_scores(scores, shape)
    except SelectionError as err:
        raise AblationError(f"{err} (model: {model_name or model.config.name_or_path})") from None
    ks = parse_ks(ks)
    pool = random_pool(full, random_from, tau)
    check_ks(ks, full, pool, shape, tau)
    configs = plan(ks, seeds, base_seed)
    heads = {c.name: heads_for(c, full, pool) for c in configs}

    needle_list = (
        load_needles(needles) if needles is None or isinstance(needles, (str, Path)) else list(needles)
    )
    text = load_haystack(None) if haystack_text is None else haystack_text
    style = resolve_prompt_style(tokenizer, prompt_style)
    fingerprint = grid_fingerprint(
        model, model_name, lengths, depths, needle_list, text, max_new_tokens, style
    ) | {
        "shape": list(shape),
        "scores_sha256": scores_digest(full),
        "random_from": random_from,
        # only when it matters and is not the default, so runs begun before the option still resume
        **({"tau": tau} if random_from == "non-retrieval" and tau != NON_RETRIEVAL_TAU else {}),
    }

    folder = ConfigFolder(out_dir, prefix, AblationError)
    results: dict[str, NiahResult] = {}
    for path in folder.saved(resume=resume, overwrite=overwrite):
        f = JsonFile(path, "ablation result", "delete it to recompute that configuration", AblationError)
        saved = f.expect(f.read(), dict, "the file")
        name = f.key(saved, "name", str)
        fix = "rerun with the same flags, or --overwrite"
        check_same_settings(saved.get("fingerprint"), fingerprint, path=path, fix=fix, error=AblationError)
        if name not in heads or saved.get("heads") != [list(h) for h in heads[name]]:
            raise AblationError(
                f"--resume: {path} was written by a run with other settings (its masked heads differ: "
                f"random pool or seeds changed); {fix}"
            )
        results[name] = _saved_result(f, f.key(saved, "result", dict))
    if results:
        log(f"resuming: {len(results)} of {len(configs)} configurations already done")

    t0 = time.perf_counter()
    for c in remaining(configs, results, limit=limit, desc="ablate", progress=progress):
        # the running configuration's finished tests, so an interrupt loses no answered test
        settings = {**fingerprint, "heads": [list(h) for h in heads[c.name]]}
        done, save = folder.running(c.name, settings, resume=resume)
        res = evaluate_niah(
            model, tokenizer, lengths=lengths, depths=depths, needles=needle_list, haystack_text=text,
            heads=heads[c.name], max_new_tokens=max_new_tokens, progress=progress, desc=c.name,
            prompt_style=style, done=done, on_entry=save,
        )  # fmt: skip
        results[c.name] = res
        folder.save(
            c.name,
            {
                "name": c.name,
                "fingerprint": fingerprint,
                "heads": [list(h) for h in heads[c.name]],
                "result": res.to_json(),
            },
        )
    meta = {
        **{k: v for k, v in fingerprint.items() if k != "needles"},
        **model_precision(model),  # also where the fingerprint leaves the defaults out
        "needles": len(needle_list),
        "ks": ks,
        "seeds": seeds,
        "base_seed": base_seed,
        "tests_per_config": len(next(iter(results.values())).entries) if results else 0,
        "top_ranking": [list(h) for h in ranked(full)[: max(ks)]],
        "configs_done": len(results),
        "configs_total": len(configs),
        "run_s_this_process": round(time.perf_counter() - t0, 1),
        "config_run_s": {n: r.meta.get("timings", {}).get("run_s") for n, r in results.items()},
    }
    out = AblationResult(configs, results, heads, meta)
    if out_dir is not None:
        out_dir = Path(out_dir)
        atomic_write_json(out_dir / f"{prefix}.json", out.to_json())
        atomic_write_text(out_dir / f"{prefix}.md", out.table() + "\n\n" + out.kinds_table() + "\n")
    return out


def _saved_result(f: JsonFile, data: dict) -> NiahResult:
    """The NIAH result of a configuration file, with what the curve reads checked (each test's recall, its
    cell of the grid): an edited file is an error naming it, not a wrong point or a ``TypeError``."""
    try:
        res = NiahResult.from_json(data)
    except (ValueError, TypeError) as err:  # NiahResult's messages name no file
        f.fail(f"'result' is not a NIAH result ({err})")
    for i, e in enumerate(res.entries):
        at = f"result.entries[{i}]"
        f.expect(e, dict, at)
        f.number(e["rouge1_recall"], f"{at}.rouge1_recall", lo=0, hi=1)
        if e["length"] not in res.lengths or e["depth"] not in res.depths:
            f.fail(f"{at} is at length {e['length']!r} / depth {e['depth']!r}, outside the grid")
    return res


def plot_ablation(result: AblationResult, path: str | Path, title: str = "") -> None:
    """Line plot: x = K heads masked, y = NIAH score; top-K retrieval heads vs K random heads (mean over the
    seeds, band = their min-max: the observed range, which stays inside the score's [0, 1], where mean ± std
    would not). The legend sits below the axes, clear of the curves and the band."""
    plt = pyplot()
    import numpy as np

    rows = [r for r in result.rows() if r["top"] is not None or r["random_mean"] is not None]
    fig, ax = plt.subplots(figsize=(5.6, 4.4))
    top = [(r["k"], r["top"]) for r in rows if r["top"] is not None]
    rnd = [
        (
            r["k"],
            r["random_mean"],
            min(r["random_values"] or [r["random_mean"]]),
            max(r["random_values"] or [r["random_mean"]]),
        )
        for r in rows
        if r["random_mean"] is not None
    ]
    if top:
        ax.plot(*zip(*top, strict=True), "o-", color="#d62728", label="top-K retrieval heads masked")
    if rnd:
        k, m, lo, hi = (np.asarray(x, dtype=float) for x in zip(*rnd, strict=True))
        n = max((r["random_n"] for r in rows), default=0)
        pool = "non-retrieval heads" if result.meta.get("random_from") == "non-retrieval" else "heads"
        label = f"K random {pool} masked (mean; band: min-max of {n} seeds)"
        ax.plot(k, m, "s-", color="#1f77b4", label=label)
        ax.fill_between(k, lo, hi, color="#1f77b4", alpha=0.2)
    ax.set_xlabel("K (heads masked)")
    ax.set_ylabel("NIAH score (mean ROUGE-1 recall)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    if title:
        ax.set_title(title, fontsize=9, wrap=True)  # each line wrapped to the figure's room
    fig.tight_layout()
    save_figure(fig, path)
