"""Time per generated token of a whole model, by attention implementation, and the attention's share of it.

Usage:  python bench/bench_decode_step.py [--device cuda|cpu] [--dtype bf16|fp32] [--prompt 4096 ...]
                                          [--steps 32] [--rounds 3] [--config DIR] [--out DIR]

The kernel benches time one attention call; a user who generates (RetMask's masked sampling, detection's
answers) pays a whole decoder step per token, where attention is one part among the projections, the MLP,
the norms and the cache. This runs greedy decoding of ``--steps`` tokens after a ``--prompt``-token prefill
on a model of SmolLM2-135M-Instruct's shape (30 layers, 9 query heads over 3 KV heads, head dim 64, random
weights: the time of a step does not depend on the weights) or of the config in ``--config``, for:

- ``sdpa``:    transformers' SDPA attention, the default a user gets;
- ``eager``:   transformers' eager attention (no ``output_attentions``: the decode step alone);
- ``retmask``: our attention, no mask, no capture;
- ``retmask+argmax``: with ``retmask.capture_argmax(model, rows=1)``, as detection decodes;
- ``retmask, half heads masked``: ``retmask.set_head_mask`` with every odd query head of every layer off;
- ``retmask, growing cache``: our attention with the in-place KV cache detection and generation use
  (``retmask.hf.kv_cache.growing_cache``); every case above uses transformers' ``DynamicCache``;
- ``retmask, CPU linears`` (CPU only): our attention with the linear layers of the CPU speed-ups
  (``retmask.hf.linears.patch_linears``: the backend measured fastest per layer shape, for one row
  retmask's few-row kernel where it wins), as ``retmask.load_model`` gives them on a CPU; every other case
  runs torch's ``nn.Linear``;
- ``retmask, cached launch`` (CUDA only): ``retmask`` with the Triton kernels launched through retmask's
  launcher cache instead of Triton's JIT entry (``retmask.kernels.triton.launch``);
- ``sdpa, static cache, CUDA graph`` / ``retmask, static cache, CUDA graph`` (CUDA only): a ``StaticCache``
  and the decode step compiled as transformers' ``generate`` compiles it for a static cache
  (``torch.compile(mode="reduce-overhead")``: CUDA graphs); the prefill runs eagerly, the compilation and
  graph recording happen in the untimed first round. Their 'attention ms' is 0: a replayed graph issues
  nothing per layer from the host.

``--cases`` picks a subset (default: every case the device has).

Per case: ms per token (the decode loop's wall time over the steps, one device sync at its end; median of
``--rounds`` rounds run in A B B A order), its ratio to sdpa, and ``attention ms``: the host time spent
inside the attention function per token (a timing wrapper around it; on a GPU that is the time to issue
the kernels, which is what a host-bound decoding loop pays, on a CPU it is the compute). Writes
bench/results/decode_step_<model>_<dtype>_<machine>.{md,json,png} (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from retmask.commands.argtypes import positive_int

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    cached_triton_launch,
    cpu_kind,
    cpu_label,
    gpu_slug,
    interleaved,
    machine_description,
    markdown_table,
    page_tail,
    save_figure,
    timed_wrapper,
    write_page,
)

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# SmolLM2-135M-Instruct's architecture (its config.json), so the bench needs no model files.
SMOLLM2_SHAPE = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
)  # fmt: skip
# case -> (attention implementation, what else the case switches on)
CASES = {
    "sdpa": ("sdpa", None),
    "eager": ("eager", None),
    "retmask": ("retmask", None),
    "retmask+argmax": ("retmask", "argmax"),
    "retmask, half heads masked": ("retmask", "mask"),
    "retmask, growing cache": ("retmask", "growing cache"),
    "retmask, CPU linears": ("retmask", "cpu linears"),
    "retmask, cached launch": ("retmask", "cached launch"),
    "sdpa, static cache, CUDA graph": ("sdpa", "graph"),
    "retmask, static cache, CUDA graph": ("retmask", "graph"),
}


def build_model(config_dir: Path | None, device: torch.device, dtype: torch.dtype):
    """A random-weight causal LM of ``config_dir``'s config (SmolLM2-135M's shape without one)."""
    import transformers

    import retmask  # noqa: F401  (registers attn_implementation="retmask")

    if config_dir is not None:
        config = transformers.AutoConfig.from_pretrained(config_dir)
        name = config_dir.name
    else:
        config = transformers.LlamaConfig(**SMOLLM2_SHAPE)
        name = "SmolLM2-135M shape"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval(), name


@contextmanager
def timed_attention(model, implementation: str, spent: list[float]) -> Iterator[None]:
    """While active, the host seconds inside ``implementation``'s attention function are appended to
    ``spent`` (one entry per layer call)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def wrap(fn: Callable) -> Callable:
        return timed_wrapper(fn, spent)

    if implementation == "eager":
        # Attention modules fall back to their modeling module's eager function (looked up at call time).
        modeling = sys.modules[type(model).__module__]
        original = getattr(modeling, "eager_attention_forward", None)
        if original is None:
            raise SystemExit(
                f"{modeling.__name__} has no eager_attention_forward to time; leave out --config"
            )
        modeling.eager_attention_forward = wrap(original)
        try:
            yield
        finally:
            modeling.eager_attention_forward = original
        return
    original = ALL_ATTENTION_FUNCTIONS[implementation]
    ALL_ATTENTION_FUNCTIONS[implementation] = wrap(original)
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS[implementation] = original


def decode_case(model, case: str, prompt: torch.Tensor, steps: int) -> Callable[[], tuple[float, float]]:
    """A callable that prefills ``prompt`` (untimed) and decodes ``steps`` greedy tokens under ``case``;
    it returns (seconds per token, attention host seconds per token)."""
    from transformers import DynamicCache

    import retmask
    from retmask.hf.kv_cache import growing_cache, reserve
    from retmask.hf.linears import decide_linears, patch_linears, unpatch_linears

    implementation, option = CASES[case]
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    half_masked = (torch.arange(heads) % 2 == 1).expand(layers, heads)
    if option == "graph":
        return graph_decode_case(model, implementation, prompt, steps)

    def sync() -> None:
        if prompt.device.type == "cuda":
            torch.cuda.synchronize()

    def run() -> tuple[float, float]:
        model.set_attn_implementation(implementation)
        if option == "mask":
            retmask.set_head_mask(model, half_masked)
        if option == "cpu linears":
            patch_linears(model)
            decide_linears(model)  # a new case measured inside the timed steps would be charged to them
        if option == "growing cache":
            cache = growing_cache(model)
            reserve(cache, prompt.shape[1] + steps)
        else:
            cache = DynamicCache(config=model.config)
        capture = retmask.capture_argmax(model, rows=1) if option == "argmax" else nullcontext()
        launches = cached_triton_launch(True) if option == "cached launch" else nullcontext()
        spent: list[float] = []
        try:
            with torch.no_grad(), capture, launches:
                out = model(input_ids=prompt, cache=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                sync()
                with timed_attention(model, implementation, spent):
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        out = model(input_ids=token, cache=cache, use_cache=True)
                        token = out.logits[:, -1:].argmax(-1)
                    sync()
                    seconds = time.perf_counter() - t0
        finally:
            if option == "mask":
                retmask.clear_head_mask(model)
            if option == "cpu linears":
                unpatch_linears(model)
        return seconds / steps, sum(spent) / steps

    return run


def graph_decode_case(
    model, implementation: str, prompt: torch.Tensor, steps: int
) -> Callable[[], tuple[float, float]]:
    """As :func:`decode_case`, with a static cache and the decode step compiled into a CUDA graph (one
    compiled step and one cache for every round: a new cache would be new addresses, a new recording)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + steps + 1)
    step = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def run() -> tuple[float, float]:
        model.set_attn_implementation(implementation)
        cache.reset()
        with torch.no_grad():
            out = model(input_ids=prompt, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                out = step(input_ids=token, cache=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        return seconds / steps, 0.0

    return run


def measure(
    model, cases: list[str], prompt_len: int, steps: int, rounds: int, device: torch.device
) -> dict[str, dict]:
    """{case: {"ms_per_token", "attention_ms", "rounds_ms"}} at one prompt length."""
    gen = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=gen).to(device)
    runs = {case: decode_case(model, case, prompt, steps) for case in cases}
    attention: dict[str, list[float]] = {case: [] for case in cases}

    def seconds_of(case: str) -> Callable[[], float]:
        def call() -> float:
            per_token, attn = runs[case]()
            attention[case].append(attn)
            # one line per call, so a run cut off by a time limit still shows where it was
            print(f"  prompt {prompt_len} {case}: {per_token * 1e3:.2f} ms/token", flush=True)
            return per_token

        return call

    times = interleaved({case: seconds_of(case) for case in cases}, rounds)
    return {
        case: {
            "ms_per_token": statistics.median(times[case]) * 1e3,
            # the first entry is interleaved()'s untimed warm-up call
            "attention_ms": statistics.median(attention[case][1:]) * 1e3,
            "rounds_ms": [t * 1e3 for t in times[case]],
        }
        for case in cases
    }


def page_lines(results: dict[int, dict[str, dict]], title: str, args: argparse.Namespace) -> list[str]:
    rows = []
    for prompt_len, cells in results.items():
        base = cells["sdpa"]["ms_per_token"]
        for case, cell in cells.items():
            share = cell["attention_ms"] / cell["ms_per_token"]
            rows.append(
                [
                    str(prompt_len),
                    case,
                    f"{cell['ms_per_token']:.2f}",
                    f"{cell['ms_per_token'] / base:.2f}x",
                    f"{cell['attention_ms']:.2f}",
                    f"{share:.0%}",
                ]
            )
    headers = ["prompt", "case", "ms / token", "vs sdpa", "attention ms / token", "attention share"]
    return [
        f"# {title}",
        "",
        f"Greedy decoding of {args.steps} tokens after the prompt, batch 1, median of {args.rounds} rounds "
        "(A B B A order). 'attention ms' is the host time inside the attention function per token "
        "(on a GPU: issuing its kernels). Lower is better; ratios are to sdpa at the same prompt length.",
        "",
        markdown_table(headers, rows),
    ]


def plot(results: dict[int, dict[str, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    lengths = list(results)
    cases = list(results[lengths[0]])
    width = 0.8 / len(cases)
    for i, case in enumerate(cases):
        xs = [j + i * width for j in range(len(lengths))]
        total = [results[n][case]["ms_per_token"] for n in lengths]
        attn = [results[n][case]["attention_ms"] for n in lengths]
        ax.bar(xs, total, width, label=case, alpha=0.85)
        ax.bar(xs, attn, width, color="none", edgecolor="black", hatch="//", linewidth=0.5)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [f"{n} prompt tokens" for n in lengths])
    ax.set_ylabel("ms per generated token (hatched: attention's host time)")
    ax.legend(fontsize=7)
    save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--prompt", type=positive_int, nargs="+", default=[1024, 4096])
    ap.add_argument("--steps", type=positive_int, default=32)
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--config", type=Path, default=None, help="a model folder whose config.json to use")
    ap.add_argument(
        "--cases",
        nargs="+",
        choices=list(CASES),
        default=None,
        metavar="CASE",
        help="the cases to run (sdpa always runs: the ratios are to it); default: all the device has",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible; use --device cpu")
    graphs = device.type == "cuda"
    cases = [c for c in CASES if (args.cases is None or c in args.cases or c == "sdpa")]
    cuda_only = ("graph", "cached launch")  # CUDA graphs; Triton launches
    if not graphs and any(CASES[c][1] in cuda_only for c in args.cases or []):
        ap.error("the CUDA graph and cached-launch cases need --device cuda")
    if graphs and any(CASES[c][1] == "cpu linears" for c in args.cases or []):
        ap.error("the CPU-linears case needs --device cpu")
    device_only = ("cpu linears",) if graphs else cuda_only  # the cases this device cannot run
    cases = [c for c in cases if CASES[c][1] not in device_only]
    model, name = build_model(args.config, device, DTYPES[args.dtype])
    machine = machine_description()
    where = gpu_slug(torch.cuda.get_device_name(device)) if device.type == "cuda" else cpu_kind(machine)
    args.out.mkdir(parents=True, exist_ok=True)
    model_tag = "smollm2" if args.config is None else args.config.name.lower()
    stem = args.out / f"decode_step_{model_tag}_{args.dtype}_{where}"
    on = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_label(machine)
    title = f"Time per generated token by attention implementation ({name}, {args.dtype}, {on})"
    results: dict[int, dict[str, dict]] = {}
    for prompt_len in args.prompt:
        results[prompt_len] = measure(model, cases, prompt_len, args.steps, args.rounds, device)
        # The page after every prompt length: a run cut off later keeps what it measured.
        plot(results, stem.with_suffix(".png"), title)
        lines = page_lines(results, title, args) + page_tail(stem, machine)
        payload = {
            "machine": machine, "model": name, "dtype": args.dtype, "steps": args.steps, "results": results,
        }  # fmt: skip
        write_page(stem, lines, payload)


if __name__ == "__main__":
    main()
