"""Retrieval-head detection (the Needle-in-a-Haystack retrieval score).

core.py     per-test copy counting: the step-by-step oracle and the fast path (proven equal by tests)
drafts.py   drafts for the fast path's verification passes: earlier answers to the needle, prompt lookup
kv_cache.py a KV cache that appends in place (no copy of the whole cache per pass)
kv_only.py  prefill calls compute only the last layer's K/V (their outputs are discarded)
prefill_chunk.py  the default prefill chunk by device (256 tokens on a CPU, 4096 on a GPU)
stopping.py newline / EOS stop tokens
scores.py   per-head scores JSON, summary, sparsity histogram, the --until-stable rule
answers.py  the answer loop shared with NIAH evaluation: prefix order, earlier answers per needle
run.py      the driver: grid, tests, resume, scores, run record
shard.py    torchrun / accelerate multi-process sharding (gloo; whole needles), merged = single-process result
"""

from retmask.detect.core import FastDetector, TestOutcome, oracle_detect
from retmask.detect.prefill_chunk import default_prefill_chunk
from retmask.detect.run import DetectConfig, DetectResult, run_detect
from retmask.detect.scores import head_scores, summarize
from retmask.detect.stopping import stop_token_ids

__all__ = [
    "DetectConfig",
    "DetectResult",
    "FastDetector",
    "TestOutcome",
    "default_prefill_chunk",
    "head_scores",
    "oracle_detect",
    "run_detect",
    "stop_token_ids",
    "summarize",
]
