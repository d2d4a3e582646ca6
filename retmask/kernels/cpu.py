"""CPU backend of ``retmask.kernels.attention``: the fused C++ kernel, or the blocked-torch path.

``cpp_forward`` calls ``attention_fwd`` of ``retmask._C``: the pybind11 binding (csrc/module.cpp) of the
C++/OpenMP kernel (csrc/attention_cpu.cpp). Each tensor goes over as (data pointer, dtype code, shape,
strides); the binding checks them against each other (ValueError naming the bad argument) and releases
the GIL for the compute. If the extension is missing (e.g. a source checkout that was never built) or
stale (built before the binding), a warning is issued once and ``forward`` falls back to ``cpu_blocked``.

The extension holds one build of the kernel per instruction set (AVX-512 + AVX512-BF16 and AVX-512: 16
fp32 lanes, AVX2 + FMA: 8, generic: 8 lanes for whatever the compiler targets) and runs the widest one this CPU has, chosen at run
time from its feature bits (``builds()``). ``RETMASK_CPU_ISA=avx2`` (or another name from ``builds()``)
makes every call run that build instead, e.g. to compare them on one machine.

``cpp_forward(bf16_dot=True)`` runs bfloat16 calls on bf16 dot products (vdpbf16ps, AVX512-BF16: the
``avx512bf16`` build), and ``cpp_forward(gemm=True)`` runs the same kernel with its block products on torch's CPU block GEMM
(``cpu_gemm``: AMX tiles, native bf16 dot products or a tuned fp32 GEMM, whatever the CPU has), and
with ``gemm_fp32=True`` fp16 / bf16 blocks converted to fp32 for the fp32 GEMM. ``forward`` picks the
fastest path per case by measuring them on this machine, once, cached on disk (``choose_path``,
``cpu_autotune``); ``RETMASK_CPU_PATH=cpp|gemm|gemm_fp32|bf16dot|blocked`` forces one ("bf16dot" changes bfloat16 calls with
an even head dim only, and is emulated, slowly, by builds other than ``avx512bf16``). The kernel also runs
the sliding window, soft-capping and sinks of the contract (``reference.py``); a build from before them
(no ``FEATURES`` in the module) sends calls that use them to the blocked path, with one warning.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import warnings
from dataclasses import dataclass
from functools import cache, lru_cache
from types import ModuleType
from typing import Any

import torch

from . import cpu_autotune, cpu_blocked, cpu_gemm
from .env import setting

BLOCK_N = 64  # keys per block (multiple of 32)


def default_block_m(N: int, window: int | None = None, *, gemm: bool = False) -> int:
    """Tile rows per work item (query rows x active heads of one KV group) for N keys.

    ``gemm`` (the block-GEMM tile layout): 256 rows whatever N, the M of its GEMMs (AVX2 EPYC, fp32 and
    bf16, N = 1K-4K: 256 rows 5-15% faster than 128, flat up to 768; docs/kernel_optimisation.md, v12);
    a sliding window as below.

    Each item streams K/V of its KV head once, so more rows per item means fewer passes over K/V. Paired
    A/B runs (docs/kernel_optimisation.md, v4): 256 rows cut time 23-33% at N = 8K-16K, where a head's K/V (N*D*8
    bytes: 4-16 MB) no longer stays in cache; at N <= 4K it costs 4-9% (more masked work on the causal
    diagonal, coarser load balance), where 128 is as fast as 64 or faster.

    With a sliding ``window`` (< N) an item streams only the ~window + rows keys its rows see, so K/V
    traffic no longer argues for large items, while every row of an item visits the keys of the whole
    item (rows per head + one block beyond its own window): 64 rows for windows up to 1024 keys
    (SmolLM2 shape, 8K keys, window 512: 64 rows ~8% faster than 256 in docs/kernel_optimisation.md,
    v7), else the rule above applied to the window.
    """
    if window is not None and window < N:
        return 64 if window <= 1024 else default_block_m(window)
    return 256 if N >= 8192 or gemm else 128


@dataclass(frozen=True)
class KernelLibrary:
    """A loaded build of ``retmask._C``: the module, its dtype codes by torch dtype, and the optional
    features its binding takes (``window``, ``softcap``, ``sinks``; empty for builds from before them)."""

    module: ModuleType
    codes: dict[torch.dtype, int]
    features: frozenset[str] = frozenset()
    builds: tuple[
        tuple[str, int], ...
    ] = ()  # (name, fp32 lanes) this CPU runs, widest first; () = older build


@lru_cache(maxsize=1)
def _library() -> KernelLibrary | None:
    """The built ``retmask._C``, or None (with one warning) when it is not built or cannot be used."""
    spec = importlib.util.find_spec("retmask._C")
    if spec is None or spec.origin is None:
        warnings.warn(
            "retmask._C (the fused C++ CPU attention kernel) is not built; falling back to the slower "
            "blocked-torch CPU path. Build it with `pip install --no-build-isolation -e .` or "
            "`python setup.py build_ext --inplace`.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    try:
        return bind_library(importlib.import_module("retmask._C"))
    except (ImportError, AttributeError) as err:
        warnings.warn(
            f"retmask._C at {spec.origin} could not be loaded ({err}); falling back to the blocked-torch "
            "CPU path. Rebuild it with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def load_library(path: str | os.PathLike[str]) -> KernelLibrary:
    """Load the build of ``retmask._C`` at ``path`` (a shared object, e.g. a copy of an older build) as a
    module of its own, beside the installed one: ``bench/bench_kernel_ab.py`` times two builds this way.

    Each path gets a module name of its own, ``_retmask_build_<hash>._C`` (the last part must stay ``_C``:
    the init function is ``PyInit__C``): pybind11 3 caches initialised modules by name, so a second build
    loaded as ``retmask._C`` would silently be the first one again.
    """
    path = os.path.realpath(os.fspath(path))
    name = f"_retmask_build_{hashlib.sha1(path.encode()).hexdigest()[:12]}._C"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if os.path.realpath(module.__file__ or "") != path:
        raise ImportError(f"loading {path} gave the module of {module.__file__}")
    return bind_library(module)


def bind_library(lib: ModuleType | str | os.PathLike[str] | Any) -> KernelLibrary:
    """A loaded ``retmask._C`` module ready for ``cpp_forward``. Also takes the path of a build, or a
    ``ctypes.CDLL`` of one (what ``bench/bench_kernel_ab.py`` passes), and loads it with ``load_library``.
    Raises AttributeError for a build without the pybind11 binding (one from before it: rebuild)."""
    if not isinstance(lib, ModuleType):
        return load_library(getattr(lib, "_name", lib))
    lib.attention_fwd  # noqa: B018 (AttributeError for a stale build)
    codes = {getattr(torch, name): code for name, code in lib.DTYPE_CODES.items()}
    builds = tuple((str(name), int(lanes)) for name, lanes in getattr(lib, "BUILDS", ()))
    return KernelLibrary(lib, codes, frozenset(getattr(lib, "FEATURES", ())), builds)


def cpp_available() -> bool:
    """Whether the fused C++ kernel is built and loadable."""
    return _library() is not None


ISA_ENV = "RETMASK_CPU_ISA"


def builds() -> tuple[tuple[str, int], ...]:
    """The kernel builds this CPU runs, widest first, as (name, fp32 vector lanes), e.g.
    ``(("avx2", 8), ("generic", 8))`` on an AVX2-only CPU; () when the extension is not built."""
    lib = _library()
    return lib.builds if lib is not None else ()


def selected_isa(isa: str | None = None) -> str:
    """The build a call runs: ``isa`` if given, else ``$RETMASK_CPU_ISA`` if set, else the widest this CPU
    has. Raises ValueError for a name this CPU has no build for, listing the ones it has."""
    wanted = isa if isa is not None else setting(ISA_ENV)
    available = builds()
    if not wanted:  # every call of the kernel asks: no list built for it
        return available[0][0] if available else ""
    names = [name for name, _ in available]
    if wanted not in names:
        source = f"${ISA_ENV}" if isa is None else "isa"
        raise ValueError(
            f"{source}: {wanted!r} is not a build of the C++ kernel this CPU can run; it has "
            f"{', '.join(names) or 'none (retmask._C is not built or predates per-ISA builds)'}"
        )
    return wanted


def vector_lanes(isa: str | None = None) -> int:
    """fp32 lanes of the build ``selected_isa(isa)``: tiles with fewer rows take the row-major layout."""
    return dict(builds()).get(selected_isa(isa), 16)


def _tensor_args(codes: dict[torch.dtype, int], **tensors: torch.Tensor) -> list[tuple]:
    """Each tensor as the binding takes it, in the order given: (data pointer, dtype code, shape, strides
    in elements). One Python call for the four tensors every kernel call passes: a decode step makes
    that call once per layer, with cold caches, where each Python function entered costs ~3-5 us."""
    args = []
    for name, t in tensors.items():
        code = codes.get(t.dtype)
        if code is None:
            raise ValueError(f"{name}: dtype {t.dtype} is not supported by the C++ kernel")
        args.append((t.data_ptr(), code, t.shape, t.stride()))
    return args


def _tensor_arg(name: str, t: torch.Tensor, codes: dict[torch.dtype, int]) -> tuple:
    """One tensor as the binding takes it (see ``_tensor_args``)."""
    return _tensor_args(codes, **{name: t})[0]


def cpp_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    argmax_rows: int,
    out: torch.Tensor | None = None,
    argmax: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int = BLOCK_N,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    isa: str | None = None,
    gemm: bool = False,
    gemm_fp32: bool = False,
    bf16_dot: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the fused C++ kernel.

    q: [B, Hq, M, D] (any strides); k, v: [B, Hkv, N, D] (any strides); key_padding_mask: bool [B, N];
    skip_heads: bool [B, Hq]; all CPU tensors of one dtype (fp32/fp16/bf16). ``window`` (int >= 1,
    needs causal), ``softcap`` (float > 0) and ``sinks`` (float [Hq], any float dtype: passed as fp32)
    follow the contract of ``reference.py``; None = off (they are then not passed at all, so builds
    from before these features still run plain calls).
    ``out`` ([B, Hq, M, D], q.dtype, any strides) and ``argmax`` (int64 [B, Hq, argmax_rows],
    contiguous) may be given by the caller; the kernel writes every element of both (tests pre-fill
    them with NaN / sentinels to prove it). ``block_m``: tile rows per work item (default
    ``default_block_m(N, window)``); ``block_n``: keys per block; ``isa``: the build to run (see
    ``selected_isa``; default: ``$RETMASK_CPU_ISA`` or the widest). ``gemm``: run the block products
    through torch's CPU block GEMM (``cpu_gemm``: AMX / native bf16 where the CPU has them) instead of
    the kernel's FMA micro-kernels; RuntimeError where this torch or build has none. ``gemm_fp32`` (with
    ``gemm``): fp16 / bf16 blocks are converted to fp32 (exactly) and multiplied by torch's fp32 block
    GEMM, for CPUs whose half-precision GEMM only converts; no effect on fp32 calls. ``bf16_dot``
    (bfloat16 with an even head dim, not with ``gemm``): both block products as bf16 dot products in the
    lanes layout, whatever the tile size (so a skipped head changes no other head's output), P rounded
    to bf16 before P V (vdpbf16ps in the ``avx512bf16``
    build; the other builds emulate it bit for bit, slowly: see ``bf16_dot_native``); RuntimeError for a
    build without it.
    Returns (out, argmax or None).
    Raises ValueError (from the binding, naming the argument) for inconsistent tensors or settings.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("retmask._C is not built; see the warning above")
    codes = lib.codes
    if out is None:  # empty_like: with cold caches (a decode step) ~15 us cheaper than torch.empty(shape)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if not argmax_rows:
        argmax = None
    elif argmax is None:
        argmax = torch.empty(q.shape[0], q.shape[1], argmax_rows, dtype=torch.int64)
    elif argmax.shape[-1:] != (argmax_rows,):
        raise ValueError(f"argmax: shape {list(argmax.shape)}, expected [B, Hq, argmax_rows = {argmax_rows}]")
    # Masks are one byte per element (bool); the binding wants them contiguous.
    kpm = key_padding_mask.contiguous() if key_padding_mask is not None else None
    skip = skip_heads.contiguous() if skip_heads is not None else None
    features: dict[str, Any] = {}
    if window is not None:  # a window of N or more keys is no window (the kernel's own rule): cap at N
        features["window"] = min(int(window), max(1, k.shape[2]))
    if softcap is not None:
        features["softcap"] = float(softcap)
    if sinks is not None:
        sinks32 = sinks.detach().to(torch.float32).contiguous()
        features["sinks"] = _tensor_arg("sinks", sinks32, codes)
    if lib.builds:  # builds from before the per-ISA ones take no isa
        features["isa"] = selected_isa(isa)
    if gemm:
        fp32_operands = gemm_fp32 and q.dtype != torch.float32
        operand_dtype = torch.float32 if fp32_operands else q.dtype
        feature = "gemm_fp32_operands" if fp32_operands else "block_gemm"
        block = cpu_gemm.block_gemm(operand_dtype, q.shape[-1], block_n) if feature in lib.features else None
        if block is None:
            raise RuntimeError(
                f"the '{'gemm_fp32' if fp32_operands else 'gemm'}' CPU path needs torch's block GEMM for "
                f"{operand_dtype} and a build of retmask._C with {feature}; this torch or build has none "
                "(use RETMASK_CPU_PATH=cpp)"
            )
        features["block_gemm"] = tuple(block)
        if fp32_operands:
            features["gemm_fp32_operands"] = True
    if bf16_dot:
        if "bf16_dot" not in lib.features:
            raise RuntimeError(
                "this build of retmask._C has no bf16 dot products (bf16_dot); rebuild it with "
                "`pip install --no-build-isolation -e .` (or use RETMASK_CPU_PATH=cpp)"
            )
        features["bf16_dot"] = True
    lib.module.attention_fwd(
        *_tensor_args(codes, q=q, k=k, v=v, out=out),
        _tensor_arg("argmax", argmax, codes) if argmax is not None else None,
        _tensor_arg("key_padding_mask", kpm, codes) if kpm is not None else None,
        _tensor_arg("skip_heads", skip, codes) if skip is not None else None,
        bool(causal), float(sm_scale), block_m or default_block_m(k.shape[2], window, gemm=gemm), block_n,
        torch.get_num_threads(), **features,
    )  # fmt: skip
    return out, argmax


def _run_path(path: str, call: dict[str, Any]) -> Any:
    """Run one CPU path on a call given as keyword arguments (the autotuner's proxy calls)."""
    if path == "cpp":
        return cpp_forward(**call)
    if path in ("gemm", "gemm_fp32"):
        return cpp_forward(**call, gemm=True, gemm_fp32=path == "gemm_fp32")
    if path == "bf16dot":
        return cpp_forward(**call, bf16_dot=bf16_dot_applies(call["q"]))
    return cpu_blocked.forward(**call)


def gemm_available(dtype: torch.dtype) -> bool:
    """Whether the "gemm" path (the kernel's products on torch's block GEMM) exists for ``dtype``: this
    build of the kernel takes ``block_gemm`` and this torch exports the GEMM (``cpu_gemm``)."""
    lib = _library()
    return lib is not None and "block_gemm" in lib.features and cpu_gemm.available(dtype)


@cache
def gemm_paths(dtype: torch.dtype) -> tuple[str, ...]:
    """The block-GEMM paths that exist for calls of ``dtype``: "gemm" (operands in ``dtype``) where
    ``gemm_available(dtype)``, and for fp16 / bf16 also "gemm_fp32" (blocks converted to fp32, torch's
    fp32 GEMM) where the build takes ``gemm_fp32_operands`` and the fp32 GEMM exists. Cached: every
    attention call asks (the build and torch do not change within a process)."""
    paths = ("gemm",) if gemm_available(dtype) else ()
    lib = _library()
    if (
        dtype in (torch.float16, torch.bfloat16)
        and lib is not None
        and "gemm_fp32_operands" in lib.features
        and gemm_available(torch.float32)
    ):
        paths += ("gemm_fp32",)
    return paths


BF16_DOT_BUILD = "avx512bf16"  # the build that runs vdpbf16ps; the others emulate it


def bf16_dot_native(isa: str | None = None) -> bool:
    """Whether the build ``selected_isa(isa)`` runs the "bf16dot" path on the CPU's own bf16 dot products
    (the ``avx512bf16`` build, on CPUs with AVX512-BF16); other builds emulate them bit for bit, slowly
    (for tests), and the autotuner never offers the path there."""
    lib = _library()
    return lib is not None and "bf16_dot" in lib.features and selected_isa(isa) == BF16_DOT_BUILD


def _bf16_dot_fits(dtype: torch.dtype, head_dim: int) -> bool:
    """bfloat16 with an even head dim: what the bf16 dot products take (pairs of dims)."""
    return dtype == torch.bfloat16 and head_dim % 2 == 0


def bf16_dot_applies(q: torch.Tensor) -> bool:
    """Whether the "bf16dot" path changes a call with queries ``q`` [B, Hq, M, D]: bfloat16 with an even
    head dim (its dot products take pairs of dims); other calls run as "cpp"."""
    return _bf16_dot_fits(q.dtype, q.shape[-1])


def kernel_paths(dtype: torch.dtype, head_dim: int) -> tuple[str, ...]:
    """The other layouts of the fused kernel the autotuner may measure for calls of ``dtype`` with
    ``head_dim``: the block-GEMM paths (``gemm_paths``), and "bf16dot" for bfloat16 with an even head dim
    where the build runs it natively (``bf16_dot_native``)."""
    dot = ("bf16dot",) if _bf16_dot_fits(dtype, head_dim) and _bf16_dot_native_cached() else ()
    return gemm_paths(dtype) + dot


@cache
def _bf16_dot_native_cached() -> bool:  # every attention call asks; the build is fixed per process
    return bf16_dot_native()


def choose_path(q: torch.Tensor, k: torch.Tensor, **call: Any) -> str:
    """Which CPU path runs this call: "cpp" (fused C++), "gemm" (the same kernel with its block products
    on torch's block GEMM), "gemm_fp32" (fp16 / bf16 only: the same with blocks converted to fp32 for the
    fp32 GEMM), "bf16dot" (bf16 only: the fused kernel on AVX512-BF16 dot products) or "blocked" (SDPA +
    a blocked argmax scan).
    q: [B, Hq, M, D]; k: [B, Hkv, N, D]; ``call``: the keyword arguments of ``forward`` except v and
    sm_scale (causal, key_padding_mask, skip_heads, argmax_rows, window, softcap, sinks).

    Measured per case on the machine itself and cached (``cpu_autotune``); ``$RETMASK_CPU_PATH`` forces
    one. fused vs blocked, fp32, 2 cores, SmolLM2 and Llama-3.1-8B shapes, each path timed interleaved
    with SDPA: AVX-512 EPYC (bench/results/attention_cpu_amd-epyc-avx512f.md, attention_cpu_paths_...):
    argmax of all rows C++ 0.42-0.55x SDPA vs blocked 3.2-6.4x (the scan recomputes every logit); last 64
    rows 0.41-0.53x vs 1.04-1.17x; decode 0.23-0.61x vs 1.30-2.14x. AVX2-only EPYC
    (bench/results/attention_cpu_amd-epyc-avx2.md): all rows 0.98-1.07x vs 3.2-4.9x; last 64 rows
    0.97-1.11x vs 1.02-1.09x; decode 0.34-1.14x vs 1.33-3.31x. The "gemm" path (kernel v12) on the AVX2
    EPYC of family 25, on the proxy calls: 0.84-0.87x the fused kernel's time for fp32 prefill and chunks
    at the Llama shape, 0.95-0.98x at SmolLM2's (kernel v14, key blocks transposed in vector tiles:
    0.79-0.83x and 0.85-0.88x), 1.2-2.2x for verification and decode (v14: 0.85-0.98x on the proxies, but
    1.14-1.21x for decode at real sizes, which is why decode is never offered it); in bf16 slower
    than the fused kernel (no native bf16: torch's GEMM converts), while "gemm_fp32" (kernel v13, bf16
    blocks converted for the fp32 GEMM) is 0.82-0.85x at the Llama shape and 0.90-0.92x at SmolLM2's.
    On the Zen 4 EPYC with AVX512-BF16 (kernel v15, bench/results/attention_cpu_amd-epyc-f25-avx512f*.md)
    "bf16dot" takes 0.55-0.66x the fused kernel's time for bf16 prefill, chunks and verification, while
    torch's bf16 "gemm" (nothing to pack for without AMX) is 1.15-1.40x, and fp32 stays on the fused kernel
    ("gemm" 0.97-1.07x). Where torch's bf16 GEMMs run on AMX tiles, "gemm", "bf16dot" and "blocked" are
    the candidates that should win; the measurement finds out.
    """
    # The other layouts are only looked at when a case is decided (its first call), not on every call.
    return cpu_autotune.path_for(
        q, k, _run_path, kernel_paths=lambda: kernel_paths(q.dtype, q.shape[-1]), **call
    )


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    key_padding_mask: torch.Tensor | None,
    skip_heads: torch.Tensor | None,
    argmax_rows: int,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    heads_last: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """Backend interface: q [B, Hq, M, D], k/v [B, Hkv, N, D] ->
    (out [B, Hq, M, D] q.dtype, argmax int64 [B, Hq, argmax_rows] | None, None). ``heads_last``: the
    fused kernel writes out into a [B, M, Hq, D] tensor (returned as its [B, Hq, M, D] view), the
    layout transformers wants, instead of a contiguous [B, Hq, M, D] one; the blocked path ignores it."""
    lib = _library()
    path = "blocked"
    plain = window is None and softcap is None and sinks is None  # no feature a build could lack
    if lib is not None and (plain or _supports(lib, dict(window=window, softcap=softcap, sinks=sinks))):
        path = choose_path(
            q, k, causal=causal, key_padding_mask=key_padding_mask, skip_heads=skip_heads,
            argmax_rows=argmax_rows, window=window, softcap=softcap, sinks=sinks,
        )  # fmt: skip
    if path == "blocked":
        return cpu_blocked.forward(
            q, k, v, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
            skip_heads=skip_heads, argmax_rows=argmax_rows, window=window, softcap=softcap, sinks=sinks,
        )  # fmt: skip
    out = None
    if heads_last and q.shape[2] > 1:  # with one query row (decode) both layouts are the same memory
        B, Hq, M, D = q.shape
        out = torch.empty((B, M, Hq, D), dtype=q.dtype).transpose(1, 2)
    out, argmax = cpp_forward(
        q, k, v, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
        skip_heads=skip_heads, argmax_rows=argmax_rows, window=window, softcap=softcap, sinks=sinks,
        out=out, gemm=path.startswith("gemm"), gemm_fp32=path == "gemm_fp32",
        bf16_dot=path == "bf16dot" and bf16_dot_applies(q),
    )  # fmt: skip
    return out, argmax, None


def _supports(lib: KernelLibrary, features: dict[str, Any]) -> bool:
    """Whether the build takes every feature in use; a build from before them warns once (the blocked
    path, which runs them through ``chunked.chunked_attention``, takes over)."""
    missing = sorted(
        name for name, value in features.items() if value is not None and name not in lib.features
    )
    if missing:
        _warn_stale_features(lib.module.__file__ or "retmask._C", tuple(missing))
    return not missing


@cache
def _warn_stale_features(path: str, missing: tuple[str, ...]) -> None:
    warnings.warn(
        f"retmask._C at {path} predates {', '.join(missing)}; those calls take the slower blocked-torch "
        "CPU path. Rebuild it with `pip install --no-build-isolation -e .`.",
        RuntimeWarning,
        stacklevel=4,
    )
