"""Shared pytest set-up: markers that skip, with the reason, the tests a machine cannot run.

- ``gpu``: needs CUDA; skipped where ``torch.cuda.is_available()`` is false.
- ``cpu_harness``: runs Megatron-Core on CPU/gloo ranks through ``megatron_gift.megatron.cpu_harness``
  (directly or by the ``--gift-cpu`` launcher), which refuses where CUDA is available (Megatron
  would take its CUDA paths with CPU tensors); skipped there. The ``gpu`` tests cover that machine.
  A test (or the fixtures it sets up) that starts the harness without the marker fails, on any
  machine: ``cpu_harness.check_host``, which the harness's entry points call first, fails it.
"""

import pytest
import torch

from megatron_gift.megatron import cpu_harness

_CHECK_HOST = cpu_harness.check_host

SKIP_REASONS = {
    "gpu": (False, "needs CUDA (torch.cuda.is_available() is false)"),
    "cpu_harness": (True, "runs Megatron-Core through the CPU harness, which refuses where CUDA is available"),
}  # marker -> (skip when CUDA is available, reason)


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_harness: " + SKIP_REASONS["cpu_harness"][1] + " (skipped there)")


def pytest_collection_modifyitems(config, items):
    cuda = torch.cuda.is_available()
    for item in items:
        for marker, (skip_with_cuda, reason) in SKIP_REASONS.items():
            if marker in item.keywords and skip_with_cuda == cuda:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the item's fixtures: an unmarked test's use of the CPU harness fails it."""
    if "cpu_harness" in item.keywords:
        cpu_harness.check_host = _CHECK_HOST
        return

    def unmarked():
        pytest.fail(
            f"{item.nodeid} starts the CPU harness without @pytest.mark.cpu_harness "
            "(on a CUDA machine it would fail, not skip)"
        )

    cpu_harness.check_host = unmarked


def pytest_runtest_teardown(item):
    cpu_harness.check_host = _CHECK_HOST


@pytest.fixture(scope="session")
def launcher_runs(tmp_path_factory):
    """tests/launches.py: the launcher runs test_launcher, test_checkpoint and test_faults share."""
    from tests.launches import run_family

    return run_family(tmp_path_factory.mktemp("launches"))
