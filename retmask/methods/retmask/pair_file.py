"""The RetMask pairs file: one JSON line per kept pair, appended, with an atomic progress file beside it.

``<out>`` holds ``{"id", "prompt", "chosen", "rejected", ...}`` rows; ``<out>.progress.json`` records the
byte offset and the instructions done after every batch, so a run killed at any point resumes exactly
where its last batch ended (a half-written tail is cut off); ``<out>.stats.json`` summarises a finished run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retmask.methods.retmask.instructions import Instruction
from retmask.methods.retmask.sampling import Completion, GenerateError
from retmask.runfiles import JsonFile, atomic_write_json, read_jsonl, settings_diff

# --------------------------------------------------------------------------------------------------
# Pairs and statistics
# --------------------------------------------------------------------------------------------------


def drop_reason(chosen: Completion, rejected: Completion) -> str | None:
    """Why a pair is unusable for DPO (the reference drops these), or None."""
    if not chosen.text or not rejected.text:
        return "empty"
    if chosen.text == rejected.text:
        return "identical"
    return None


def pair_record(
    inst: Instruction,
    chosen: Completion,
    rejected: Completion,
    prompt_tokens: int,
    meta: dict[str, Any],
    conversational: bool = True,
) -> dict[str, Any]:
    """TRL's conversational preference format (chat messages) plus ``id`` and ``metadata``; with
    ``conversational=False`` (the responses were sampled from the plain prompt of a model without a chat
    template) its standard format, plain strings, which the trainer tokenizes the same way."""

    def turn(role: str, text: str) -> list[dict[str, str]] | str:
        return [{"role": role, "content": text}] if conversational else text

    return {
        "id": inst.id,
        "prompt": turn("user", inst.prompt),
        "chosen": turn("assistant", chosen.text),
        "rejected": turn("assistant", rejected.text),
        "metadata": {
            **meta,
            "category": inst.category,
            "prompt_tokens": prompt_tokens,
            "chosen_tokens": chosen.num_tokens,
            "rejected_tokens": rejected.num_tokens,
            "chosen_finished": chosen.finished,
            "rejected_finished": rejected.finished,
        },
    }


@dataclass
class PairStats:
    """Table-12-style statistics of a pairs file (token counts with the policy model's tokenizer)."""

    pairs: int = 0
    mean_prompt_tokens: float = 0.0  # chat-templated prompt
    mean_instruction_tokens: float = 0.0  # the instruction text alone
    mean_chosen_tokens: float = 0.0
    mean_rejected_tokens: float = 0.0
    truncated_chosen: int = 0
    truncated_rejected: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: {"empty": 0, "identical": 0})
    instructions: int = 0

    def table(self) -> str:
        rows = [
            ("instructions", f"{self.instructions}"),
            ("pairs", f"{self.pairs}"),
            ("dropped (empty)", f"{self.dropped.get('empty', 0)}"),
            ("dropped (identical)", f"{self.dropped.get('identical', 0)}"),
            *(
                [("dropped (tied: the judge could not order them)", f"{self.dropped['tied']}")]
                if "tied" in self.dropped
                else []
            ),
            ("mean input tokens (chat template)", f"{self.mean_prompt_tokens:.1f}"),
            ("mean instruction tokens", f"{self.mean_instruction_tokens:.1f}"),
            ("mean output tokens (chosen)", f"{self.mean_chosen_tokens:.1f}"),
            ("mean output tokens (rejected)", f"{self.mean_rejected_tokens:.1f}"),
            (
                "hit max-new-tokens (chosen / rejected)",
                f"{self.truncated_chosen} / {self.truncated_rejected}",
            ),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def compute_stats(records: Sequence[dict[str, Any]], dropped: dict[str, int]) -> PairStats:
    n = len(records)
    meta = [r["metadata"] for r in records]

    def mean(key: str) -> float:
        return sum(m.get(key, 0) for m in meta) / n if n else 0.0

    return PairStats(
        pairs=n,
        mean_prompt_tokens=mean("prompt_tokens"),
        mean_instruction_tokens=mean("instruction_tokens"),
        mean_chosen_tokens=mean("chosen_tokens"),
        mean_rejected_tokens=mean("rejected_tokens"),
        truncated_chosen=sum(not m["chosen_finished"] for m in meta),
        truncated_rejected=sum(not m["rejected_finished"] for m in meta),
        dropped=dict(dropped),
        instructions=n + sum(dropped.values()),
    )


# --------------------------------------------------------------------------------------------------
# Append-only output with atomic progress (resume)
# --------------------------------------------------------------------------------------------------


def progress_path(out: Path) -> Path:
    return out.with_name(out.name + ".progress.json")


def stats_path(out: Path) -> Path:
    return out.with_name(out.stem + ".stats.json")


@dataclass
class Progress:
    """What is safely on disk: the JSONL's committed byte length and every instruction id handled.

    Written after each batch, after the batch's lines are flushed and fsynced. Lines past ``offset`` come
    from a batch whose progress was never recorded (the run died in between); resume truncates them and
    generates that batch again, with the same per-row seeds, so nothing is duplicated or lost.
    """

    fingerprint: dict[str, Any]
    offset: int = 0
    done: list[str] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=lambda: {"empty": 0, "identical": 0})
    seconds: float = 0.0
    generated_tokens: int = 0
    complete: bool = False  # True once every instruction of the run is handled and the stats are written


def read_progress(path: Path, fix: str) -> dict[str, Any]:
    """The fields of a progress file (:class:`Progress`), checked: an edited or foreign file is an error
    naming it and ``fix`` instead of a ``TypeError`` in ``Progress(**state)`` or a wrong resume offset."""
    f = JsonFile(path, "generation progress file", fix)
    state = f.expect(f.read(), dict, "the file")
    known = set(Progress.__dataclass_fields__)
    unknown = sorted(set(state) - known)
    if unknown:
        f.fail(f"it holds entries a progress file has not ({', '.join(map(repr, unknown))})")
    f.key(state, "fingerprint", dict)
    for name in ("offset", "generated_tokens"):
        if name in state:
            f.number(state[name], repr(name), integer=True, lo=0)
    if "seconds" in state:
        f.number(state["seconds"], "'seconds'", lo=0)
    for i, d in enumerate(f.expect(state.get("done", []), list, "'done'")):
        f.expect(d, str, f"done[{i}]")
    for k, v in f.expect(state.get("dropped", {}), dict, "'dropped'").items():
        f.number(v, f"dropped[{k!r}]", integer=True, lo=0)
    f.expect(state.get("complete", False), bool, "'complete'")
    return state


class PairWriter:
    """Appends pair records to ``out`` and records progress atomically in ``out.progress.json``."""

    def __init__(self, out: Path, fingerprint: dict[str, Any], resume: bool):
        self.out = Path(out)
        self.progress_file = progress_path(self.out)
        if resume and self.progress_file.exists():
            state = read_progress(self.progress_file, fix="start a new --out, or pass --overwrite")
            self.progress = Progress(**state)
            diff = settings_diff(self.progress.fingerprint, fingerprint)
            if diff:
                raise GenerateError(
                    f"--resume: {self.out} was started with different settings ({', '.join(diff)}); use the same "
                    "settings or write to a new file"
                )
            size = self.out.stat().st_size if self.out.exists() else 0
            if size < self.progress.offset:
                raise GenerateError(
                    f"--resume: {self.out} has {size} bytes but {self.progress_file} records {self.progress.offset}; "
                    "the output was modified after the run; start a new file"
                )
            with self.out.open("r+b" if self.out.exists() else "wb") as f:
                f.truncate(self.progress.offset)  # drop lines of a batch whose progress was never written
        else:
            if self.out.exists() and self.out.stat().st_size > 0:
                hint = (
                    f"it has no progress file ({self.progress_file.name}) to resume from"
                    if resume
                    else "pass --resume to continue it"
                )
                raise GenerateError(f"{self.out} already exists; {hint}, or remove it")
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_bytes(b"")
            self.progress = Progress(fingerprint=fingerprint)
            atomic_write_json(self.progress_file, asdict(self.progress))
        self._done = set(self.progress.done)
        self.progress.complete = False  # until finish(): an interrupted continuation is not complete

    def finish(self) -> None:
        """Record the run as complete (after the statistics file is written)."""
        self.progress.complete = True
        atomic_write_json(self.progress_file, asdict(self.progress))

    def is_done(self, instruction_id: str) -> bool:
        return instruction_id in self._done

    def commit(
        self,
        records: Sequence[dict],
        handled: Sequence[str],
        dropped: dict[str, int],
        seconds: float,
        tokens: int,
    ) -> None:
        """Append one batch's records, then record the batch as done (in that order: see :class:`Progress`)."""
        with self.out.open("ab") as f:
            for rec in records:
                f.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
            offset = f.tell()
        p = self.progress
        p.offset = offset
        p.done.extend(handled)
        self._done.update(handled)
        for k, v in dropped.items():
            p.dropped[k] = p.dropped.get(k, 0) + v
        p.seconds += seconds
        p.generated_tokens += tokens
        atomic_write_json(self.progress_file, asdict(p))


def unfinished_generation(out: str | os.PathLike) -> str | None:
    """Why the pairs file ``out`` is not the result of a finished ``retmask generate`` run, or None.

    A run is finished when its progress file says so (or, for files of older versions, when the statistics
    file is there). A pairs file without a progress file was not written by ``retmask generate`` (or its
    progress file was removed) and is taken as it is.
    """
    out = Path(out)
    prog, stats = progress_path(out), stats_path(out)
    if not prog.exists():
        return None
    state = read_progress(prog, fix="finish the run with generate --resume")
    if state.get("complete") is True or ("complete" not in state and stats.exists()):
        return None
    rows = sum(1 for line in out.open(encoding="utf-8") if line.strip()) if out.exists() else 0
    return (
        f"{out} is from an unfinished `retmask generate` run ({len(state.get('done', []))} instructions handled, "
        f"{rows} pairs so far; {prog.name} does not record the end of the run"
        + ("" if stats.exists() else f" and there is no {stats.name}")
        + "): finish it with the same generate command plus --resume"
    )


def read_pairs(path: Path) -> list[dict[str, Any]]:
    """The records of a pairs file; an unreadable file or a corrupt line is an error naming file and line."""
    return [obj for _, obj in read_jsonl(path, what="pairs file")]
