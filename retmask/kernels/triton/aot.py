"""Compile the Triton kernels for a GPU target on a machine without a GPU, and report their resources.

The interpreter (how the tests run without a GPU) checks the kernels' arithmetic but not their GPU code
generation: a kernel can interpret fine and still fail to compile, or spill registers with a given tile
config. This module closes part of that gap with Triton's ahead-of-time path and the bundled ``ptxas``:

1. ``record_launches()`` runs the real launchers (``triton.fwd``, ``triton.decode``, ``triton.bwd``)
   on small CPU tensors with the *GPU* config tables, but replaces each kernel by a recorder: the exact
   signature (pointer dtypes, integer/float scalars) and constexprs of every launch are captured and
   nothing is executed. The recorder also applies the specialisation a real launch gets from Triton's
   launcher (``_specialise``): an integer argument equal to 1 (a unit stride) becomes the constant 1, and
   integers divisible by 16 and pointers aligned to 16 bytes carry a divisibility hint. Without them the
   compiler can neither vectorise the loads nor pipeline them, and reports the registers and spills of a
   kernel no launch runs (the bf16 D = 128 forward: 255 registers with 40-216 B of spills, against
   182-234 registers and none specialised).
2. ``compile_launch()`` compiles one recorded launch for a CUDA target (default sm_90, H100) in a
   process where ``TRITON_INTERPRET`` is not set, and reads registers / spill stack from the cubin.

Command line: ``python -m retmask.kernels.triton.aot [--dtypes fp16 bf16 fp32] [--head-dims 64 128 256]
[--features none|all|both]`` prints one line per kernel launch: registers, spill stack bytes, shared
memory (``--features``: the launches without, with, or without and with a sliding window (and sink
tokens), soft-capping and sinks). Record in one process
(``--record-only FILE``, under TRITON_INTERPRET=1) and compile in another (``--compile FILE``) when the
kernel modules are already imported in interpreter mode.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from retmask.runfiles import atomic_write_text

KERNELS = {
    "retmask.kernels.triton.fwd": ("_fwd_kernel",),
    "retmask.kernels.triton.decode": ("_decode_partial_kernel", "_decode_merge_kernel"),
    "retmask.kernels.triton.bwd": ("_bwd_preprocess_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"),
}
_PTR_TYPES = {
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.bool: "*i1",
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Launch:
    """One recorded kernel launch: runtime argument types by name, constexprs, launch options."""

    module: str
    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    label: str = ""
    grid: tuple[int, ...] = ()
    divisible: list[str] = field(default_factory=list)  # arguments with a divisibility-by-16 hint


@dataclass
class Resources:
    """Per-thread registers, spill stack bytes and static shared memory of a compiled kernel."""

    registers: int
    stack: int
    shared: int
    extra: dict[str, Any] = field(default_factory=dict)


def _arg_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return _PTR_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type kernel argument {value!r}")


def _specialise(value: Any) -> tuple[str, bool]:
    """(type, divisible by 16) of a runtime argument as Triton's launcher specialises it
    (``BaseBackend.get_int_specialization`` / ``get_tensor_specialization`` with alignment on, the
    default of a ``triton.jit`` parameter): an int equal to 1 is the constant 1 (type "constexpr"); ints
    divisible by 16 and pointers to 16-byte aligned data are marked divisible. Floats and bools carry no
    hint."""
    from triton.backends.compiler import BaseBackend

    arg_type = _arg_type(value)
    if isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)):
        return arg_type, False
    if isinstance(value, int):
        if value == 1:
            return "constexpr", False
        return arg_type, BaseBackend.get_int_specialization(value, align=True) == "D"
    return arg_type, BaseBackend.get_tensor_specialization(value, align=True) == "D"


class _Recorder:
    """Stands in for a kernel object: ``kernel[grid](*args, **kw)`` records instead of running."""

    def __init__(self, module: str, name: str, arg_names: list[str], sink: list[Launch], label: str):
        self.module, self.name, self.arg_names, self.sink, self.label = module, name, arg_names, sink, label

    def __getitem__(self, grid: Any):
        def launch(*args: Any, num_warps: int = 4, num_stages: int = 3, **constexprs: Any) -> None:
            signature: dict[str, str] = {}
            divisible = []
            constexprs = dict(constexprs)
            for n, v in zip(self.arg_names[: len(args)], args, strict=True):  # the runtime arguments
                signature[n], hint = _specialise(v)
                if signature[n] == "constexpr":
                    constexprs[n] = 1
                if hint:
                    divisible.append(n)
            for n in self.arg_names[len(args) :]:
                signature[n] = "constexpr"
            self.sink.append(
                Launch(
                    self.module, self.name, signature, constexprs, num_warps, num_stages, self.label,
                    tuple(int(g) for g in grid), divisible,
                )
            )  # fmt: skip

        return launch


@contextlib.contextmanager
def record_launches(label: str = "") -> Iterator[list[Launch]]:
    """Within the block, kernel launches are recorded (with GPU tile configs), not executed."""

    launches: list[Launch] = []
    saved: list[tuple[Any, str, Any]] = []
    for module_name, names in KERNELS.items():
        module = importlib.import_module(module_name)
        for name in names:
            kernel = getattr(module, name)
            saved.append((module, name, kernel))
            setattr(module, name, _Recorder(module_name, name, list(kernel.arg_names), launches, label))
    saved_interp = os.environ.pop("TRITON_INTERPRET", None)  # GPU config tables, not the interpreter's
    try:
        yield launches
    finally:
        if saved_interp is not None:
            os.environ["TRITON_INTERPRET"] = saved_interp
        for module, name, kernel in saved:
            setattr(module, name, kernel)


def record_standard_launches(dtype: torch.dtype, head_dim: int, features: bool = False) -> list[Launch]:
    """Launches of a causal GQA prefill with padding and skips, with argmax on the last rows and without
    (both forward variants), a decode step, a verification pass of 33 rows (the split-key kernel with two
    row blocks of 64 at D <= 128) and the backward, on tiny CPU tensors (nothing runs). ``features`` adds
    a sliding window (100 of 256 keys) with 4 sink tokens, soft-capping and sinks to all of them."""
    from .bwd import attention_backward
    from .decode import decode_forward
    from .fwd import attention_forward

    B, Hq, Hkv, N = 1, 4, 2, 256
    label = f"{str(dtype).removeprefix('torch.')} D={head_dim}" + (" +w/cap/sink" if features else "")
    q = torch.zeros(B, Hq, N, head_dim, dtype=dtype)
    k = torch.zeros(B, Hkv, N, head_dim, dtype=dtype)
    pad = torch.ones(B, N, dtype=torch.bool)
    skip = torch.tensor([[False, True, False, False]])
    kw: dict[str, Any] = dict(sm_scale=0.125, key_padding_mask=pad, skip_heads=skip)
    if features:
        kw.update(window=100, sink_tokens=4, softcap=30.0, sinks=torch.zeros(Hq))
    with record_launches(label) as launches:
        out, _, lse = attention_forward(q, k, k, causal=True, argmax_rows=50, return_lse=True, **kw)
        attention_forward(q, k, k, causal=True, argmax_rows=0, return_lse=False, **kw)
        decode_forward(q[:, :, -1:], k, k, argmax_rows=1, return_lse=True, **kw)
        decode_forward(q[:, :, -33:], k, k, argmax_rows=33, return_lse=False, **kw)
        attention_backward(out, q, k, k, out, torch.zeros(B, Hq, N), causal=True, **kw)
    del lse
    return launches


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def compile_launch(launch: Launch, arch: int = 90) -> Resources:
    """Compile ``launch`` for CUDA sm_<arch> with ptxas; needs TRITON_INTERPRET unset in this process."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_launch needs a process without TRITON_INTERPRET=1 (use --compile)")
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch.module), launch.kernel)
    hint = BaseBackend.parse_attr("D")  # [["tt.divisibility", 16]], as a launch's attributes carry it
    attrs = {(fn.arg_names.index(n),): hint for n in launch.divisible}
    src = ASTSource(fn, launch.signature, launch.constexprs, attrs)
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(
        item.split(":", 1)
        for line in usage.splitlines()
        if "REG:" in line
        for item in line.split()
        if ":" in item
    )
    return Resources(int(fields["REG"]), int(fields["STACK"]), int(compiled.metadata.shared))


def _describe(launch: Launch) -> str:
    keys = ("BLOCK_M", "BLOCK_G", "BLOCK_N", "BLOCK_D", "TRACK_ARGMAX", "SPLITS")
    cfg = " ".join(f"{k}={launch.constexprs[k]}" for k in keys if k in launch.constexprs)
    return (
        f"{launch.label:>28s} {launch.kernel:24s} {cfg} warps={launch.num_warps} stages={launch.num_stages}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compile retmask's Triton kernels for sm_90 without a GPU")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp16", "fp32"])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument(
        "--features",
        choices=["none", "all", "both"],
        default="both",
        help="without / with sliding window + sink tokens + soft-capping + sinks, or both variants (default)",
    )
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--record-only", metavar="FILE", help="write the recorded launches as JSON and stop")
    parser.add_argument("--compile", metavar="FILE", help="compile launches from JSON; print JSON results")
    args = parser.parse_args(argv)

    if args.compile:
        launches = [
            Launch(**{**d, "grid": tuple(d["grid"])}) for d in json.loads(Path(args.compile).read_text())
        ]
        results = [asdict(compile_launch(launch, args.arch)) for launch in launches]
        print(json.dumps(results))
        return 0
    variants = {"none": [False], "all": [True], "both": [False, True]}[args.features]
    launches = [
        launch
        for dt in args.dtypes
        for d in args.head_dims
        for feat in variants
        for launch in record_standard_launches(DTYPES[dt], d, feat)
    ]
    if args.record_only:
        atomic_write_text(args.record_only, json.dumps([asdict(launch) for launch in launches]))
        return 0
    spills = 0
    for launch in launches:
        res = compile_launch(launch, args.arch)
        spills += res.stack > 0
        print(f"{_describe(launch)}  regs={res.registers} spill_stack={res.stack}B shared={res.shared}B")
    print(f"{len(launches)} launches compiled for sm_{args.arch}; {spills} with a spill stack")
    return 0


if __name__ == "__main__":
    sys.exit(main())
