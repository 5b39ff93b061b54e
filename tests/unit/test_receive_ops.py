"""The receive stages' host work does not grow with the bucket or the data-parallel size: the ATen
ops dispatched and the Triton launches of the own shard's reduction, the all-reduce's own message,
the all-gathered decode and the two-level node sums are the same at 64K and 1M elements and at two
group sizes, on the PyTorch path and on the fused one (its kernels replaced by recording stubs, so
no interpreter is needed: the count is of the launches, not of their work). The stages run on
received bytes made up here, with fake groups; the collectives they start are stubbed."""

import importlib

import pytest
import torch
import torch.distributed as dist

from megatron_gift import kernels
from megatron_gift.comm import hierarchical, quantized
from megatron_gift.comm.hierarchical import intra_wire
from megatron_gift.comm.layout import BucketLayout, Segment
from megatron_gift.comm.packing import Received, packing
from megatron_gift.comm.schedule import StageResult
from megatron_gift.comm.topology import Topology, TwoLevelGroups
from megatron_gift.config import Mode
from megatron_gift.numerics.fp8 import CodecConfig
from megatron_gift.numerics.whitening import LowRankWhitening
from megatron_gift.testing.dispatch import OpCounter

COLS = 64  # a GIFT weight's row


class _Group:
    def __init__(self, world, rank):
        self._world, self._rank = world, rank

    def size(self):
        return self._world

    def rank(self):
        return self._rank


def _layout(shard: int, world: int) -> BucketLayout:
    """``world`` shards of ``shard`` elements, each (the last aside) holding the same parts: the end of
    the previous shard's GIFT weight (a cut row, whole rows), a small and a large Euclidean weight, an
    ``off`` norm, a ``bf16`` bias, and the start of its own GIFT weight (whole rows, a cut row)."""
    segs, head = [], shard // 2 + 10
    for j in range(world):
        base = j * shard
        pos = base + (200 if j else 0)
        rows = (shard // 2 - 400) // 100
        for name, n_rows, cols, mode in (
            ("e", 1, 100, Mode.EUCLIDEAN),
            ("n", 1, 50, Mode.OFF),
            ("b", 1, 30, Mode.BF16),
            ("E", rows, 100, Mode.EUCLIDEAN),
        ):
            segs.append(Segment(pos, n_rows, cols, mode, f"{name}{j}"))
            pos += -(-n_rows * cols // 4) * 4
        end = base + shard + 200 if j < world - 1 else base + shard
        segs.append(Segment(base + head, (end - base - head) // COLS, COLS, Mode.GIFT, f"g{j}"))
    return BucketLayout(world * shard, world, segs, CodecConfig(), torch.float32)


def _transforms(layout):
    gen = torch.Generator().manual_seed(0)
    out = []
    for s in layout.segments:
        x = torch.randn(4 * s.cols, s.cols, generator=gen)
        out.append(LowRankWhitening.from_statistics(x.T @ x / x.shape[0], 4) if s.mode is Mode.GIFT else None)
    return out


class _Stub:
    """A Triton kernel that records its launches and does nothing."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(self.name)


@pytest.fixture(params=[False, True], ids=["torch", "fused"])
def path(request, monkeypatch):
    """The path under count (``kernels`` setting) and the log of the fused kernels' launches."""
    for name in ("all_to_all_single", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, lambda *args, **kwargs: None)
    for module in (quantized, hierarchical):
        monkeypatch.setattr(module, "_all_gather", lambda *args, **kwargs: None)
    log = []
    if request.param:
        pytest.importorskip("triton")
        for name in ("fused", "receive"):
            module = importlib.import_module(f"megatron_gift.kernels.{name}")
            for kernel in [k for k in vars(module) if k.endswith("_kernel")]:
                monkeypatch.setattr(module, kernel, _Stub(kernel, log))
        monkeypatch.setattr(kernels, "available", lambda device: True)
    return request.param, log


def _count(run, log):
    """``(ATen ops, Triton launches)`` of ``run()`` once the layout's plans are built (a second call)."""
    run()
    log.clear()
    with OpCounter() as ops:
        run()
    return ops.total, len(log)


def _received(nbytes):
    """Received bytes: finite FP8 codes (the counts do not depend on them)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 0x70, (nbytes,), generator=gen, dtype=torch.uint8)


def _flat_stages(numel, world, fused, log, rank=1):
    layout = _layout(numel // world, world)
    ts = _transforms(layout)
    out = {}
    for all_reduce in (False, True):
        red = quantized.QuantizedReduce(
            torch.randn(layout.numel),
            layout,
            _Group(world, rank),
            ts,
            average=True,
            all_reduce=all_reduce,
            kernels=fused,
        )
        pk = packing(layout, list(range(world)), [[j] for j in range(world) if j != rank] + [[rank]], None, "cpu")
        recv, own = _received((world - 1) * pk.own.nbytes), _received(pk.own.nbytes)
        rows = lambda: Received(recv, own, rank, pk.own, world)  # noqa: E731
        if all_reduce:
            out["own message"] = _count(lambda: red._own_message(rows()), log)
        else:
            out["own shard"] = _count(lambda: red._reduce_own(rows()), log)
    return out


def _gathered_decode(numel, world, fused, log):
    """The same segments (those of ``_layout`` at 4 shards) cut into ``world`` shards."""
    segments = _layout(numel // 4, 4).segments
    layout = BucketLayout(numel, world, segments, CodecConfig(), torch.float32)
    ts, flat = _transforms(layout), torch.zeros(numel)
    gathered = _received(world * layout.max_message_bytes)
    slots = list(range(world))
    return {
        "gathered decode": _count(
            lambda: quantized.decode_gathered(gathered, layout, ts, flat, slots, kernels.CodecOps(fused)), log
        )
    }


def _node_sums(numel, nodes, per_node, fused, log, rank=1):
    world = nodes * per_node
    layout = _layout(numel // world, world)
    topo = Topology(nodes, per_node)
    groups = TwoLevelGroups(_Group(world, rank), topo)
    local = topo.local(rank)
    messages = [topo.inter_ranks(lp) for lp in range(per_node) if lp != local] + [topo.inter_ranks(rank)]
    out = {}
    for intra in ("bf16", "fp8"):
        red = hierarchical.TwoLevelReduce(
            torch.randn(layout.numel), layout, groups, _transforms(layout), intra=intra, average=True, kernels=fused
        )
        pk = packing(layout, list(range(world)), messages, intra_wire(intra, torch.float32), "cpu")
        buf, recv = _received(pk.nbytes), _received((per_node - 1) * pk.own.nbytes)

        def run():
            red._node_sums(StageResult(pk=pk, buf=buf, recv=recv))

        out[f"node sums ({intra})"] = _count(run, log)
    return out


SIZES = [(1 << 16, 4), (1 << 20, 4), (1 << 20, 8)]  # (bucket elements, group size)


def test_receive_stages_do_not_grow_with_the_bucket_or_the_group(path):
    """Each receive stage issues the same ATen ops and Triton launches at 64K and 1M elements and at
    4 and 8 ranks (two-level: 2x2, 2x2, 4x2 and 2x4), on both paths. A loop over element chunks of a
    part (its count grows with the bucket), a chunk budget divided by the number of senders, or a
    host loop over the senders or the nodes fails."""
    fused, log = path
    counts = []
    for (numel, world), (nodes, per_node) in zip(SIZES, [(2, 2), (2, 2), (4, 2)]):
        stages = {
            **_flat_stages(numel, world, fused, log),
            **_gathered_decode(numel, world, fused, log),
            **_node_sums(numel, nodes, per_node, fused, log),
        }
        counts.append(stages)
    counts.append(_node_sums(1 << 20, 2, 4, fused, log))
    for stage, first in counts[0].items():
        assert all(c[stage] == first for c in counts if stage in c), (stage, [c.get(stage) for c in counts])
    if fused:  # the fused path does launch kernels for each stage
        assert all(launches > 0 for _, launches in counts[0].values()), counts[0]
