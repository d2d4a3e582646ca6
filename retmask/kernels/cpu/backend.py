"""CPU backend of ``retmask.kernels.attention``: the fused C++ kernel, or the blocked-torch path.

``cpp_forward`` calls ``attention_fwd`` of ``retmask._C``: the pybind11 binding (csrc/module.cpp) of the
C++/OpenMP kernel (csrc/attention_cpu.cpp). Each tensor goes over as (data pointer, dtype code, shape,
strides); the binding checks them against each other (ValueError naming the bad argument) and releases
the GIL for the compute. If the extension is missing (a source checkout that was never built) or cannot
be loaded, a warning is issued once and every call takes the blocked path (``cpu_blocked``).

The extension holds one build of the kernel per instruction set (AVX-512 + AVX512-BF16 and AVX-512: 16
fp32 lanes, AVX2 + FMA: 8, generic: 8 lanes for whatever the compiler targets) and runs the widest one
this CPU has, chosen at run time from its feature bits (``builds()``). ``RETMASK_CPU_ISA=avx2`` (or
another name from ``builds()``) makes every call run that build instead, e.g. to compare them.

Which path a call takes ("cpp", "bf16dot" or "blocked") is decided by ``paths.cpu_forward_path``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import warnings
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType

import torch

from retmask.errors import UsageError

from .. import paths
from . import blocked as cpu_blocked

BLOCK_N = 64  # keys per block (multiple of 32)
ISA_ENV = "RETMASK_CPU_ISA"


def default_block_m(N: int, window: int | None = None) -> int:
    """Tile rows per work item (query rows x active heads of one KV group) for N keys.

    Each item streams K/V of its KV head once, so more rows per item means fewer passes over K/V: 256
    rows from 8K keys on, where a head's K/V no longer stays in cache; 128 below, where larger items
    cost more masked work on the causal diagonal and a coarser load balance. With a sliding ``window``
    (< N) an item streams only the ~window + rows keys its rows see, while every row of an item visits
    the keys of the whole item: 64 rows for windows up to 1024 keys, else the rule applied to the
    window. (The measurements behind these sizes: docs/kernel_optimisation.md.)
    """
    if window is not None and window < N:
        return 64 if window <= 1024 else default_block_m(window)
    return 256 if N >= 8192 else 128


@dataclass(frozen=True)
class KernelLibrary:
    """A loaded build of ``retmask._C``: the module, its dtype codes by torch dtype, the kernel builds
    this CPU runs as (name, fp32 lanes), widest first, and their names (checked on every call)."""

    module: ModuleType
    codes: dict[torch.dtype, int]
    builds: tuple[tuple[str, int], ...]
    names: frozenset[str]


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
    the init function is ``PyInit__C``): pybind11 caches initialised modules by name, so a second build
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


def bind_library(lib: ModuleType | str | os.PathLike[str]) -> KernelLibrary:
    """A loaded ``retmask._C`` module (or the path of a build, loaded with ``load_library``) ready for
    ``cpp_forward``. Raises AttributeError for a module that is not a build of this kernel."""
    if not isinstance(lib, ModuleType):
        return load_library(lib)
    codes = {getattr(torch, name): code for name, code in lib.DTYPE_CODES.items()}
    builds = tuple((str(name), int(lanes)) for name, lanes in lib.BUILDS)
    lib.attention_fwd  # noqa: B018 (AttributeError for a module without the binding)
    return KernelLibrary(lib, codes, builds, frozenset(name for name, _ in builds))


def cpp_available() -> bool:
    """Whether the fused C++ kernel is built and loadable."""
    return _library() is not None


def builds() -> tuple[tuple[str, int], ...]:
    """The kernel builds this CPU runs, widest first, as (name, fp32 vector lanes), e.g.
    ``(("avx2", 8), ("generic", 8))`` on an AVX2-only CPU; () when the extension is not built."""
    lib = _library()
    return lib.builds if lib is not None else ()


def selected_isa(isa: str | None = None) -> str:
    """The build a call runs: ``isa`` if given, else ``$RETMASK_CPU_ISA`` if set, else the widest this CPU
    has. Raises UsageError (a ValueError) for a name this CPU has no build for, listing the ones it has."""
    wanted = isa if isa is not None else os.environ.get(ISA_ENV, "").strip()
    lib = _library()
    if not wanted:
        return lib.builds[0][0] if lib is not None else ""
    if lib is None or wanted not in lib.names:
        source = f"${ISA_ENV}" if isa is None else "isa"
        raise UsageError(
            f"{source}: {wanted!r} is not a build of the C++ kernel this CPU can run; it has "
            f"{', '.join(name for name, _ in builds()) or 'none (retmask._C is not built)'}; pick one of "
            "those, or unset it for the widest"
        )
    return wanted


def vector_lanes(isa: str | None = None) -> int:
    """fp32 lanes of the build ``selected_isa(isa)``: tiles with fewer rows take the row-major layout."""
    return dict(builds()).get(selected_isa(isa), 16)


def bf16_dot_native(isa: str | None = None) -> bool:
    """Whether the build ``selected_isa(isa)`` runs bf16 dot products on the CPU's own instruction
    (the ``avx512bf16`` build, on CPUs with AVX512-BF16); the other builds emulate it bit for bit, slowly
    (so that the layout is tested on every CPU), and ``paths`` never picks it there."""
    return cpp_available() and selected_isa(isa) == paths.BF16_DOT_BUILD


def tensor_arg(name: str, t: torch.Tensor, codes: dict[torch.dtype, int]) -> tuple:
    """One tensor as the binding takes it: (data pointer, dtype code, shape, strides in elements).

    The tuple holds a raw address and no reference: ``t`` must stay referenced until the binding returns.
    Bind a converted copy (``.contiguous()``, ``.to(...)``) to a local first; a temporary made inside the
    call's argument list is freed as soon as this function returns, and the kernel would read freed memory."""
    code = codes.get(t.dtype)
    if code is None:
        raise ValueError(f"{name}: dtype {t.dtype} is not supported by the C++ kernel")
    return (t.data_ptr(), code, t.shape, t.stride())


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
    bf16_dot: bool = False,
    sink_tokens: int | None = None,
    stats: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the fused C++ kernel.

    q: [B, Hq, M, D] (any strides); k, v: [B, Hkv, N, D] (any strides); key_padding_mask: bool [B, N];
    skip_heads: bool [B, Hq]; all CPU tensors of one dtype (fp32/fp16/bf16). ``window`` (int >= 1,
    needs causal), ``sink_tokens`` (int >= 1, needs a window), ``softcap`` (float > 0) and ``sinks``
    (float [Hq], any float dtype: passed as fp32) follow the contract of ``reference.py``; None = off.
    ``stats`` (a dict, or None): receives ``"logits"``, the (query row, key) logits the kernel computed
    (key-block visits times their tiles' rows; tests bound the work of a window with it).
    ``out`` ([B, Hq, M, D], q.dtype, any strides) and ``argmax`` (int64 [B, Hq, argmax_rows],
    contiguous) may be given by the caller; the kernel writes every element of both (tests pre-fill
    them with NaN / sentinels to prove it). ``block_m``: tile rows per work item (default
    ``default_block_m(N, window)``); ``block_n``: keys per block; ``isa``: the build to run (see
    ``selected_isa``). ``bf16_dot`` (bfloat16 with an even head dim): both block products as bf16 dot
    products in the lanes layout, whatever the tile size (so a skipped head changes no other head's
    output), P rounded to bf16 before P V (vdpbf16ps in the ``avx512bf16`` build; the other builds
    emulate it bit for bit, slowly: see ``bf16_dot_native``).
    Returns (out, argmax or None).
    Raises ValueError (from the binding, naming the argument) for inconsistent tensors or settings,
    RuntimeError when the extension is not built.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("retmask._C is not built; see the warning above")
    codes = lib.codes
    if out is None:  # empty_like: cheaper than torch.empty(shape) in a decode step with cold caches
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if not argmax_rows:
        argmax = None
    elif argmax is None:
        argmax = torch.empty(q.shape[0], q.shape[1], argmax_rows, dtype=torch.int64)
    elif argmax.shape[-1:] != (argmax_rows,):
        raise ValueError(f"argmax: shape {list(argmax.shape)}, expected [B, Hq, argmax_rows = {argmax_rows}]")
    kpm = key_padding_mask.contiguous() if key_padding_mask is not None else None  # one byte per element
    skip = skip_heads.contiguous() if skip_heads is not None else None
    features: dict[str, object] = {"isa": selected_isa(isa), "bf16_dot": bool(bf16_dot)}
    if window is not None:  # a window of N or more keys is no window (the kernel's own rule): cap at N
        features["window"] = min(int(window), max(1, k.shape[2]))
    if sink_tokens is not None:  # likewise (sink + window >= N: plain causal); without a window: refused
        features["sink_tokens"] = min(int(sink_tokens), max(1, k.shape[2]))
    if softcap is not None:
        features["softcap"] = float(softcap)
    # a local: the fp32 copy must outlive the call (tensor_arg keeps only its address)
    sinks32 = sinks.detach().to(torch.float32).contiguous() if sinks is not None else None
    if sinks32 is not None:
        features["sinks"] = tensor_arg("sinks", sinks32, codes)
    logits = lib.module.attention_fwd(
        tensor_arg("q", q, codes), tensor_arg("k", k, codes), tensor_arg("v", v, codes),
        tensor_arg("out", out, codes),
        tensor_arg("argmax", argmax, codes) if argmax is not None else None,
        tensor_arg("key_padding_mask", kpm, codes) if kpm is not None else None,
        tensor_arg("skip_heads", skip, codes) if skip is not None else None,
        bool(causal), float(sm_scale), block_m or default_block_m(k.shape[2], window), block_n,
        torch.get_num_threads(), **features,
    )  # fmt: skip
    if stats is not None:
        stats["logits"] = int(logits)
    return out, argmax


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
    sink_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """Backend interface: q [B, Hq, M, D], k/v [B, Hkv, N, D] ->
    (out [B, Hq, M, D] q.dtype, argmax int64 [B, Hq, argmax_rows] | None, None), on the path
    ``paths.cpu_forward_path`` names. ``heads_last``: the fused kernel writes out into a [B, M, Hq, D]
    tensor (returned as its [B, Hq, M, D] view), the layout transformers wants, instead of a contiguous
    [B, Hq, M, D] one; the blocked path ignores it."""
    build = selected_isa()  # read once: the rule and the kernel call run the same build
    path = paths.cpu_forward_path(q.dtype, q.shape[-1], q.shape[2], build=build)
    if path == "blocked":
        return cpu_blocked.forward(
            q, k, v, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
            skip_heads=skip_heads, argmax_rows=argmax_rows, window=window, softcap=softcap, sinks=sinks,
            sink_tokens=sink_tokens,
        )  # fmt: skip
    out = None
    if heads_last and q.shape[2] > 1:  # with one query row (decode) both layouts are the same memory
        B, Hq, M, D = q.shape
        out = torch.empty((B, M, Hq, D), dtype=q.dtype).transpose(1, 2)
    out, argmax = cpp_forward(
        q, k, v, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
        skip_heads=skip_heads, argmax_rows=argmax_rows, window=window, softcap=softcap, sinks=sinks,
        out=out, isa=build, bf16_dot=path == "bf16dot", sink_tokens=sink_tokens,
    )  # fmt: skip
    return out, argmax, None
