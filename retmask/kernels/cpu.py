"""CPU backend of ``retmask.kernels.attention``: the fused C++ kernel, or the blocked-torch path.

``cpp_forward`` calls ``retmask_attention_fwd_cpu`` from ``retmask._C`` (csrc/attention_cpu.cpp) through
ctypes with tensor data pointers and element strides; ctypes releases the GIL for the call. If the
extension is missing (e.g. a source checkout that was never built) a warning is issued once and
``forward`` falls back to ``cpu_blocked``.

``forward`` picks the faster path per case, by measurement (bench/results/attention_cpu.md): see
``choose_path`` (today: the C++ kernel whenever it is built).
"""

from __future__ import annotations

import ctypes
import importlib.util
import warnings
from functools import lru_cache

import torch

from . import cpu_blocked

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
BLOCK_N = 64  # keys per block (multiple of 32)


def default_block_m(N: int) -> int:
    """Tile rows per work item (query rows x active heads of one KV group) for N keys.

    Each item streams K/V of its KV head once, so more rows per item means fewer passes over K/V. Paired
    A/B runs (bench/README.md, v4): 256 rows cut time 23-33% at N = 8K-16K, where a head's K/V (N*D*8
    bytes: 4-16 MB) no longer stays in cache; at N <= 4K it costs 4-9% (more masked work on the causal
    diagonal, coarser load balance), where 128 is as fast as 64 or faster.
    """
    return 256 if N >= 8192 else 128


_I64x4 = ctypes.c_int64 * 4


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The loaded ``retmask._C`` shared object, or None (with one warning) when it is not built."""
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
        return bind_library(ctypes.CDLL(spec.origin))
    except (OSError, AttributeError) as err:
        warnings.warn(
            f"retmask._C at {spec.origin} could not be loaded ({err}); falling back to the blocked-torch "
            "CPU path. Rebuild it with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def bind_library(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C signature of ``retmask_attention_fwd_cpu`` on a loaded build of the kernel (also used
    by ``bench/bench_kernel_ab.py`` to load a second build)."""
    fn = lib.retmask_attention_fwd_cpu
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, p, p, p, p, p, p, p, p, p, p, p]
    fn.argtypes += [i64] * 6 + [ctypes.c_int, ctypes.c_float, i64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


def cpp_available() -> bool:
    """Whether the fused C++ kernel is built and loadable."""
    return _library() is not None


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the fused C++ kernel.

    q: [B, Hq, M, D] (any strides); k, v: [B, Hkv, N, D] (any strides); key_padding_mask: bool [B, N];
    skip_heads: bool [B, Hq]; all CPU tensors of one dtype (fp32/fp16/bf16).
    ``out`` ([B, Hq, M, D], q.dtype, any strides) and ``argmax`` (int64 [B, Hq, argmax_rows],
    contiguous) may be given by the caller; the kernel writes every element of both (tests pre-fill
    them with NaN / sentinels to prove it). ``block_m``: tile rows per work item (default
    ``default_block_m(N)``); ``block_n``: keys per block. Returns (out, argmax or None).
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("retmask._C is not built; see the warning above")
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    if out is None:
        out = torch.empty(B, Hq, M, D, dtype=q.dtype)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {list(q.shape)} {q.dtype}, got {list(out.shape)} {out.dtype}")
    if argmax_rows and argmax is None:
        argmax = torch.empty(B, Hq, argmax_rows, dtype=torch.int64)
    if argmax_rows and (argmax.shape != (B, Hq, argmax_rows) or not argmax.is_contiguous()):
        raise ValueError(f"argmax must be a contiguous int64 [{B}, {Hq}, {argmax_rows}] tensor")
    # bool tensors are one byte per element: pass them as uint8 arrays.
    kpm = key_padding_mask.contiguous() if key_padding_mask is not None else None
    skip = skip_heads.contiguous() if skip_heads is not None else None
    rc = lib.retmask_attention_fwd_cpu(
        _DTYPE_CODES[q.dtype],
        q.data_ptr(), _I64x4(*q.stride()), k.data_ptr(), _I64x4(*k.stride()),
        v.data_ptr(), _I64x4(*v.stride()), out.data_ptr(), _I64x4(*out.stride()),
        argmax.data_ptr() if argmax_rows else None,
        kpm.data_ptr() if kpm is not None else None,
        skip.data_ptr() if skip is not None else None,
        B, Hq, Hkv, M, N, D, int(causal), float(sm_scale), argmax_rows,
        block_m or default_block_m(N), block_n, torch.get_num_threads(),
    )  # fmt: skip
    if rc == 2:
        raise MemoryError("retmask CPU attention kernel could not allocate its scratch buffers")
    if rc != 0:
        raise RuntimeError(f"retmask CPU attention kernel rejected its arguments (code {rc})")
    return out, (argmax if argmax_rows else None)


def choose_path(M: int, N: int, argmax_rows: int) -> str:
    """Which CPU path is faster for this case: "cpp" (fused C++) or "blocked" (SDPA + torch argmax scan).

    Measured (bench/results/attention_cpu.md, "CPU path comparison": each path timed interleaved with
    SDPA on this 2-core machine, fp32, SmolLM2 and Llama-3.1-8B shapes): the fused kernel is faster in
    every case, so it is always chosen when built. Prefill, argmax on all rows (2K-4K): C++ 0.42-0.55x
    SDPA vs blocked 3.2-6.4x (the blocked scan recomputes every logit, above the diagonal too).
    Argmax on the last 64 rows: C++ 0.41-0.53x vs blocked 1.04-1.17x (it *is* SDPA plus a scan).
    Decode (M = 1, 2K-32K keys; bench/results/attention_cpu_paths.md, after the v5/v6 decode changes):
    C++ 0.23-0.61x SDPA vs blocked 1.30-2.14x. The blocked path stays as the fallback when
    ``retmask._C`` is not built.
    """
    return "cpp"


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
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """Backend interface: q [B, Hq, M, D], k/v [B, Hkv, N, D] ->
    (out [B, Hq, M, D] q.dtype, argmax int64 [B, Hq, argmax_rows] | None, None)."""
    M, N = q.shape[2], k.shape[2]
    if _library() is None or choose_path(M, N, argmax_rows) == "blocked":
        return cpu_blocked.forward(
            q, k, v, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
            skip_heads=skip_heads, argmax_rows=argmax_rows,
        )  # fmt: skip
    out, argmax = cpp_forward(
        q, k, v, causal=causal, sm_scale=sm_scale, key_padding_mask=key_padding_mask,
        skip_heads=skip_heads, argmax_rows=argmax_rows,
    )  # fmt: skip
    return out, argmax, None
