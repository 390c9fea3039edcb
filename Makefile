# paratrain: the two quick-start commands (`make train`, `make test`) and their helpers.
# Each target installs what it needs first: PyTorch where torch is missing (pinned; where
# the machine offers a CPU build, as here, pip takes it; TORCH_INDEX= names an index to
# take it from, e.g. https://download.pytorch.org/whl/cpu, since a plain `torch`
# requirement from PyPI pulls several GB of CUDA packages), then paratrain itself in
# editable mode with its test tools.
#
# Which Python installs and runs: an active virtual environment's or conda environment's
# as it is; any other (a distribution's own, which PEP 668 marks externally managed, or a
# pyenv build) gets a virtual environment in the project, $(VENV), made once with
# `$(PYTHON) -m venv` and reused on later runs.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
DEVICES ?=
STEPS ?= 1000
PYTEST_ARGS ?=
DATA_DIR ?= $(wildcard ../shared/data)
DATA_FLAG := $(if $(DATA_DIR),--data-dir $(DATA_DIR),)
DEVICES_FLAG := $(if $(DEVICES),--devices $(DEVICES),)
IN_ENV := $(shell $(PYTHON) -c "import os, sys; \
	print(int(sys.prefix != sys.base_prefix or os.environ.get('CONDA_PREFIX') == sys.prefix))" \
	2>/dev/null)
RUN_PYTHON := $(if $(filter 1,$(IN_ENV)),$(PYTHON),$(VENV)/bin/python)
ENV_TARGET := $(if $(filter 1,$(IN_ENV)),,$(VENV)/bin/python)
TORCH_INDEX_FLAG := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)

.PHONY: install train test test-fast test-isa lint bench clean distclean

# A failed `venv` (Debian without python3-venv says which package to add) leaves no
# half-made environment behind to be reused.
$(VENV)/bin/python:
	@echo "$(PYTHON) is no virtual environment: making one in $(VENV) (reused on later runs)"
	@$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }

# Reinstalls when the importable paratrain is another checkout's (an editable install
# left by a different clone would otherwise be what the tests import).
install: $(ENV_TARGET)
	@$(RUN_PYTHON) -c "import torch" 2>/dev/null || \
		$(RUN_PYTHON) -m pip install -q $(TORCH_INDEX_FLAG) $(TORCH_SPEC)
	@$(RUN_PYTHON) -c "import os, sys, pytest, ruff, matplotlib, transformers, tensorboard, paratrain; \
		sys.exit(os.path.realpath(paratrain.__file__) != os.path.realpath('src/paratrain/__init__.py'))" \
		2>/dev/null || $(RUN_PYTHON) -m pip install -q -e ".[dev]"

train: install
	$(RUN_PYTHON) -m paratrain train --model gpt --dataset shakespeare --strategy dp \
		--steps $(STEPS) --global-batch 32 --eval-every 200 $(DEVICES_FLAG) $(DATA_FLAG)

test: install
	$(RUN_PYTHON) -m pytest -q --durations=25 $(PYTEST_ARGS)

# The quick tier (tests marked fast, listed in tests/conftest.py): the pure-logic tests and
# one parity case per engine, a few minutes on 2 cores; `make test` stays the whole suite.
test-fast: install
	$(RUN_PYTHON) -m pytest -q -m fast $(PYTEST_ARGS)

# The whole suite again under the other x86-64 kernel sets torch picks from (AVX2, and
# the default set of CPUs with neither): every tolerance in it is derived to hold on any
# of them, not tuned to this machine's AVX-512. The whole suite, not a list of the numeric
# files: such a list fell behind the tests added after it (the pipeline schedules', tensor
# parallel on real models', elastic data parallel's).
test-isa: install
	ATEN_CPU_CAPABILITY=avx2 $(RUN_PYTHON) -m pytest -q $(PYTEST_ARGS)
	ATEN_CPU_CAPABILITY=default $(RUN_PYTHON) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(RUN_PYTHON) -m ruff check src tests benchmarks
	$(RUN_PYTHON) -m ruff format --check src tests benchmarks

bench: install
	$(RUN_PYTHON) benchmarks/bench_dp.py
	$(RUN_PYTHON) benchmarks/bench_pipeline.py
	$(RUN_PYTHON) benchmarks/bench_zero.py
	$(RUN_PYTHON) benchmarks/bench_ps.py
	$(RUN_PYTHON) benchmarks/stale_adam.py
	$(RUN_PYTHON) benchmarks/bench_memory.py
	$(RUN_PYTHON) benchmarks/largest_gpt.py
	$(RUN_PYTHON) benchmarks/launch_start.py

# Leaves the project's virtual environment (a reinstall takes minutes); distclean removes it.
clean:
	rm -rf runs .pytest_cache .ruff_cache build src/*.egg-info
	@if [ -d $(VENV) ]; then echo "kept $(VENV); remove it with: make distclean (or rm -rf $(VENV))"; fi

distclean: clean
	rm -rf $(VENV)
