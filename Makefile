# autoshard: set-up, run, test, benchmark, lint.  GNU make.
#
#   make run    solve the bundled GPT-2 example on a 2x4 mesh
#   make test   run the test suite (what CI runs)
#   make test-fast  the suite without multi-process launches and large models (-m "not slow")
#   make bench  time each stage on the MLP, GPT-2 small and the Llama-7B shape
#   make lint   ruff check + ruff format --check
#
# Each target first installs what it needs into .venv (once: the stamp .venv/.installed is
# rebuilt only when pyproject.toml changes). torch is pinned and installed FIRST so that pip
# takes the local CPU build instead of resolving torch>=2.13 to a CUDA build from the registry.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest-xdist: one worker per core (2 here); WORKERS=0 runs in this process (a debugger)
WORKERS ?= auto

.PHONY: install run test test-fast bench lint

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install torch==$(TORCH_VERSION)
	$(BIN)/pip install -e '.[dev]'
	touch $@

run: install
	$(BIN)/autoshard solve examples/gpt2.py --mesh 2x4

test: install
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist worksteal $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist worksteal -m "not slow" $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m autoshard.bench

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
