"""``retmask pipeline``: detect → mask → generate → train → eval, every artefact in one run directory.

Layout of ``run_dir``::

    pipeline.json            config, and per stage: status, fingerprint, its config, outputs, seconds
    detect/scores.json       retrieval scores (+ scores.run.json, scores.png); a copy of --scores if given
    mask/heads.json          the masked heads (RetMask: the retrieval heads; baselines: as many other heads)
    mask/retrieval_heads.json  the retrieval heads themselves (what a baseline was matched against)
    generate/pairs.jsonl     chosen / rejected pairs (+ .stats.json, .progress.json)
    train/model/             the DPO-trained model, retmask_train.json, telemetry.json / .png
    eval/                    report.md, eval.json, niah.png, tasks.png, shift.png (+ models/ cache)

Resumption. A stage's fingerprint is the hash of its own settings and its inputs' fingerprints. A stage
is skipped when ``pipeline.json`` records it as done with the same fingerprint and its outputs exist; a
stage whose settings changed is cleared and rerun, and so is everything after it (their fingerprints
change with it). A stage interrupted mid-way restarts through its own resume mechanism where one exists:
detection continues from its progress file, generation from its pairs file (no pair lost or repeated),
evaluation from its per-model cache; training restarts (the short default run saves no checkpoints).

The defaults make the embedded SmolLM2-135M run fit in well under an hour on 2 CPU cores: the default
detection grid (96 tests), 32 instructions (stratified over the shipped categories), ≤ 128 new tokens per
response, DPO with the paper's optimiser settings for 2 epochs at global batch 8, and a 3-length eval.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from retmask.detect.run import atomic_write_json

STAGES = ("detect", "mask", "generate", "train", "eval")
VARIANTS = ("retmask", "random", "non-retrieval")
VERSION = 1


class PipelineError(ValueError):
    """A pipeline request that cannot run; the message says what to change."""


@dataclass
class PipelineConfig:
    model: str | None = None  # None = the embedded SmolLM2-135M-Instruct
    baseline: str = "retmask"  # which heads make the rejected responses: retmask | random | non-retrieval
    scores: str | None = None  # reuse this scores JSON instead of running detect
    # detect (the protocol's grid unless overridden)
    protocol: str = "default"
    detect_min_len: int | None = None
    detect_max_len: int | None = None
    detect_lengths: int | None = None
    detect_depths: int | None = None
    # mask
    threshold: float | None = 0.1
    top_k: int | None = None
    mask_seed: int = 0
    # generate
    instructions: str = "builtin"
    num_instructions: int = 32
    temperature: float = 0.6
    top_p: float = 1.0
    gen_max_new_tokens: int = 128
    gen_batch_size: int = 8
    gen_seed: int = 0
    # train (paper optimiser settings; a short run)
    lr: float = 5e-7
    epochs: float = 2.0
    max_steps: int = -1
    batch_size: int = 2
    grad_accum: int = 4
    max_length: int = 512
    beta: float = 0.1
    train_seed: int = 0
    telemetry_every: int = 2
    # eval
    eval_min_len: int = 1000
    eval_max_len: int | None = None
    eval_lengths: int = 3
    eval_depths: int = 3
    eval_needles: int = 3
    eval_cache: str | None = None  # shared per-model eval cache (default run_dir/eval/models)
    eval_tasks: list[str] = field(default_factory=lambda: ["niah", "multi_needle", "kv"])

    def check(self) -> None:
        if self.baseline not in VARIANTS:
            raise PipelineError(f"--baseline must be one of {VARIANTS}, got {self.baseline!r}")
        if (self.threshold is None) == (self.top_k is None):
            raise PipelineError("give exactly one of --threshold or --top-k")
        if self.num_instructions <= 0:
            raise PipelineError(f"--num-instructions must be positive, got {self.num_instructions}")
        if self.telemetry_every < 0:
            raise PipelineError("--telemetry-every must be >= 0 (0 = off)")


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:20]


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


class Pipeline:
    """Runs the stages of ``cfg`` in ``run_dir``; ``stop_after`` ends after that stage."""

    def __init__(self, cfg: PipelineConfig, run_dir: str | Path, *, progress: bool = True, log=print):
        cfg.check()
        self.cfg = cfg
        self.dir = Path(run_dir)
        self.progress = progress
        self.log = log
        self.state_path = self.dir / "pipeline.json"
        self.state: dict[str, Any] = {"version": VERSION, "stages": {}}
        if self.state_path.is_file():
            self.state = json.loads(self.state_path.read_text(encoding="utf-8"))
        self.state["config"] = asdict(cfg)
        self.fingerprints: dict[str, str] = {}

    # -- bookkeeping --------------------------------------------------------------------------------------
    def _save(self) -> None:
        atomic_write_json(self.state_path, self.state)

    def stage_config(self, name: str) -> dict:
        c = self.cfg
        model = c.model or "embedded"
        if name == "detect":
            if c.scores is not None:
                return {"scores_file_sha256": _file_hash(Path(c.scores))}
            return {"model": model, "protocol": c.protocol, "min_len": c.detect_min_len, "max_len": c.detect_max_len,
                    "lengths": c.detect_lengths, "depths": c.detect_depths}  # fmt: skip
        if name == "mask":
            return {"baseline": c.baseline, "threshold": c.threshold, "top_k": c.top_k, "seed": c.mask_seed}
        if name == "generate":
            return {"model": model, "instructions": c.instructions, "n": c.num_instructions, "temperature": c.temperature,
                    "top_p": c.top_p, "max_new_tokens": c.gen_max_new_tokens, "batch_size": c.gen_batch_size,
                    "seed": c.gen_seed}  # fmt: skip
        if name == "train":
            return {"model": model, "lr": c.lr, "epochs": c.epochs, "max_steps": c.max_steps, "batch_size": c.batch_size,
                    "grad_accum": c.grad_accum, "max_length": c.max_length, "beta": c.beta, "seed": c.train_seed,
                    "telemetry_every": c.telemetry_every}  # fmt: skip
        return {"model": model, **self.eval_config_dict()}

    def eval_config_dict(self) -> dict:
        c = self.cfg
        return {"min_len": c.eval_min_len, "max_len": c.eval_max_len, "num_lengths": c.eval_lengths,
                "num_depths": c.eval_depths, "niah_needles": c.eval_needles, "tasks": list(c.eval_tasks)}  # fmt: skip

    def fingerprint(self, name: str) -> str:
        i = STAGES.index(name)
        upstream = [self.fingerprints[s] for s in STAGES[:i]]
        fp = _hash({"stage": name, "config": self.stage_config(name), "inputs": upstream})
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
        from retmask.detect import DetectConfig, run_detect

        out = self.dir / "detect" / "scores.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        c = self.cfg
        if c.scores is not None:
            from retmask.selection import load_scores

            load_scores(c.scores)  # a wrong file fails here, with its name
            shutil.copyfile(c.scores, out)
            run = Path(c.scores).with_name(Path(c.scores).stem + ".run.json")
            if run.is_file():
                shutil.copyfile(run, out.with_name("scores.run.json"))
            return {"source": str(c.scores)}
        cfg = DetectConfig(model=c.model, protocol=c.protocol, min_len=c.detect_min_len, max_len=c.detect_max_len,
                           num_lengths=c.detect_lengths, num_depths=c.detect_depths)  # fmt: skip
        res = run_detect(cfg, out, plot=out.with_suffix(".png"), resume=resume, progress_bar=self.progress)
        return {"tests_counted": res.record["tests_counted"]}

    def _mask(self, resume: bool) -> dict:
        import retmask
        from retmask.contrastive import model_shape
        from retmask.selection import load_scores, select_heads, write_heads

        c = self.cfg
        scores_path = self.dir / "detect" / "scores.json"
        scores = load_scores(scores_path)
        shape = _shape(retmask, c.model, model_shape)
        retrieval = select_heads(
            scores, threshold=c.threshold, top_k=c.top_k, model_shape=shape, source=str(scores_path)
        )
        if not retrieval.heads:
            raise PipelineError(
                f"no head scores >= {c.threshold} in {scores_path}: nothing to mask; use a lower --threshold or --top-k K"
            )
        baseline = None if c.baseline == "retmask" else c.baseline
        sel = select_heads(scores, threshold=c.threshold, top_k=c.top_k, baseline=baseline, seed=c.mask_seed,
                           model_shape=shape, source=str(scores_path)) if baseline else retrieval  # fmt: skip
        write_heads(retrieval, self.dir / "mask" / "retrieval_heads.json")
        write_heads(sel, self.dir / "mask" / "heads.json")
        self.log(
            f"[pipeline] mask: {len(sel.heads)} heads ({c.baseline}); retrieval heads: {len(retrieval.heads)}"
        )
        return {"heads": len(sel.heads)}

    def _generate(self, resume: bool) -> dict:
        import retmask
        from retmask.contrastive import SamplingConfig, generate_pairs, model_shape
        from retmask.instructions import load_instructions
        from retmask.selection import read_heads

        c = self.cfg
        model, tok = retmask.load_model(c.model)
        heads = read_heads(self.dir / "mask" / "heads.json", model_shape=model_shape(model)).heads
        insts = stratified(
            load_instructions(c.instructions, tokenizer=tok, max_tokens=512), c.num_instructions
        )
        out = self.dir / "generate" / "pairs.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        sampling = SamplingConfig(c.temperature, c.top_p, c.gen_max_new_tokens, c.gen_seed)
        fp = {"model": c.model or "embedded", "rejected_model": None, "instructions": f"{c.instructions}[:{c.num_instructions}]",
              "column": None}  # fmt: skip
        stats = generate_pairs(insts, model, tok, out, sampling, heads=heads, batch_size=c.gen_batch_size,
                               resume=resume, fingerprint=fp, progress_bar=self.progress)  # fmt: skip
        self.log(stats.table())
        return {"pairs": stats.pairs, "instructions": len(insts)}

    def _train(self, resume: bool) -> dict:
        from retmask.selection import read_heads
        from retmask.train.config import TrainConfig
        from retmask.train.dpo import train_dpo

        c = self.cfg
        out = self.dir / "train" / "model"
        shutil.rmtree(out, ignore_errors=True)  # no checkpoints: an interrupted training starts over
        cfg = TrainConfig(learning_rate=c.lr, epochs=c.epochs, max_steps=c.max_steps, batch_size=c.batch_size,
                          grad_accum=c.grad_accum, max_length=c.max_length, beta=c.beta, seed=c.train_seed)  # fmt: skip
        callbacks = None
        if c.telemetry_every:
            from retmask.train.telemetry import RetrievalTelemetry

            heads = read_heads(self.dir / "mask" / "heads.json").heads
            callbacks = [RetrievalTelemetry(heads, c.telemetry_every)]
        res = train_dpo(self.dir / "generate" / "pairs.jsonl", out, c.model, cfg, callbacks=callbacks)
        return {"steps": res.steps, "seconds_per_step": round(res.seconds_per_step, 2)}

    def _eval(self, resume: bool) -> dict:
        from retmask.evaluate.suite import EvalConfig, run_suite

        c = self.cfg
        ecfg = EvalConfig(**self.eval_config_dict())
        d = self.dir / "eval"
        heads = [self.dir / "mask" / "heads.json"]
        if c.baseline != "retmask":
            heads.append(self.dir / "mask" / "retrieval_heads.json")
        label = "retmask-dpo" if c.baseline == "retmask" else f"{c.baseline}-mask-dpo"
        data = run_suite([c.model, str(self.dir / "train" / "model")], d, ecfg, labels=["original", label],
                         heads_files=heads, cache_dir=c.eval_cache or d / "models", progress=self.progress,
                         log=self.log)  # fmt: skip
        return {"tasks": {r["label"]: r["tasks"] for r in data["models"]}}


def _shape(retmask: Any, spec: str | None, model_shape: Any) -> list[int]:
    """[L, Hq] from the model's config alone (no weights loaded)."""
    from transformers import AutoConfig

    path = spec if spec is not None else str(retmask.default_model_path())
    try:
        cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):  # a GGUF file or similar: load the model once
        return model_shape(retmask.load_model(spec)[0])
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    return [int(cfg.num_hidden_layers), int(cfg.num_attention_heads)]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_pipeline(cfg: PipelineConfig, run_dir: str | Path, *, stop_after: str | None = None, progress: bool = True,
                 log=print) -> dict:  # fmt: skip
    """Run (or resume) the pipeline; returns the ``pipeline.json`` content."""
    return Pipeline(cfg, run_dir, progress=progress, log=log).run(stop_after)
