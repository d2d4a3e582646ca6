"""One head at a time: the NIAH score with each listed head masked alone, against the unmasked model.

A low retrieval score does not make a head safe to remove: on SmolLM2-135M, head 1-5 scores 0.00 yet
masking it alone drops NIAH from 0.85 to 0.53 (``bench/results/ablate_smollm2.md``). This sweep finds
such heads before they end up in a "non-retrieval" baseline mask. Each head's result is written
atomically as soon as it completes (``resume=True`` skips the finished ones of the same settings).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from retmask.evaluate.niah import NiahResult, evaluate_niah, grid_fingerprint
from retmask.heads.selection import Head
from retmask.niah import resolve_prompt_style
from retmask.niah.answer_kind import ANSWER_KINDS
from retmask.runfiles import JsonFile, atomic_write_json, check_same_settings

SWEEP_VERSION = 1


def _exact(result: NiahResult) -> int:
    return sum(e["rouge1_recall"] == 1.0 for e in result.entries)


def sweep_single_heads(
    model,
    tokenizer,
    heads: Sequence[Head],
    *,
    lengths: Sequence[int],
    depths: Sequence[int],
    needles,
    haystack_text: str,
    scores: Mapping[Head, float] | None = None,
    max_new_tokens: int = 50,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    model_name: str = "",
    log=print,
    prompt_style: str = "auto",
) -> dict:
    """Evaluate the NIAH grid unmasked and with each of ``heads`` masked alone.

    Returns (and writes to ``out``) ``{"meta", "baseline": {"mean", "exact"}, "heads": [{"head", "score",
    "mean", "exact", "drop", "examples"}, ...]}`` with heads in the given order; ``drop`` = baseline mean -
    masked mean; ``score`` = the head's mean retrieval score when ``scores`` is given.
    """
    style = resolve_prompt_style(tokenizer, prompt_style)
    fingerprint = grid_fingerprint(
        model, model_name, lengths, depths, needles, haystack_text, max_new_tokens, style
    )
    out = Path(out) if out is not None else None
    state: dict = {"version": SWEEP_VERSION, "meta": fingerprint, "baseline": None, "heads": {}}
    if out is not None and out.exists():
        if not resume:
            raise ValueError(f"{out} exists; pass --resume to continue that sweep or choose another --out")
        saved = _read_sweep(out)
        check_same_settings(
            {"version": saved.get("version"), **(saved.get("meta") or {})},
            {"version": SWEEP_VERSION, **fingerprint},
            path=out,
            fix="rerun with the same flags or choose another --out",
        )
        state["baseline"] = saved["baseline"]
        state["heads"] = {r["name"]: r for r in saved["heads"]}
        log(
            f"resuming: baseline {'done' if state['baseline'] else 'not done'}, {len(state['heads'])} heads done"
        )

    def run(mask: list[Head], desc: str) -> NiahResult:
        return evaluate_niah(
            model, tokenizer, lengths=lengths, depths=depths, needles=needles, haystack_text=haystack_text,
            heads=mask or None, max_new_tokens=max_new_tokens, progress=progress, desc=desc, prompt_style=style,
        )  # fmt: skip

    def save() -> None:
        if out is not None:
            atomic_write_json(out, _summary(state, heads))

    if state["baseline"] is None:
        base = run([], "no heads masked")
        state["baseline"] = {
            "mean": base.mean,
            "exact": _exact(base),
            "tests": len(base.entries),
            "kinds": base.answer_kinds(),
        }
        save()
    for head in heads:
        name = f"{head[0]}-{head[1]}"
        if name in state["heads"]:
            continue
        res = run([head], f"head {name}")
        state["heads"][name] = {
            "name": name,
            "head": [int(head[0]), int(head[1])],
            "score": None if scores is None else float(scores.get(tuple(head), 0.0)),
            "mean": res.mean,
            "exact": _exact(res),
            "kinds": res.answer_kinds(),
            "drop": state["baseline"]["mean"] - res.mean,
            "examples": [e["response"] for e in res.entries[:3]],
        }
        save()
    save()  # also when a resume ran nothing: the file lists the heads in this call's order
    return _summary(state, heads)


def _read_sweep(out: Path) -> dict:
    """A sweep file to resume, checked for what the sweep and its table read: an edited file is an error
    naming it, not a ``KeyError`` / ``TypeError`` (or a wrong drop) after the model has run."""
    f = JsonFile(out, "single-head sweep", "choose another --out, or delete it to start over")
    saved = f.expect(f.read(), dict, "the file")

    def kinds(r: dict, at: str) -> None:  # the table's answer kinds: {kind: tests}
        for k, n in f.expect(r.get("kinds", {}), dict, f"{at}.kinds").items():
            f.number(n, f"{at}.kinds[{k!r}]", integer=True, lo=0)
        if "kinds" in r and set(r["kinds"]) != set(ANSWER_KINDS):
            f.fail(f"{at}.kinds must count {', '.join(ANSWER_KINDS)}")

    f.expect(saved.get("meta"), (dict, type(None)), "'meta'")
    base = f.key(saved, "baseline", (dict, type(None)))
    if base is not None:
        f.number(f.key(base, "mean", float, "baseline"), "baseline.mean", lo=0, hi=1)
        f.number(f.key(base, "exact", int, "baseline"), "baseline.exact", integer=True, lo=0)
        f.number(f.key(base, "tests", int, "baseline"), "baseline.tests", integer=True, lo=0)
        kinds(base, "baseline")
    for i, r in enumerate(f.key(saved, "heads", list)):
        at = f"heads[{i}]"
        f.expect(r, dict, at)
        f.key(r, "name", str, at)
        f.key(r, "head", list, at)
        f.expect(r.get("score"), (float, type(None)), f"{at}.score")
        f.number(f.key(r, "mean", float, at), f"{at}.mean", lo=0, hi=1)
        f.number(f.key(r, "drop", float, at), f"{at}.drop", lo=-1, hi=1)
        f.number(f.key(r, "exact", int, at), f"{at}.exact", integer=True, lo=0)
        kinds(r, at)
    return saved


def _summary(state: dict, heads: Sequence[Head]) -> dict:
    """The sweep file: the heads asked for, in their order, then the heads an earlier run on the same file
    measured that this one did not list (a resume with another --each list adds to the sweep, never drops
    finished results)."""
    order = [f"{a}-{b}" for a, b in heads]
    listed = set(order)
    order += [name for name in state["heads"] if name not in listed]
    return {
        "version": SWEEP_VERSION,
        "meta": state["meta"],
        "baseline": state["baseline"],
        "heads": [state["heads"][n] for n in order if n in state["heads"]],
    }


def sweep_table(sweep: dict) -> str:
    """Markdown table, the largest drop first; drop = NIAH without a mask - NIAH with the head masked (a
    plain signed number: positive = the head mattered, negative = masking it helped). When the sweep
    recorded answer kinds, the last column counts them: complete / cut short / partial / none / empty."""
    base = sweep["baseline"]
    with_kinds = "kinds" in base and all("kinds" in r for r in sweep["heads"])

    def answers(r: dict) -> str:
        if with_kinds:
            return " / ".join(str(r["kinds"][k]) for k in ANSWER_KINDS)
        return f"{r['exact']}/{base['tests']}"

    what = "answers: " + " / ".join(ANSWER_KINDS) if with_kinds else "exact answers"
    lines = [
        f"| head masked alone | retrieval score | NIAH | drop (= none - masked) | {what} |",
        "|---|---|---|---|---|",
        f"| none | - | {base['mean']:.3f} | - | {answers(base)} |",
    ]
    for r in sorted(sweep["heads"], key=lambda r: -r["drop"]):
        score = "-" if r["score"] is None else f"{r['score']:.3f}"
        lines.append(
            f"| {r['name']} | {score} | {r['mean']:.3f} | {round(r['drop'], 3) + 0.0:.3f} | {answers(r)} |"
        )
    return "\n".join(lines)
