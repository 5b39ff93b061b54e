"""Test support for the runtime: multi-rank spawning, dispatch probes, reference models, shapes and datasets.

``run_on_ranks`` and ``RankError`` load ``testing.spawn`` (and with it the CPU harness) on first use, so the
light modules (``dense``, ``shapes``, ``indexed_data``) that the tools import bring in no Megatron.
"""

__all__ = ["RankError", "run_on_ranks"]


def __getattr__(name: str):
    if name in __all__:
        from megatron_gift.testing import spawn

        return getattr(spawn, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
