"""RetMask preference pairs: a chosen response from the original model, a rejected one from the masked model.

``generate_pairs`` batches the instructions, samples both sides in one pass per batch
(``sampling.contrast_batch``: per-row head masks on one model copy) and appends the kept pairs to the
pairs file (``pair_file``), resumably. See ``retmask.methods.retmask.sampling`` for the reproducibility
guarantee of the sampling.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from retmask.methods.retmask.instructions import Instruction
from retmask.methods.retmask.pair_file import (
    PairStats,
    PairWriter,
    compute_stats,
    drop_reason,
    pair_record,
    progress_path,
    read_pairs,
    stats_path,
)
from retmask.methods.retmask.sampling import (
    SIDES,
    Completion,
    GenerateError,
    PerRowSampler,
    SamplingConfig,
    chat_prompts,
    contrast_batch,
    generate_rows,
    row_seed,
)
from retmask.methods.retmask.win_lose import JUDGE, judge_pair
from retmask.niah.prompt import is_chat_tokenizer
from retmask.runfiles import atomic_write_json

__all__ = [
    "SIDES",
    "Completion",
    "GenerateError",
    "PairStats",
    "PairWriter",
    "PerRowSampler",
    "SamplingConfig",
    "compute_stats",
    "contrast_batch",
    "drop_reason",
    "generate_pairs",
    "generate_rows",
    "pair_record",
    "progress_path",
    "read_pairs",
    "row_seed",
    "stats_path",
]


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def batches(items: Sequence[Instruction], size: int) -> Iterator[list[Instruction]]:
    for i in range(0, len(items), size):
        yield list(items[i : i + size])


def check_unique_ids(instructions: Sequence[Instruction]) -> None:
    """Resume and seeding key on instruction ids: a repeated id would be skipped or sampled alike."""
    seen: set[str] = set()
    for inst in instructions:
        if inst.id in seen:
            raise GenerateError(f"instruction id {inst.id!r} appears twice; ids must be unique")
        seen.add(inst.id)


def generate_pairs(
    instructions: Sequence[Instruction],
    model: Any,
    tokenizer: Any,
    out: Path,
    sampling: SamplingConfig,
    *,
    heads: Sequence[tuple[int, int]] | None = None,
    rejected_model: Any = None,
    rejected_tokenizer: Any = None,
    batch_size: int = 8,
    resume: bool = False,
    fingerprint: dict[str, Any] | None = None,
    progress_bar: bool = True,
    on_batch: Callable[[int], None] | None = None,
    win_lose: bool = False,
    target_pairs: int | None = None,
) -> PairStats:
    """Write preference pairs for ``instructions`` to ``out`` (JSONL) and stats next to it; return the stats.

    ``fingerprint``: the settings a resumed run must match (the command passes models, heads, sampling).
    ``on_batch(i)`` is called after batch i is committed (tests use it to interrupt a run).
    ``win_lose``: the Win-Lose-Pair baseline: no head masked, two samples of the model per instruction,
    the better one against the instruction's reference chosen (``win_lose.judge_pair``); ties dropped.
    ``target_pairs``: stop once this many pairs are written, taking ``instructions`` in order only as far
    as needed (the instructions after the one that completes the target are not handled, so a resumed run
    stops at the same place). Without it every instruction is handled. Fewer pairs than the target when
    the instructions run out.
    """
    from tqdm.auto import tqdm

    if batch_size <= 0:
        raise GenerateError(f"batch size must be positive, got {batch_size}")
    if target_pairs is not None and target_pairs <= 0:
        raise GenerateError(f"the target number of pairs must be positive, got {target_pairs}")
    check_unique_ids(instructions)
    if win_lose:
        unjudged = [inst.id for inst in instructions if not inst.reference]
        if unjudged:
            raise GenerateError(
                f"the Win-Lose-Pair judge needs a reference answer per instruction; {len(unjudged)} have none "
                f"(first: {unjudged[0]!r}): keep only instructions with a 'reference' field"
            )
        if heads or rejected_model is not None:
            raise GenerateError(
                "the Win-Lose-Pair baseline samples the one model twice and masks no head; drop the heads and "
                "the rejected model"
            )
    fp = {**(fingerprint or {}), **asdict(sampling), "heads": [list(h) for h in heads or []]}
    if win_lose:
        fp["judge"] = JUDGE  # only then, so the fingerprints of earlier runs still resume
    if target_pairs is not None:
        fp["target_pairs"] = target_pairs  # likewise
    writer = PairWriter(Path(out), fp, resume)
    todo = [inst for inst in instructions if not writer.is_done(inst.id)]
    # pairs already on disk (a resumed run); only a target needs the count
    written = len(read_pairs(writer.out)) if target_pairs is not None else 0
    if win_lose:
        meta_common = {"rejected_by": "win-lose", "judge": JUDGE}
    else:
        meta_common = {"rejected_by": "smaller-model" if rejected_model is not None else "head-mask"}
    if target_pairs is None:
        bar = tqdm(total=len(instructions), initial=len(instructions) - len(todo), desc="pairs", unit="instr",
                   disable=not progress_bar)  # fmt: skip
    else:  # the work is counted in pairs: how many instructions it takes depends on the drops
        bar = tqdm(total=target_pairs, initial=min(written, target_pairs), desc="pairs", unit="pair",
                   disable=not progress_bar)  # fmt: skip
    # chat messages when the prompts were sampled through the chat template, else plain text (chat_prompts)
    conversational = is_chat_tokenizer(tokenizer)
    for i, batch in enumerate(batches(todo, batch_size)):
        if target_pairs is not None and written >= target_pairs:
            break
        start = time.perf_counter()
        results = contrast_batch(
            batch, model, tokenizer, sampling, heads=heads, rejected_model=rejected_model,
            rejected_tokenizer=rejected_tokenizer, same_model=win_lose,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        records, dropped = [], {"empty": 0, "identical": 0, **({"tied": 0} if win_lose else {})}
        texts = [x.prompt for x in batch]
        # input tokens as the model sees them (chat template, incl. any default system prompt) and bare
        prompt_lens = [
            len(ids)
            for ids in tokenizer(chat_prompts(tokenizer, texts), add_special_tokens=False)["input_ids"]
        ]
        bare_lens = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        tokens, handled = 0, []
        for inst, (chosen, rejected), n_prompt, n_bare in zip(
            batch, results, prompt_lens, bare_lens, strict=True
        ):
            tokens += chosen.num_tokens + rejected.num_tokens  # generated, whether used or not
            if target_pairs is not None and written + len(records) >= target_pairs:
                continue  # the target is met: the rest of the batch stays unhandled
            handled.append(inst.id)
            reason = drop_reason(chosen, rejected)
            if reason is not None:
                dropped[reason] += 1
                continue
            meta = {**meta_common, "seed": sampling.seed, "instruction_tokens": n_bare}
            if win_lose:
                judged = judge_pair(inst.reference, chosen, rejected)
                if judged is None:
                    dropped["tied"] += 1
                    continue
                chosen, rejected = judged.chosen, judged.rejected
                meta["quality"] = {"chosen": judged.chosen_quality, "rejected": judged.rejected_quality}
            records.append(pair_record(inst, chosen, rejected, n_prompt, meta, conversational))
        writer.commit(records, handled, dropped, seconds, tokens)
        written += len(records)
        bar.update(len(batch) if target_pairs is None else len(records))
        bar.set_postfix(tok_s=f"{writer.progress.generated_tokens / max(writer.progress.seconds, 1e-9):.0f}")
        if on_batch is not None:
            on_batch(i)
    bar.close()
    stats = compute_stats(read_pairs(writer.out), writer.progress.dropped)
    data = asdict(stats)
    data["settings"] = fp  # models, dtype, heads, sampling: what produced these pairs
    data["generation_seconds"] = round(writer.progress.seconds, 2)
    data["generated_tokens"] = writer.progress.generated_tokens
    data["tokens_per_second"] = round(
        writer.progress.generated_tokens / max(writer.progress.seconds, 1e-9), 1
    )
    atomic_write_json(stats_path(writer.out), data)
    writer.finish()
    return stats
