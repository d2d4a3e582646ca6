"""Benchmark: where a Gemma-3-270M prefill's time goes, against SDPA's forward of the same model.

Gemma-3-270M: 18 layers (5 local layers with a 512-key sliding window per global layer), 4 query heads on
1 KV head of dimension 256, QK-norm, a 262,144-token vocabulary. Sides, on the same random prompt of N
tokens, interleaved (A B B A) after one untimed call each:

* ``sdpa, all logits``: one SDPA forward of the whole prompt computing the logits of every position, as
  the published detection script does before it decodes;
* ``sdpa, last logits``: the same forward, logits of the last position only;
* ``retmask detect prefill``: what ``retmask detect`` runs: the prompt in chunks (the device's default,
  256 tokens on a CPU) into a reserved cache, the retmask attention, the last layer writing only its
  K/V and the LM head skipped (``retmask.detect.kv_only``);
* ``retmask one pass``: the same in one pass (chunk = N);
* ``sdpa detect prefill``: the chunked path with SDPA attention (``retmask detect --prefill-impl sdpa``).

Then one more run of the detect prefill with timers on every part (the attention call of local and
global layers, the q/k/v/o projections, the MLPs, the RMS norms, the embedding, the LM head; the rest is
the model's glue: rotary tables, residual adds, cache writes, masks): the breakdown table. On a GPU each
timer synchronises the device when its part starts and ends, so the parts are GPU time plus launch cost
and the breakdown's total is above an unsynchronised prefill's: read its shares, not its total.

Weights: ``--weights package`` (default) loads the model from its optional package (the GGUF converted
into the cache); ``--weights random`` builds the same architecture from its configuration with random
weights (no files: what a lent GPU machine, which cannot carry the 245 MB package, runs). Random prompt
tokens either way, and every side computes the same dense products whatever the weights' values, so the
times compare; only the model's outputs differ.

Writes bench/results/gemma3_prefill_<cpu kind or GPU>[_bf16].md / .json / .png (``--out`` another folder).

    flock /tmp/retmask-heavy.lock python bench/bench_gemma3_prefill.py --lengths 4096,16384
    python bench/bench_gemma3_prefill.py --device cuda --weights random --dtype bfloat16 --lengths 4096,16384,32768
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
    gpu_slug,
    interleaved,
    machine_description,
    markdown_table,
    median,
    mem_available_bytes,
    page_tail,
    save_figure,
    sync_device,
    text_table,
    write_page,
)

import retmask  # noqa: E402,F401  (registers the retmask attention)
from retmask.commands.argtypes import positive_int, token_count  # noqa: E402
from retmask.detect.core import attn_implementation  # noqa: E402
from retmask.detect.kv_only import kv_only  # noqa: E402
from retmask.detect.prefill_chunk import resolve_prefill_chunk  # noqa: E402
from retmask.hf.kv_cache import growing_cache, reserve  # noqa: E402
from retmask.hf.linears import decide_linears  # noqa: E402
from retmask.hf.loading import load_model, parse_dtype  # noqa: E402
from retmask.kernels import describe as describe_kernels  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# Gemma-3-270M's architecture (the configuration of the converted package model), for --weights random.
GEMMA3_270M = dict(
    vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
    max_position_embeddings=32768, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
    layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(18)],
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
)  # fmt: skip


def build_model(weights: str, device: torch.device, dtype: torch.dtype):
    """Gemma-3-270M on retmask attention: from its package (``weights="package"``) or, with random weights,
    from :data:`GEMMA3_270M` (``"random"``), on ``device`` in ``dtype``."""
    if weights == "package":
        model, _ = load_model("gemma3-270m", dtype=dtype)
        decide_linears(model)  # measured here, not by whichever timed call first runs a new linear case
        return model.to(device)
    import transformers

    torch.manual_seed(0)
    with device:  # initialised where it runs
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.Gemma3TextConfig(**GEMMA3_270M), dtype=dtype, attn_implementation="retmask"
        )
    return model.eval()


def free_memory_bytes(device: torch.device) -> int:
    """Bytes free for new tensors on ``device``: the GPU's free memory, or the host's available memory."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else mem_available_bytes()


def detect_prefill(model, ids: torch.Tensor, impl: str, chunk: int) -> float:
    """Seconds of ``retmask detect``'s prefill of ``ids`` (int64 [1, N]) with attention ``impl``."""
    n = ids.shape[1]
    cache = growing_cache(model)
    reserve(cache, n + 64)  # as detect: the cache is sized once for the prompt and the answer
    sync_device(ids.device)
    t0 = time.perf_counter()
    with torch.no_grad(), attn_implementation(model, impl), kv_only(model):
        for a in range(0, n, chunk):
            model(
                input_ids=ids[:, a : a + chunk],
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
    sync_device(ids.device)
    return time.perf_counter() - t0


def sdpa_forward(model, ids: torch.Tensor, logits_to_keep: int) -> float:
    """Seconds of one SDPA forward of the whole prompt (``logits_to_keep=0``: every position's logits)."""
    sync_device(ids.device)
    t0 = time.perf_counter()
    with torch.no_grad(), attn_implementation(model, "sdpa"):
        model(input_ids=ids, use_cache=True, logits_to_keep=logits_to_keep)
    sync_device(ids.device)
    return time.perf_counter() - t0


class PartTimer:
    """Wall-clock seconds per part of a forward, from hooks on the model's modules and a wrapper around the
    retmask attention function (timers nest: the projections run inside the attention module, so the
    attention module itself is not timed, only its parts). On a GPU every timer synchronises the device
    first (see the module docstring)."""

    def __init__(self, model) -> None:
        self.model = model
        self.device = model.device
        self.seconds: dict[str, float] = defaultdict(float)
        self._handles: list = []
        self._starts: dict[int, float] = {}

    def _time(self, module: torch.nn.Module, part: str) -> None:
        def pre(mod, args):
            sync_device(self.device)
            self._starts[id(mod)] = time.perf_counter()

        def post(mod, args, out):
            sync_device(self.device)
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
                self._time(module, "LM head (skipped: zeros)")
        inner = interface.retmask_attention

        def timed(module, *args, **kwargs):
            kind = "local (window 512)" if getattr(module, "sliding_window", None) else "global"
            sync_device(self.device)
            t0 = time.perf_counter()
            out = inner(module, *args, **kwargs)
            sync_device(self.device)
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
    if all_logits_bytes(model, n) <= free_memory_bytes(ids.device) // 4:
        sides["sdpa, all logits"] = lambda: sdpa_forward(model, ids, 0)
    return sides | {
        f"retmask detect prefill (chunk {chunk})": lambda: detect_prefill(model, ids, "retmask", chunk),
        "retmask one pass": lambda: detect_prefill(model, ids, "retmask", n),
        f"sdpa detect prefill (chunk {chunk})": lambda: detect_prefill(model, ids, "sdpa", chunk),
    }


def all_logits_bytes(model, n: int) -> int:
    """Bytes of the logits of every position of an ``n``-token prompt ([n, vocab] in the model's dtype)."""
    return model.dtype.itemsize * n * model.config.get_text_config().vocab_size


def lengths_list(text: str) -> list[int]:
    """``"4096,16384"`` -> ``[4096, 16384]``; each length a token count (argparse type: >= 1 and below
    ``argtypes.MAX_TOKENS``)."""
    return [token_count(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--lengths", type=lengths_list, default=[4096, 16384], help="prompt lengths (tokens), e.g. 4096,16384"
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument(
        "--weights", choices=["package", "random"], default="package",
        help="the model from its optional package (default) or random weights of the same architecture",
    )  # fmt: skip
    ap.add_argument(
        "--repeats", type=positive_int, default=2, help="timed calls per side (after one untimed)"
    )
    ap.add_argument(
        "--chunk", type=positive_int, default=None, help="detect prefill chunk (default: the device's)"
    )
    ap.add_argument("--threads", type=positive_int, default=2, help="CPU threads")
    ap.add_argument("--tag", default=None, help="page name (default gemma3_prefill_<cpu kind or GPU>[_bf16])")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder of the page (default bench/results)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible; use --device cpu")
    torch.set_num_threads(args.threads)
    machine = machine_description()
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
    where = gpu_slug(machine["gpu"]) if device.type == "cuda" else cpu_kind(machine)
    label = machine["gpu"] if device.type == "cuda" else cpu_label(machine)
    tag = args.tag or f"gemma3_prefill_{where}{dtype_suffix(args.dtype)}"
    stem = args.out / tag
    stem.parent.mkdir(parents=True, exist_ok=True)
    model = build_model(args.weights, device, parse_dtype(args.dtype))
    chunk = resolve_prefill_chunk(args.chunk, device)
    rows, parts_by_n, skipped, payload = (
        [],
        {},
        [],
        {"machine": machine, "kernels": describe_kernels(), "lengths": {}},
    )
    for n in args.lengths:
        ids = torch.randint(1000, 200_000, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
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
        f"# Gemma-3-270M prefill: where the time goes ({label})",
        "",
        f"{args.dtype}, {f'{args.threads} threads' if device.type == 'cpu' else label}, "
        f"{'weights from the package' if args.weights == 'package' else 'random weights of the same architecture'}, "
        f"random prompt tokens, {args.repeats} interleaved timed calls per side after one untimed (medians). "
        "See the script's docstring for the sides.",
        "",
        markdown_table(headers, rows),
        *(["", *skipped] if skipped else []),
        "",
        f"Breakdown of one `retmask detect` prefill (chunk {chunk}), timers on every part:",
        "",
        markdown_table(["part", *(f"N = {n}" for n in parts_by_n)], part_rows),
        *page_tail(stem, machine),
    ]
    payload["weights"] = args.weights
    write_page(stem, lines, payload)
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
    save_figure(fig, stem.with_suffix(".png"), f"Gemma-3-270M prefill, {label}")


if __name__ == "__main__":
    main()
