"""Shared pytest set-up: markers that skip, with the reason, the tests a machine cannot run.

- ``gpu``: needs CUDA; skipped where ``torch.cuda.is_available()`` is false.
- ``cpu_harness``: runs Megatron-Core on CPU/gloo ranks through ``megatron_gift.megatron.cpu_harness``
  (directly or by the ``--gift-cpu`` launcher), which refuses where CUDA is available (Megatron
  would take its CUDA paths with CPU tensors); skipped there. The ``gpu`` tests cover that machine.
  A test (or the fixtures it sets up) that starts the harness without the marker fails, on any
  machine: ``cpu_harness.check_host``, which the harness's entry points call first, fails it.
- Under Triton's interpreter (the kernel tests' own runs, and ranks a test spawns with ``TRITON_INTERPRET=1``)
  every kernel specialisation launched must be in ``bench/results/kernel-specs.json``, the list the offline
  sm_90a compile report compiles.
"""

import os
from pathlib import Path

import pytest
import torch

from megatron_gift.megatron import cpu_harness
from megatron_gift.testing import kernel_log

ROOT = Path(__file__).resolve().parents[1]
_SPECS = pytest.StashKey[tuple]()

_CHECK_HOST = cpu_harness.check_host

SKIP_REASONS = {
    "gpu": (False, "needs CUDA (torch.cuda.is_available() is false)"),
    "cpu_harness": (True, "runs Megatron-Core through the CPU harness, which refuses where CUDA is available"),
}  # marker -> (skip when CUDA is available, reason)


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_harness: " + SKIP_REASONS["cpu_harness"][1] + " (skipped there)")
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernel tests' run: note what each launch specialises
        recording = kernel_log.launched_specialisations()
        config.stash[_SPECS] = (recording, recording.__enter__())


def pytest_sessionfinish(session, exitstatus):
    """Under the interpreter (this session's or its spawned ranks'): with ``GIFT_KERNEL_SPECS`` set, add the
    launched specialisations to that JSON; else fail the session if one is missing from the committed list,
    which the offline sm_90a compile report (``bench/compile.py``) compiles: a kernel variant the report has
    never compiled (issue 35)."""
    seen = set(kernel_log.SPAWNED)  # launched by interpreted ranks (testing.spawn), in any session
    if _SPECS in session.config.stash:
        recording, here = session.config.stash[_SPECS]
        recording.__exit__(None, None, None)
        seen |= here
    if not seen:
        return
    out = os.environ.get(kernel_log.SPECS_ENV)
    if out:
        kernel_log.save_specs(out, kernel_log.load_specs(out) | seen)
        return
    missing = seen - kernel_log.load_specs(str(ROOT / kernel_log.SPECS))
    if missing:
        print(f"\n{len(missing)} kernel specialisation(s) launched here are not in {kernel_log.SPECS}: record them")
        print(f"({kernel_log.SPECS_ENV}={kernel_log.SPECS} with the tests that launched them: the kernel tests")
        print("under TRITON_INTERPRET=1, the tests whose ranks run them so, in an ordinary session) and")
        print("recompile the report (python -m megatron_gift_tools.bench.compile):")
        for m, k, c, f in sorted(missing):
            print(f"  {m}.{k} {c} fusion={f}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
