"""Benchmark: where a Gemma-3-270M prefill's time goes, against SDPA's forward of the same model.

Gemma-3-270M: 18 layers (5 local layers with a 512-key sliding window per global layer), 4 query heads on
1 KV head of dimension 256, QK-norm, a 262,144-token vocabulary. Sides, on the same random prompt of N
tokens, interleaved (A B B A) after one untimed call each:

* ``sdpa, all logits``: one SDPA forward of the whole prompt computing the logits of every position, as
  the published detection script does before it decodes;
* ``sdpa, last logits``: the same forward, logits of the last position only;
* ``retmask detect prefill``: what ``retmask detect`` runs: the prompt in chunks (the device's default,
  256 tokens on a CPU) into a reserved cache, the retmask attention, no logits but the last, the last
  layer writing only its K/V;
* ``retmask one pass``: the same in one pass (chunk = N);
* ``sdpa detect prefill``: the chunked path with SDPA attention (``retmask detect --prefill-impl sdpa``).

Then one more run of the detect prefill with timers on every part (the attention call of local and
global layers, the q/k/v/o projections, the MLPs, the RMS norms, the embedding, the LM head; the rest is
the model's glue: rotary tables, residual adds, cache writes, masks): the breakdown table.

Writes bench/results/gemma3_prefill_<cpu kind>[_bf16].md / .json / .png.

    flock /tmp/retmask-heavy.lock python bench/bench_gemma3_prefill.py --lengths 4096,16384
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    cpu_kind,
    cpu_label,
    dtype_suffix,
    interleaved,
    machine_description,
    markdown_table,
    median,
    mem_available_bytes,
    page_tail,
    save_figure,
    text_table,
    write_page,
)

import retmask  # noqa: E402,F401  (registers the retmask attention)
from retmask.detect.core import attn_implementation  # noqa: E402
from retmask.detect.kv_only import last_layer_kv_only  # noqa: E402
from retmask.detect.prefill_chunk import resolve_prefill_chunk  # noqa: E402
from retmask.hf.kv_cache import growing_cache, reserve  # noqa: E402
from retmask.hf.loading import load_model, parse_dtype  # noqa: E402
from retmask.kernels import describe as describe_kernels  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def detect_prefill(model, ids: torch.Tensor, impl: str, chunk: int) -> float:
    """Seconds of ``retmask detect``'s prefill of ``ids`` (int64 [1, N]) with attention ``impl``."""
    n = ids.shape[1]
    cache = growing_cache(model)
    reserve(cache, n + 64)  # as detect: the cache is sized once for the prompt and the answer
    t0 = time.perf_counter()
    with torch.no_grad(), attn_implementation(model, impl), last_layer_kv_only(model):
        for a in range(0, n, chunk):
            model(
                input_ids=ids[:, a : a + chunk],
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
    return time.perf_counter() - t0


def sdpa_forward(model, ids: torch.Tensor, logits_to_keep: int) -> float:
    """Seconds of one SDPA forward of the whole prompt (``logits_to_keep=0``: every position's logits)."""
    t0 = time.perf_counter()
    with torch.no_grad(), attn_implementation(model, "sdpa"):
        model(input_ids=ids, use_cache=True, logits_to_keep=logits_to_keep)
    return time.perf_counter() - t0


class PartTimer:
    """Wall-clock seconds per part of a forward, from hooks on the model's modules and a wrapper around the
    retmask attention function (timers nest: the projections run inside the attention module, so the
    attention module itself is not timed, only its parts)."""

    def __init__(self, model) -> None:
        self.model = model
        self.seconds: dict[str, float] = defaultdict(float)
        self._handles: list = []
        self._starts: dict[int, float] = {}

    def _time(self, module: torch.nn.Module, part: str) -> None:
        def pre(mod, args):
            self._starts[id(mod)] = time.perf_counter()

        def post(mod, args, out):
            self.seconds[part] += time.perf_counter() - self._starts.pop(id(mod))

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def __enter__(self) -> PartTimer:
        from transformers import AttentionInterface

        from retmask.hf import interface

        for name, module in self.model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
                self._time(module, "q/k/v/o projections")
            elif leaf == "mlp":
                self._time(module, "MLP (gate, up, GELU, down)")
            elif type(module).__name__.endswith("RMSNorm"):
                self._time(module, "RMS norms (incl. QK-norm)")
            elif leaf == "embed_tokens":
                self._time(module, "embedding")
            elif leaf == "lm_head":
                self._time(module, "LM head (last position)")
        inner = interface.retmask_attention

        def timed(module, *args, **kwargs):
            kind = "local (window 512)" if getattr(module, "sliding_window", None) else "global"
            t0 = time.perf_counter()
            out = inner(module, *args, **kwargs)
            self.seconds[f"attention, {kind} layers"] += time.perf_counter() - t0
            return out

        AttentionInterface.register(interface.NAME, timed)
        self._restore: Callable[[], None] = lambda: AttentionInterface.register(interface.NAME, inner)
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._restore()


def breakdown(model, ids: torch.Tensor, chunk: int) -> dict[str, float]:
    """Seconds per part of one detect prefill (see :class:`PartTimer`), with ``total`` and ``rest``."""
    with PartTimer(model) as timer:
        total = detect_prefill(model, ids, "retmask", chunk)
    parts = dict(timer.seconds)
    parts["rest (rotary, residuals, cache writes, masks, Python)"] = total - sum(parts.values())
    parts["total"] = total
    return parts


def side_calls(model, ids: torch.Tensor, chunk: int) -> dict[str, Callable[[], float]]:
    """The compared prefills of ``ids`` (int64 [1, N]), each returning its seconds."""
    n = ids.shape[1]
    sides = {"sdpa, last logits": lambda: sdpa_forward(model, ids, 1)}
    if all_logits_bytes(model, n) <= mem_available_bytes() // 4:
        sides["sdpa, all logits"] = lambda: sdpa_forward(model, ids, 0)
    return sides | {
        f"retmask detect prefill (chunk {chunk})": lambda: detect_prefill(model, ids, "retmask", chunk),
        "retmask one pass": lambda: detect_prefill(model, ids, "retmask", n),
        f"sdpa detect prefill (chunk {chunk})": lambda: detect_prefill(model, ids, "sdpa", chunk),
    }


def all_logits_bytes(model, n: int) -> int:
    """Bytes of the float32 logits of every position of an ``n``-token prompt: [n, vocab]."""
    return 4 * n * model.config.get_text_config().vocab_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,16384", help="prompt lengths (tokens)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls per side (after one untimed)")
    ap.add_argument("--chunk", type=int, default=None, help="detect prefill chunk (default: the device's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default=None, help="page name (default gemma3_prefill_<cpu kind>[_bf16])")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_description()
    tag = args.tag or f"gemma3_prefill_{cpu_kind(machine)}{dtype_suffix(args.dtype)}"
    model, _ = load_model("gemma3-270m", dtype=parse_dtype(args.dtype))
    chunk = resolve_prefill_chunk(args.chunk, "cpu")
    rows, parts_by_n, skipped, payload = (
        [],
        {},
        [],
        {"machine": machine, "kernels": describe_kernels(), "lengths": {}},
    )
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(1000, 200_000, (1, n), generator=torch.Generator().manual_seed(n))
        sides = side_calls(model, ids, chunk)
        times = interleaved(sides, args.repeats)
        base = median(times["sdpa, last logits"])
        if "sdpa, all logits" not in times:
            skipped.append(
                f"N = {n}: `sdpa, all logits` not run: its logits alone need {all_logits_bytes(model, n) / 2**30:.1f} GiB"
            )
        for name, ts in times.items():
            t = median(ts)
            rows.append([str(n), name, f"{t:.2f}", f"{t / n * 1e3:.2f}", f"{t / base:.2f}x"])
        parts_by_n[n] = breakdown(model, ids, chunk)
        payload["lengths"][n] = {"times": times, "parts": parts_by_n[n]}
        print(text_table(["N", "side", "s", "ms/token", "vs sdpa last"], rows), flush=True)
    headers = ["N", "side", "seconds (median)", "ms / token", "/ sdpa, last logits"]
    part_names = list(dict.fromkeys(k for p in parts_by_n.values() for k in p))
    part_rows = [
        [
            name,
            *(f"{p.get(name, 0.0):.2f} s ({p.get(name, 0.0) / p['total']:.0%})" for p in parts_by_n.values()),
        ]
        for name in part_names
    ]
    lines = [
        f"# Gemma-3-270M prefill: where the time goes ({cpu_label(machine)})",
        "",
        f"{args.dtype}, {args.threads} threads, random prompt tokens, {args.repeats} interleaved timed calls per "
        "side after one untimed (medians). See the script's docstring for the sides.",
        "",
        markdown_table(headers, rows),
        *(["", *skipped] if skipped else []),
        "",
        f"Breakdown of one `retmask detect` prefill (chunk {chunk}), timers on every part:",
        "",
        markdown_table(["part", *(f"N = {n}" for n in parts_by_n)], part_rows),
        *page_tail(RESULTS / tag, machine),
    ]
    write_page(RESULTS / tag, lines, payload)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    sides = list(dict.fromkeys(r[1] for r in rows))
    ns = list(parts_by_n)
    width = 0.8 / len(sides)
    for i, side in enumerate(sides):
        vals = [float(r[3]) for r in rows if r[1] == side]
        ax.bar([j + i * width for j in range(len(ns))], vals, width, label=side)
    ax.set(xticks=[j + 0.4 - width / 2 for j in range(len(ns))], xticklabels=[f"N = {n}" for n in ns])
    ax.set_ylabel("ms per prompt token")
    ax.legend(fontsize=7)
    save_figure(fig, (RESULTS / tag).with_suffix(".png"), f"Gemma-3-270M prefill, {cpu_label(machine)}")


if __name__ == "__main__":
    main()
