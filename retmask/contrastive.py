"""RetMask preference pairs: a chosen response from the original model, a rejected one from the masked model.

One model copy serves both sides. A batch of b instructions becomes 2b rows
``[chosen_1 .. chosen_b, rejected_1 .. rejected_b]`` (left padded) and a per-row head mask ``[2b, L, Hq]``
switches the selected heads off in the rejected rows only, so both sides share every forward pass (the
reference implementation needs two servers and two checkpoints). ``rejected_model`` instead gives the
paper's Smaller-Model baseline: two models, no masks.

Reproducibility guarantee. Every row samples from its own ``torch.Generator`` seeded from
``(seed, instruction id, side)`` (:func:`row_seed`), and a token is drawn by inverse-CDF sampling with one
uniform number per step (:class:`PerRowSampler`). The random numbers a response sees therefore depend
neither on the batch it lands in, on the batch size, nor on where a resumed run starts. The logits
themselves can differ at float-rounding level between batch compositions (different padding, different
matmul blocking), so a token whose uniform falls within rounding of a CDF boundary may flip: same seed +
same batch size + same instruction order = bit-identical output; other batchings = identical up to such
rare boundary cases (tests check exact equality on a tiny model; on SmolLM2-135M, 32 instructions at
batch 16 and at batch 8 + kill + resume gave 32/32 identical pairs). Not guaranteed across versions of
torch, transformers or the attention kernels, which change the rounding.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from .instructions import Instruction

SIDES = ("chosen", "rejected")


class GenerateError(ValueError):
    """A generation request that cannot be honoured (bad arguments, resume state that does not match)."""


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings; ``temperature == 0`` means greedy. Paper/reference: T = 0.6, top-p = 1.0."""

    temperature: float = 0.6
    top_p: float = 1.0
    max_new_tokens: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise GenerateError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise GenerateError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens <= 0:
            raise GenerateError(f"max_new_tokens must be positive, got {self.max_new_tokens}")


# --------------------------------------------------------------------------------------------------
# Per-row sampling
# --------------------------------------------------------------------------------------------------


def row_seed(seed: int, instruction_id: str, side: str) -> int:
    """A 63-bit seed for one response, a pure function of (run seed, instruction id, side)."""
    digest = hashlib.sha256(f"{seed}\x00{instruction_id}\x00{side}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def make_generators(seeds: Sequence[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


class PerRowSampler(LogitsProcessor):
    """Samples the next token of every row from that row's own generator; returns one-hot scores.

    Used as the last logits processor of a *greedy* ``generate`` call: the argmax of the returned scores is
    the sampled token, so transformers still handles the cache, positions, EOS and padding, while the
    randomness stays per row. Each row draws exactly one uniform per step (finished rows too, harmlessly),
    so row r's t-th token always uses the t-th number of its generator.

    scores: [R, V] logits -> [R, V] with 0 at the sampled token and -inf elsewhere.
    """

    def __init__(self, generators: Sequence[torch.Generator], temperature: float, top_p: float = 1.0):
        self.generators = list(generators)
        self.temperature = float(temperature)
        self.top_p = float(top_p)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.temperature == 0.0:
            return scores  # greedy: the argmax of the raw logits
        rows = scores.shape[0]
        if rows != len(self.generators):
            raise GenerateError(
                f"{rows} rows but {len(self.generators)} generators (beam search is not supported)"
            )
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)  # [R, V]
        if self.top_p < 1.0:
            probs, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            before = probs.cumsum(-1) - probs
            probs = probs.masked_fill(before >= self.top_p, 0.0)
        else:
            order = None  # no sort needed: inverse-CDF works in vocabulary order
        cdf = probs.cumsum(-1)  # [R, V]
        u = torch.stack([torch.rand((), generator=g) for g in self.generators]).to(cdf.device)  # [R]
        # first index with cdf > u * total: never a zero-probability token
        idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1).contiguous(), right=True)
        idx = idx.clamp_(max=cdf.shape[-1] - 1)  # [R, 1]
        if order is not None:
            idx = order.gather(-1, idx)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, idx, 0.0)


# --------------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------------


@dataclass
class Completion:
    """One generated response: text (special tokens removed, stripped), token count, whether EOS ended it."""

    text: str
    num_tokens: int
    finished: bool


def chat_prompts(tokenizer: Any, prompts: Sequence[str]) -> list[str]:
    """The first user turn with the chat template and the generation prompt (plain text for base models)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return list(prompts)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise GenerateError("the model and tokenizer define no EOS token; generation could never stop")
    return ids


@torch.no_grad()
def generate_rows(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    seeds: Sequence[int],
    sampling: SamplingConfig,
    head_mask: torch.Tensor | None = None,
) -> list[Completion]:
    """Generate one response per prompt in one left-padded batch.

    prompts: R instruction texts (the chat template is applied here); seeds: R per-row seeds;
    head_mask: None, or bool [R, L, Hq] = per-row masked heads (needs ``attn_implementation="retmask"``).
    """
    import retmask

    if len(prompts) != len(seeds):
        raise GenerateError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only batches must end at the same column
    try:
        enc = tokenizer(
            chat_prompts(tokenizer, prompts), return_tensors="pt", padding=True, add_special_tokens=False
        )
    finally:
        tokenizer.padding_side = side
    device = next(model.parameters()).device
    enc = {k: v.to(device) for k, v in enc.items()}
    config = GenerationConfig(
        max_new_tokens=sampling.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad
    )
    processors = LogitsProcessorList(
        [PerRowSampler(make_generators(seeds), sampling.temperature, sampling.top_p)]
    )
    if head_mask is not None:
        with retmask.head_mask(model, head_mask):
            out = model.generate(**enc, generation_config=config, logits_processor=processors)
    else:
        out = model.generate(**enc, generation_config=config, logits_processor=processors)
    new = out[:, enc["input_ids"].shape[1] :].cpu()  # [R, T]
    results = []
    for row in new.tolist():
        n = len(row)
        for i, tok in enumerate(row):
            if tok in eos:
                n = i
                break
        finished = n < len(row)
        text = tokenizer.decode(row[:n], skip_special_tokens=True).strip()
        results.append(Completion(text=text, num_tokens=n, finished=finished))
    return results


def rejected_mask(batch: int, heads: Sequence[tuple[int, int]], shape: Sequence[int]) -> torch.Tensor:
    """bool [2b, L, Hq]: rows [chosen_1..chosen_b] unmasked, rows [rejected_1..rejected_b] with ``heads`` off."""
    n_layers, n_heads = shape
    mask = torch.zeros(2 * batch, n_layers, n_heads, dtype=torch.bool)
    for layer, head in heads:
        mask[batch:, layer, head] = True
    return mask


def contrast_batch(
    instructions: Sequence[Instruction],
    model: Any,
    tokenizer: Any,
    sampling: SamplingConfig,
    *,
    heads: Sequence[tuple[int, int]] | None = None,
    rejected_model: Any = None,
    rejected_tokenizer: Any = None,
) -> list[tuple[Completion, Completion]]:
    """(chosen, rejected) for each instruction: one 2b-row batch with per-row masks, or two models."""
    prompts = [inst.prompt for inst in instructions]
    seeds = {s: [row_seed(sampling.seed, inst.id, s) for inst in instructions] for s in SIDES}
    if rejected_model is None:
        if not heads:
            raise GenerateError("give the heads to mask, or a rejected model (the Smaller-Model baseline)")
        shape = model_shape(model)
        rows = generate_rows(
            model, tokenizer, prompts + prompts, seeds["chosen"] + seeds["rejected"], sampling,
            head_mask=rejected_mask(len(prompts), heads, shape),
        )  # fmt: skip
        chosen, rejected = rows[: len(prompts)], rows[len(prompts) :]
    else:
        chosen = generate_rows(model, tokenizer, prompts, seeds["chosen"], sampling)
        rejected = generate_rows(
            rejected_model, rejected_tokenizer or tokenizer, prompts, seeds["rejected"], sampling
        )
    return list(zip(chosen, rejected, strict=True))


def model_shape(model: Any) -> list[int]:
    """``[num_layers, num_query_heads]`` from an HF model's (text) config."""
    config = model.config
    config = getattr(config, "get_text_config", lambda: config)()
    return [int(config.num_hidden_layers), int(config.num_attention_heads)]


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
    inst: Instruction, chosen: Completion, rejected: Completion, prompt_tokens: int, meta: dict[str, Any]
) -> dict[str, Any]:
    """TRL's conversational preference format plus ``id`` and ``metadata``."""
    return {
        "id": inst.id,
        "prompt": [{"role": "user", "content": inst.prompt}],
        "chosen": [{"role": "assistant", "content": chosen.text}],
        "rejected": [{"role": "assistant", "content": rejected.text}],
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


def _atomic_write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: readers see the old or the new file, never half of one


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


class PairWriter:
    """Appends pair records to ``out`` and records progress atomically in ``out.progress.json``."""

    def __init__(self, out: Path, fingerprint: dict[str, Any], resume: bool):
        self.out = Path(out)
        self.progress_file = progress_path(self.out)
        if resume and self.progress_file.exists():
            state = json.loads(self.progress_file.read_text(encoding="utf-8"))
            self.progress = Progress(**state)
            diff = sorted(
                k for k in set(fingerprint) | set(self.progress.fingerprint)
                if fingerprint.get(k) != self.progress.fingerprint.get(k)
            )  # fmt: skip
            if diff:
                details = ", ".join(
                    f"{k}: {self.progress.fingerprint.get(k)!r} -> {fingerprint.get(k)!r}" for k in diff
                )
                raise GenerateError(
                    f"--resume: {self.out} was started with different settings ({details}); use the same "
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
            _atomic_write_json(self.progress_file, asdict(self.progress))
        self._done = set(self.progress.done)

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
        _atomic_write_json(self.progress_file, asdict(p))


def read_pairs(path: Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


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
) -> PairStats:
    """Write preference pairs for ``instructions`` to ``out`` (JSONL) and stats next to it; return the stats.

    ``fingerprint``: the settings a resumed run must match (the command passes models, heads, sampling).
    ``on_batch(i)`` is called after batch i is committed (tests use it to interrupt a run).
    """
    from tqdm.auto import tqdm

    if batch_size <= 0:
        raise GenerateError(f"batch size must be positive, got {batch_size}")
    check_unique_ids(instructions)
    fp = {**(fingerprint or {}), **asdict(sampling), "heads": [list(h) for h in heads or []]}
    writer = PairWriter(Path(out), fp, resume)
    todo = [inst for inst in instructions if not writer.is_done(inst.id)]
    meta_common = {"rejected_by": "smaller-model" if rejected_model is not None else "head-mask"}
    bar = tqdm(total=len(instructions), initial=len(instructions) - len(todo), desc="pairs", unit="instr",
               disable=not progress_bar)  # fmt: skip
    for i, batch in enumerate(batches(todo, batch_size)):
        start = time.perf_counter()
        results = contrast_batch(
            batch, model, tokenizer, sampling, heads=heads, rejected_model=rejected_model,
            rejected_tokenizer=rejected_tokenizer,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        records, dropped = [], {"empty": 0, "identical": 0}
        texts = [x.prompt for x in batch]
        # input tokens as the model sees them (chat template, incl. any default system prompt) and bare
        prompt_lens = [
            len(ids)
            for ids in tokenizer(chat_prompts(tokenizer, texts), add_special_tokens=False)["input_ids"]
        ]
        bare_lens = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        tokens = 0
        for inst, (chosen, rejected), n_prompt, n_bare in zip(
            batch, results, prompt_lens, bare_lens, strict=True
        ):
            tokens += chosen.num_tokens + rejected.num_tokens
            reason = drop_reason(chosen, rejected)
            if reason is not None:
                dropped[reason] += 1
                continue
            meta = {**meta_common, "seed": sampling.seed, "instruction_tokens": n_bare}
            records.append(pair_record(inst, chosen, rejected, n_prompt, meta))
        writer.commit(records, [x.id for x in batch], dropped, seconds, tokens)
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{writer.progress.generated_tokens / max(writer.progress.seconds, 1e-9):.0f}")
        if on_batch is not None:
            on_batch(i)
    bar.close()
    stats = compute_stats(read_pairs(writer.out), writer.progress.dropped)
    data = asdict(stats)
    data["generation_seconds"] = round(writer.progress.seconds, 2)
    data["generated_tokens"] = writer.progress.generated_tokens
    data["tokens_per_second"] = round(
        writer.progress.generated_tokens / max(writer.progress.seconds, 1e-9), 1
    )
    _atomic_write_json(stats_path(writer.out), data)
    return stats
