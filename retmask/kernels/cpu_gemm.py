"""torch's CPU block GEMM, resolved from libtorch by symbol, for the fused kernel's "gemm" tile layout.

The fused C++ kernel can run both block products of a tile (S = Q K^T and O += P V) through an external
GEMM instead of its FMA micro-kernels, keeping the online softmax and the argmax in between (see
``block_gemm`` of ``retmask._C.attention_fwd``). The GEMM is the one torch's own CPU attention uses,
``at::native::cpublas::brgemm``: fp16 / bf16 x same -> fp32, and fp32. With oneDNN's micro-kernels it runs
on AMX tiles after a ``pack`` into the paired-k (VNNI) layout where ``could_pack`` says the CPU can
(AMX-BF16 / AMX-FP16); without packing, bf16 goes to oneDNN / MKL's bf16 GEMM (AVX512-BF16 dot products
where the CPU has them, a converting GEMM elsewhere) and fp32 to a vectorised fp32 GEMM.

These functions are exported by libtorch_cpu but are not a public torch API, so they are looked up by
their C++ symbol names with ctypes, and the extension is handed plain function addresses: it still
neither includes torch headers nor links libtorch. A torch without one of these symbols (another version,
another platform) has no "gemm" path: ``block_gemm`` returns None and the autotuner never offers it.
"""

from __future__ import annotations

import ctypes
import os
import platform
from functools import cache
from typing import NamedTuple

import torch

from .env import setting

# C++ symbols (Itanium ABI) of at::native::cpublas in libtorch_cpu.
SYMBOLS = {
    torch.bfloat16: "_ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb",
    torch.float16: "_ZN2at6native7cpublas6brgemmEllllllbPKN3c104HalfES5_Pfb",
    torch.float32: "_ZN2at6native7cpublas6brgemmEllllllbPKfS3_Pfb",
}
PACK_SYMBOL = "_ZN2at6native7cpublas4packEllllN3c1010ScalarTypeES3_PKvPv"
COULD_PACK_SYMBOL = "_ZN2at6native7cpublas10could_packEN3c1010ScalarTypeE"
RELEASE_SYMBOL = "_ZN2at6native7cpublas14brgemm_releaseEb"
# c10::ScalarType codes (the enum's order has been fixed since torch 1.x).
SCALAR_TYPE = {torch.float16: 5, torch.float32: 6, torch.bfloat16: 15}
VNNI_ENV = "RETMASK_CPU_GEMM_VNNI"  # "0": never pack (AMX off), for comparisons


class BlockGemm(NamedTuple):
    """What ``retmask._C.attention_fwd(block_gemm=...)`` takes: function addresses and the packing mode."""

    gemm: int
    pack: int
    release: int
    vnni: bool
    pack_dtype: int


@cache
def _libtorch() -> ctypes.CDLL | None:
    if platform.system() != "Linux":  # the symbol names and library name below are Linux (Itanium ABI) ones
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def _address(name: str) -> int:
    lib = _libtorch()
    if lib is None:
        return 0
    try:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
    except AttributeError:  # not exported by this torch
        return 0


@cache
def could_pack(dtype: torch.dtype) -> bool:
    """Whether torch's block GEMM runs ``dtype`` on matrix units after packing (AMX on x86)."""
    addr = _address(COULD_PACK_SYMBOL)
    if not addr or dtype not in (torch.bfloat16, torch.float16):
        return False
    fn = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_int8)(addr)
    return bool(fn(SCALAR_TYPE[dtype]))


@cache
def block_gemm(dtype: torch.dtype, head_dim: int, block_n: int = 64) -> BlockGemm | None:
    """The block GEMM for calls of ``dtype`` with head dim ``head_dim`` and ``block_n`` keys per block, or
    None where this torch has none. Packs (``vnni``) where ``could_pack(dtype)``, the head dim is a
    multiple of 64 and ``block_n == 64`` (the packed layouts the kernel uses), unless ``$RETMASK_CPU_GEMM_VNNI``
    is ``0``."""
    gemm = _address(SYMBOLS.get(dtype, ""))
    if not gemm:
        return None
    vnni = could_pack(dtype) and head_dim % 64 == 0 and block_n == 64 and setting(VNNI_ENV) != "0"
    pack = _address(PACK_SYMBOL) if vnni else 0
    if vnni and not pack:
        vnni = False
    return BlockGemm(gemm, pack, _address(RELEASE_SYMBOL), vnni, SCALAR_TYPE[dtype])


@cache
def available(dtype: torch.dtype) -> bool:
    """Whether the "gemm" path exists for ``dtype`` with this torch."""
    return bool(_address(SYMBOLS.get(dtype, "")))
