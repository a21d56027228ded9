# Two commands on a fresh machine (Python 3.11, pip, make, gcc): `make demo`, `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.blobnet-installed

.PHONY: install p2pd demo test lint typecheck pytest bench clean

# torch==2.13.0 goes in first: a CPU build lies on disk here, and a looser range alone
# would pull a multi-GB CUDA build. The project's own ranges accept 2.13.0.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[train,dev]'
	touch $(STAMP)

install: $(STAMP)

# go-libp2p's daemon for the interop tests, from the hivemind wheel on PyPI (idempotent;
# when it cannot be fetched the interop tests skip and say why).
p2pd: install
	test ! -f tests/fast/fetch_p2pd.py || $(BIN)/python tests/fast/fetch_p2pd.py --optional

demo: install
	$(BIN)/blob demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

pytest: install p2pd
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/python -m pytest

test: lint typecheck pytest

bench: install
	$(BIN)/python bench/store.py
	$(BIN)/python bench/stack.py --json-out bench/results/stack.json
	$(BIN)/python bench/transfer.py --json-out bench/results/transfer.json
	$(BIN)/python bench/round.py
	$(BIN)/python bench/outer.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
