"""Guards shared by every training loop (``retmask train`` DPO / SFT, ``retmask mudaf-train``, the train stage
of ``retmask pipeline``).

* **Non-finite stop.** :func:`check_finite` is called once per optimizer step, before ``optimizer.step()``,
  with the step's loss and the total gradient norm: the first NaN / inf stops training with a
  :class:`NonFiniteTrainingError` (a :class:`~retmask.errors.UsageError`: the command prints it and exits 2)
  naming the step, the value and the likely cause (a learning rate too high; before any weight update: the
  model or the dtype). Nothing is saved: a diverged model whose every tensor is NaN is worse than none.
  The hand-written MuDAF loop calls it directly; a transformers ``Trainer`` (TRL's DPO / SFT) gets it through
  :class:`FiniteTrainingGuard`, which checks every micro-batch's loss (the Trainer itself replaces a NaN
  loss in its logs by the running mean and only logs every ``logging_steps``, so its logs hide the problem)
  and the gradient norm at ``on_pre_optimizer_step``.
* **Whole-or-nothing model save.** :func:`staged_model_save` writes the model files into a hidden folder
  inside ``out`` and moves them in by renames only at the end, the run's summary file last: a failed save
  (full disk, Ctrl-C) leaves ``out`` as it was (files the run wrote during training, an earlier model
  replaced with ``--overwrite``, a resume checkpoint) and nothing that blocks a rerun; ``OSError`` becomes
  :class:`~retmask.runfiles.OutputWriteError` (``cannot write OUT: REASON``).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from retmask.errors import UsageError
from retmask.runfiles import OutputWriteError, io_failure, output_error


class NonFiniteTrainingError(UsageError):
    """A training step's loss or gradient norm was NaN or infinite; training stopped and nothing was saved."""


def gradient_norm(parameters: Iterable[torch.nn.Parameter]) -> float:
    """Total L2 norm of the parameters' gradients (what ``clip_grad_norm_`` reports): NaN / inf as soon as
    one gradient entry is. Parameters without a gradient are skipped; 0.0 when none has one."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    # one fused norm per device and dtype group, then the norm of the norms (no [N] concatenation)
    return float(torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=None))


def _value(x: float | torch.Tensor | None) -> float | None:
    if x is None:
        return None
    return float(x.detach().float().sum()) if isinstance(x, torch.Tensor) else float(x)


def check_finite(
    step: int,
    *,
    learning_rate: float,
    updates: int,
    loss: float | torch.Tensor | None = None,
    grad_norm: float | torch.Tensor | None = None,
    flag: str = "--lr",
    kept: str | os.PathLike | None = None,
) -> None:
    """Raise :class:`NonFiniteTrainingError` when ``loss`` or ``grad_norm`` (floats or tensors; None: not
    checked) is NaN or infinite.

    ``step``: the optimizer step being computed (1-based); ``updates``: weight updates already applied (0:
    the model itself gives non-finite values, the learning rate played no part yet); ``learning_rate``: the
    peak learning rate, named with ``flag`` in the advice; ``kept``: an earlier checkpoint that stays.
    """
    checks = (("loss", _value(loss)), ("gradient norm", _value(grad_norm)))
    bad = [(what, v) for what, v in checks if v is not None and not math.isfinite(v)]
    if not bad:
        return
    what = " and ".join(f"the {name} is {v}" for name, v in bad)
    if updates == 0:
        cause = (
            "this is before any weight update, so the learning rate played no part: the model or the data "
            "gives non-finite values (check the model's weights, --model; under --dtype bfloat16 try float32)"
        )
    else:
        cause = (
            f"after {updates} weight update(s) the model diverged, most likely because the learning rate is "
            f"too high: lower {flag} (now {learning_rate:g}; try {learning_rate / 10:g} or less)"
        )
    saved = f"no weights were saved ({kept} is kept)" if kept is not None else "no weights were saved"
    raise NonFiniteTrainingError(f"training stopped at step {step}: {what}; {cause}; {saved}")


class FiniteTrainingGuard(TrainerCallback):
    """Stop a transformers ``Trainer`` (TRL's DPO / SFT) at the first non-finite loss or gradient norm.

    ``watch(trainer)`` registers it and wraps the trainer's ``training_step`` so every micro-batch's loss is
    checked as soon as it is computed; ``on_pre_optimizer_step`` checks the norm of the gradients the
    optimizer is about to apply (after the Trainer's clipping, which turns an infinite norm into NaN
    gradients: still caught). Both run before ``optimizer.step()``, so the weights never take a
    non-finite update.
    """

    def __init__(self, learning_rate: float, *, flag: str = "--lr"):
        self.learning_rate = float(learning_rate)
        self.flag = flag

    def watch(self, trainer: Any) -> Any:
        """Check ``trainer``'s losses and gradient norms from now on; returns ``trainer``."""
        inner = trainer.training_step

        def training_step(*args: Any, **kwargs: Any) -> torch.Tensor:
            loss = inner(*args, **kwargs)  # scalar tensor, already backpropagated
            step = int(trainer.state.global_step)
            check_finite(step + 1, loss=loss, learning_rate=self.learning_rate, updates=step, flag=self.flag)
            return loss

        trainer.training_step = training_step  # the Trainer calls self.training_step: this instance's
        trainer.add_callback(self)
        return trainer

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any):
        if model is not None:
            step = int(state.global_step)
            check_finite(
                step + 1,
                grad_norm=gradient_norm(model.parameters()),
                learning_rate=self.learning_rate,
                updates=step,
                flag=self.flag,
            )
        return control


# --------------------------------------------------------------------------------------------------
# Whole-or-nothing model save into a folder that may already hold the run's other files
# --------------------------------------------------------------------------------------------------


def _move_in(staged: Path, out: Path, last: Sequence[str]) -> None:
    """Rename every entry of ``staged`` into ``out`` (``config.json`` after the weights, then ``last`` in
    order); on an ``OSError`` undo the renames done so far (replaced entries are restored), then re-raise."""
    names = sorted(p.name for p in staged.iterdir() if p.name != ".replaced")
    tail = [n for n in ("config.json", *last) if n in names]
    order = [n for n in names if n not in tail] + tail
    backup = staged / ".replaced"  # what the new files replace, until all of them are in place
    done: list[tuple[str, bool]] = []  # (name, an earlier entry was set aside)
    try:
        for name in order:
            dest = out / name
            replaced = dest.exists() or dest.is_symlink()
            if replaced:
                backup.mkdir(exist_ok=True)
                os.rename(dest, backup / name)
            try:
                os.rename(staged / name, dest)
            except OSError:
                if replaced:
                    os.rename(backup / name, dest)
                raise
            done.append((name, replaced))
    except OSError:
        for name, replaced in reversed(done):  # best effort: each undo is one rename in the same folder
            with contextlib.suppress(OSError):
                os.rename(out / name, staged / name)
                if replaced:
                    os.rename(backup / name, out / name)
        raise


@contextlib.contextmanager
def staged_model_save(out: str | os.PathLike, *, last: Sequence[str] = ()) -> Iterator[Path]:
    """``with staged_model_save(out, last=("summary.json",)) as tmp:`` write a trained model's files into
    ``tmp``; at the end they are renamed into ``out`` (weights first, ``config.json`` next, ``last`` at the
    very end, so a reader that waits for the summary file sees a complete model).

    ``out`` may already hold files (written during training, or an earlier model being replaced): those the
    model does not overwrite stay. ``tmp`` is a hidden folder inside ``out``, so every move is a rename on
    one file system (also when ``out`` is a mount point). On any error ``tmp`` is removed, replaced files are
    restored and a folder ``out`` created here is removed again if empty: the previous state, nothing that
    blocks a rerun. ``OSError`` (and an :class:`OutputWriteError` from a write inside ``tmp``) becomes
    ``OutputWriteError("cannot write OUT...: REASON")`` naming ``out``, not the hidden folder.
    """
    out = Path(out)
    created = not out.exists()
    # a save killed with kill -9 leaves its hidden folder (model-sized); the callers hold the run's lock
    # on ``out``, so any such folder is a dead run's
    stale = [p for p in out.glob(".model-partial-*") if p.is_dir() and not p.is_symlink()]
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    if stale:
        print(f"removed {len(stale)} unfinished model save(s) of a killed run from {out}", file=sys.stderr)
    try:
        out.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=".model-partial-", dir=out))
    except OSError as err:
        raise output_error(out, err) from None
    try:
        try:
            yield staged
            _move_in(staged, out, last)
        except OutputWriteError as err:  # atomic_write_* inside the hidden folder: name the real place
            raise OutputWriteError(str(err).replace(str(staged), str(out))) from None
        except Exception as err:
            cause = io_failure(err)  # a full disk under safetensors / torch.save is not an OSError
            if cause is None:
                raise
            raise output_error(out, cause) from None
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # only when empty: files written during training stay
        raise
    shutil.rmtree(staged, ignore_errors=True)  # emptied; holds only the replaced files of an earlier model
