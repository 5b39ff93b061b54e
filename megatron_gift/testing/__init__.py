"""Test support: a CPU stand-in for Megatron-Core's CUDA-only calls and a multi-rank launcher."""

from megatron_gift.testing import cpu_harness
from megatron_gift.testing.spawn import RankError, run_on_ranks

__all__ = ["RankError", "cpu_harness", "run_on_ranks"]
