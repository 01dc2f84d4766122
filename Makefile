# Everyday commands; each is one line of the README or CI, so they stay the same everywhere.
PY ?= python
PATHS = common services tests bench
BENCH ?= decode-1

.PHONY: install test test-quick lint typecheck gpu-test bench

install:  ## the package and its test tools (the CPU build of torch first)
	pip install torch==2.13.0 && pip install -e '.[test]'

test:  ## the whole suite, as CI runs it (~25 minutes on two cores)
	$(PY) -m pytest -q

test-quick:  ## everything but the end-to-end tests marked slow
	$(PY) -m pytest -q -m "not slow"

lint:  ## style, spelling, the layers' import contracts and the type check
	ruff check $(PATHS)
	ruff format --check $(PATHS)
	typos
	lint-imports
	mypy

typecheck:
	mypy

gpu-test:  ## the CUDA tests (skip without a GPU)
	$(PY) -m pytest -q tests/gpu

bench:  ## one benchmark on the GPU: make bench BENCH=decode-allfit ARGS='--out /tmp/out'
	spillway bench $(BENCH) $(ARGS)
