"""Builds csrc/ into ``retmask._C``: the fused CPU attention kernel (C++17, OpenMP).

The shared object is a regular CPython extension module (so setuptools places it inside the package)
whose kernels have a plain C ABI; ``retmask.kernels.cpu`` calls them through ctypes with tensor data
pointers. No torch headers are needed, hence no torch in the build requirements.

Environment:
  RETMASK_NO_NATIVE=1   do not add -march=native (for wheels meant for other machines)
  RETMASK_NO_OPENMP=1   build without OpenMP (single-threaded kernel)
"""

import glob
import os
import sys

from setuptools import Extension, setup

compile_args = ["-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=fast"]
link_args: list[str] = []
if sys.platform != "win32":
    if not os.environ.get("RETMASK_NO_NATIVE"):
        compile_args.append("-march=native")
    if not os.environ.get("RETMASK_NO_OPENMP"):
        compile_args.append("-fopenmp")
        link_args.append("-fopenmp")

ext = Extension(
    "retmask._C",
    sources=sorted(glob.glob("csrc/*.cpp")),
    extra_compile_args=compile_args,
    extra_link_args=link_args,
    language="c++",
)

setup(ext_modules=[ext])
