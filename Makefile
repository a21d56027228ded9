# Two commands on a fresh machine (Python 3.11, pip, make, gcc): `make demo`, `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CORE_STAMP := $(VENV)/.blobnet-core
FULL_STAMP := $(VENV)/.blobnet-full
TPM_STAMP := $(VENV)/.blobnet-tpm
PKG_CONFIG ?= pkg-config
P2PD := .cache/p2pd/p2pd

.PHONY: install install-core p2pd tpm demo test lint typecheck pytest bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# The CLI and the embedded node only (what `make demo` uses): no torch, no dev tools.
$(CORE_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

# Everything the tests and benchmarks use. torch==2.13.0 goes in first: a CPU build lies on
# disk here, and a looser range alone would pull a multi-GB CUDA build. The project's own
# ranges accept 2.13.0.
$(FULL_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[train,bench,dev]'
	touch $@ $(CORE_STAMP)

# The tpm extra (tpm2-pytss) compiles against the system's tpm2-tss headers. Where they are
# missing (no libtss2-dev), or the build fails, install goes on without it: the TPM commands
# then say what is missing and their tests skip saying why. Retried on the next make.
$(TPM_STAMP): pyproject.toml $(FULL_STAMP)
	@if $(PKG_CONFIG) --exists tss2-esys tss2-tctildr 2>/dev/null; then \
		if $(BIN)/python -m pip install -q -e '.[tpm]'; then touch $@; \
		else echo "make: tpm2-pytss did not build; the TPM tests will skip"; fi; \
	else \
		echo "make: no tpm2-tss headers (Debian: libtss2-dev pkgconf); tpm2-pytss not installed, the TPM tests will skip"; \
	fi

install-core: $(CORE_STAMP)
tpm: $(TPM_STAMP)
install: $(FULL_STAMP) p2pd tpm

# go-libp2p's daemon for the interop tests, from the hivemind wheel on PyPI, fetched here at
# install time and never during the test run (idempotent; when it cannot be fetched the
# interop tests skip and say why).
p2pd: $(FULL_STAMP)
	$(BIN)/python tests/fast/fetch_p2pd.py --optional

demo: $(CORE_STAMP)
	$(BIN)/blob demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_import_cycles.py

typecheck: install
	$(BIN)/mypy

# Two pytest workers (pytest-xdist): run one after another, the tests mostly wait on node
# processes, networks and timers (the suite kept one CPU busy less than half its time), so
# two at once halve the wall time on any machine with two cores or more. tests/wan/ runs
# after them, alone: its testbeds measure shaped links and punch timings, which a
# neighbouring test's CPU use would skew.
PYTEST_WORKERS ?= 2
PYTEST_ENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

pytest: install
	$(PYTEST_ENV) $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --ignore=tests/wan
	$(PYTEST_ENV) $(BIN)/python -m pytest tests/wan

test: lint typecheck pytest

bench: install
	$(BIN)/python bench/store.py
	$(BIN)/python bench/stack.py --json-out bench/results/stack.json
	$(BIN)/python bench/transfer.py --json-out bench/results/transfer.json
	$(BIN)/python bench/round.py
	$(BIN)/python bench/outer.py
	$(BIN)/python bench/wan_transfer.py --json-out bench/results/wan.json  # needs root

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
