"""Test tiers: pure logic, gloo worker processes on CPU, and GPU tests behind a marker; and
the quick tier `make test-fast` runs (`pytest -m fast`), chosen here in one list."""

from __future__ import annotations

import pytest
import torch

FAST_FILES = (
    # contracts, options, the layout rules, configuration and command-line parsing
    "tests/test_architecture.py",
    "tests/test_docs.py",
    "tests/test_fast_tier.py",
    "tests/test_engine_contract.py",
    "tests/test_strategy_declarations.py",
    "tests/test_config.py",
    "tests/test_cli_help.py",
    "tests/test_cli_pairings.py",
    "tests/test_cli_preflight.py",
    "tests/test_cli_train.py",
    "tests/test_resume_config.py",
    "tests/test_memory_budget.py",
    # planner arithmetic, schedules, partitioning, the ledger, the engines' pure parts
    "tests/test_planner.py",
    "tests/test_schedules.py",
    "tests/test_partition.py",
    "tests/test_ledger.py",
    "tests/test_zero.py",
    "tests/test_zero_units.py",
    "tests/test_ps_units.py",
    "tests/test_ps_stale_lr.py",
    "tests/test_tp.py",
    "tests/test_tensor_compose.py",
    "tests/test_pipeline.py",
    # checkpoints, data, models, reports
    "tests/test_checkpoint.py",
    "tests/test_foreign_checkpoints.py",
    "tests/test_data_download.py",
    "tests/test_data_errors.py",
    "tests/test_data_fashion_mnist.py",
    "tests/test_data_loader.py",
    "tests/test_data_registry.py",
    "tests/test_data_shakespeare.py",
    "tests/test_data_synthetic.py",
    "tests/test_models.py",
    "tests/test_timeline.py",
)
"""Files whose tests not marked slow are in the quick tier, but for NOT_FAST."""

FAST_TESTS = (
    # one parity case per engine: single against the plain loop, then each strategy against
    # single (zero's case covers zero1, zero2 and zero3 in one launch)
    "tests/test_parity_dp.py::test_single_engine_equals_hand_written_loop",
    "tests/test_parity_dp.py::test_dp_matches_single_device[2]",
    "tests/test_parity_zero.py::test_zero_stages_match_single_device[2]",
    "tests/test_parity_pipeline.py::test_pipeline_matches_single_device[2]",
    "tests/test_tp.py::test_tp_equals_one_device_and_all_reduces_once_per_pair[2]",
    "tests/test_ps_parity.py::test_synchronous_ps_reports_the_global_batch_loss_on_every_worker[2]",
)
"""Tests in the quick tier whatever their markers (a name without [...] takes every case)."""

NOT_FAST = (
    # whole training runs or worker launches, each 6-60 s on a loaded 2-core machine;
    # `make test` runs them
    "tests/test_cli_pairings.py::test_an_accepted_pairing_trains_and_prints_its_summary",
    "tests/test_cli_train.py::test_single_strategy_on_one_device",
    "tests/test_cli_preflight.py::test_more_cpu_workers_than_cores_warn_once_that_they_time_share",
    "tests/test_foreign_checkpoints.py::test_an_imported_checkpoint_resumes_under_any_strategy",
    "tests/test_models.py::test_tiny_gpt_overfits_one_batch",
    "tests/test_data_synthetic.py::test_images_are_learnable_and_shaped",
    "tests/test_data_synthetic.py::test_classification_is_learnable_and_seeds_share_the_teacher",
    "tests/test_data_errors.py::test_the_printed_command_places_the_file_where_the_next_run_finds_it",
)
"""Tests of FAST_FILES left out of the quick tier for their time."""


def _names(nodeid: str, entries: tuple[str, ...]) -> bool:
    """Whether ``nodeid`` is one of ``entries`` or a case of one."""
    return any(nodeid == entry or nodeid.startswith(entry + "[") for entry in entries)


def is_fast(item: pytest.Item) -> bool:
    if _names(item.nodeid, FAST_TESTS):
        return True
    in_fast_file = item.nodeid.split("::")[0] in FAST_FILES
    slow = "slow" in item.keywords or "gpu" in item.keywords
    return in_fast_file and not slow and not _names(item.nodeid, NOT_FAST)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_fast(item):
            item.add_marker(pytest.mark.fast)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
