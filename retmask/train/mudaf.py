"""MuDAF training (MuDAF §3.2 and App. B): ``L = L_CLM + λ·L_CON`` with a plain torch loop, CPU fp32.

* Data: MDQA records (``retmask.mdqa``) rendered with the paper's template
  ``Based on the following passages, answer the question.\\n\\n<passages>\\n{body}\\n\\n</passages>\\n\\n
  Question: {question}\\nAnswer: {answer}`` + EOS; the CLM loss covers the answer tokens only (the
  leading space and the EOS included), prompt and padding are ``-100``.
* L_CON: :mod:`retmask.train.mudaf_loss`, on q / k tapped from the same forward pass
  (:func:`retmask.hf.taps.tap_qk`; no forked modeling code).
* Vanilla SFT baseline: λ = 0 -> the loss is exactly the CLM loss; L_CON is still computed (detached)
  on the same heads when heads are given, so both runs log it.
* Optimiser: AdamW (β = 0.9, 0.999 as in the paper), constant learning rate after an optional linear
  warm-up; batches of right-padded examples, gradient accumulation, seeded shuffling per epoch.
* Output: an HF checkpoint (``save_pretrained`` + tokenizer) and ``mudaf_train.json`` (settings, heads,
  per-step losses, timings). ``save_every`` writes ``<out>/resume.pt`` (weights, optimiser, step, log,
  RNG state) atomically; ``resume=True`` continues from it.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..detect.run import atomic_write_json, max_context
from ..hf.layers import head_layout
from ..hf.taps import tap_qk
from ..mdqa import MDQAError, MDQAExample, build_prompt, example_from_json
from .mudaf_loss import SIMILARITIES, Head, combine, contrastive_loss


@dataclass
class MuDAFConfig:
    """MuDAF training settings. ``lambda_con`` = λ of Eq. 8; ``alpha`` switches to the reference code's
    ``(1-α)·L_CLM + α·L_CON`` (it used α = 0.3); ``vanilla_sft`` = λ = 0 (the paper's baseline)."""

    heads: list[Head] = field(default_factory=list)
    lambda_con: float = 1.0
    alpha: float | None = None
    vanilla_sft: bool = False
    temperature: float = 0.05
    similarity: str = "concat"
    learning_rate: float = 5e-6  # the paper's (Llama-3.1-8B, full fine-tuning)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_steps: int = 100
    batch_size: int = 1  # the reference code's
    grad_accum: int = 1
    max_length: int | None = None  # None = the model's context
    seed: int = 0
    save_every: int = 0  # optimizer steps between resume checkpoints; 0 = none

    def check(self) -> None:
        if self.vanilla_sft and self.alpha not in (None, 0):
            raise MDQAError("--vanilla-sft trains on the CLM loss only; drop --alpha")
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise MDQAError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.lambda_con < 0:
            raise MDQAError(f"lambda must be >= 0, got {self.lambda_con}")
        if self.temperature <= 0:
            raise MDQAError(f"temperature must be > 0, got {self.temperature}")
        if self.similarity not in SIMILARITIES:
            raise MDQAError(f"similarity must be one of {SIMILARITIES}, got {self.similarity!r}")
        for name in ("max_steps", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise MDQAError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.learning_rate <= 0 or self.warmup_steps < 0 or self.save_every < 0:
            raise MDQAError("learning rate must be > 0, warm-up steps and save-every >= 0")
        if not self.vanilla_sft and not self.heads:
            raise MDQAError(
                "MuDAF needs target heads: pass --heads heads.json or --scores mdqa_scores.json (sampled), "
                "or --vanilla-sft for the CLM-only baseline"
            )

    @property
    def con_weight(self) -> float:
        """Weight of L_CON in the optimised loss (0 for vanilla SFT)."""
        if self.vanilla_sft:
            return 0.0
        return self.alpha if self.alpha is not None else self.lambda_con


@dataclass
class TrainItem:
    """One encoded example: ids [S], labels [S] (-100 outside the answer), passage token spans, golden
    passage indices and the last prompt token's position (the contrastive query row)."""

    example_id: str
    input_ids: list[int]
    labels: list[int]
    passage_spans: list[tuple[int, int]]
    golden: list[int]
    query_row: int


def encode(examples: Sequence[MDQAExample], tokenizer: Any, max_length: int | None) -> list[TrainItem]:
    """Render and tokenise every example with its answer; errors name the example."""
    if not examples:
        raise MDQAError("no MDQA training examples")
    items = []
    for ex in examples:
        example_from_json(ex.to_json(), f"example {ex.id}")  # same checks as the file loader
        pr = build_prompt(ex, tokenizer, include_answer=True, max_length=max_length)
        a, b = pr.answer_span
        labels = [-100] * a + pr.input_ids[a:b] + [-100] * (len(pr.input_ids) - b)
        items.append(
            TrainItem(ex.id, pr.input_ids, labels, pr.passage_spans, pr.golden_indices, pr.prompt_length - 1)
        )
    return items


def collate(items: Sequence[TrainItem], pad_id: int) -> dict[str, Any]:
    """Right-padded ``input_ids`` / ``attention_mask`` / ``labels`` int64 [B, S], ``query_rows`` int64 [B]."""
    S = max(len(it.input_ids) for it in items)
    B = len(items)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.long)
    labels = torch.full((B, S), -100, dtype=torch.long)
    for b, it in enumerate(items):
        n = len(it.input_ids)
        ids[b, :n] = torch.tensor(it.input_ids)
        mask[b, :n] = 1
        labels[b, :n] = torch.tensor(it.labels)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "query_rows": torch.tensor([it.query_row for it in items]),
        "passage_spans": [it.passage_spans for it in items],
        "golden": [it.golden for it in items],
    }


def mudaf_losses(
    model: torch.nn.Module, batch: dict[str, Any], cfg: MuDAFConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One forward pass -> (loss to optimise, L_CLM, L_CON or None when no heads are set).

    L_CON enters the loss only with a non-zero weight; for vanilla SFT it is returned detached.
    """
    device = next(model.parameters()).device
    kwargs = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "labels")}
    if not cfg.heads:
        clm = model(**kwargs, use_cache=False).loss
        return clm, clm, None
    layers = sorted({ly for ly, _ in cfg.heads})
    with tap_qk(model, layers, query_rows=batch["query_rows"]) as tap:
        clm = model(**kwargs, use_cache=False).loss
    con = contrastive_loss(
        tap, cfg.heads, batch["passage_spans"], batch["golden"], cfg.temperature, cfg.similarity
    )
    tap.clear()
    if cfg.con_weight == 0:
        return clm, clm, con.detach()
    return combine(clm, con, cfg.lambda_con, cfg.alpha), clm, con


@dataclass
class MuDAFResult:
    out: Path
    steps: int
    seconds: float
    log: list[dict[str, float]]

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / max(self.steps, 1)


def _check_heads(model: torch.nn.Module, heads: Sequence[Head]) -> None:
    L, Hq = head_layout(model).shape
    bad = [hd for hd in heads if not (0 <= hd[0] < L and 0 <= hd[1] < Hq)]
    if bad:
        raise MDQAError(f"heads {bad} do not exist in this model ({L} layers x {Hq} query heads)")


def _batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    order = list(range(n))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def _save_resume(path: Path, model, optimizer, step: int, log: list, seconds: float) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "log": log,
                "seconds": seconds}, tmp)  # fmt: skip
    os.replace(tmp, path)  # a crash leaves the previous checkpoint intact


def train_mudaf(
    model: torch.nn.Module,
    tokenizer: Any,
    examples: Sequence[MDQAExample],
    out: str | Path,
    cfg: MuDAFConfig,
    *,
    resume: bool = False,
    progress: bool = True,
    extra_record: dict[str, Any] | None = None,
) -> MuDAFResult:
    """Train ``model`` (on retmask attention) in place for ``cfg.max_steps`` optimizer steps; save to ``out``."""
    from tqdm.auto import tqdm

    cfg.check()
    _check_heads(model, cfg.heads)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    limit = cfg.max_length if cfg.max_length is not None else max_context(model)
    items = encode(examples, tokenizer, limit)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    torch.manual_seed(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
    )  # fmt: skip
    step, log, spent = 0, [], 0.0
    resume_path = out / "resume.pt"
    if resume and resume_path.is_file():
        state = torch.load(resume_path, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, log, spent = int(state["step"]), list(state["log"]), float(state["seconds"])
    model.train()
    per_epoch = _batches(len(items), cfg.batch_size, cfg.seed, 0)
    micro_per_epoch = len(per_epoch)
    micro = step * cfg.grad_accum  # micro-batches already consumed (resume continues the same order)
    bar = tqdm(
        total=cfg.max_steps,
        initial=step,
        desc="mudaf" if cfg.con_weight else "vanilla-sft",
        disable=not progress,
    )
    t0 = time.perf_counter()
    while step < cfg.max_steps:
        lr = (
            cfg.learning_rate * min(1.0, (step + 1) / cfg.warmup_steps)
            if cfg.warmup_steps
            else cfg.learning_rate
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        sums = {"loss": 0.0, "clm": 0.0, "con": 0.0}
        has_con = False
        for _ in range(cfg.grad_accum):
            epoch, pos = divmod(micro, micro_per_epoch)
            idx = _batches(len(items), cfg.batch_size, cfg.seed, epoch)[pos]
            micro += 1
            loss, clm, con = mudaf_losses(model, collate([items[i] for i in idx], pad_id), cfg)
            (loss / cfg.grad_accum).backward()
            sums["loss"] += float(loss.detach()) / cfg.grad_accum
            sums["clm"] += float(clm.detach()) / cfg.grad_accum
            if con is not None:
                has_con = True
                sums["con"] += float(con.detach()) / cfg.grad_accum
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        entry = {"step": step, "lr": lr, "loss": round(sums["loss"], 6), "clm": round(sums["clm"], 6)}
        if has_con:
            entry["con"] = round(sums["con"], 6)
        log.append(entry)
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in entry.items() if k in ("clm", "con")})
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
            _save_resume(resume_path, model, optimizer, step, log, spent + time.perf_counter() - t0)
    bar.close()
    seconds = spent + time.perf_counter() - t0
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = {
        "mode": "vanilla-sft" if cfg.vanilla_sft else "mudaf",
        "loss": "L_CLM" if cfg.con_weight == 0 else (
            f"L_CLM + {cfg.lambda_con:g} * L_CON" if cfg.alpha is None else f"{1 - cfg.alpha:g} * L_CLM + {cfg.alpha:g} * L_CON"
        ),
        "config": {**asdict(cfg), "heads": [list(h) for h in cfg.heads]},
        "examples": len(items),
        "tokens_mean": round(sum(len(it.input_ids) for it in items) / len(items), 1),
        "steps": step,
        "seconds": round(seconds, 2),
        "seconds_per_step": round(seconds / max(step, 1), 3),
        "log": log,
        **(extra_record or {}),
    }  # fmt: skip
    atomic_write_json(out / "mudaf_train.json", record)
    if resume_path.is_file():
        resume_path.unlink()  # finished: the HF checkpoint is the result
    return MuDAFResult(out, step, seconds, log)


def read_record(out: str | Path) -> dict[str, Any]:
    """The ``mudaf_train.json`` of a finished run."""
    return json.loads((Path(out) / "mudaf_train.json").read_text())
