"""Builds csrc/ into ``retmask._C``: the fused CPU attention kernel (C++17, OpenMP) and its pybind11 binding.

The binding (csrc/module.cpp) takes tensors as plain integers (data pointer, dtype code, shape, strides),
so it needs no torch headers and does not link libtorch: the build is independent of the installed torch
(no ABI coupling, no torch in the build requirements). Build requirements: setuptools and pybind11 only
(``[build-system]`` in pyproject.toml; for ``pip install --no-build-isolation`` install them first, as
``make install`` does).

OpenMP: the extension links ``libgomp.so.1``. torch's Linux wheels bundle their own copy under the same
soname (torch/lib/libgomp.so.1), and the dynamic loader maps one object per soname, so in a process that
has imported torch (retmask always does first) the kernel runs on torch's OpenMP runtime and thread pool.

No -march=native: the kernel is compiled once per instruction set (csrc/attention_cpu_{avx512,avx2,generic}.cpp,
each under its own ``#pragma GCC target``) and the widest one the CPU has is picked at run time, so a build
runs on any x86-64 CPU (a wheel, or a checkout that moves between machines) at that CPU's vector width.

Environment:
  RETMASK_NO_OPENMP=1    build without OpenMP (single-threaded kernel)
  RETMASK_BUILD_JOBS=N   compile the sources on N parallel jobs (default: one per CPU)
"""

import glob
import os
import sys

from setuptools import setup

try:
    from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
except ImportError as err:  # a --no-build-isolation build in an environment without pybind11
    raise SystemExit(
        "building retmask._C needs pybind11>=2.12: `pip install pybind11` first (make install does), "
        "or build with build isolation"
    ) from err

# Compiles the translation units concurrently (threads running the compiler; no ninja needed).
ParallelCompile("RETMASK_BUILD_JOBS").install()

compile_args = ["-O3", "-fno-math-errno", "-ffp-contract=fast"]
link_args: list[str] = []
if sys.platform != "win32":
    if not os.environ.get("RETMASK_NO_OPENMP"):
        compile_args.append("-fopenmp")
        link_args.append("-fopenmp")

ext = Pybind11Extension(
    "retmask._C",
    sources=sorted(glob.glob("csrc/*.cpp")),
    depends=sorted(glob.glob("csrc/*.h")),
    cxx_std=17,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)

setup(ext_modules=[ext])
