# kvlab: `make lab` runs the workbook, `make test` passes the tests. Both set up .venv first.
#   make lab PORT=9000          pick the port (IP=0.0.0.0 to listen beyond this machine)
#   make test TORCH=2.6.0       choose the torch release installed into .venv
#   make test TORCH=            let pip choose torch (on Linux that is a CUDA build of several GB)
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= 2.13.0
PORT   ?= 8888
IP     ?= 127.0.0.1
PYTEST_ARGS ?=

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
BIN := $(VENV)/bin
# pip on some machines warns about every unreachable local index entry; keep the log readable.
QUIET_PIP := 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }
# The stamp is keyed on pyproject.toml and the torch choice: a second run installs nothing.
STAMP := $(VENV)/.kvlab-$(shell cat pyproject.toml 2>/dev/null | cksum | cut -d' ' -f1)-torch$(TORCH)

.PHONY: venv lab test test-long bench lint strip clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "Installing kvlab and its dependencies into $(VENV) (torch: $(or $(TORCH),pip's choice))"
	$(if $(TORCH),$(BIN)/python -m pip install --quiet "torch==$(TORCH)" $(QUIET_PIP))
	$(BIN)/python -m pip install --quiet -e . $(QUIET_PIP)
	@rm -f $(VENV)/.kvlab-*
	@touch $@

lab: $(STAMP)
	@echo "Starting JupyterLab on notebooks/; open the URL printed below (with its token)."
	$(BIN)/jupyter lab --no-browser --ip=$(IP) --port=$(PORT) --ServerApp.root_dir=notebooks

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-long: $(STAMP)
	HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest tests $(PYTEST_ARGS)

bench: $(STAMP)
	@for f in benchmarks/bench_*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

lint: $(STAMP)
	$(BIN)/ruff check kvlab kernels tests notebooks scripts benchmarks

strip: $(STAMP)
	$(BIN)/python scripts/strip_notebooks.py

clean-venv:
	rm -rf $(VENV)
