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

# The numeric tests under the other x86-64 kernel sets torch picks from: every test that
# holds an engine's floats to a reference's within a tolerance (parity with one device or
# the plain loop, precision, clipping, resharded checkpoints, recompute, ties, ...), whose
# tolerances are derived to hold on any of them (about an hour per kernel set on a loaded
# 2-core machine). tests/test_tp.py belongs here once it has passed under both.
NUMERIC_TESTS := tests/test_parity_dp.py tests/test_parity_zero.py tests/test_parity_pipeline.py \
	tests/test_precision.py tests/test_ps_precision.py tests/test_zero.py \
	tests/test_loss_reduction.py tests/test_ps_parity.py tests/test_zero_param_groups.py \
	tests/test_clipping.py tests/test_checkpoint_resharding.py tests/test_sync_batchnorm.py \
	tests/test_recompute_dp.py tests/test_recompute_zero.py tests/test_recompute_pipeline.py \
	tests/test_pipeline_split_points.py tests/test_hf_models.py tests/test_zero_units.py \
	tests/test_zero3_branches.py tests/test_ps_clipping.py tests/test_buffer_broadcast.py \
	tests/test_grad_buckets.py tests/test_param_groups.py tests/test_fused_optim.py \
	tests/test_unused_parameters.py tests/test_ties.py tests/test_inputs.py \
	tests/test_replica_rng.py tests/test_epochs_accuracy.py tests/test_resume.py \
	tests/test_ps_units.py tests/test_ps_backup.py tests/test_ps_checkpoint.py \
	tests/test_engine_contract.py tests/test_models.py tests/test_pipeline.py \
	tests/test_tp.py tests/test_tensor_compose.py tests/test_planner.py
test-isa: install
	ATEN_CPU_CAPABILITY=avx2 $(RUN_PYTHON) -m pytest -q $(NUMERIC_TESTS)
	ATEN_CPU_CAPABILITY=default $(RUN_PYTHON) -m pytest -q $(NUMERIC_TESTS)

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
