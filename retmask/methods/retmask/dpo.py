"""RetMask DPO (and the SFT baseline) with TRL 1.16, the policy on ``attn_implementation="retmask"``.

The reference policy is the original model: a frozen deep copy of the policy taken before training (same
weights, same retmask attention), passed to ``DPOTrainer`` explicitly so TRL never re-loads it from
``config._name_or_path``, which fails for GGUF-loaded models. The policy itself is loaded with
``retmask.load_model``, which converts GGUF files once to a cached plain HF folder
(``retmask.default_model_path()`` for the embedded model), with its attention dropout set to 0: retmask
attention computes none (TRL's DPO turns dropout off anyway; SFT would otherwise stop at its first step on
a model that has some, e.g. GPT-2's ``attn_pdrop`` 0.1).

Every micro-batch's loss and every step's gradient norm are checked before the optimizer step
(``training_guards.FiniteTrainingGuard``): the first NaN / inf stops training with an error naming the
step and the likely cause, and nothing is saved. The trained model is moved into ``out`` whole or not at
all (``training_guards.staged_model_save``), ``retmask_train.json`` last.

With ``cfg.save_every = N`` the Trainer keeps a checkpoint in ``out`` every N steps, and ``resume=True``
continues from the newest one (the same steps, data order and optimizer state as an uninterrupted run;
``retmask.methods.checkpoints``). The checkpoints are deleted once the trained model is saved.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from retmask import kernels
from retmask.hf.loading import ModelLoadError, check_device, load_model
from retmask.methods import checkpoints
from retmask.methods.retmask.pairs import (
    Pairs,
    PairsError,
    check_chat_template,
    drop_unfinished,
    read_pairs_file,
)
from retmask.methods.retmask.train_config import LengthReport, TrainConfig, check_lengths
from retmask.methods.training_guards import FiniteTrainingGuard, staged_model_save
from retmask.model_files import copy_processor_files
from retmask.requirements import check_installed
from retmask.runfiles import atomic_write_json, check_writable


@dataclass
class TrainResult:
    """``steps``: the run's optimizer steps in all; ``seconds``: the wall time of the steps this call ran
    (``steps - resumed_from_step``; the Trainer keeps no time in its checkpoints), per step in
    ``seconds_per_step``."""

    out: Path
    steps: int
    seconds: float
    seconds_per_step: float
    losses: list[float]
    lengths: LengthReport
    resumed_from_step: int = 0


def _use_cpu(device: str) -> bool:
    """The Trainer's ``use_cpu`` for ``TrainConfig.device``. ``load_model`` returns a CPU model and the
    Trainer (accelerate: one GPU per process) moves it itself, always to the first visible GPU: another
    index is an error that says how to pick that GPU."""
    dev = check_device(device)  # a wrong name or a missing GPU: a clear error before any work
    if dev.type == "cpu":
        return True
    if dev.type != "cuda":
        raise ModelLoadError(f"--device {device}: training runs on cpu or cuda")
    if dev.index not in (None, 0):
        raise ModelLoadError(
            f"--device {device}: the Trainer uses the first visible GPU; run with CUDA_VISIBLE_DEVICES={dev.index} "
            "and --device cuda"
        )
    return False


def _check_training_packages() -> None:
    """TRL and datasets come with retmask's "train" extra: a missing or older one is named, with the fix,
    before anything is imported from it or loaded."""
    for package in ("trl", "datasets"):
        check_installed(package, extra="train")


def _read_pairs(path: str | Path, cfg: TrainConfig, sides: tuple[str, ...]) -> tuple[Pairs, int]:
    """The pairs to train on and how many ``cfg.drop_unfinished`` dropped (printed, and recorded)."""
    pairs = read_pairs_file(path)
    if not cfg.drop_unfinished:
        return pairs, 0
    pairs, dropped = drop_unfinished(pairs, sides)
    print(f"retmask train: dropped {dropped} pair(s) with a {' or '.join(sides)} response cut at the token limit; "
          f"{len(pairs.rows)} left")  # fmt: skip
    return pairs, dropped


def _bind(trainer: Any, callbacks: list | None) -> None:
    """Give callbacks that log through the trainer (``RetrievalTelemetry.bind``) the trainer itself."""
    for cb in callbacks or []:
        if hasattr(cb, "bind"):
            cb.bind(trainer)


def _train(
    trainer: Any, out: Path, cfg: TrainConfig, settings: dict[str, Any], checkpoint: Path | None
) -> int:
    """``trainer.train()``: from ``checkpoint`` (:func:`_resume_point`), else from the start, recording
    ``settings`` in ``out`` first when checkpoints will be written. Returns the step it started from."""
    if checkpoint is None:
        if cfg.save_every and trainer.is_world_process_zero():  # one process writes (as the Trainer's saves)
            checkpoints.start(out, settings)
        trainer.train()
        return 0
    print(f"retmask train: resuming from {checkpoint}")
    from transformers import TrainerState

    state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    if not _restore_finished(trainer, checkpoint, state):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    return int(state.global_step)


def _load_weights(model: Any, checkpoint: Path) -> None:
    """The weights a Trainer checkpoint saved (one safetensors file, or shards named by their index) into
    ``model``. Every parameter must come back, except a tied one whose twin did (saved once)."""
    import json

    from safetensors.torch import load_file

    index = checkpoint / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    state: dict = {}
    for name in files:
        state.update(load_file(str(checkpoint / name)))
    result = model.load_state_dict(state, strict=False)
    by_storage: dict[int, list[str]] = {}
    for key, tensor in model.state_dict().items():
        by_storage.setdefault(tensor.data_ptr(), []).append(key)
    tied = {key for keys in by_storage.values() if len(keys) > 1 for key in keys}
    missing = [key for key in result.missing_keys if key not in tied]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"checkpoint {checkpoint} does not match the model: missing {missing[:5]}, unexpected "
            f"{result.unexpected_keys[:5]}; resume from an earlier checkpoint or train again with --overwrite"
        )


def _restore_finished(trainer: Any, checkpoint: Path, state: Any) -> bool:
    """When ``checkpoint`` (its ``TrainerState``: ``state``) was written at the run's last step (its global step reached the planned total,
    the same plan: the settings were checked), restore its weights and state into ``trainer`` and return
    True: the trained model is those weights. ``Trainer.train`` would instead run one step past the plan
    (or, at an epoch's end, log a ``train_loss`` of 0.0 over no steps). The callbacks still see the train's
    begin and end (telemetry writes its files); the losses are the checkpoint's log, none recomputed."""
    if not state.max_steps or state.global_step < state.max_steps:
        return False
    _load_weights(trainer.model, checkpoint)
    trainer.state = state
    handler = trainer.callback_handler
    trainer.control = handler.on_train_begin(trainer.args, trainer.state, trainer.control)
    trainer.control = handler.on_train_end(trainer.args, trainer.state, trainer.control)
    print(
        f"retmask train: {checkpoint.name} is the planned last step ({state.global_step}): its weights are the "
        "trained model, nothing more trained (losses from its log history; no train_loss recomputed)"
    )
    return True


def _resume_point(
    mode: str,
    cfg: TrainConfig,
    pairs_path: str | Path,
    out: Path,
    model: Any,
    model_spec: str | None,
    resume: bool,
) -> tuple[dict[str, Any], Path | None]:
    """(the settings a resumable run records, the checkpoint to continue from with ``resume``), checked
    before any model is loaded: ``--resume`` without a checkpoint or with other settings is an error."""
    if model_spec is not None:
        name = str(model_spec)
    else:  # a model object, or the embedded default model that load_model(None) loads
        name = str(getattr(model.config, "name_or_path", "")) if model is not None else "default"
    settings = checkpoints.training_settings(mode, cfg, pairs_path, name)
    return settings, checkpoints.resume_point(out, settings, PairsError) if resume else None


def _finish(trainer: Any, tokenizer: Any, out: Path, cfg: TrainConfig, pairs: Pairs, lengths: LengthReport,
            seconds: float, mode: str, dropped: int = 0, first_step: int = 0) -> TrainResult:  # fmt: skip
    """Save the trained model + tokenizer and a ``retmask_train.json`` summary in ``out``, whole or not at
    all: staged in a hidden folder and renamed in, the summary last (``staged_model_save``); files the run
    wrote during training (telemetry) stay. A full disk is ``cannot write OUT: ...`` and leaves ``out`` as
    it was. ``first_step``: the checkpoint's step a resumed run started from (``seconds`` timed the rest)."""
    steps = int(trainer.state.global_step)
    losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    ran = steps - first_step
    result = TrainResult(out, steps, seconds, seconds / ran if ran else 0.0, losses, lengths, first_step)
    summary = {
        "mode": mode, "pairs": pairs.source, "examples": len(pairs.rows), "dropped_unfinished": dropped, "steps": steps,
        "resumed_from_step": first_step,  # seconds, seconds_per_step and a train_loss entry cover the steps after it
        "seconds": round(seconds, 2), "seconds_per_step": round(result.seconds_per_step, 3), "losses": losses,
        "config": asdict(cfg), "lengths": asdict(lengths),
        "log_history": trainer.state.log_history,  # every logged entry (losses, rewards, retrieval/* telemetry)
    }  # fmt: skip
    summary["kernels"] = kernels.describe()  # the machine, and the path each kind of call took on it
    with staged_model_save(out, last=("retmask_train.json",)) as staged:
        trainer.save_model(str(staged))
        tokenizer.save_pretrained(str(staged))
        copy_processor_files(trainer.model, staged)
        atomic_write_json(staged / "retmask_train.json", summary, indent=1)
    if trainer.is_world_process_zero():
        checkpoints.clear(out)  # the run is complete: nothing left to resume
    return result


def _train_and_save(trainer: Any, tokenizer: Any, out: Path, cfg: TrainConfig, pairs: Pairs, lengths: LengthReport,
                    settings: dict[str, Any], checkpoint: Path | None, mode: str, dropped: int) -> TrainResult:  # fmt: skip
    """The common tail of DPO and SFT: guard the steps (:func:`_watch`), train (:func:`_train`, timed from
    the step it starts at) and save (:func:`_finish`)."""
    _watch(trainer, cfg)
    start = time.perf_counter()
    first_step = _train(trainer, out, cfg, settings, checkpoint)
    seconds = time.perf_counter() - start
    return _finish(trainer, tokenizer, out, cfg, pairs, lengths, seconds, mode, dropped, first_step)


def _watch(trainer: Any, cfg: TrainConfig) -> None:
    """Stop at the first non-finite loss or gradient norm, before the optimizer applies it."""
    FiniteTrainingGuard(cfg.learning_rate).watch(trainer)


def train_dpo(
    pairs_path: str | Path,
    out: str | Path,
    model_spec: str | None = None,
    cfg: TrainConfig | None = None,
    *,
    model: Any = None,
    ref_model: Any = None,
    tokenizer: Any = None,
    callbacks: list | None = None,
    resume: bool = False,
) -> TrainResult:
    """DPO on a pairs file (sigmoid loss, β = ``cfg.beta``). Loads policy and reference with
    ``retmask.load_model(model_spec)`` unless ``model``/``ref_model``/``tokenizer`` are given. ``resume``:
    continue from the newest checkpoint in ``out`` (written with ``cfg.save_every``)."""
    _check_training_packages()
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    cfg = cfg or TrainConfig()
    kernels.check_settings()  # a bad $RETMASK_* setting fails here, not at the first step
    pairs, dropped = _read_pairs(pairs_path, cfg, ("chosen", "rejected"))  # before loading: fails fast
    cfg.warn_if_nothing_trains()
    check_writable(out, what="output folder", directory=True)  # likewise: not after minutes of loading
    out = Path(out)
    settings, checkpoint = _resume_point("dpo", cfg, pairs_path, out, model, model_spec, resume)
    if model is None:
        model, tokenizer = load_model(model_spec, attention_dropout=0.0)  # retmask attention has none
    if ref_model is None:
        # a frozen copy of the untrained weights = the original model; no reload by path needed
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    check_chat_template(pairs, tokenizer)
    lengths = check_lengths(pairs.rows, tokenizer, cfg.max_length, ("chosen", "rejected"), pairs.source)
    args = DPOConfig(
        **cfg.trainer_kwargs(str(out), _use_cpu(cfg.device)), beta=cfg.beta, loss_type=["sigmoid"]
    )
    model.train()
    trainer = DPOTrainer(
        model=model, ref_model=ref_model, args=args, train_dataset=Dataset.from_list(pairs.rows),
        processing_class=tokenizer, callbacks=callbacks,
    )  # fmt: skip
    _bind(trainer, callbacks)
    return _train_and_save(trainer, tokenizer, out, cfg, pairs, lengths, settings, checkpoint, "dpo", dropped)


def train_sft(
    pairs_path: str | Path,
    out: str | Path,
    model_spec: str | None = None,
    cfg: TrainConfig | None = None,
    *,
    model: Any = None,
    tokenizer: Any = None,
    callbacks: list | None = None,
    resume: bool = False,
) -> TrainResult:
    """The SFT baseline: supervised training on the chosen responses only (loss on the response).
    ``resume``: as in :func:`train_dpo`."""
    _check_training_packages()
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cfg = cfg or TrainConfig()
    kernels.check_settings()  # a bad $RETMASK_* setting fails before any loading
    pairs, dropped = _read_pairs(pairs_path, cfg, ("chosen",))
    cfg.warn_if_nothing_trains()
    check_writable(out, what="output folder", directory=True)  # before loading: fails fast
    out = Path(out)
    settings, checkpoint = _resume_point("sft", cfg, pairs_path, out, model, model_spec, resume)
    if model is None:
        model, tokenizer = load_model(model_spec, attention_dropout=0.0)  # retmask attention has none
    check_chat_template(pairs, tokenizer)
    lengths = check_lengths(pairs.rows, tokenizer, cfg.max_length, ("chosen",), pairs.source)
    rows = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in pairs.rows]
    # prompt-completion rows: TRL computes the loss on the completion only (completion_only_loss)
    args = SFTConfig(**cfg.trainer_kwargs(str(out), _use_cpu(cfg.device)), completion_only_loss=True)
    model.train()
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
        callbacks=callbacks,
    )  # fmt: skip
    _bind(trainer, callbacks)
    return _train_and_save(trainer, tokenizer, out, cfg, pairs, lengths, settings, checkpoint, "sft", dropped)
