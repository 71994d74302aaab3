# kvlab: `make lab` runs the workbook, `make test` passes the tests. Both set up .venv first.
#   make lab PORT=9000          pick the port (IP=0.0.0.0 to listen beyond this machine)
#   make test TORCH=2.6.0       choose the torch release installed into .venv
#   make test TORCH=            let pip choose torch (on Linux that is a CUDA build of several GB)
#   make present NB=02          one notebook in Voila for a projector (widgets and text, code hidden)
#   make html                   execute every notebook into a static copy in build/html/ (NB=01 for one)
#   make gpu-wheels             wheels for a GPU machine without PyPI, for scripts/gpu_check.sh (CONTRIBUTING.md)
#   make test-vllm              kvlab's allocator side by side with the real vLLM 0.33.0 (tests/vllm/, a second venv)
#   make test-mutants           the mutation suite: each hand-written bug applied alone to a copy of kvlab, the
#                               notebooks and tests run on it (MUTANTS_ARGS="--only no_rescale", "--list", "--jobs 1")
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= 2.13.0
PORT   ?= 8888
IP     ?= 127.0.0.1
PYTEST_ARGS ?=
# make test runs test files in parallel, one file (and so one notebook's cells) per worker: JOBS=1 for one process.
JOBS   ?= auto
# torch's threads per test process (and per notebook kernel, which inherits it): the workers already fill every
# core, and torch's default of one thread per core on top of them made the engine tests use ~35 % more CPU.
TEST_THREADS ?= 1
NB     ?=
VOILA_ARGS ?=
CHROMIUM ?= $(or $(KVLAB_CHROMIUM),/usr/bin/chromium)
# The GPU machine's Python (this workplace's H200 image has 3.12) and what it lacks for the engine tests.
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEELS ?= cbor2
# make test-vllm: a second environment that sees .venv's packages (torch CPU, the editable kvlab) through a .pth
# file, plus vLLM with --no-deps and only the light pure-Python packages its allocator path imports. Each was
# checked with `pip install --dry-run`: none pulls torch or a CUDA package (einops: vLLM's Scheduler imports it,
# for the scheduler twin). VLLM_ARGS go to pytest.
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.33.0
VLLM_LIGHT ?= msgspec aiohttp oss-harmony openai pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo \
	"fastapi<0.137" partial-json-parser "llguidance<1.8" einops
VLLM_NO_DEPS ?= xgrammar==0.2.8 apache-tvm-ffi
VLLM_ARGS ?=
# make test-mutants: arguments for scripts/mutation.py (--only NAME..., --list, --jobs N, --baseline, --keep).
MUTANTS_ARGS ?=

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
BIN := $(VENV)/bin
# Jupyter refuses to run as root unless told to (containers, CI machines).
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)
# pip on some machines warns about every unreachable local index entry; keep the log readable.
QUIET_PIP := 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }
# The stamp is keyed on pyproject.toml and the torch choice: a second run installs nothing.
STAMP := $(VENV)/.kvlab-$(shell cat pyproject.toml 2>/dev/null | cksum | cut -d' ' -f1)-torch$(TORCH)

.PHONY: venv lab test test-solutions test-long test-vllm test-mutants bench lint strip clean-venv present html gpu-wheels

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
	$(BIN)/jupyter lab --no-browser --ip=$(IP) --port=$(PORT) --ServerApp.root_dir=notebooks $(ROOT_FLAG)

test: $(STAMP)
	@test -x "$(CHROMIUM)" || echo "NOTE: no Chromium at $(CHROMIUM): the browser tests (marker ui) will be skipped; apt-get install chromium to run them."
	OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest $(if $(filter-out 1,$(JOBS)),-n $(JOBS) --dist loadfile) $(PYTEST_ARGS)

# The vLLM environment is stamped like .venv. A failed download says so loudly and skips (exit 0), as CI wants:
# the recipe is one shell, so that the skip ends it.
# keyed on the version and the package lists too, so that a package added to VLLM_LIGHT reaches an existing venv
VLLM_STAMP := $(VLLM_VENV)/.vllm-$(VLLM_VERSION)-$(shell echo '$(VLLM_LIGHT) $(VLLM_NO_DEPS)' | cksum | cut -d' ' -f1)
VPY := $(VLLM_VENV)/bin/python
$(VLLM_STAMP): $(STAMP)
	@set -e; rm -rf $(VLLM_VENV); $(BIN)/python -m venv --without-pip $(VLLM_VENV); \
	site="$$($(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
	base="$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
	echo "import site; site.addsitedir('$$base')" > "$$site/kvlab-base-venv.pth"; \
	echo "Downloading vllm==$(VLLM_VERSION) (no dependencies) from PyPI"; \
	if ! $(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: -d $(VLLM_VENV)/wheels \
			"vllm==$(VLLM_VERSION)" $(QUIET_PIP) || ! ls $(VLLM_VENV)/wheels/vllm-*.whl >/dev/null 2>&1; then \
		echo "WARNING: ****************************************************************************"; \
		echo "WARNING: could not download vllm==$(VLLM_VERSION); make test-vllm SKIPS the comparison."; \
		echo "WARNING: ****************************************************************************"; \
		rm -rf $(VLLM_VENV); exit 0; fi; \
	echo "Installing vLLM (--no-deps) and the light packages its allocator imports into $(VLLM_VENV)"; \
	$(BIN)/python -m pip --python $(VPY) install --quiet --no-warn-conflicts --no-deps \
		$(VLLM_VENV)/wheels/vllm-*.whl $(VLLM_NO_DEPS) $(QUIET_PIP); \
	$(BIN)/python -m pip --python $(VPY) install --quiet --no-warn-conflicts $(VLLM_LIGHT) $(QUIET_PIP); \
	$(VPY) -c "import torch, kvlab, vllm.v1.core.kv_cache_manager; \
		assert '$(TORCH)' in ('', torch.__version__.split('+')[0]), 'pulled torch ' + torch.__version__" \
		|| { echo "the vLLM environment does not import (or pulled another torch)"; exit 1; }; \
	rm -rf $(VLLM_VENV)/wheels; touch $@

test-vllm: $(VLLM_STAMP)
	@if [ ! -x $(VPY) ]; then echo "SKIPPED: vllm==$(VLLM_VERSION) is not installed (see the warning above)"; \
	else $(VPY) -m pytest tests/vllm -p no:cacheprovider $(VLLM_ARGS); fi

test-mutants: $(STAMP)
	$(BIN)/python scripts/mutation.py $(MUTANTS_ARGS)

test-solutions: $(STAMP)
	$(BIN)/python -m pytest tests/test_notebook_solutions.py --solutions $(PYTEST_ARGS)

test-long: $(STAMP)
	HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest tests $(PYTEST_ARGS)

bench: $(STAMP)
	@for f in benchmarks/bench_*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

lint: $(STAMP)
	$(BIN)/ruff check kvlab kernels tests notebooks scripts benchmarks
	$(BIN)/python scripts/check_layers.py

strip: $(STAMP)
	$(BIN)/python scripts/strip_notebooks.py

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)

present: $(STAMP)
	@nb="$$(ls notebooks/$(or $(NB),none)_*.ipynb 2>/dev/null | head -1)"; \
	if [ -z "$$nb" ]; then echo "Usage: make present NB=02  (one of: $$(ls notebooks | sed -n 's/^\([0-9][0-9]\)_.*ipynb$$/\1/p' | tr '\n' ' '))"; exit 2; fi; \
	echo "Presenting $$nb with Voila (widgets and text, code hidden); open the URL printed below."; \
	$(BIN)/voila "$$nb" --no-browser --Voila.ip=$(IP) --port=$(PORT) --token --show_tracebacks=True $(VOILA_ARGS)

html: $(STAMP)
	$(BIN)/python scripts/export_html.py $(if $(NB),$(wildcard notebooks/$(NB)_*.ipynb))

gpu-wheels:
	@rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS) $(QUIET_PIP)
	@ls .whl
