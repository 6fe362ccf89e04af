# Two commands for a fresh machine with Python >= 3.10 and pip:
#   make demo   -> Diffusion-DPO on the bundled shapes testbed, on a CPU, with before/after scores and the
#                  gain on captions no training prompt names (unseen captions), with its caption-clustered SE
#   make test   -> the test suite (fast; `make test-all` includes the slow tests)
# Both create .venv and install what is missing. TORCH picks the torch build: the default pin is
# the CPU wheel used by CI; on a GPU machine use e.g. `make demo TORCH=torch`.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-all fuzz lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install "$(TORCH)"
	$(BIN)/python -m pip install -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# The testbed models are tiny: one thread per process is faster than several.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python align/dpo.py --config configs/testbed_dpo.yaml --output-dir runs/testbed-dpo --overwrite true

test: $(STAMP)
	$(BIN)/python -m ruff check align rewards scripts experiments tests
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

# Every case of the fuzzer (tests/test_fuzz.py); the default suite runs a fixed sample of them.
fuzz: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests/test_fuzz.py -m "slow or not slow"

test-all: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "slow or not slow"

bench: $(STAMP)
	$(BIN)/python scripts/bench_dpo.py

clean:
	rm -rf $(VENV) runs .pytest_cache
