# flashkiln: `make generate` sets everything up and builds the default kernels (CPU only);
# `make test` runs the test suite (GPU tests skip without a GPU).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
HOST_PYTHON ?= python3
JOBS ?= $(shell nproc)
SPECS ?= specs
OUT ?= generated
# Archs to build, comma-separated (e.g. ARCHS=sm_80,sm_90a), or `all`: every arch the specs list.
# The default is Hopper's alone: its default set takes 16 minutes cold on two cores (docs/perf.md, v25).
ARCHS ?= sm_90a
# Kernel set: `default`, or `full`, which adds the spec groups marked `set: full` (on sm_90a the
# portable family's kernels for what the hopper family covers: for tests of both families).
SET ?= default
SELECT_ARGS := $(if $(filter all,$(ARCHS)),,--archs $(ARCHS)) --set $(SET)
# On a GPU machine that has torch and cuda-bindings but no registry (the device), use its python3.
GPU_PYTHON ?= python3
# CUDA flavor of `make wheel`: 13 (NVRTC 13.0, in .venv) or 12 (NVRTC 12.9, in .venv-cu12).
CUDA ?= 13
VENV_CU12 := .venv-cu12
WHEEL_PY := $(if $(filter 12,$(CUDA)),$(VENV_CU12)/bin/python,$(PY))

.PHONY: all setup generate test gpu-test bench wheel wheels clean

all: generate

$(VENV)/.installed: pyproject.toml
	$(HOST_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first, so that the project's `torch` requirement pulls nothing more.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[generator,dev]'
	touch $@

# The CUDA 12 flavor's generator lives in its own environment (cuda-bindings 12 loads NVRTC 12).
$(VENV_CU12)/.installed: pyproject.toml
	$(HOST_PYTHON) -m venv $(VENV_CU12)
	$(VENV_CU12)/bin/python -m pip install -q --upgrade pip
	$(VENV_CU12)/bin/python -m pip install -q torch==2.13.0
	$(VENV_CU12)/bin/python -m pip install -q -e '.[generator-cu12]'
	touch $@

setup: $(VENV)/.installed

generate: $(VENV)/.installed
	$(PY) -m flashkiln.generator generate --specs $(SPECS) --out $(OUT) -j $(JOBS) $(SELECT_ARGS)

# The CUDA 12 environment is part of the test setup: a test builds a cu12 wheel with it.
test: $(VENV)/.installed $(VENV_CU12)/.installed
	$(PY) -m pytest -q tests

# GPU tests on a machine with a GPU, using that machine's python3 (no installs) and the
# cubins under $(OUT) built by `make generate SET=full` elsewhere (the tests run both families).
gpu-test:
	FLASHKILN_REQUIRE_GPU=1 tools/pyenv.sh $(GPU_PYTHON) -m pytest -q -m gpu -rs --maxfail=40 $(PYTEST_ARGS) tests

bench:
	tools/pyenv.sh $(GPU_PYTHON) bench/bench.py --out build/bench
	tools/pyenv.sh $(GPU_PYTHON) bench/bench.py --out build/bench-bias-full --bias full
	tools/pyenv.sh $(GPU_PYTHON) bench/bench.py --out build/bench-bias-shared --bias shared
	tools/pyenv.sh $(GPU_PYTHON) bench/bench.py --out build/bench-varlen --varlen
	tools/pyenv.sh $(GPU_PYTHON) bench/bench.py --out build/bench-window --window
	tools/pyenv.sh $(GPU_PYTHON) bench/bench.py --out build/bench-softcap --softcap
	tools/pyenv.sh $(GPU_PYTHON) bench/host_overhead.py --out build/bench-host
	tools/pyenv.sh $(GPU_PYTHON) bench/memory.py --out build/bench-memory

# A wheel of the runtime with the cubins of $(SPECS) (and the generator, for opt-in JIT), into dist/.
wheel: $(if $(filter 12,$(CUDA)),$(VENV_CU12)/.installed,$(VENV)/.installed)
	$(WHEEL_PY) -m flashkiln.generator wheel --specs $(SPECS) --out dist -j $(JOBS) $(SELECT_ARGS)

# One such wheel per arch (`make wheels ARCHS=all`: every arch the specs list).
wheels: $(if $(filter 12,$(CUDA)),$(VENV_CU12)/.installed,$(VENV)/.installed)
	$(WHEEL_PY) -m flashkiln.generator wheel --per-arch --specs $(SPECS) --out dist -j $(JOBS) $(SELECT_ARGS)

clean:
	rm -rf build dist $(OUT)/manifest.json $(OUT)/*.cubin $(OUT)/src
