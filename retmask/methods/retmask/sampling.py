"""RetMask preference pairs: a chosen response from the original model, a rejected one from the masked model.

One model copy serves both sides. A batch of b instructions becomes 2b rows
``[chosen_1 .. chosen_b, rejected_1 .. rejected_b]`` (left padded) and a per-row head mask ``[2b, L, Hq]``
switches the selected heads off in the rejected rows only, so both sides share every forward pass (the
reference implementation needs two servers and two checkpoints). ``rejected_model`` instead gives the
Smaller-Model baseline: two models, no masks.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from retmask.heads import heads_to_mask, model_shape
from retmask.hf.generation import generate_copies
from retmask.methods.retmask.instructions import Instruction
from retmask.niah.prompt import is_chat_tokenizer

SIDES = ("chosen", "rejected")


class GenerateError(ValueError):
    """A generation request that cannot be honoured (bad arguments, resume state that does not match)."""


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings; ``temperature == 0`` means greedy. Published RetMask runs: T = 0.6, top-p = 1.0."""

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
    """The first user turn with the chat template and the generation prompt (plain text for a tokenizer
    without a chat template: a base model)."""
    if not is_chat_tokenizer(tokenizer):
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
    copies: int = 1,
) -> list[Completion]:
    """Generate one response per prompt in one left-padded batch.

    prompts: R instruction texts (the chat template is applied here); seeds: R per-row seeds;
    head_mask: None, or bool [R, L, Hq] = per-row masked heads (needs ``attn_implementation="retmask"``);
    copies: the prompts are ``copies`` stacked copies of their first R / copies (chosen rows, then rejected
    rows): the layers below the first one their masks differ in prefill each prompt once
    (``retmask.hf.generation``).
    """

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
    out = generate_copies(
        model, enc["input_ids"], enc["attention_mask"], config,
        copies=copies, head_mask=head_mask, logits_processor=processors,
    )  # fmt: skip
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
    mask = heads_to_mask(heads, shape, rows=2 * batch)
    mask[:batch] = False
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
    same_model: bool = False,
) -> list[tuple[Completion, Completion]]:
    """(chosen, rejected) for each instruction: one 2b-row batch with per-row masks, or two models.
    ``same_model``: two samples of the unmasked model per instruction (the Win-Lose-Pair baseline, whose
    judge orders them afterwards), with the chosen and rejected sides' seeds."""
    prompts = [inst.prompt for inst in instructions]
    seeds = {s: [row_seed(sampling.seed, inst.id, s) for inst in instructions] for s in SIDES}
    if same_model:
        # two stacked copies of the prompts: their prefill is shared (``retmask.hf.shared_prefill``)
        rows = generate_rows(
            model, tokenizer, prompts + prompts, seeds["chosen"] + seeds["rejected"], sampling, copies=2
        )
        chosen, rejected = rows[: len(prompts)], rows[len(prompts) :]
    elif rejected_model is None:
        if not heads:
            raise GenerateError("give the heads to mask, or a rejected model (the Smaller-Model baseline)")
        shape = model_shape(model)
        rows = generate_rows(
            model, tokenizer, prompts + prompts, seeds["chosen"] + seeds["rejected"], sampling,
            head_mask=rejected_mask(len(prompts), heads, shape), copies=2,
        )  # fmt: skip
        chosen, rejected = rows[: len(prompts)], rows[len(prompts) :]
    else:
        chosen = generate_rows(model, tokenizer, prompts, seeds["chosen"], sampling)
        rejected = generate_rows(
            rejected_model, rejected_tokenizer or tokenizer, prompts, seeds["rejected"], sampling
        )
    return list(zip(chosen, rejected, strict=True))
