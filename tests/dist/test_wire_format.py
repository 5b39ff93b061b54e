"""The wire-format table (``numerics.wire``): a format defined here, 16 bits per element, needs only its
entry; the codec, the bucket layouts, message packing, the ledger, the telemetry's and the planner's byte
counts (tests/tools/test_wire_format_planner.py) follow it, the kernel gate refuses it, and a 2-rank gloo
``QuantizedReduce`` with it lands within its error bound of an FP32 reduction computed by hand.

The toy is IEEE half precision (E5M10) as a wire format: its codes are torch's float16 bits, so its codec
is the table's cast codec. 16 bits rather than 4 packed two per byte: messages address coded values element
by element and a shard may start at any element (module doc of ``numerics.wire``).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_gift import kernels
from megatron_gift.comm.layout import BucketLayout, Segment
from megatron_gift.comm.ledger import CommLedger
from megatron_gift.comm.packing import packing
from megatron_gift.comm.quantized import QuantizedReduce
from megatron_gift.comm.schedule import reduce_now
from megatron_gift.config import Mode
from megatron_gift.numerics import fp8
from megatron_gift.numerics.fp8 import CodecConfig, Scaling
from megatron_gift.numerics.wire import WireFormat
from megatron_gift.testing import run_on_ranks
from tests.reference import fp8_roundtrip

TOY = WireFormat(
    "toy-e5m10",
    bits=16,
    exponent_bias=15,
    mantissa_bits=10,
    max=65504.0,
    nan_code=0x7E00,
    has_inf=True,
    dtype=torch.float16,
    label="toy16",
)
CODEC = CodecConfig(TOY, Scaling.BLOCK)

# 2 shards of 300: shard 0 holds a (2 groups), the BF16 bias, c's first 4 elements (a group cut at 300);
# shard 1 the rest of c (3 groups: 96, 100, 100) and the off-mode norm.
NUMEL = 600
SEGMENTS = [
    Segment(0, 2, 128, Mode.EUCLIDEAN, "a"),
    Segment(256, 1, 40, Mode.BF16, "bias"),
    Segment(296, 3, 100, Mode.EUCLIDEAN, "c"),
    Segment(596, 1, 4, Mode.OFF, "norm"),
]
# Hand-counted messages [scales | off | bf16 | codes], each section padded to 4 bytes:
# shard 0: 3 FP32 scales (12) + 40 BF16 (80) + 260 codes x 2 B (520) = 612
# shard 1: 3 scales (12) + 4 FP32 (16) + 296 codes x 2 B (592) = 620
SHARD_BYTES = [612, 620]
CODED = [(0, 256), (296, 596)]


def _grads(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(20 + rank)
    return torch.randn(NUMEL, generator=gen) * torch.logspace(-2, 2, NUMEL)


def test_codec_follows_the_entry():
    """Codes are 2 bytes, the round trip is bit for bit the independent one through torch's float16 cast,
    non-finite inputs survive, and the byte count is 2 per element plus the scales (catches a codec that
    still casts through FP8 or sizes payloads at one byte per element)."""
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 300)
    enc = fp8.encode(x, CODEC)
    assert enc.payload.dtype == torch.int16 and enc.payload.shape == (5, 300)
    assert torch.equal(fp8.decode(enc, CODEC), fp8_roundtrip(x, torch.float16, 128))
    assert enc.nbytes == CODEC.encoded_bytes(5, 300) == 2 * 1500 + 4 * 5 * 3
    special = fp8.roundtrip(torch.tensor([[1.0, float("inf"), float("nan"), -float("inf")]]), CODEC)
    assert special[0, 1] == float("inf") and special[0, 2].isnan() and special[0, 3] == -float("inf")


def test_layout_and_packing_bytes():
    """Shard plans, messages and the placement of codes in a send buffer at 2 bytes per code, against
    the hand counts above; E4M3's counts alongside (one byte per code) stay what they were."""
    layout = BucketLayout(NUMEL, 2, SEGMENTS, CODEC, torch.float32)
    assert [p.payload_bytes for p in layout.shards] == [520, 592]
    assert [p.message_bytes for p in layout.shards] == SHARD_BYTES == [layout.message([j]).nbytes for j in (0, 1)]
    both = layout.message([0, 1])  # 6 scales (24) + 4 FP32 (16) + 40 BF16 (80) + 556 codes (1112)
    assert (both.coded_at, both.nbytes) == (120, 1232)
    assert layout.max_message_bytes == 620
    e4m3 = BucketLayout(NUMEL, 2, SEGMENTS, CodecConfig("e4m3", "block"), torch.float32)
    assert [p.message_bytes for p in e4m3.shards] == [12 + 80 + 260, 12 + 16 + 296]

    # Rank 0's buffer: shard 1's message (to rank 1) at 0, its own at 620. Codes are int16 elements: shard
    # 0's first at (620 + 12 + 80) / 2, shard 1's first (source index 260) at (12 + 16) / 2.
    pk = packing(layout, [0, 1], [[1], [0]], None, "cpu")
    assert (pk.starts, pk.nbytes, pk.sent_bytes) == ((0, 620), 1232, 620)
    assert pk.place["coded"].index(259, 261).tolist() == [356 + 259, 14]


def test_kernel_gate_refuses_the_format(monkeypatch):
    """Where the Triton kernels would run, a format whose entry does not name them takes the reference
    (catches a gate that checks only the device and block size and runs FP8 kernels on 16-bit codes)."""

    def no_kernels():
        raise AssertionError("the fused kernels were called for a format they do not implement")

    monkeypatch.setattr(kernels, "available", lambda device: True)
    monkeypatch.setattr(kernels, "_fused", no_kernels)
    g = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    enc = kernels.whiten_encode(g, None, CODEC, fused=True)
    assert torch.equal(enc.payload, fp8.encode(g, CODEC).payload)
    total = kernels.decode_sum_unwhiten(
        torch.stack([enc.payload.view(-1)] * 2),
        torch.stack([enc.scales.view(-1)] * 2),
        4,
        256,
        None,
        CODEC,
        average=True,
        fused=True,
    )
    assert torch.equal(total, fp8.decode(enc, CODEC))
    assert not kernels.CodecOps.resolve(torch.device("cpu"), True, CODEC).fused


def test_triton_kernels_refuse_the_format():
    """Called directly, the Triton kernels raise for the format instead of writing FP8 codes."""
    pytest.importorskip("triton")
    from megatron_gift.kernels import fused

    with pytest.raises(ValueError, match="toy-e5m10"):
        fused.whiten_encode(torch.randn(2, 128), None, CODEC)


def _reduce_worker(rank, world):
    layout = BucketLayout(NUMEL, world, SEGMENTS, CODEC, torch.float32)
    out = {}
    for all_reduce in (False, True):
        flat, ledger = _grads(rank), CommLedger()
        reduce_now(
            QuantizedReduce(
                flat, layout, dist.group.WORLD, [None] * len(SEGMENTS), all_reduce=all_reduce, ledger=ledger
            ),
            "cpu",
        )
        out[all_reduce] = (flat, ledger.as_dict())
    return out


def test_two_rank_reduction_within_the_format_bound():
    """A 2-rank gloo reduce-scatter and all-reduce in the toy format against the FP32 sum by hand.

    Bound on a coded element, ranks r = 0, 1, group scale ``s_r = amax_r / 65504`` (FP32): ``x_r / s_r``
    rounds once in FP32 (2^-24), to float16 (2^-11 relative in the normal range, 2^-25 · s_r absolute in
    the subnormal one), ``q · s_r`` once more (2^-24), and the FP32 sum once (2^-24 of the sum):
    ``|r - (x_0 + x_1)| <= (2^-11 + 2^-21)(|x_0| + |x_1|) + 2^-24 (s_0 + s_1)`` (2^-21 covers the three
    FP32 roundings and second-order terms). The all-reduce encodes that sum once more: again
    ``(2^-11 + 2^-21)`` of it plus 2^-24 of its scale (E4M3's 2^-4 would miss it by far). Off values are
    the FP32 sum exactly, BF16 ones the FP32 sum of the BF16 values exactly (the all-reduce sends that sum
    in BF16 again); in the all-reduce every rank holds the same bits. The ledger counts the peer's message
    at 2 bytes per code under the entry's label.
    """
    results = run_on_ranks(_reduce_worker, 2, timeout=120)
    x0, x1 = _grads(0), _grads(1)
    ref = x0.double() + x1.double()
    mag = x0.double().abs() + x1.double().abs()
    s = (x0.abs().max() + x1.abs().max()).double() / 65504  # bounds s_0 + s_1
    tol_rs = 2.0**-11 * mag + 2.0**-21 * mag + 2.0**-24 * s
    tol_ar = tol_rs + (2.0**-11 + 2.0**-21) * (ref.abs() + tol_rs) + 2.0**-24 * (ref.abs().max() + tol_rs.max()) / 65504
    coded = torch.zeros(NUMEL, dtype=torch.bool)
    for a, b in CODED:
        coded[a:b] = True
    bf16_sum = (x0.bfloat16().float() + x1.bfloat16().float())[256:296]
    fp32 = (x0 + x1)[596:]
    for all_reduce, tol in ((False, tol_rs), (True, tol_ar)):
        bf16 = bf16_sum.bfloat16().float() if all_reduce else bf16_sum
        for rank, res in enumerate(results):
            flat, sent = res[all_reduce]
            lo, hi = (0, NUMEL) if all_reduce else (300 * rank, 300 * rank + 300)
            inside = torch.zeros(NUMEL, dtype=torch.bool)
            inside[lo:hi] = True
            err = (flat.double() - ref).abs()
            assert (err[coded & inside] <= tol[coded & inside]).all(), (
                all_reduce,
                rank,
                (err - tol)[coded & inside].max(),
            )
            if lo <= 256:
                assert torch.equal(flat[256:296], bf16), (all_reduce, rank)
            if hi >= NUMEL:
                assert torch.equal(flat[596:], fp32), (all_reduce, rank)
            want = {"all_to_all/toy16+scales": SHARD_BYTES[1 - rank]}
            if all_reduce:
                want["all_gather/toy16+scales"] = max(SHARD_BYTES)
            assert sent == want, (all_reduce, rank, sent)
    assert torch.equal(results[0][True][0], results[1][True][0])
