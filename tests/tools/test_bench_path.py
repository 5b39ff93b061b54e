"""``bench path``: the counts of one bucket's steady reduction, and no call up a layer on it."""

import pytest

from megatron_gift_tools.bench import path
from megatron_gift_tools.layering import layers

TABLE = [("megatron_gift.megatron",), ("megatron_gift.comm",), ("megatron_gift.numerics",)]


def test_summary_counts_by_hand():
    """Bug caught: a counter that misses a file switch, counts a function twice, or never flags a call
    up a layer (the numerics calling back into the adapter), so the path-length report stays flat."""
    calls = [  # (module, file, qualname, class, caller module)
        ("megatron_gift.megatron.ddp", "ddp.py", "DDP.sync", "DDP", "megatron.core"),
        ("megatron_gift.comm.quantized", "q.py", "Reduce.send", "Reduce", "megatron_gift.megatron.ddp"),
        ("megatron_gift.numerics.fp8", "fp8.py", "encode", None, "megatron_gift.comm.quantized"),
        ("megatron_gift.comm.quantized", "q.py", "Reduce.send", "Reduce", "megatron_gift.megatron.ddp"),
        ("megatron_gift.megatron.ddp", "ddp.py", "DDP.hook", "DDP", "megatron_gift.numerics.fp8"),
    ]
    got = path.summarize(calls, TABLE)
    assert (got["functions"], got["files"], got["calls"], got["file_switches"]) == (4, 3, 5, 4)
    assert got["types"] == ["DDP", "Reduce"]
    assert got["upward_calls"] == ["megatron_gift.numerics.fp8 -> megatron_gift.megatron.ddp.DDP.hook"]


@pytest.mark.cpu_harness
def test_a_steady_reduction_never_calls_up_a_layer():
    """Bug caught: a callback from the refresh, the reduction or a kernel back into the DDP on every step
    (the refresh asking the DDP for its layers at each sync), which makes the layers of
    docs/how-it-works.md false for calls as the import test keeps them true for imports."""
    from megatron_gift.testing import run_on_ranks

    per_rank = run_on_ranks(path._rank_main, 2, True, cpu_harness=True, timeout=600)
    assert all(r["upward_calls"] == [] for r in per_rank), [r["upward_calls"] for r in per_rank]
    assert per_rank[0]["functions"] > 0 and len(layers()) > 5
