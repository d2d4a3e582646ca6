"""Live retrieval telemetry: the retrieval score of the masked heads and of the other heads while training.

RetMask training is expected to raise the retrieval scores of the masked heads most (the published runs
show it). This
``TrainerCallback`` makes that visible during training: at step 0, every ``every`` optimizer steps and at
the end it runs a small fixed NIAH probe (``retmask.evaluate.shift``: a few detection tests built once,
the detection fast path with argmax capture, the retrieval score per head) on the model being trained and
logs

* ``retrieval/masked_mean``: mean retrieval score of the masked heads (the heads file used for the pairs;
  a baseline that masks no head tracks the retrieval heads instead, under the same key, ``heads_label``
  saying which),
* ``retrieval/other_mean``: mean retrieval score of every other head,
* ``retrieval/probe_recall`` (mean ROUGE-1 recall of the probe answers) and ``retrieval/probe_counted``
  (tests passing the ROUGE-1 > 0.5 filter, the only ones that score),

through ``Trainer.log`` (so they land in ``state.log_history``, on the console and in every ``report_to``
integration) as their own log entries. It writes ``telemetry.json`` after every probe (atomically) and
``telemetry.png`` (steps × the two means) at the end, in the trainer's ``output_dir`` unless told otherwise.

Mechanics: the probe runs on the unwrapped model (DDP/accelerate wrappers removed) in eval mode under
``no_grad`` with a fresh KV cache (weights change between probes), then restores train mode; it does not
touch the optimizer, the RNG state or the batch. Only the main process probes; under DeepSpeed ZeRO-3 the
parameters are sharded and the probe cannot run (use ZeRO-2). The trainer's own ``log`` is bypassed in
favour of ``transformers.Trainer.log`` so TRL's averaged DPO metrics are not flushed into our entries.

Cost: one probe = its tests' prefill + greedy answers. Default probe: 2 needles × 1 length (1000 tokens) ×
2 depths = 4 tests, about 4-8 s on SmolLM2-135M on 2 CPU cores (the two depths of a needle share their KV
prefix); a DPO step on that model with 2 × 8 pairs of ~250 tokens takes tens of seconds, so probing every
5-10 steps costs a few percent.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from retmask.detect.stopping import stop_token_ids
from retmask.evaluate.shift import Head, Probe, build_probe, probe_scores, split_means
from retmask.heads.selection import check_heads, read_heads
from retmask.hf.layers import head_layout
from retmask.methods.retmask.generate import progress_path
from retmask.plotting import pyplot, save_figure
from retmask.runfiles import RunFileError, atomic_write_json, read_json

PROBE_LENGTHS = (1000,)
PROBE_DEPTHS = (25, 75)
PROBE_NEEDLES = 2
KEYS = ("retrieval/masked_mean", "retrieval/other_mean", "retrieval/probe_recall", "retrieval/probe_counted")


def _history_entry(step: int, logged: dict[str, Any]) -> dict[str, Any]:
    """A probe as ``history`` keeps it: the step and the ``retrieval/*`` values without their prefix."""
    return {"step": step, **{k.split("/", 1)[1]: v for k, v in logged.items() if k.startswith("retrieval/")}}


def unwrap(model: Any) -> Any:
    """The bare model under DDP / DataParallel / DeepSpeed / FSDP / torch.compile wrappers (accelerate's
    ``extract_model_from_parallel``, what the trainer itself uses)."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_torch_compile=False)


class RetrievalTelemetry(TrainerCallback):
    """Probe the retrieval scores of ``heads`` vs the other heads every ``every`` optimizer steps.

    Args:
        heads: the masked heads, ``[(layer, head), ...]``.
        every: probe interval in optimizer steps (> 0); step 0 and the last step are always probed.
        tokenizer: builds the probe; default: the trainer's ``processing_class`` at ``on_train_begin``.
        lengths, depths, num_needles: the probe grid (shipped needles and haystack).
        max_new_tokens: answer budget per test (the probe's needles need ~20 tokens).
        out_dir: where ``telemetry.json`` / ``.png`` go (default: the trainer's ``output_dir``).
        heads_label: what ``heads`` are, for the plot's legend and ``telemetry.json`` (default "masked heads";
            a baseline that masks none tracks e.g. "retrieval heads, none masked").

    Call :meth:`bind` with the trainer (``retmask train`` does) so entries go through ``Trainer.log``;
    unbound, entries are appended to ``state.log_history`` and printed.
    """

    def __init__(
        self,
        heads: Sequence[Head],
        every: int,
        *,
        tokenizer: Any = None,
        lengths: Sequence[int] = PROBE_LENGTHS,
        depths: Sequence[int] = PROBE_DEPTHS,
        num_needles: int = PROBE_NEEDLES,
        max_new_tokens: int = 32,
        out_dir: str | Path | None = None,
        heads_label: str = "masked heads",
    ):
        if every <= 0:
            raise ValueError(f"telemetry interval must be a positive number of steps, got {every}")
        if not heads:
            raise ValueError("telemetry needs the masked heads (the heads file used to make the pairs)")
        self.heads = [(int(a), int(b)) for a, b in heads]
        self.heads_label = heads_label
        self.every = int(every)
        self.tokenizer = tokenizer
        self.grid = (tuple(lengths), tuple(depths), int(num_needles))
        self.max_new_tokens = max_new_tokens
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.probe: Probe | None = None
        self.stop_ids: frozenset[int] | None = None
        self.history: list[dict] = []
        self.trainer: Any = None

    def bind(self, trainer: Any) -> RetrievalTelemetry:
        """Log through this trainer (``transformers.Trainer.log``)."""
        self.trainer = trainer
        return self

    # -- the probe ----------------------------------------------------------------------------------
    def _prepare(self, model: Any, tokenizer: Any) -> None:

        if self.probe is not None:
            return
        tokenizer = self.tokenizer if self.tokenizer is not None else tokenizer
        if tokenizer is None:
            raise ValueError(
                "RetrievalTelemetry needs a tokenizer: pass tokenizer= or train with processing_class"
            )
        self.tokenizer = tokenizer
        check_heads(self.heads, head_layout(model).shape, source="telemetry heads")
        lengths, depths, num_needles = self.grid
        self.probe = build_probe(tokenizer, lengths, depths, num_needles=num_needles)
        self.stop_ids = stop_token_ids(tokenizer, model)

    def measure(self, model: Any) -> dict[str, float]:
        """One probe on ``model`` (unwrapped here), train/eval mode restored; returns the logged values."""
        model = unwrap(model)
        self._prepare(model, None)
        was_training = model.training
        model.eval()
        try:
            res = probe_scores(
                model, self.tokenizer, self.probe, stop_ids=self.stop_ids, max_new_tokens=self.max_new_tokens
            )
        finally:
            model.train(was_training)
        masked, other = split_means(res.mean, self.heads)
        return {
            KEYS[0]: masked,
            KEYS[1]: other,
            KEYS[2]: res.recall,
            KEYS[3]: float(res.counted),
            "retrieval/probe_seconds": round(res.seconds, 3),
        }

    def _probe(self, args: Any, state: Any, control: Any, model: Any) -> None:
        if not state.is_world_process_zero:
            return
        step = int(state.global_step)
        if self.history and self.history[-1]["step"] == step:
            return
        values = self.measure(model)
        self.history.append(_history_entry(step, values))
        if self.trainer is not None:
            # the base class's log: TRL's override would flush its averaged DPO metrics into this entry
            from transformers import Trainer

            # Trainer.log resets control.should_log (CallbackHandler.on_log): keep the trainer's own
            # decision to log this step's loss
            should_log = control.should_log
            Trainer.log(self.trainer, dict(values))
            control.should_log = self.trainer.control.should_log = should_log
        else:
            state.log_history.append({**values, "step": step})
            print({**values, "step": step})
        self._write_json(args)

    # -- callback hooks -------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        if not state.is_world_process_zero:
            return
        self._prepare(unwrap(model), processing_class)
        if state.global_step:  # resumed from a checkpoint: its log history holds the probes until then
            self.history = [_history_entry(int(e["step"]), e) for e in state.log_history if KEYS[0] in e]
        else:
            self._probe(args, state, control, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0:
            self._probe(args, state, control, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        self._probe(args, state, control, model)
        self._write_json(args)
        self.plot(self._dir(args) / "telemetry.png")

    # -- outputs ------------------------------------------------------------------------------------------
    def _dir(self, args: Any) -> Path:
        return self.out_dir if self.out_dir is not None else Path(args.output_dir)

    def to_json(self) -> dict:
        lengths, depths, num_needles = self.grid
        probe = self.probe
        return {
            "every": self.every,
            "heads": [list(h) for h in self.heads],
            "heads_label": self.heads_label,
            "probe": {
                "lengths": list(lengths), "depths": list(depths), "needles": num_needles,
                "tests": probe.keys if probe else [], "skipped": probe.skipped if probe else [],
                "max_new_tokens": self.max_new_tokens,
            },
            "history": self.history,
        }  # fmt: skip

    def _write_json(self, args: Any) -> None:

        atomic_write_json(self._dir(args) / "telemetry.json", self.to_json())

    def plot(self, path: str | Path) -> Path:
        """Steps × masked-head and other-head mean retrieval score (PNG)."""
        plt = pyplot()

        steps = [h["step"] for h in self.history]
        fig, ax = plt.subplots(figsize=(6, 3.6))
        ax.plot(
            steps,
            [h["masked_mean"] for h in self.history],
            "o-",
            label=f"{self.heads_label} ({len(self.heads)})",
        )
        ax.plot(steps, [h["other_mean"] for h in self.history], "s-", label="other heads")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("mean retrieval score (probe)")
        ax.set_title(
            f"retrieval telemetry: {len(self.probe.tests) if self.probe else 0} probe tests", fontsize=9
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        save_figure(fig, path)
        return path


def heads_for_pairs(pairs: str | Path, heads_file: str | Path | None = None) -> list[Head]:
    """The masked heads for telemetry: ``heads_file`` (a heads JSON) if given, else the heads that
    ``retmask generate`` recorded in the pairs' progress file (``<pairs>.progress.json``)."""

    if heads_file is not None:
        return read_heads(heads_file).heads
    prog = progress_path(Path(pairs))
    heads = []
    if prog.is_file():
        state = read_json(prog, what="generation progress file", fix="pass --telemetry-heads heads.json")
        heads = state.get("fingerprint", {}).get("heads") or []
    if not heads:
        raise ValueError(
            f"no masked heads recorded for {pairs} (no {prog.name} with heads: made with --rejected-model or "
            "elsewhere); pass --telemetry-heads heads.json"
        )
    return [(int(a), int(b)) for a, b in heads]


def load_history(path: str | Path) -> list[dict]:
    """The probe history from a ``telemetry.json``."""
    record = read_json(path, what="telemetry file", fix="pass the telemetry.json written by `retmask train`")
    if not isinstance(record, dict) or not isinstance(record.get("history"), list):
        raise RunFileError(f"telemetry file {path} has no 'history' list; is it a retmask telemetry.json?")
    return record["history"]


__all__ = ["KEYS", "RetrievalTelemetry", "heads_for_pairs", "load_history", "unwrap"]
