"""MuDAF training: ``L = L_CLM + λ·L_CON`` with a plain torch loop, CPU fp32.

* Data: MDQA records (``retmask.methods.mudaf.mdqa``) rendered with the MDQA template
  ``Based on the following passages, answer the question.\\n\\n<passages>\\n{body}\\n\\n</passages>\\n\\n
  Question: {question}\\nAnswer: {answer}`` + EOS; the CLM loss covers the answer tokens only (the
  leading space and the EOS included), prompt and padding are ``-100``; the LM head runs on the answer
  positions only (:func:`clm_loss`: the loss of transformers' causal-LM head over full logits).
* L_CON: :mod:`retmask.methods.mudaf.loss`, on q / k tapped from the same forward pass
  (:func:`retmask.hf.taps.tap_qk`; no forked modeling code).
* Vanilla SFT baseline: λ = 0 -> the loss is exactly the CLM loss; L_CON is still computed (detached)
  on the same heads when heads are given, so both runs log it.
* Optimiser: AdamW (β = 0.9, 0.999 as MuDAF publishes; torch's fused implementation, one kernel for all
  parameters instead of a loop over them: 7x faster per step on a 2-core CPU), constant learning rate after an optional linear
  warm-up; batches of right-padded examples, gradient accumulation, seeded shuffling per epoch.
* Output: an HF checkpoint (``save_pretrained`` + tokenizer) and ``mudaf_train.json`` (settings, heads,
  per-step losses, timings), moved into ``out`` whole or not at all (``staged_model_save``, the record
  last); a full disk is ``cannot write OUT: ...`` and leaves ``out`` as it was. ``save_every`` writes
  ``<out>/resume.pt`` (weights, optimiser, step, log) atomically; ``resume=True`` continues from it. No
  RNG state is needed: the data order is rebuilt from the seed and the step (retmask attention takes no
  dropout; a model with other dropout layers resumes with fresh dropout draws).
* Every step's loss and gradient norm are checked before ``optimizer.step()``: the first NaN / inf stops
  training (``NonFiniteTrainingError``, naming the step and the likely cause); nothing is saved and the
  last ``resume.pt`` stays.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from retmask import kernels
from retmask.hf.layers import head_layout
from retmask.hf.loading import max_context
from retmask.hf.precision import training_autocast
from retmask.hf.taps import tap_qk
from retmask.methods.mudaf.config import MuDAFConfig
from retmask.methods.mudaf.loss import Head, combine, contrastive_loss
from retmask.methods.mudaf.mdqa import MDQAError, MDQAExample, build_prompt, example_from_json
from retmask.methods.training_guards import (
    NonFiniteTrainingError,
    check_finite,
    gradient_norm,
    staged_model_save,
)
from retmask.model_files import copy_processor_files
from retmask.runfiles import (
    RunFileError,
    atomic_write_json,
    check_same_settings,
    io_failure,
    output_error,
    stale_temporaries,
    temporary_path,
    without_default_dtype,
)


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


def clm_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """L_CLM: the mean cross-entropy of the labelled next tokens, the value of ``model(..., labels=labels)
    .loss``, with the LM head run on the labelled positions only.

    input_ids, attention_mask, labels: int64 [B, S] (labels -100 where not scored). Position p predicts
    token p + 1, so the model keeps the hidden states of the positions whose next label is set
    (``logits_to_keep`` as a bool [B, S] mask) and the LM head gives [n, vocab] logits for those n rows
    instead of [B, S, vocab]: the answer after a long prompt costs a few rows, not the prompt's length
    (at 8K tokens and SmolLM2's 49K vocabulary the full logits alone are 1.6 GB in fp32). The logits are
    upcast to fp32 before the loss, as transformers' causal-LM loss does.
    """
    targets = labels[:, 1:]
    scored = targets != -100
    keep = torch.nn.functional.pad(scored, (0, 1), value=False)  # bool [B, S]
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=keep
    ).logits
    return torch.nn.functional.cross_entropy(logits.float(), targets[scored])


def mudaf_losses(
    model: torch.nn.Module, batch: dict[str, Any], cfg: MuDAFConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One forward pass -> (loss to optimise, L_CLM, L_CON or None when no heads are set).

    L_CON enters the loss only with a non-zero weight; for vanilla SFT it is returned detached.
    """
    device = next(model.parameters()).device
    kwargs = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "labels")}
    if not cfg.heads:
        clm = clm_loss(model, **kwargs)
        return clm, clm, None
    layers = sorted({ly for ly, _ in cfg.heads})
    with tap_qk(model, layers, query_rows=batch["query_rows"]) as tap:
        clm = clm_loss(model, **kwargs)
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


# identity entries the caller adds to the resume fingerprint (the command: the data file's SHA-256 and the
# model as given); a checkpoint written before they were recorded lacks them, which is not a mismatch
IDENTITY_KEYS = ("data_sha256", "model")


def _resume_settings(
    cfg: MuDAFConfig, examples: int, identity: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint (more --steps, another --save-every or
    --gradient-checkpointing is fine: none changes the result)."""
    changeable = ("max_steps", "save_every", "gradient_checkpointing")
    settings = {k: v for k, v in asdict(cfg).items() if k not in changeable}
    return (
        without_default_dtype(settings)
        | {"heads": [list(h) for h in cfg.heads], "examples": examples}
        | dict(identity or {})
    )


def check_not_finished(out: str | Path) -> None:
    """``--resume`` on a folder whose run finished (``mudaf_train.json`` is written last, once the model is
    in place) is refused: resuming would retrain from the base model and replace the result."""
    record = Path(out) / "mudaf_train.json"
    if not record.is_file():
        return
    try:
        steps = json.loads(record.read_text()).get("steps")
        trained = f" ({steps} steps)" if isinstance(steps, int) else ""
    except (OSError, ValueError, AttributeError):
        trained = ""
    raise RunFileError(
        f"--resume: the training in {out} already finished{trained}, see {record}; there is nothing to "
        "continue. Pass --overwrite to train again, or choose another --out"
    )


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Delete the staging files a ``kill -9`` during an atomic write of ``resume.pt`` / ``heads.json`` left
    in ``out`` (a model-sized ``.resume.pt.tmpNNN``: ``runfiles.stale_temporaries``), with one line on
    stderr saying so; the command calls it under the run's lock (no writer of this folder is running)."""
    stale = sorted(p for name in ("resume.pt", "heads.json") for p in stale_temporaries(out / name))
    for p in stale:
        p.unlink(missing_ok=True)
    if stale:
        names = ", ".join(p.name for p in stale)
        print(f"retmask: removed {len(stale)} temporary file(s) an interrupted write left in {out}: {names}",
              file=sys.stderr)  # fmt: skip
    return stale


def _save_resume(path: Path, model, optimizer, step: int, log: list, seconds: float, settings: dict) -> None:
    """Write the resume checkpoint atomically; a full disk is ``cannot write PATH: REASON`` (the previous
    checkpoint stays)."""
    tmp = temporary_path(path)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "log": log,
             "seconds": seconds, "settings": settings}  # fmt: skip
    try:
        # through a Python file object: a failed write then leaves its OSError in the zip writer's
        # RuntimeError (``io_failure`` finds it), instead of a bare "unexpected pos"
        with open(tmp, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, path)  # a crash leaves the previous checkpoint intact
    except Exception as err:
        cause = io_failure(err)
        if cause is None:
            raise
        raise output_error(path, cause) from None
    finally:
        if tmp.exists():
            tmp.unlink()


def _load_resume(path: Path, settings: dict) -> dict:
    """The checkpoint at ``path``; an unreadable file or one of other settings is an error naming it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # data only: never run its code
    except Exception as err:  # a torn or foreign file: zip / unpickling errors that do not name it
        raise RunFileError(
            f"resume checkpoint {path} cannot be read ({type(err).__name__}: {err}); it is damaged: delete it "
            "(or pass --overwrite) to start over"
        ) from None
    if not isinstance(state, dict) or not {"model", "optimizer", "step", "log", "seconds"} <= set(state):
        raise RunFileError(f"resume checkpoint {path} is not a MuDAF checkpoint; delete it to start over")
    if "settings" in state:  # checkpoints of earlier versions carry none
        saved = state["settings"]
        if isinstance(saved, dict):  # nor, before IDENTITY_KEYS, the data file's digest and the model
            settings = {k: v for k, v in settings.items() if k in saved or k not in IDENTITY_KEYS}
        check_same_settings(saved, settings, path=path,
                            fix="rerun with the same flags, or --overwrite to start over")  # fmt: skip
    return state


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
    identity: Mapping[str, Any] | None = None,
) -> MuDAFResult:
    """Train ``model`` (on retmask attention) in place for ``cfg.max_steps`` optimizer steps; save to ``out``.

    ``identity`` (keys of ``IDENTITY_KEYS``: the data file's SHA-256, the model as given) joins the settings
    a resume must share with ``resume.pt``."""
    from tqdm.auto import tqdm

    cfg.check()
    _check_heads(model, cfg.heads)
    out = Path(out)
    if resume:
        check_not_finished(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise output_error(out, err) from None
    remove_stale_temporaries(out)
    limit = cfg.max_length if cfg.max_length is not None else max_context(model)
    items = encode(examples, tokenizer, limit)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    torch.manual_seed(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), fused=True,
    )  # fmt: skip
    step, log, spent = 0, [], 0.0
    resume_path = out / "resume.pt"
    settings = _resume_settings(cfg, len(items), identity)
    if resume and resume_path.is_file():
        state = _load_resume(resume_path, settings)
        if int(state["step"]) > cfg.max_steps:  # it would save the checkpoint's steps as if --steps were met
            raise RunFileError(
                f"--resume: {resume_path} is at step {int(state['step'])}, past --steps {cfg.max_steps}; resume "
                f"with --steps {int(state['step'])} or more, or pass --overwrite to train again"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, log, spent = int(state["step"]), list(state["log"]), float(state["seconds"])
    model.train()
    if cfg.gradient_checkpointing:
        # transformers' default is non-reentrant: the q / k tapped for L_CON leave the checkpointed layers with
        # their autograd graph, and the recomputation in the backward pass runs after the tap has closed
        model.activation_checkpointing_enable()
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
            with training_autocast(cfg.dtype, model.device.type):
                loss, clm, con = mudaf_losses(model, collate([items[i] for i in idx], pad_id), cfg)
            (loss / cfg.grad_accum).backward()
            sums["loss"] += float(loss.detach()) / cfg.grad_accum
            sums["clm"] += float(clm.detach()) / cfg.grad_accum
            if con is not None:
                has_con = True
                sums["con"] += float(con.detach()) / cfg.grad_accum
        try:  # before the update: a NaN / inf here would turn every weight into NaN
            check_finite(
                step + 1, loss=sums["loss"], grad_norm=gradient_norm(model.parameters()),
                learning_rate=cfg.learning_rate, updates=step, kept=resume_path if resume_path.is_file() else None,
            )  # fmt: skip
        except NonFiniteTrainingError:
            bar.close()  # the error message on its own line, not after the progress bar
            raise
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
            _save_resume(resume_path, model, optimizer, step, log, spent + time.perf_counter() - t0, settings)
    bar.close()
    seconds = spent + time.perf_counter() - t0
    model.eval()
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_disable()  # the model is trained in place: returned as it came
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
        "kernels": kernels.describe(),  # the machine, and the path each kind of call took on it
        **(extra_record or {}),
    }  # fmt: skip
    with staged_model_save(out, last=("mudaf_train.json",)) as staged:
        model.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        copy_processor_files(model, staged)
        atomic_write_json(staged / "mudaf_train.json", record)
    if resume_path.is_file():
        resume_path.unlink()  # finished: the HF checkpoint is the result
    return MuDAFResult(out, step, seconds, log)


def read_record(out: str | Path) -> dict[str, Any]:
    """The ``mudaf_train.json`` of a finished run."""
    return json.loads((Path(out) / "mudaf_train.json").read_text())
