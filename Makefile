# flashkiln: `make generate` sets everything up and builds the default kernels (CPU only);
# `make test` runs the test suite (GPU tests skip without a GPU).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
HOST_PYTHON ?= python3
JOBS ?= $(shell nproc)
SPECS ?= specs
OUT ?= generated
# On a GPU machine that has torch and cuda-bindings but no registry (the device), use its python3.
GPU_PYTHON ?= python3

.PHONY: all setup generate test gpu-test bench clean

all: generate

$(VENV)/.installed: pyproject.toml
	$(HOST_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first, so that the project's `torch` requirement pulls nothing more.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[generator,dev]'
	touch $@

setup: $(VENV)/.installed

generate: $(VENV)/.installed
	$(PY) -m flashkiln.generator generate --specs $(SPECS) --out $(OUT) -j $(JOBS)

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

# GPU tests on a machine with a GPU, using that machine's python3 (no installs) and the
# cubins under $(OUT) built by `make generate` elsewhere.
gpu-test:
	FLASHKILN_REQUIRE_GPU=1 tools/pyenv.sh $(GPU_PYTHON) -m pytest -q -m gpu -rs --maxfail=40 $(PYTEST_ARGS) tests

bench:
	tools/pyenv.sh $(GPU_PYTHON) bench/bench.py --out build/bench

clean:
	rm -rf build $(OUT)/manifest.json $(OUT)/*.cubin $(OUT)/*.cu
