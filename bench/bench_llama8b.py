"""End to end at a real model's scale: detection per test at 16K-64K tokens and a DPO step at 8K, on a
Llama-3.1-8B-shaped model with random weights (no weights can be downloaded; the cost of a forward does not
depend on them).

Usage:  python bench/bench_llama8b.py [--device cuda] [--lengths 16384 32768 65536] [--dpo-length 8192]
                                      [--parts detect dpo] [--new-tokens 20] [--shape llama8b|tiny]
                                      [--split-key-rows 64] [--out DIR]

detect: per context length, one test of the retrieval-score procedure on a random prompt with a needle span,
  ``--new-tokens`` greedy tokens (no stop token: a random model's answer is arbitrary, and every test
  decodes the same number of tokens):
  - reference: what the published procedure costs (``retmask.detect.oracle_detect``): SDPA prefill computing
    the logits of every prompt position, then one decode step at a time with eager attention and
    ``output_attentions=True``, a top-1 check per (layer, head) on the host;
  - retmask: ``retmask detect``'s fast path (``FastDetector``): chunked prefill without prompt logits,
    verification passes with the argmax captured by the fused kernel;
  - retmask, static passes: the same with fixed-shape verification passes (CUDA graphs on a GPU);
  - the two fast sides again with the verification passes in the Triton split-key kernel (the rule's
    ``paths.SPLIT_KEY_ROWS`` set to ``--split-key-rows`` for them; only where that differs from the rule's
    value): the measurement that decides the rule for passes of a few rows.
  Each fast side runs two different prompts of the length and reports the second (the first pays Triton
  compilation and graph capture; different prompts, so nothing of the first is reused). Peak memory is
  ``torch.cuda.max_memory_allocated`` over the test. The page also states what one layer's attention
  weights would take if the prefill were run with eager attention and ``output_attentions``.
dpo: forward + backward of a DPO loss (sigmoid, beta 0.1, reference log-ratio 0) on a chosen and a rejected
  sequence of ``--dpo-length`` tokens, bf16, gradient checkpointing on (as 8B-scale DPO runs it), through
  SDPA and through retmask attention; median of 3 steps after a warm-up, peak memory.

Writes bench/results/llama8b_<gpu or cpu kind>.{md,json,png} (``--out`` to change the folder). ``--shape
tiny`` (2 layers, the same heads and head dimension) checks the script on a CPU in a minute.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retmask.commands.argtypes import positive_int

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    cpu_kind,
    cpu_label,
    gpu_slug,
    machine_description,
    markdown_table,
    page_tail,
    save_figure,
    split_key_rows,
    sync_device,
    write_page,
)

RESULTS = Path(__file__).resolve().parent / "results"
# Llama-3.1-8B's architecture (its config.json; RoPE scaling left out: it does not change the cost).
LLAMA31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=False,
)  # fmt: skip
TINY = dict(LLAMA31_8B, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, vocab_size=4096)
SHAPES = {"llama8b": LLAMA31_8B, "tiny": TINY}
NEEDLE = 24  # tokens of the needle span, at the middle of the prompt


def build_model(shape: str, device: torch.device, dtype: torch.dtype):
    import transformers

    import retmask  # noqa: F401  (registers attn_implementation="retmask")

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPES[shape])
    with device:  # initialise on the device: an 8B model initialised on the host takes minutes
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation="retmask"
        )
    return model.eval()


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _prompt(length: int, vocab: int, seed: int) -> tuple[np.ndarray, tuple[int, int]]:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, vocab, size=length).astype(np.int64)
    start = length // 2
    return prompt, (start, start + NEEDLE)


def _measured(
    device: torch.device, run: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[Any, float, float | None]:
    """(result, seconds, peak GiB) of ``run(*args, **kwargs)``."""
    sync_device(device)
    _peak_reset(device)
    t0 = time.perf_counter()
    result = run(*args, **kwargs)
    sync_device(device)
    return result, time.perf_counter() - t0, _peak_gb(device)


def detect_part(
    model, lengths: list[int], new_tokens: int, device: torch.device, split_rows_side: int
) -> list[dict]:
    from retmask.detect import FastDetector, oracle_detect
    from retmask.kernels import paths

    vocab = model.config.vocab_size
    # side -> (detector, split-key rows for its calls; None: the rule's)
    fast = {}
    rules = [(None, "")] + (
        [(split_rows_side, ", split-key")] if split_rows_side != paths.SPLIT_KEY_ROWS else []
    )
    for split_rows, label in rules:
        fast[f"retmask{label}"] = (
            FastDetector(model, set(), max_new_tokens=new_tokens, chunk=4096),
            split_rows,
        )
        fast[f"retmask, static passes{label}"] = (
            FastDetector(model, set(), max_new_tokens=new_tokens, chunk=4096, static_passes=True),
            split_rows,
        )
    rows = []
    for length in lengths:
        prompt, span = _prompt(length, vocab, seed=length)
        cells: dict[str, dict] = {}
        outcome, seconds, peak = _measured(
            device, oracle_detect, model, prompt, span, set(), max_new_tokens=new_tokens, prompt_logits=True
        )
        cells["reference"] = dict(seconds=seconds, peak_gb=peak, **outcome.timings, passes=outcome.passes)
        for name, (detector, split_rows) in fast.items():
            for seed in (length + 1, length + 2):  # the second prompt is the one reported
                other, other_span = _prompt(length, vocab, seed=seed)
                with split_key_rows(split_rows):
                    outcome, seconds, peak = _measured(device, detector.run, other, other_span)
            cells[name] = dict(seconds=seconds, peak_gb=peak, **outcome.timings, passes=outcome.passes)
        heads, layers = model.config.num_attention_heads, model.config.num_hidden_layers
        row = dict(
            length=length, cells=cells,
            # eager attention's weights of one layer in a prefill with output_attentions (bf16), and all layers'
            eager_weights_gb_per_layer=heads * length * length * 2 / 2**30,
            eager_weights_gb_all_layers=layers * heads * length * length * 2 / 2**30,
        )  # fmt: skip
        rows.append(row)
        print(
            f"detect {length}: " + ", ".join(f"{k} {v['seconds']:.2f} s" for k, v in cells.items()),
            flush=True,
        )
    return rows


def _dpo_loss(model, ids: torch.Tensor, beta: float = 0.1) -> torch.Tensor:
    """DPO's sigmoid loss of chosen ids[0] over rejected ids[1] with a reference log-ratio of 0."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    logp = -torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none"
    ).view(ids.shape[0], -1)
    chosen, rejected = logp.sum(-1)
    return -torch.nn.functional.logsigmoid(beta * (chosen - rejected))


def _train_step(model, ids: torch.Tensor) -> None:
    _dpo_loss(model, ids).backward()


def dpo_part(model, length: int, device: torch.device, steps: int = 3) -> dict[str, dict]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (2, length), generator=gen).to(device)
    model.train()
    # transformers renamed gradient checkpointing "activation checkpointing" (the old name warns)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        disable = model.activation_checkpointing_disable
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        disable = model.gradient_checkpointing_disable
    out = {}
    try:
        for implementation in ("sdpa", "retmask"):
            model.set_attn_implementation(implementation)
            times, peak = [], None
            for step in range(steps + 1):  # the first is a warm-up
                model.zero_grad(set_to_none=True)
                _, seconds, peak_step = _measured(device, _train_step, model, ids)
                if step:
                    times.append(seconds)
                    peak = peak_step if peak is None or peak_step is None else max(peak, peak_step)
            out[implementation] = dict(seconds=statistics.median(times), rounds=times, peak_gb=peak)
            print(f"dpo {length} {implementation}: {out[implementation]['seconds']:.2f} s", flush=True)
    finally:
        model.zero_grad(set_to_none=True)
        disable()
        model.set_attn_implementation("retmask")
        model.eval()
    return out


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def page_lines(title: str, args: argparse.Namespace, detect: list[dict], dpo: dict | None) -> list[str]:
    lines = [f"# {title}", ""]
    if detect:
        lines += [
            f"One detection test per length: a random prompt with a {NEEDLE}-token needle span, {args.new_tokens} "
            "greedy tokens. Reference: SDPA prefill with the logits of every position, then eager decoding with "
            "output_attentions and a host check per head (the published procedure). retmask: `retmask detect`'s "
            "fast path (prefill chunk 4096, verification passes, argmax from the fused kernel); static passes: "
            "the same with fixed-shape verification passes (CUDA graphs on a GPU). Sides marked split-key: "
            f"Triton calls of up to {args.split_key_rows} query rows (the verification passes) in the split-key "
            "kernel. Times of one test; peak = most device memory allocated during it.",
            "",
        ]
        rows = []
        for row in detect:
            ref = row["cells"]["reference"]
            for name, cell in row["cells"].items():
                rows.append(
                    [
                        str(row["length"]), name, f"{cell['seconds']:.2f}", f"{cell['prefill_s']:.2f}",
                        f"{cell['decode_s']:.2f}", str(cell["passes"]), f"{ref['seconds'] / cell['seconds']:.2f}x",
                        _gb(cell["peak_gb"]),
                    ]
                )  # fmt: skip
        lines.append(
            markdown_table(
                [
                    "tokens",
                    "side",
                    "s / test",
                    "prefill s",
                    "decode s",
                    "passes",
                    "speed-up vs reference",
                    "peak GiB",
                ],
                rows,
            )
        )
        lines += [
            "",
            "Eager attention with output_attentions in the prefill would hold each layer's weights [heads, L, L]: "
            + "; ".join(
                f"{row['length']} tokens: {_gb(row['eager_weights_gb_per_layer'])} GiB per layer, "
                f"{_gb(row['eager_weights_gb_all_layers'])} GiB for all layers' outputs"
                for row in detect
            )
            + ".",
            "",
        ]
    if dpo:
        base = dpo["sdpa"]["seconds"]
        lines += [
            f"DPO step (forward + backward, chosen + rejected of {args.dpo_length} tokens, {args.dtype}, "
            "gradient checkpointing), median of 3 after a warm-up:",
            "",
            markdown_table(
                ["attention", "s / step", "vs sdpa", "peak GiB"],
                [
                    [k, f"{v['seconds']:.2f}", f"{v['seconds'] / base:.2f}x", _gb(v["peak_gb"])]
                    for k, v in dpo.items()
                ],
            ),
        ]
    return lines


def plot(detect: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    lengths = [row["length"] for row in detect]
    for name in detect[0]["cells"]:
        ax.plot(lengths, [row["cells"][name]["seconds"] for row in detect], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("seconds per detection test")
    ax.legend()
    save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    ap.add_argument("--lengths", type=positive_int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--dpo-length", type=positive_int, default=8192)
    ap.add_argument("--new-tokens", type=positive_int, default=20)
    ap.add_argument("--parts", nargs="+", choices=["detect", "dpo"], default=["detect", "dpo"])
    ap.add_argument(
        "--split-key-rows", type=positive_int, default=64,
        help="query rows up to which the split-key sides send Triton calls to the split-key kernel (default: 64)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible; use --device cpu (with --shape tiny)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.dtype = str(dtype).removeprefix("torch.")
    model = build_model(args.shape, device, dtype)
    machine = machine_description()
    on = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_label(machine)
    where = gpu_slug(torch.cuda.get_device_name(device)) if device.type == "cuda" else cpu_kind(machine)
    stem = (
        args.out / f"llama8b_{where}"
        if args.shape == "llama8b"
        else args.out / f"llama8b_{args.shape}_{where}"
    )
    title = f"Detection and a DPO step at Llama-3.1-8B's shape ({args.shape}, {args.dtype}, {on})"
    detect = (
        detect_part(model, args.lengths, args.new_tokens, device, args.split_key_rows)
        if "detect" in args.parts
        else []
    )
    dpo = dpo_part(model, args.dpo_length, device) if "dpo" in args.parts else None
    stem.parent.mkdir(parents=True, exist_ok=True)
    if detect:
        plot(detect, stem.with_suffix(".png"), title)
    lines = page_lines(title, args, detect, dpo) + (page_tail(stem, machine) if detect else [])
    write_page(stem, lines, dict(machine=machine, shape=args.shape, args=vars(args) | {"out": str(args.out)},
                                 detect=detect, dpo=dpo))  # fmt: skip


if __name__ == "__main__":
    main()
