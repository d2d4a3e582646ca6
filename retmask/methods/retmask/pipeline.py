"""``retmask pipeline``: detect → mask → generate → train → eval, every artefact in one run directory.

Layout of ``run_dir``::

    pipeline.json            config, and per stage: status, fingerprint, its config, outputs, seconds
    detect/scores.json       retrieval scores (+ scores.run.json, scores.png); a copy of --scores if given
    mask/heads.json          the masked heads (RetMask: the retrieval heads; baselines: as many other heads;
                             win-lose and smaller-model: none)
    mask/retrieval_heads.json  the retrieval heads themselves (what a baseline was matched against)
    generate/pairs.jsonl     chosen / rejected pairs (+ .stats.json, .progress.json)
    train/model/             the DPO-trained model (``--sft``: SFT on the chosen responses), retmask_train.json,
                             telemetry.json / .png
    eval/                    report.md, eval.json, niah.png, tasks.png, shift.png (+ models/ cache)

Resumption. A stage's fingerprint is the hash of its own settings and its inputs' fingerprints. A stage
is skipped when ``pipeline.json`` records it as done with the same fingerprint and its outputs exist. A
stage recorded with other settings is refused before any work (:class:`StageSettingsChanged`, naming the
stage and what changed): running it again would delete its outputs and those of every stage after it
(their fingerprints change with it), a trained model among them. ``overwrite`` runs it again, and every
stage after it; earlier stages whose settings did not change are kept (with no stage changed, every stage
runs again). A stage interrupted mid-way restarts through its own resume mechanism where one exists:
detection continues from its progress file, generation from its pairs file (no pair lost or repeated),
evaluation from its per-model cache, training from its newest checkpoint when ``save_every`` keeps them
(``retmask.methods.checkpoints``; by default it restarts: the short default run saves no checkpoints).

The defaults make the embedded SmolLM2-135M run take about 17 minutes on 2 CPU cores: the default
detection grid (96 tests), 32 instructions (stratified over the shipped categories), ≤ 128 new tokens per
response, DPO with RetMask's published optimiser settings for 2 epochs at global batch 8, and a 3-length eval.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from retmask.detect import DetectConfig, run_detect
from retmask.evaluate.suite import EvalConfig, run_suite
from retmask.heads import model_shape
from retmask.heads.selection import load_scores, read_heads, select_heads, write_heads
from retmask.hf.loading import DTYPES, check_model_spec, default_model_path, load_model
from retmask.methods import checkpoints
from retmask.methods.retmask.dpo import train_dpo, train_sft
from retmask.methods.retmask.generate import SamplingConfig, generate_pairs
from retmask.methods.retmask.instructions import load_instructions, source_digest
from retmask.methods.retmask.pipeline_config import STAGES, UNMASKED_VARIANTS, PipelineConfig, PipelineError
from retmask.methods.retmask.telemetry import RetrievalTelemetry
from retmask.methods.retmask.train_config import TrainConfig
from retmask.runfiles import (
    JsonFile,
    RunFileError,
    RunLock,
    atomic_write_bytes,
    atomic_write_json,
    check_writable,
    digest,
    file_digest,
    settings_diff,
    without_default_dtype,
)

VERSION = 1
PROMPT_TOKENS = 512  # the longest instruction the generate stage takes (tokens, without the chat template)
# the training schedule's settings: in the training stage's fingerprint only when not PipelineConfig's
# default, so runs begun before these options existed still resume
_SCHEDULE = ("min_lr_rate", "warmup_ratio", "weight_decay")
# the pipeline's names for the detection settings a failed detection suggests changing (None: no such flag)
_DETECT_FLAGS = {"min_len": "--detect-min-len", "max_len": "--detect-max-len", "max_new_tokens": None,
                 "needles": None, "span_rule": None, "span_miss": None}  # fmt: skip


class StageSettingsChanged(PipelineError, RunFileError):
    """A stage recorded in ``pipeline.json`` with other settings than this run's: running it again would
    delete its outputs (and the later stages'), so it takes ``--overwrite`` (or a new run dir)."""


def stratified(instructions: list, n: int) -> list:
    """The first ``n`` instructions taken round-robin over categories (in file order), so a small subset
    covers every kind of instruction the shipped set has."""
    groups: dict[Any, list] = {}
    for inst in instructions:
        groups.setdefault(inst.category, []).append(inst)
    out: list = []
    queues = [list(g) for g in groups.values()]
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def read_state(path: Path) -> dict[str, Any]:
    """``pipeline.json``, checked for what the driver reads (each stage's status and fingerprint): an edited
    file is an error naming it and ``--overwrite``, not a ``KeyError`` or ``AttributeError`` mid-run."""
    f = JsonFile(path, "pipeline state", "pass --overwrite to start over")
    state = f.expect(f.read(), dict, "the file")
    stages = f.key(state, "stages", dict)
    for name, rec in stages.items():
        if name not in STAGES:
            f.fail(f"stages holds {name!r}, which is not a stage ({', '.join(STAGES)})")
        f.expect(rec, dict, f"stages.{name}")
        f.key(rec, "status", str, f"stages.{name}")
        f.key(rec, "fingerprint", str, f"stages.{name}")
        if "seconds" in rec:  # printed at the end of every run
            f.number(rec["seconds"], f"stages.{name}.seconds", lo=0)
    return state


class Pipeline:
    """Runs the stages of ``cfg`` in ``run_dir``; ``stop_after`` ends after that stage."""

    def __init__(
        self,
        cfg: PipelineConfig,
        run_dir: str | Path,
        *,
        progress: bool = True,
        log=print,
        overwrite: bool = False,
    ):
        cfg.check()
        self.cfg = cfg
        self.dir = Path(run_dir)
        self.progress = progress
        self.log = log
        self.overwrite = overwrite
        self.state_path = self.dir / "pipeline.json"
        self.state: dict[str, Any] = {"version": VERSION, "stages": {}}
        if self.state_path.is_file():
            try:
                self.state = read_state(self.state_path)
            except RunFileError:
                if not overwrite:
                    raise  # --overwrite: a damaged state is started over
        self.state["config"] = asdict(cfg)
        self.fingerprints: dict[str, str] = {}

    # -- bookkeeping --------------------------------------------------------------------------------------
    def _save(self) -> None:
        atomic_write_json(self.state_path, self.state)

    def stage_config(self, name: str) -> dict:
        config = without_default_dtype(self._stage_config(name))
        # the device only off the CPU (and not for mask, which loads no model), so runs begun before the
        # option still resume
        if self.cfg.device != "cpu" and name != "mask" and not (name == "detect" and self.cfg.scores):
            config["device"] = self.cfg.device
        return config

    def _stage_config(self, name: str) -> dict:
        c = self.cfg
        model = c.model or "embedded"
        if name == "detect":
            if c.scores is not None:
                return {"scores_file_sha256": file_digest(c.scores)[:20]}
            return {"model": model, "protocol": c.protocol, "min_len": c.detect_min_len, "max_len": c.detect_max_len,
                    "lengths": c.detect_lengths, "depths": c.detect_depths, "dtype": c.dtype}  # fmt: skip
        if name == "mask":
            return {"baseline": c.baseline, "threshold": c.threshold, "top_k": c.top_k, "seed": c.mask_seed}
        if name == "generate":
            return {"model": model, "instructions": c.instructions, "instructions_sha256": source_digest(c.instructions),
                    "n": c.num_instructions, "temperature": c.temperature,
                    "top_p": c.top_p, "max_new_tokens": c.gen_max_new_tokens, "batch_size": c.gen_batch_size,
                    "seed": c.gen_seed, "dtype": c.dtype,
                    # only where they apply, so the runs of the other variants still resume
                    **({"rejected_model": c.rejected_model} if c.rejected_model else {}),
                    **({"target_pairs": c.num_instructions} if c.baseline == "win-lose" else {})}  # fmt: skip
        if name == "train":
            return {"model": model, "lr": c.lr, "epochs": c.epochs, "max_steps": c.max_steps, "batch_size": c.batch_size,
                    "grad_accum": c.grad_accum, "max_length": c.max_length, "beta": c.beta, "seed": c.train_seed,
                    "telemetry_every": c.telemetry_every, "dtype": c.dtype,
                    # only when not the default, so runs started before the option still resume
                    **({"objective": c.objective} if c.objective != "dpo" else {}),
                    **{k: getattr(c, k) for k in _SCHEDULE if getattr(c, k) != getattr(PipelineConfig, k)},
                    **({"drop_unfinished": True} if c.drop_unfinished else {})}  # fmt: skip
        return {"model": model, **self.eval_config_dict()}

    def eval_config_dict(self) -> dict:
        c = self.cfg
        return {"min_len": c.eval_min_len, "max_len": c.eval_max_len, "num_lengths": c.eval_lengths,
                "num_depths": c.eval_depths, "niah_needles": c.eval_needles, "tasks": list(c.eval_tasks),
                "dtype": c.dtype}  # fmt: skip

    def fingerprint(self, name: str) -> str:
        i = STAGES.index(name)
        upstream = [self.fingerprints[s] for s in STAGES[:i]]
        fp = digest({"stage": name, "config": self.stage_config(name), "inputs": upstream})[:20]
        self.fingerprints[name] = fp
        return fp

    def outputs(self, name: str) -> list[Path]:
        d = self.dir
        return {
            "detect": [d / "detect" / "scores.json"],
            "mask": [d / "mask" / "heads.json", d / "mask" / "retrieval_heads.json"],
            "generate": [d / "generate" / "pairs.jsonl"],
            "train": [d / "train" / "model" / "retmask_train.json"],
            "eval": [d / "eval" / "report.md", d / "eval" / "eval.json"],
        }[name]

    # -- driver ---------------------------------------------------------------------------------------------
    def run(self, stop_after: str | None = None) -> dict:
        if stop_after is not None and stop_after not in STAGES:
            raise PipelineError(f"--stop-after must be one of {STAGES}, got {stop_after!r}")
        check_writable(self.dir, what="run dir", directory=True)
        for spec in (self.cfg.model, self.cfg.rejected_model):  # a typo fails now, not after the first stages
            check_model_spec(spec)
        with RunLock(self.state_path, flag="--run-dir"):
            return self._run(stop_after)

    def stage_in_the_way(self, stop_after: str | None = None) -> tuple[str, str] | None:
        """``(stage, why)`` for the first stage (up to ``stop_after``) whose outputs this run would delete
        unasked: ``pipeline.json`` records it with another fingerprint than this run's (its settings changed,
        or an earlier stage's since it ran), or records no run of it while its folder holds files (a run dir
        whose ``pipeline.json`` was removed). None: no such stage."""
        for name in STAGES:
            fp = self.fingerprint(name)  # every stage's, in order: a stage's includes the earlier ones'
            rec = self.state["stages"].get(name)
            # a run that stopped before writing anything (an error in the mask stage) has nothing to lose
            lost = rec is not None and (rec.get("status") == "done" or _holds_files(self.dir / name))
            if lost and rec["fingerprint"] != fp:
                saved = rec.get("config")
                diff = settings_diff(saved, self.stage_config(name)) if isinstance(saved, dict) else []
                if diff:
                    return name, f"was run with other settings ({'; '.join(diff)})"
                return name, "was run with the same settings, but before an earlier stage ran with other ones"
            if rec is None and _holds_files(self.dir / name):
                return name, f"holds files that {self.state_path} records no run of"
            if name == stop_after:
                break
        return None

    def check_settings(self, stop_after: str | None = None) -> None:
        """Before any work: refuse to run a stage again whose outputs were made with other settings, unless
        ``overwrite`` (which runs it, and every stage after it, again; earlier stages are kept; with no stage
        in the way, every stage up to ``stop_after`` runs again). A rerun would delete its outputs and the
        later stages', a trained model among them."""
        found = self.stage_in_the_way(stop_after)
        if self.overwrite:
            if found is None:  # nothing changed: every stage (up to stop_after) runs again
                for name in STAGES[: STAGES.index(stop_after) + 1 if stop_after else len(STAGES)]:
                    self.state["stages"].pop(name, None)
            return
        if found is None:
            return
        name, why = found
        last = STAGES.index(stop_after) if stop_after else len(STAGES) - 1
        lost = [
            str(self.dir / s) for s in STAGES[STAGES.index(name) : last + 1] if _holds_files(self.dir / s)
        ]
        deletes = f"; running it again deletes {', '.join(lost)}" if lost else ""
        raise StageSettingsChanged(
            f"the {name} stage of {self.dir} {why}{deletes}; pass --overwrite to run the pipeline again from "
            f"{name}, or choose a new --run-dir to keep this run"
        )

    def _run(self, stop_after: str | None) -> dict:
        self.check_settings(stop_after)
        self.dir.mkdir(parents=True, exist_ok=True)
        total = time.perf_counter()
        for name in STAGES:
            fp = self.fingerprint(name)
            rec = self.state["stages"].get(name)
            done = rec is not None and rec.get("status") == "done" and rec.get("fingerprint") == fp
            if done and all(p.exists() for p in self.outputs(name)):
                self.log(f"[pipeline] {name}: up to date (fingerprint {fp}), skipped")
            else:
                resume = (
                    rec is not None and rec.get("fingerprint") == fp
                )  # interrupted with the same settings
                if not resume:
                    shutil.rmtree(self.dir / name, ignore_errors=True)  # stale outputs of other settings
                self.state["stages"][name] = {"status": "running", "fingerprint": fp, "config": self.stage_config(name),
                                              "started": _now(), "resumed": resume}  # fmt: skip
                self._save()
                self.log(f"[pipeline] {name}: {'resuming' if resume else 'running'}")
                start = time.perf_counter()
                info = getattr(self, f"_{name}")(resume) or {}
                seconds = time.perf_counter() - start
                self.state["stages"][name].update({"status": "done", "finished": _now(), "seconds": round(seconds, 1),
                                                   "outputs": [str(p) for p in self.outputs(name)], **info})  # fmt: skip
                self._save()
                self.log(f"[pipeline] {name}: done in {seconds:.1f} s")
            if name == stop_after:
                break
        self.state["last_run_seconds"] = round(time.perf_counter() - total, 1)
        self._save()
        return self.state

    # -- stages ---------------------------------------------------------------------------------------------
    def _detect(self, resume: bool) -> dict:

        out = self.dir / "detect" / "scores.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        c = self.cfg
        if c.scores is not None:
            load_scores(c.scores)  # a wrong file fails here, with its name
            # copied atomically: a full disk names the copy and leaves no torn one
            atomic_write_bytes(out, Path(c.scores).read_bytes())
            run = Path(c.scores).with_name(Path(c.scores).stem + ".run.json")
            if run.is_file():
                atomic_write_bytes(out.with_name("scores.run.json"), run.read_bytes())
            return {"source": str(c.scores)}
        cfg = DetectConfig(model=c.model, protocol=c.protocol, min_len=c.detect_min_len, max_len=c.detect_max_len,
                           num_lengths=c.detect_lengths, num_depths=c.detect_depths, dtype=c.dtype, device=c.device)  # fmt: skip
        res = run_detect(cfg, out, plot=out.with_suffix(".png"), resume=resume, progress_bar=self.progress,
                         flags=_DETECT_FLAGS)  # fmt: skip
        return {"tests_counted": res.record["tests_counted"]}

    def _mask(self, resume: bool) -> dict:

        c = self.cfg
        scores_path = self.dir / "detect" / "scores.json"
        scores = load_scores(scores_path)
        shape = _shape(c.model)
        retrieval = select_heads(
            scores, threshold=c.threshold, top_k=c.top_k, model_shape=shape, source=str(scores_path)
        )
        if not retrieval.heads:
            raise PipelineError(
                f"no head scores >= {c.threshold} in {scores_path}: nothing to mask; use a lower --threshold or --top-k K"
            )
        baseline = None if c.baseline == "retmask" else c.baseline
        # no head is masked; the file says so and keeps what it is compared with
        if baseline in UNMASKED_VARIANTS:
            sel = replace(retrieval, heads=[], scores=[], method="none", baseline=baseline,
                          retrieval_heads=list(retrieval.heads))  # fmt: skip
        elif baseline:
            sel = select_heads(scores, threshold=c.threshold, top_k=c.top_k, baseline=baseline, seed=c.mask_seed,
                               model_shape=shape, source=str(scores_path))  # fmt: skip
        else:
            sel = retrieval
        write_heads(retrieval, self.dir / "mask" / "retrieval_heads.json")
        write_heads(sel, self.dir / "mask" / "heads.json")
        self.log(
            f"[pipeline] mask: {len(sel.heads)} heads ({c.baseline}); retrieval heads: {len(retrieval.heads)}"
        )
        return {"heads": len(sel.heads)}

    def _generate(self, resume: bool) -> dict:

        c = self.cfg
        model, tok = load_model(c.model, dtype=DTYPES[c.dtype], device=c.device)
        win_lose = c.baseline == "win-lose"
        heads = (
            []
            if c.baseline in UNMASKED_VARIANTS
            else read_heads(self.dir / "mask" / "heads.json", model_shape=model_shape(model)).heads
        )
        rejected_model = rejected_tok = None
        if c.rejected_model:  # smaller-model: its own tokenizer and chat template, in the same dtype
            rejected_model, rejected_tok = load_model(
                c.rejected_model, dtype=DTYPES[c.dtype], device=c.device
            )
        pool = load_instructions(c.instructions, tokenizer=tok, max_tokens=PROMPT_TOKENS)
        if win_lose:  # its judge ranks the two samples against the instruction's reference answer
            pool = [inst for inst in pool if inst.reference]
            if not pool:
                raise PipelineError(
                    f"--baseline win-lose needs instructions with a 'reference' answer; {c.instructions} has none"
                )
        # Win-Lose-Pair draws further instructions (same stratified order) until it has as many pairs as the
        # other variants get from --num-instructions: its ROUGE judge ties often, an LLM judge picks one
        insts = stratified(pool, len(pool) if win_lose else c.num_instructions)
        target = c.num_instructions if win_lose else None
        out = self.dir / "generate" / "pairs.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        sampling = SamplingConfig(c.temperature, c.top_p, c.gen_max_new_tokens, c.gen_seed)
        fp = {"model": c.model or "embedded", "rejected_model": c.rejected_model,
              "instructions": f"{c.instructions}[:{c.num_instructions}]",
              "instructions_sha256": source_digest(c.instructions), "column": None, "dtype": c.dtype}  # fmt: skip
        stats = generate_pairs(insts, model, tok, out, sampling, heads=heads, rejected_model=rejected_model,
                               rejected_tokenizer=rejected_tok, batch_size=c.gen_batch_size, resume=resume,
                               fingerprint=fp, progress_bar=self.progress, win_lose=win_lose,
                               target_pairs=target)  # fmt: skip
        self.log(stats.table())
        if target is not None and stats.pairs < target:
            self.log(f"[pipeline] warning: {stats.pairs} pairs, fewer than {target}: every instruction with a "
                     "reference answer was used")  # fmt: skip
        return {"pairs": stats.pairs, "instructions": stats.instructions}

    def _train(self, resume: bool) -> dict:

        c = self.cfg
        out = self.dir / "train" / "model"
        # an interrupted training of the same settings continues from its newest checkpoint (--save-every);
        # without one it starts over
        found = checkpoints.checkpoints(out) if resume else []
        if found:
            self.log(f"[pipeline] train: continuing from {found[-1].name}")
        else:
            shutil.rmtree(out, ignore_errors=True)
        cfg = TrainConfig(learning_rate=c.lr, min_lr_rate=c.min_lr_rate, warmup_ratio=c.warmup_ratio,
                          weight_decay=c.weight_decay, epochs=c.epochs, max_steps=c.max_steps,
                          batch_size=c.batch_size, grad_accum=c.grad_accum, max_length=c.max_length, beta=c.beta,
                          seed=c.train_seed, gradient_checkpointing=c.gradient_checkpointing, dtype=c.dtype,
                          device=c.device, drop_unfinished=c.drop_unfinished, save_every=c.save_every)  # fmt: skip
        callbacks = None
        if c.telemetry_every:
            # a baseline that masks nothing follows the retrieval heads themselves
            unmasked = c.baseline in UNMASKED_VARIANTS
            heads_file = self.dir / "mask" / ("retrieval_heads.json" if unmasked else "heads.json")
            heads = read_heads(heads_file).heads
            label = "retrieval heads, none masked" if unmasked else "masked heads"
            callbacks = [RetrievalTelemetry(heads, c.telemetry_every, heads_label=label)]
        train = train_sft if c.objective == "sft" else train_dpo
        pairs = self.dir / "generate" / "pairs.jsonl"
        res = train(pairs, out, c.model, cfg, callbacks=callbacks, resume=bool(found))
        return {"steps": res.steps, "seconds_per_step": round(res.seconds_per_step, 2)}

    def _eval(self, resume: bool) -> dict:

        c = self.cfg
        ecfg = EvalConfig(**self.eval_config_dict())
        d = self.dir / "eval"
        # the masked heads (none for the unmasked baselines), then what a baseline is compared against
        heads = [] if c.baseline in UNMASKED_VARIANTS else [self.dir / "mask" / "heads.json"]
        if c.baseline != "retmask":
            heads.append(self.dir / "mask" / "retrieval_heads.json")
        if c.objective == "sft":
            label = "sft-chosen"  # the rejected responses (and so the baseline) play no part
        else:
            label = {
                "retmask": "retmask-dpo",
                "win-lose": "win-lose-dpo",
                "smaller-model": "smaller-model-dpo",
            }.get(c.baseline, f"{c.baseline}-mask-dpo")
        data = run_suite([c.model, str(self.dir / "train" / "model")], d, ecfg, labels=["original", label],
                         heads_files=heads, cache_dir=c.eval_cache or d / "models", progress=self.progress,
                         log=self.log, device=c.device)  # fmt: skip
        return {"tasks": {r["label"]: r["tasks"] for r in data["models"]}}


def _shape(spec: str | None) -> list[int]:
    """[L, Hq] from the model's config alone (no weights loaded)."""
    from transformers import AutoConfig

    path = spec if spec is not None else str(default_model_path())
    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError):  # a GGUF file or similar: load the model once
        return model_shape(load_model(spec)[0])
    return list(model_shape(cfg))


def _holds_files(path: Path) -> bool:
    """``path`` exists and is not an empty folder."""
    return path.exists() and not (path.is_dir() and not any(path.iterdir()))


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_pipeline(cfg: PipelineConfig, run_dir: str | Path, *, stop_after: str | None = None, progress: bool = True,
                 log=print, overwrite: bool = False) -> dict:  # fmt: skip
    """Run (or resume) the pipeline; returns the ``pipeline.json`` content. A stage recorded with other
    settings is refused (:class:`StageSettingsChanged`) unless ``overwrite``, which runs it and every later
    stage again (their earlier outputs deleted first); with no stage changed, ``overwrite`` runs every stage
    again, as in a fresh run dir."""
    return Pipeline(cfg, run_dir, progress=progress, log=log, overwrite=overwrite).run(stop_after)
