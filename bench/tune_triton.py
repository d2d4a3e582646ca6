"""Measure the Triton kernels' tile configs on this GPU and report the fastest per head dim.

Usage:  python bench/tune_triton.py [--dtype bf16|fp32] [--n 8192] [--workers 8] [--kinds fwd bwd]
                                    [--head-dims 64 128 256] [--softcap CAP]

The tile tables in ``retmask/kernels/triton/common.py`` (BLOCK_M, BLOCK_N, num_warps, num_stages per
padded head dim) decide most of the kernels' speed. This script times each candidate config on the
attention shapes of the models we ship or target (bf16 or --dtype fp32, each with its own tables; batch 1,
causal, M = N keys):
  D = 64: SmolLM2-135M (Hq 9, Hkv 3); D = 128: Llama-3.1-8B (32, 8); D = 256: Gemma-3-270M (4, 1).
- fwd: the prefill forward without argmax; the fastest few are re-timed with the argmax of the last 50
  rows (the detection case) and with the argmax of every row;
- bwd: the backward alone (preprocess + dK/dV + dQ kernels, which share one config), after one forward.
``--softcap`` times every call with logit soft-capping at that cap (capped calls take the same tables:
this checks that the table's tiles suit them).
Compilation dominates a sweep, so worker processes compile every candidate first (they share Triton's
on-disk cache) and the timing then runs in this process, one config at a time. A config that does not
compile or launch (too much shared memory, ...) is reported as failed. Registers and spills are read
from the compiled kernels where this Triton version exposes them.
Writes bench/results/triton_tune_<gpu>[_fp32][_softcap].{md,json} (or --out). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import multiprocessing
import sys
from dataclasses import astuple
from pathlib import Path

import torch

from retmask.commands.argtypes import positive_float, positive_int

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import gpu_slug, markdown_table, write_page  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEVICE = "cuda"
SHAPES = {
    64: (9, 3, "SmolLM2-135M"),
    128: (32, 8, "Llama-3.1-8B"),
    256: (4, 1, "Gemma-3-270M"),
}  # D: (Hq, Hkv)
# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates per kernel kind and padded head dim.
FWD_CANDIDATES = {
    64: [(128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (128, 64, 8, 2), (128, 128, 8, 3), (128, 128, 8, 2),
         (128, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 32, 4, 4)],
    128: [(128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 3),
          (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3), (64, 128, 4, 2), (64, 64, 8, 3), (128, 64, 8, 4)],
    256: [(32, 32, 8, 2), (64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 3),
          (128, 32, 8, 2), (32, 32, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2)],
}  # fmt: skip
BWD_CANDIDATES = {
    64: [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 2), (128, 64, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2),
         (128, 128, 8, 2), (64, 32, 4, 2), (32, 128, 4, 2), (64, 128, 4, 2)],
    128: [(32, 64, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (64, 64, 4, 2),
          (32, 128, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2)],
    256: [(16, 32, 8, 1), (16, 64, 8, 1), (32, 32, 8, 1), (32, 32, 4, 1), (16, 32, 4, 1), (32, 64, 8, 1),
          (16, 32, 8, 2), (32, 32, 8, 2)],
}  # fmt: skip
# fp32 inputs run tl.dot in IEEE fp32 on the CUDA cores (no tensor cores) and hold fp32 tiles: far more
# registers per element, so smaller tiles. D = 16 / 32 share D = 64's entries and are not swept.
FWD_CANDIDATES_FP32 = {
    64: [(64, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (128, 32, 8, 2),
         (64, 16, 4, 2), (32, 32, 8, 2), (16, 32, 4, 2), (64, 64, 4, 1)],
    128: [(64, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (128, 32, 8, 2),
          (64, 16, 4, 2), (32, 32, 8, 2), (16, 32, 4, 2), (32, 16, 4, 2)],
    256: [(16, 16, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1), (32, 32, 8, 1), (16, 16, 8, 1), (32, 32, 4, 1),
          (16, 64, 4, 1), (64, 16, 8, 1)],
}  # fmt: skip
BWD_CANDIDATES_FP32 = {
    64: [(16, 32, 4, 2), (32, 32, 4, 2), (16, 64, 4, 2), (32, 32, 8, 2), (16, 32, 8, 2), (32, 64, 8, 2),
         (16, 16, 4, 2), (64, 32, 8, 2)],
    128: [(16, 32, 8, 2), (16, 32, 4, 2), (32, 32, 8, 2), (16, 16, 4, 2), (16, 64, 8, 2), (32, 16, 4, 2),
          (32, 32, 4, 1), (16, 32, 8, 1)],
    256: [(16, 16, 4, 1), (16, 16, 8, 1), (16, 32, 8, 1), (32, 16, 8, 1), (16, 32, 4, 1)],
}  # fmt: skip
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CANDIDATES = {
    ("fwd", "bf16"): FWD_CANDIDATES, ("bwd", "bf16"): BWD_CANDIDATES,
    ("fwd", "fp32"): FWD_CANDIDATES_FP32, ("bwd", "fp32"): BWD_CANDIDATES_FP32,
}  # fmt: skip
TABLES = {
    ("fwd", "bf16"): "_FWD_CONFIGS", ("bwd", "bf16"): "_BWD_CONFIGS",
    ("fwd", "fp32"): "_FWD_CONFIGS_FP32", ("bwd", "fp32"): "_BWD_CONFIGS_FP32",
}  # fmt: skip
KERNELS = {"fwd": ("triton.fwd", ["_fwd_kernel"]),
           "bwd": ("triton.bwd", ["_bwd_preprocess_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"])}  # fmt: skip


def _set_config(kind: str, dtype: str, d: int, cfg: tuple[int, int, int, int]) -> None:
    from retmask.kernels.triton import common as tc

    getattr(tc, TABLES[kind, dtype])[d] = tc.TileConfig(*cfg)


def _inputs(d: int, n: int, dtype: str, *, grad: bool = False):
    hq, hkv, _ = SHAPES[d]
    gen = torch.Generator(device=DEVICE).manual_seed(d + n)
    mk = lambda h: torch.randn(1, h, n, d, device=DEVICE, dtype=DTYPES[dtype], generator=gen)  # noqa: E731
    q, k, v = mk(hq), mk(hkv), mk(hkv)
    return q, k, v, (mk(hq) if grad else None)


def _call(kind: str, dtype: str, d: int, n: int, argmax_rows: int = 0, softcap: float | None = None):
    """A callable running one ``kind`` call at D = ``d``, N = ``n`` with the current tables."""
    from retmask.kernels.triton.bwd import attention_backward
    from retmask.kernels.triton.fwd import attention_forward

    scale = d**-0.5
    kw = dict(sm_scale=scale, key_padding_mask=None, skip_heads=None, softcap=softcap)
    if kind == "fwd":
        q, k, v, _ = _inputs(d, n, dtype)
        return lambda: attention_forward(
            q, k, v, causal=True, argmax_rows=argmax_rows, return_lse=False, **kw
        )
    q, k, v, do = _inputs(d, n, dtype, grad=True)
    out, _, lse = attention_forward(q, k, v, causal=True, argmax_rows=0, return_lse=True, **kw)
    return lambda: attention_backward(do, q, k, v, out, lse, causal=True, **kw)


def _compiled(kind: str) -> list:
    """Every compiled kernel of ``kind`` in this process (Triton keeps one per specialisation / config)."""
    import importlib

    module, names = KERNELS[kind]
    mod = importlib.import_module(f"retmask.kernels.{module}")
    found = []
    for name in names:
        try:
            for cache in getattr(mod, name).device_caches.values():
                found.extend(cache[0].values())
        except (AttributeError, TypeError, IndexError):
            pass
    return found


def _resources(compiled: list) -> dict[str, int]:
    """Largest register count and spill size over ``compiled`` kernels."""
    regs = max((int(getattr(c, "n_regs", -1)) for c in compiled), default=-1)
    spills = max((int(getattr(c, "n_spills", -1)) for c in compiled), default=-1)
    return {"regs": regs, "spills": spills}


def _compile_one(
    kind: str, dtype: str, d: int, cfg: tuple[int, int, int, int], n: int, softcap: float | None
) -> dict:
    """Worker: compile (and run once) one candidate; its resources, or why it failed."""
    if DEVICE == "cuda":
        torch.cuda.init()
    _set_config(kind, dtype, d, cfg)
    # A worker compiles several candidates: only the kernels this one added count for its resources.
    before = {id(c) for c in _compiled(kind)}
    try:
        _call(kind, dtype, d, n, softcap=softcap)()
        if kind == "fwd":
            _call(kind, dtype, d, n, argmax_rows=50, softcap=softcap)()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001  (any compile / launch failure disqualifies the config)
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"}
    return _resources([c for c in _compiled(kind) if id(c) not in before])


def _time(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def _config_text(cfg: list) -> str:
    """'128x64 w8 s3' for a (BLOCK_M, BLOCK_N, warps, stages) config."""
    return f"{cfg[0]}x{cfg[1]} w{cfg[2]} s{cfg[3]}"


def write_tune_page(
    rows: list[dict],
    out: Path,
    dtype: str,
    n: int,
    versions: str,
    note: str = "",
    softcap: float | None = None,
) -> None:
    """The sweep's page: one row per candidate, fastest first per (kind, D); ``note`` says what is missing."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else versions.split(";")[0]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    table = []
    for r in sorted(rows, key=lambda r: (r["kind"], r["d"], r.get("ms", float("inf")))):
        table.append([
            r["kind"], f"{r['d']} ({SHAPES[r['d']][2]})", _config_text(r["config"]),
            "yes" if r["current"] else "", fmt(r.get("ms")), fmt(r.get("ms_argmax_last50")), fmt(r.get("ms_argmax_all")),
            r.get("regs", "-"), r.get("spills", "-"), r.get("error", ""),
        ])  # fmt: skip
    headers = [
        "kind",
        "D (shape)",
        "config",
        "table",
        "ms",
        "argmax last 50",
        "argmax all",
        "regs",
        "spills",
        "error",
    ]
    lines = [
        f"# Triton tile configs measured on {name}",
        "",
        f"Machine: {versions}. {dtype}, batch 1, causal, "
        + (f"logits soft-capped at {softcap:g}, " if softcap is not None else "")
        + f"M = N = {n}; triton.testing.do_bench medians (ms). fwd = prefill forward (argmax columns: "
        "last 50 rows / every row, for the fastest three and the table's config); bwd = the backward alone. "
        "Config = BLOCK_M x BLOCK_N, warps, stages; "
        "'table' marks the config in triton/common.py when this ran.",
        "",
        *([note, ""] if note else []),
        markdown_table(headers, table),
        "",
    ]
    suffix = ("" if dtype == "bf16" else f"_{dtype}") + ("" if softcap is None else "_softcap")
    data = dict(device=name, n=n, dtype=dtype, softcap=softcap, rows=rows)
    write_page(out / f"triton_tune_{gpu_slug(name)}{suffix}", lines, data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=positive_int, default=8192, help="keys (= query rows, causal)")
    ap.add_argument("--kinds", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    ap.add_argument("--head-dims", type=int, nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    ap.add_argument(
        "--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype (its own tile tables)"
    )
    ap.add_argument("--workers", type=positive_int, default=8, help="processes that compile the candidates")
    ap.add_argument(
        "--softcap", type=positive_float, help="time every call with logits soft-capped at this cap"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("tune_triton.py needs a CUDA GPU; nothing was measured.", file=sys.stderr)
        return 1
    import triton

    from retmask.kernels.triton import common as tc

    # The tables as shipped (each timing below swaps one entry in and restores it).
    dt = args.dtype
    shipped = {kind: {d: astuple(c) for d, c in getattr(tc, TABLES[kind, dt]).items()} for kind in args.kinds}
    jobs = [
        (kind, dt, d, tuple(cfg))
        for kind in args.kinds
        for d in args.head_dims
        for cfg in CANDIDATES[kind, dt][d]
    ]
    ctx = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx) as pool:
        compiled = list(
            pool.map(_compile_one, *zip(*jobs, strict=True), [args.n] * len(jobs), [args.softcap] * len(jobs))
        )
    print(f"compiled {len(jobs)} candidates", flush=True)

    rows: list[dict] = []
    for (kind, _, d, cfg), res in zip(jobs, compiled, strict=True):
        row = dict(kind=kind, d=d, config=list(cfg), current=cfg == shipped[kind][d], **res)
        if "error" not in res:
            _set_config(kind, dt, d, cfg)
            try:
                row["ms"] = _time(_call(kind, dt, d, args.n, softcap=args.softcap))
            except Exception as err:  # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            _set_config(kind, dt, d, shipped[kind][d])
        rows.append(row)
        print(kind, d, cfg, {k: v for k, v in row.items() if k not in ("kind", "d", "config")}, flush=True)

    versions = f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}"
    # Written now and again after the argmax timings, so a run stopped there keeps what it measured.
    write_tune_page(rows, args.out, dt, args.n, versions, "(argmax timings still running)", args.softcap)
    # Re-time the three fastest forward configs per D (and the current one) with argmax.
    for d in args.head_dims if "fwd" in args.kinds else []:
        cands = sorted(
            (r for r in rows if r["kind"] == "fwd" and r["d"] == d and "ms" in r), key=lambda r: r["ms"]
        )
        for r in {id(r): r for r in cands[:3] + [r for r in cands if r["current"]]}.values():
            _set_config("fwd", dt, d, tuple(r["config"]))
            r["ms_argmax_last50"] = _time(_call("fwd", dt, d, args.n, argmax_rows=50, softcap=args.softcap))
            r["ms_argmax_all"] = _time(_call("fwd", dt, d, args.n, argmax_rows=args.n, softcap=args.softcap))
            _set_config("fwd", dt, d, shipped["fwd"][d])

    write_tune_page(rows, args.out, dt, args.n, versions, softcap=args.softcap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
