"""The planner's byte counts follow the wire-format table (moved from tests/dist/test_wire_format.py, whose
toy 16-bit format it uses)."""

from megatron_gift.comm.layout import wire_bytes
from megatron_gift.config import Mode
from megatron_gift.numerics.fp8 import CodecConfig
from megatron_gift_tools.planner.buckets import buckets, param_bytes
from megatron_gift_tools.planner.choices import FP8Params
from megatron_gift_tools.planner.schemes import Scheme
from megatron_gift_tools.planner.workloads import workload
from tests.dist.test_wire_format import CODEC


def test_telemetry_and_planner_bytes():
    """The one per-mode count (``comm.layout.wire_bytes``) and the planner's follow the format: a
    [3, 300] gradient is 1800 code bytes + 9 FP32 block scales; a workload's buckets cost one byte more
    per element than with E4M3 (catches a planner that keeps one byte per element)."""
    assert wire_bytes(Mode.EUCLIDEAN, 3, 300, CODEC, 4) == 1800 + 36
    assert wire_bytes(Mode.GIFT, 3, 300, CodecConfig("e4m3"), 4) == 900 + 36
    assert (wire_bytes(Mode.BF16, 3, 300, CODEC, 4), wire_bytes(Mode.OFF, 3, 300, CODEC, 4)) == (1800, 3600)
    assert param_bytes(Scheme.EUCLIDEAN, "layers.0.fc2", (3, 300), FP8Params.ALL, CODEC) == 1836
    w = workload("600m")
    toy, e4m3 = buckets(w, Scheme.EUCLIDEAN, 64, codec=CODEC), buckets(w, Scheme.EUCLIDEAN, 64)
    assert sum(b.wire_bytes for b in toy) - sum(b.wire_bytes for b in e4m3) == sum(b.elements for b in e4m3)
    assert sum(b.intra_bytes["fp8"] for b in toy) == sum(b.wire_bytes for b in toy)
