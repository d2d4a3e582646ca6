"""Shared benchmark utilities: machine description, per-config subprocesses with peak-memory
measurement, timing, Markdown tables and plots.

Memory method (Linux): a config runs in a fresh Python subprocess. After its inputs are built, the
worker resets the kernel's peak-RSS counter (``echo 5 > /proc/self/clear_refs`` resets ``VmHWM``) and
records the current RSS; after the timed calls it reads ``VmHWM`` again. ``peak - baseline`` is the
most memory the measured calls held at once beyond their inputs (outputs included), as the OS saw it.
Where ``clear_refs`` is unavailable the lifetime peak (``ru_maxrss``) is used and the result is marked.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from retmask.plotting import save_figure as save_png
from retmask.runfiles import atomic_write_text

# ---- machine ---------------------------------------------------------------------------------------


def cpu_model() -> str:
    """CPU model name (``retmask.cpuinfo``; imported here, not at the top, so that a worker that
    imports only ``retmask.kernels`` does not load the whole package)."""
    from retmask.cpuinfo import cpu_model as model

    return model()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``retmask.cpuinfo``; imported lazily, see ``cpu_model``)."""
    from retmask.cpuinfo import cpu_flags as flags

    return flags()


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 when unknown)."""
    try:
        m = re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text())
        return int(m.group(1)) * 1024 if m else 0
    except OSError:
        return 0


def mem_total_bytes() -> int:
    try:
        m = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
        return int(m.group(1)) * 1024 if m else 0
    except OSError:
        return 0


def machine_description() -> dict[str, str]:
    """CPU model, cores, SIMD level, the C++ kernel build it runs, how the CPU attention path is chosen,
    whether the CPU speed-ups are on, memory, torch / python versions, threads used by torch."""
    import torch

    from retmask.kernels.cpu import backend as cpu_kernel

    flags = cpu_flags()
    simd = "avx512f" if "avx512f" in flags else ("avx2" if "avx2" in flags else "baseline")
    bf16 = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    from retmask import cpu_speedups
    from retmask.cpuinfo import cpu_family, cpu_model_number
    from retmask.kernels import paths

    try:
        build = cpu_kernel.selected_isa() or "not built"
        forced = paths.forced_cpu_path()
        path_mode = f"{forced} (forced)" if forced else "the rule of retmask/kernels/paths.py"
        speedups = "on" if cpu_speedups.enabled() else "off"
    except ValueError as err:  # a bad $RETMASK_* setting: say so in the header rather than fail
        build = path_mode = speedups = str(err)

    return {
        "cpu": cpu_model(),
        "cpu family": cpu_family() or "unknown",
        "cpu model": cpu_model_number() or "unknown",
        "cores": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "simd": simd,
        "native bf16": ", ".join(bf16) or "none",
        "kernel build": build,
        "cpu attention path": path_mode,
        "cpu speed-ups": speedups,
        "memory": f"{mem_total_bytes() / 2**30:.1f} GiB",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": platform.platform(),
    }


def cpu_kind(machine: dict[str, str]) -> str:
    """File-name tag of the machine: CPU model and SIMD level, e.g. ``intel-xeon-platinum-8481c-avx512f``.
    A generic model name without a model number (a hypervisor's "AMD EPYC") also gets the CPU family,
    e.g. ``amd-epyc-f25-avx2`` (Zen 3) apart from ``amd-epyc-f23-avx2`` (Zen 2), and on Intel, whose cores
    are all family 6, the model number too (``intel-xeon-f6m207-avx512f``); pages from before this rule
    are named ``amd-epyc-avx2`` (family 23) and ``amd-epyc-avx512f``. Speed results hold only for the CPU
    they were measured on, so benchmarks keep one result file per kind."""
    model = re.sub(r"\(r\)|\(tm\)|processor|\d+-core|cpu @.*", "", machine.get("cpu", "cpu").lower())
    slug = re.sub(r"[^a-z0-9]+", "-", model).strip("-")[:40] or "cpu"
    family = machine.get("cpu family", "")
    if family.isdigit() and not re.search(r"\d", slug):
        slug += f"-f{family}"
        number = machine.get("cpu model", "")
        if family == "6" and number.isdigit():
            slug += f"m{number}"
    return f"{slug}-{machine.get('simd', 'unknown')}"


def gpu_slug(name: str) -> str:
    """File-name tag of a GPU, e.g. ``h100`` for "NVIDIA H100 80GB HBM3"."""
    found = re.search(r"\b([A-Z]+\d{2,4}[A-Z]?)\b", name.upper())
    return found.group(1).lower() if found else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def cpu_label(machine: dict[str, str]) -> str:
    """The CPU for a page title: model and family, e.g. ``AMD EPYC family 25`` (a hypervisor's generic
    model name says nothing without the family; see ``cpu_kind``)."""
    family = machine.get("cpu family", "")
    return f"{machine.get('cpu', 'cpu')} family {family}" if family else machine.get("cpu", "cpu")


# ---- memory inside a worker ------------------------------------------------------------------------


def _status_kb(field: str) -> int | None:
    try:
        m = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
        return int(m.group(1)) if m else None
    except OSError:
        return None


class PeakMemory:
    """Peak RSS above a baseline, for the code run between ``start()`` and ``stop()`` (bytes)."""

    def __init__(self) -> None:
        self.baseline = 0
        self.exact = True

    def start(self) -> None:
        import gc

        gc.collect()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        except OSError:
            self.exact = False
        rss = _status_kb("VmRSS")
        self.baseline = (rss or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def stop(self) -> int:
        hwm = _status_kb("VmHWM") if self.exact else None
        peak = (hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        return max(0, peak - self.baseline)


def python_calls(fn: Callable[[], Any]) -> tuple[int, int]:
    """(Python function calls, C function calls) made by one call of ``fn``, counted with
    ``sys.setprofile`` after one untimed call: a measure of host work that, unlike a time, does not
    depend on how busy the machine is (functions called from C code, e.g. torch's dispatcher calling
    back into Python, count too)."""
    fn()
    counts = {"call": 0, "c_call": 0}

    def count(frame: Any, event: str, arg: Any) -> None:
        if event in counts:
            counts[event] += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts["call"] - 1, counts["c_call"]  # minus fn's own frame


def timed_wrapper(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    """``fn`` that also appends the wall-clock seconds of each call to ``spent`` (for timing one part of a
    larger job, e.g. an attention function or a kernel binding, while the job runs)."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        spent.append(time.perf_counter() - t0)
        return result

    return timed


def time_calls(fn: Callable[[], Any], repeats: int, warmup: int) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def sync_device(device: Any) -> None:
    """Wait for a CUDA device's queued work, so that a wall-clock time covers it (nothing on a CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(calls: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each call in A B B A ... order (so that drift of the machine hits all alike), after one
    untimed call each; every call returns its own seconds (it may leave its setup out)."""
    for fn in calls.values():
        fn()
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(calls[name]())
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


# ---- subprocess driver -----------------------------------------------------------------------------


def run_worker(script: str | Path, config: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
    """Run ``python script --worker '<json config>'`` in a fresh process; it must print one JSON object
    on its last stdout line. Returns that object, or ``{"error": ...}`` on failure / timeout."""
    cmd = [sys.executable, str(script), "--worker", json.dumps(config)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


def run_cells(
    script: str | Path, configs: dict[str, dict[str, Any]], timeout: float
) -> dict[str, dict[str, Any]]:
    """Each ``configs[key]`` in a fresh worker (:func:`run_worker`) that returns ``seconds`` and
    ``peak_bytes``; prints a line per cell as it finishes. Returns ``{key: result}``."""
    cells = {}
    for key, config in configs.items():
        res = run_worker(script, config, timeout=timeout)
        cells[key] = res
        print(f"{key}: {res.get('error') or time_and_peak(res)}", flush=True)
    return cells


def time_and_peak(cell: dict[str, Any]) -> str:
    """'<time> / <peak memory>' of a worker result (``-`` for what it lacks)."""
    return fmt_seconds(cell.get("seconds")) + " / " + fmt_bytes(cell.get("peak_bytes"))


def cell_ratio(num: dict[str, Any], den: dict[str, Any], key: str) -> str:
    """``num[key] / den[key]`` as '0.55x', or '-' when either cell failed or the denominator is 0."""
    if key not in num or not den.get(key):
        return "-"
    return f"{num[key] / den[key]:.2f}x"


def write_page(stem: Path, lines: Sequence[str], payload: dict[str, Any]) -> None:
    """Write ``stem``.md (the lines) and ``stem``.json (the payload), print the page and where it went."""
    atomic_write_text(stem.with_suffix(".md"), "\n".join(lines))
    atomic_write_text(stem.with_suffix(".json"), json.dumps(payload, indent=1))
    print("\n".join(lines))
    print(f"-> {stem}.md")


def page_tail(stem: Path, machine: dict[str, str]) -> list[str]:
    """The end of a result page: its plot (``stem``.png), the machine, and the hand-written findings of
    ``stem``.notes.md when that file exists."""
    lines = [
        "",
        f"![plot]({stem.with_suffix('.png').name})",
        "",
        f"Machine: {', '.join(f'{k} {v}' for k, v in machine.items())}.",
    ]
    notes = stem.with_name(stem.name + ".notes.md")
    return lines + (["", notes.read_text(encoding="utf-8").strip()] if notes.is_file() else [])


def sign_test_p(won: int, lost: int) -> float:
    """Exact two-sided sign-test p-value of ``won`` against ``lost`` (ties already dropped); 1.0 if both 0."""
    import math

    n, k = won + lost, min(won, lost)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0


def paired_stats(differences: Sequence[float]) -> dict[str, Any]:
    """Per-seed paired differences (A - B): the list, mean, sample std (NaN for one seed), the 95%
    t-interval of the mean (NaN for one seed; it assumes the per-seed differences are roughly normal), on
    how many seeds A is ahead / behind, and the exact sign-test p-value of ahead against behind."""
    import math
    import statistics

    from scipy.stats import t

    diffs = list(differences)
    mean = statistics.fmean(diffs)
    std = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
    half = t.ppf(0.975, len(diffs) - 1) * std / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    ahead, behind = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    return {
        "per_seed": diffs,
        "mean": mean,
        "std": std,
        "ci95": [mean - half, mean + half],
        "ahead": ahead,
        "behind": behind,
        "p_sign_seeds": sign_test_p(ahead, behind),
    }


def run_step(cmd: list[str], done: Path | None, log: list[dict]) -> None:
    """Run one step of a multi-command benchmark unless ``done`` exists (None: always; the command resumes
    itself); record the command line and its wall time in ``log``. A failing command stops the benchmark."""
    import shlex

    line = " ".join(shlex.quote(c) for c in cmd)
    if done is not None and done.exists():
        print(f"[skip, done] {line}", flush=True)
        log.append({"cmd": line, "seconds": None, "skipped": True})
        return
    print(f"[run] {line}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    log.append({"cmd": line, "seconds": round(time.perf_counter() - t0, 1)})


# ---- the CPU attention backward, forced for a comparison ------------------------------------------

RECOMPUTE_BACKWARDS = ("sdpa", "sdpa_fp32")
_BACKWARD_RULE: list[Callable[..., str]] = []  # retmask.kernels.paths.cpu_backward_path, once replaced


def force_cpu_backward(path: str | None) -> None:
    """Make the eager CPU attention calls whose backward the rule gives to the C++ kernel take ``path``
    instead: "sdpa" (PyTorch SDPA's backward in the inputs' dtype) or "sdpa_fp32" (on fp32 copies, rounded
    back); calls with a sliding window, which SDPA cannot express, take the query-chunked recompute. None:
    the rule again. Replaces ``retmask.kernels.paths.cpu_backward_path``, which ``ops.recompute_grads``
    asks on every backward (the recompute the C++ backward replaced, for benchmarks only)."""
    from retmask.kernels import paths

    if not _BACKWARD_RULE:
        _BACKWARD_RULE.append(paths.cpu_backward_path)
    rule = _BACKWARD_RULE[0]
    if path is None:
        paths.cpu_backward_path = rule
        return
    if path not in RECOMPUTE_BACKWARDS:
        raise ValueError(f"force_cpu_backward: {path!r} is not one of {RECOMPUTE_BACKWARDS} or None")

    def forced(dtype: Any, **kwargs: Any) -> str:
        chosen = rule(dtype, **kwargs)
        if chosen != "kernel":
            return chosen
        return "chunked" if kwargs["window"] is not None else path

    paths.cpu_backward_path = forced


# ---- the Triton rules, moved for a comparison ------------------------------------------------------


@contextlib.contextmanager
def _paths_setting(name: str, value: Any) -> Iterator[None]:
    """Inside, ``retmask.kernels.paths.<name>`` is ``value`` (the rules read it on every call; for
    benchmarks only). None: as it is."""
    from retmask.kernels import paths

    saved = getattr(paths, name)
    setattr(paths, name, saved if value is None else value)
    try:
        yield
    finally:
        setattr(paths, name, saved)


def split_key_rows(rows: int | None) -> contextlib.AbstractContextManager:
    """Inside, Triton forward calls of up to ``rows`` query rows take the split-key kernel
    (``paths.SPLIT_KEY_ROWS``). None: the rule as it is."""
    return _paths_setting("SPLIT_KEY_ROWS", rows)


def cached_triton_launch(on: bool | None) -> contextlib.AbstractContextManager:
    """Inside, Triton kernels launch through retmask's launcher cache (True) or Triton's JIT entry (False)
    (``paths.CACHED_TRITON_LAUNCH``). None: the rule as it is."""
    return _paths_setting("CACHED_TRITON_LAUNCH", on)


# ---- the NIAH grid of the detection benchmarks -----------------------------------------------------


def add_niah_grid_args(ap: Any) -> None:
    """``--lengths``, ``--depths``, ``--needles``, ``--model``, ``--dtype``: the grid of :func:`load_niah_grid`."""
    ap.add_argument("--lengths", default="1000,2000,3000,4000,5000")
    ap.add_argument("--depths", default="0,50,100")
    ap.add_argument("--needles", type=int, default=2, help="first N shipped needles")
    ap.add_argument("--model", default=None, help="model name or path (default: the embedded SmolLM2)")
    ap.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], default="float32",
        help="model dtype (auto: bfloat16 on CPUs with native bf16); bf16 pages end in _bf16",
    )  # fmt: skip


DTYPE_SUFFIX = {"float32": "", "bfloat16": "_bf16", "float16": "_fp16"}  # result page name suffix per dtype


def dtype_suffix(dtype: str) -> str:
    """What a page name gets for its dtype: "" for float32, "_bf16" for bfloat16, "_fp16" for float16."""
    return DTYPE_SUFFIX[dtype]


def load_niah_grid(
    model_spec: str | None,
    lengths: Sequence[int],
    depths: Sequence[int],
    needles: int,
    dtype: str = "float32",
):
    """The model (in ``dtype``, a ``--dtype`` name), its tokenizer, the runnable NIAH tests of ``lengths`` x
    ``depths`` x the first ``needles`` shipped needles (prompt style auto), and the model's stop tokens."""
    import retmask
    from retmask.detect import stop_token_ids
    from retmask.hf.linears import decide_linears
    from retmask.hf.loading import parse_dtype
    from retmask.niah import build_tests, default_haystack_text, load_needles, resolve_prompt_style

    model, tok = retmask.load_model(model_spec, dtype=parse_dtype(dtype))
    decide_linears(model)  # measured here, not by whichever timed call first runs a new linear case
    chat = resolve_prompt_style(tok, "auto") == "chat"
    built = build_tests(
        tok, load_needles()[:needles], default_haystack_text(), list(lengths), list(depths), chat=chat
    )
    return model, tok, [t for t in built if not t.skip_reason], stop_token_ids(tok, model)


# ---- formatting ------------------------------------------------------------------------------------


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def plot_lines(ax: Any, rows: Sequence[dict[str, Any]], series: str, y: str) -> None:
    """One line per distinct ``row[series]`` of ``row[y]`` against ``row["n"]`` (rows without a ``y``
    value are left out), on log-log axes with a legend."""
    for name in dict.fromkeys(r[series] for r in rows):
        pts = [(r["n"], r[y]) for r in rows if r[series] == name and r.get(y) is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="N (keys)")
    ax.legend(fontsize=7)


def save_figure(fig: Any, path: Path, title: str) -> None:
    """Title a matplotlib figure, lay it out, write it to ``path`` atomically (PNG, 110 dpi) and close it."""
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """GitHub Markdown table."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Fixed-width table for the terminal."""
    widths = [
        max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True))
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])
