"""Test support for the runtime: multi-rank spawning, dispatch probes, reference models."""

from megatron_gift.testing.spawn import RankError, run_on_ranks

__all__ = ["RankError", "run_on_ranks"]
