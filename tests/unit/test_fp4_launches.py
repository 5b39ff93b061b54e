"""The four-bit exchange's ops per bucket (``comm.fp4_reduce``) grow with neither the data-parallel size
nor the bucket size: the sender's encode and placement, and the receiver's decode and sum, counted
as dispatched ATen ops (the PyTorch path: every op a launch on a GPU) at 2 and 8 ranks and at 64K and
1M elements. No process group: a stand-in reports the group's size and rank, and the all-to-all is
not run."""

import pytest
import torch

from megatron_gift.comm import fp4_reduce
from megatron_gift.comm.fp4_reduce import FP4Reduce
from megatron_gift.comm.layout import BucketLayout, Segment
from megatron_gift.comm.schedule import StageResult
from megatron_gift.config import Mode
from megatron_gift.numerics import CodecConfig
from megatron_gift.numerics.fp4 import FP4_FORMATS
from megatron_gift.testing.dispatch import OpCounter
from tests.dist.test_comm import _transforms


class _Group:
    def __init__(self, world):
        self.world = world

    def size(self):
        return self.world

    def rank(self):
        return 0


def _reduction(elements: int, world: int, fmt: str) -> FP4Reduce:
    """A flat FP4 reduction on rank 0 of ``world`` of a bucket of about ``elements`` (GIFT, plain,
    Euclidean and GIFT parameters, every shard boundary on a 64-element block)."""
    rows = elements // (4 * 512)
    segments = [
        Segment(0, rows, 512, Mode.GIFT, "a"),
        Segment(rows * 512, 1, 512, Mode.OFF, "norm"),
        Segment(rows * 512 + 512, rows, 512, Mode.EUCLIDEAN, "b"),
        Segment(2 * rows * 512 + 512, 2 * rows, 512, Mode.GIFT, "c"),
    ]
    numel = -(-segments[-1].end // (64 * world)) * 64 * world
    layout = BucketLayout(numel, world, segments, CodecConfig(), torch.float32)
    layout.check_blocks(64, "test")
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(world))
    ts = _transforms(segments)
    return FP4Reduce(flat, layout, _Group(world), ts, FP4_FORMATS[fmt], average=True)


def _counts(monkeypatch, elements: int, world: int, fmt: str) -> tuple[int, int]:
    """``(ops of the send stage, ops of the own shard's decode and sum)``, each the second run (the
    first builds the layout's plans)."""
    monkeypatch.setattr(fp4_reduce.dist, "all_to_all_single", lambda *a, **k: None)
    red = _reduction(elements, world, fmt)
    counts = []
    for stage in ("send", "decode"):
        for _ in range(2):
            if stage == "send":
                with OpCounter() as ops:
                    sent = red._send(StageResult())
            else:
                m = red.msgs[0]  # every sender's message for the own shard: the own one, as sent
                msgs = sent.buf[sent.buf.numel() - m.nbytes :].view(1, -1).expand(world, -1).contiguous()
                with OpCounter() as ops:
                    total = red._decoded_sum(msgs, red.layout.shards[0].n_coded, m)
                assert total is not None and total.numel() == red.layout.shards[0].n_coded
        counts.append(ops.total)
    return tuple(counts)


@pytest.mark.parametrize("fmt", sorted(FP4_FORMATS))
def test_fp4_ops_do_not_grow(fmt, monkeypatch):
    """The same op counts for buckets of 64K and 1M elements at 2 and 8 ranks, for the sender (one
    encode of the whole bucket, each section placed by one index per table) and the receiver (the
    senders' messages decoded as one sequence). Bug caught: a loop over the messages (one encode
    or decode per peer: a launch count that grows with the data-parallel size)."""
    counts = {(e, w): _counts(monkeypatch, e, w, fmt) for e in (1 << 16, 1 << 20) for w in (2, 8)}
    print(fmt, counts)
    assert len(set(counts.values())) == 1, counts


@pytest.mark.parametrize("rotation", [None, "hadamard"])
@pytest.mark.parametrize("fmt", sorted(FP4_FORMATS))
def test_fp4_node_sums_ops_do_not_grow(fmt, rotation, monkeypatch):
    """The two-level exchange's inter-node stage (the held shards' node sums, rotated, encoded once and
    placed into one message per node) takes the same ops at 2 and 4 nodes of 2 ranks, for 64K and 1M
    elements. Bugs caught: one encode per node's message; the rotation one call per held shard part
    (``--gift-rotation hadamard``; one held shard per node)."""
    from megatron_gift.comm import hierarchical
    from megatron_gift.comm.fp4_reduce import FP4TwoLevelReduce
    from megatron_gift.comm.topology import Topology, TwoLevelGroups
    from megatron_gift.config import IntraNode
    from megatron_gift.numerics.rotation import BlockHadamard

    for module in (fp4_reduce, hierarchical):
        monkeypatch.setattr(module.dist, "all_to_all_single", lambda *a, **k: None)
    counts = {}
    for elements in (1 << 16, 1 << 20):
        for nodes in (2, 4):
            flat_red = _reduction(elements, 2 * nodes, fmt)
            groups = TwoLevelGroups(_Group(2 * nodes), Topology(nodes, 2))
            red = FP4TwoLevelReduce(
                flat_red.flat,
                flat_red.layout,
                groups,
                flat_red.transforms,
                FP4_FORMATS[fmt],
                IntraNode.FP32,
                rotation=BlockHadamard(64, 3) if rotation else None,
            )
            for _ in range(2):  # the second run: the first builds the layout's plans
                sent = red._intra(StageResult())
                with OpCounter() as ops:
                    red._node_sums(sent)
            counts[(elements, nodes)] = ops.total
    print(fmt, rotation, counts)
    assert len(set(counts.values())) == 1, counts


def test_kernel_sender_input_holds_the_gift_values_alone():
    """Where the kernels encode (``FP4Reduce._coded_values``), the sender's FP32 input holds ``G T`` of the
    GIFT parameters one after another and nothing of the Euclidean ones, which the encode reads in the
    bucket (a packed ``Source``): here the two GIFT parameters' elements, each its whitening of its
    gradient. Catches the input laid out up to the last GIFT parameter's position in the coded sequence
    (4 B per element of every coded parameter before it, Euclidean ones included)."""
    red = _reduction(1 << 16, 2, "nvfp4")
    layout, flat = red.layout, red.flat
    u, source = red._coded_values()
    gift = [i for i in layout.coded_segments if red.transforms[i] is not None]
    elements = sum(layout.segments[i].end - layout.segments[i].start for i in gift)
    assert source is not None and source.own == u.numel() == elements
    at = 0
    for i in gift:
        s = layout.segments[i]
        want = red.transforms[i].apply(flat[s.start : s.end].view(s.rows, s.cols)).reshape(-1)
        assert torch.equal(u[at : at + want.numel()], want)
        at += want.numel()
