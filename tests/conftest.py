"""Shared pytest set-up: markers that skip, with the reason, the tests a machine cannot run.

- ``gpu``: needs CUDA; skipped where ``torch.cuda.is_available()`` is false.
- ``cpu_harness``: runs Megatron-Core on CPU/gloo ranks through ``megatron_gift.testing.cpu_harness``
  (directly or by the ``--gift-cpu`` launcher), which refuses where CUDA is available (Megatron
  would take its CUDA paths with CPU tensors); skipped there. The ``gpu`` tests cover that machine.
"""

import pytest
import torch

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
