"""Benchmark: `retmask detect`'s prefill on a hybrid model, with and without shared prefixes.

A hybrid model's cache holds running states (convolution windows, gated-DeltaNet / Mamba recurrent
states) besides keys and values, and a running state cannot be cut back to an earlier position. Detection
keeps copies of them at every chunk boundary (``retmask/detect/state_snapshots.py``), so a test reuses the
prefix it shares with the previous one, as on a plain model. This script measures what that saves against
a fresh cache per test (the detector reset before each test, as detection ran hybrids before; it takes
the same copies, so the difference is the reuse alone), on the NIAH grid in prefix order: tokens computed,
prefill seconds, and the memory the kept states take.

The model is a Qwen3.5-shaped hybrid (gated-DeltaNet layers 3 : 1 attention layers) with random weights
(nothing can be downloaded here), so only the prefill is timed: the tokens computed and the work per token
do not depend on the weights. Both variants run interleaved test by test, the order alternating.

Writes bench/results/hybrid_detect_<cpu kind>.{md,json,png}.

    flock /tmp/retmask-heavy.lock python bench/bench_hybrid_detect.py
    python bench/bench_hybrid_detect.py --lengths 1000,2000 --out /tmp/hd        # quick look
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_kind, cpu_label, fmt_bytes, machine_description, markdown_table, save_figure  # noqa: E402

from retmask.detect import FastDetector, state_snapshots  # noqa: E402
from retmask.detect.answers import prefix_order  # noqa: E402
from retmask.runfiles import atomic_write_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("fresh cache per test", "shared prefixes (kept states)")
# Qwen3.5-shaped, small enough for 2 CPU cores: 12 layers, [3 gated DeltaNet, 1 attention] x 3
SHAPE = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_value_heads=8,
    linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=8192,
)  # fmt: skip


def hybrid_model(vocab: int):
    import transformers

    import retmask

    torch.manual_seed(0)
    shape = dict(SHAPE, layer_types=SHAPE["layer_types"] * (SHAPE["num_hidden_layers"] // 4))
    config = transformers.AutoConfig.for_model("qwen3_5_text", vocab_size=vocab, **shape)
    return retmask.patch(transformers.AutoModelForCausalLM.from_config(config).eval())


def state_bytes(detector: FastDetector) -> int:
    """Bytes of the running states ``detector`` keeps (all positions)."""
    return sum(state_snapshots.nbytes(states) for states in detector.states.values())


def measure(model, tests, stops, chunk: int) -> dict[str, dict[str, float]]:
    """Prefill seconds and tokens computed per variant over ``tests`` (prefix order), interleaved."""
    detectors = {name: FastDetector(model, stops, chunk=chunk) for name in VARIANTS}
    totals = {name: {"seconds": 0.0, "tokens": 0, "peak_state_bytes": 0} for name in VARIANTS}
    for i, t in enumerate(prefix_order(tests)):
        prefix = np.asarray(t.prompt_ids[:-1], dtype=np.int64)
        for name in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
            detector = detectors[name]
            if name == VARIANTS[0]:
                detector.reset()
            start = time.perf_counter()
            with torch.no_grad():
                totals[name]["tokens"] += detector._prefill(prefix)
            totals[name]["seconds"] += time.perf_counter() - start
            if name == VARIANTS[1]:
                totals[name]["peak_state_bytes"] = max(
                    totals[name]["peak_state_bytes"], state_bytes(detector)
                )
        print(f"test {i + 1}/{len(tests)} ({len(prefix)} tokens): "
              + ", ".join(f"{n}: {totals[n]['seconds']:.1f}s" for n in VARIANTS), flush=True)  # fmt: skip
    return totals


def plot(totals: dict[str, dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(9, 3.6))
    labels = ["fresh cache\nper test", "shared prefixes\n(kept states)"]
    ax_s.bar(labels, [totals[n]["seconds"] for n in VARIANTS], color=["tab:gray", "tab:blue"])
    ax_s.set_ylabel("prefill seconds, whole grid")
    ax_t.bar(labels, [totals[n]["tokens"] / 1000 for n in VARIANTS], color=["tab:gray", "tab:blue"])
    ax_t.set_ylabel("prompt tokens computed (thousands)")
    for ax in (ax_s, ax_t):
        ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1000,2000,3000,4000")
    ap.add_argument("--depths", default="0,25,50,75,100")
    ap.add_argument("--needles", type=int, default=1, help="first N shipped needles")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (`retmask detect`'s CPU default)")
    ap.add_argument(
        "--out", default=None, help="output path without suffix (default: results/hybrid_detect_<cpu>)"
    )
    ap.add_argument(
        "--report", action="store_true", help="only re-render the .md/.png of --out from its .json"
    )
    args = ap.parse_args()
    if args.chunk < 1 or args.needles < 1:
        ap.error(f"--chunk and --needles must be >= 1, got {args.chunk} and {args.needles}")
    machine = machine_description()
    out = Path(args.out) if args.out else RESULTS / f"hybrid_detect_{cpu_kind(machine)}"
    if args.report:
        report(out)
        return
    import retmask
    from retmask.detect import stop_token_ids
    from retmask.niah import build_tests, default_haystack_text, load_needles, resolve_prompt_style

    torch.set_num_threads(2)
    _, tok = retmask.load_model()  # the embedded model's tokenizer builds the prompts
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [int(x) for x in args.depths.split(",")]
    chat = resolve_prompt_style(tok, "auto") == "chat"
    built = build_tests(
        tok, load_needles()[: args.needles], default_haystack_text(), lengths, depths, chat=chat
    )
    tests = [t for t in built if not t.skip_reason]
    if not tests:
        ap.error(f"no runnable test in lengths {lengths} x depths {depths}: use longer lengths")
    model = hybrid_model(len(tok))
    stops = stop_token_ids(tok, model)
    with torch.no_grad():  # untimed warm-up (thread pool, allocator)
        FastDetector(model, stops, chunk=args.chunk)._prefill(
            np.asarray(tests[0].prompt_ids[:-1], dtype=np.int64)
        )
    totals = measure(model, tests, stops, args.chunk)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine, "shape": SHAPE, "chunk": args.chunk, "lengths": lengths, "depths": depths,
            "needles": args.needles, "tests": len(tests), "totals": totals}  # fmt: skip
    atomic_write_text(out.with_suffix(".json"), json.dumps(data, indent=1))
    report(out)


def report(out: Path) -> None:
    """Write ``out``.md and .png from ``out``.json (``--report`` re-renders without measuring)."""
    data = json.loads(out.with_suffix(".json").read_text())
    machine, totals = data["machine"], data["totals"]
    before = totals[VARIANTS[0]]
    rows = [
        [name, str(totals[name]["tokens"]), f"{totals[name]['seconds']:.1f}",
         f"{before['seconds'] / totals[name]['seconds']:.2f}x", fmt_bytes(totals[name]["peak_state_bytes"] or None)]
        for name in VARIANTS
    ]  # fmt: skip
    shape = data["shape"]
    md = [
        f"# `retmask detect` on a hybrid model: prefill with shared prefixes ({cpu_label(machine)}, "
        f"SIMD {machine['simd']})",
        "",
        f"Qwen3.5-shaped hybrid, random weights, float32: {shape['num_hidden_layers']} layers (gated DeltaNet "
        f"3 : 1 attention), hidden {shape['hidden_size']}, {shape['num_attention_heads']} query / "
        f"{shape['num_key_value_heads']} KV heads. {data['tests']} tests = lengths {data['lengths']} x depths "
        f"{data['depths']} x {data['needles']} needle(s), in prefix order, chunk {data['chunk']}; the two "
        "variants interleaved test by test (alternating order). Prefill only.",
        "",
        markdown_table(
            ["variant", "prompt tokens computed", "prefill s", "speed-up", "kept states (peak)"], rows
        ),
        "",
        "Reading: a test reuses the whole chunks of the prompt prefix it shares with the previous test (the "
        "haystack before the needle, for tests of one length and needle); the running states kept at each "
        "chunk boundary make that possible on a hybrid, at the memory in the last column.",
        "",
        f"Machine: {', '.join(f'{k} {v}' for k, v in machine.items())}.",
        "",
        f"![prefill]({out.name}.png)",
    ]
    atomic_write_text(out.with_suffix(".md"), "\n".join(md) + "\n")
    plot(totals, out.with_suffix(".png"), f"detection prefill on a hybrid model ({cpu_label(machine)})")
    print("\n".join(md))


if __name__ == "__main__":
    main()
