"""The stage protocol's lifetime rule on every reduction path, checked on a CPU (``testing.dispatch.Lifetimes``):
every tensor a stage gives a collective, or creates and a later stage reads, is in the handoff of every
stage in between (on CUDA: recorded on their streams, so the caching allocator cannot give its block to
the creating stream's next allocation while a later stream still uses it)."""

import torch
import torch.distributed as dist

from megatron_gift.comm.fp4_reduce import FP4Reduce, FP4TwoLevelReduce
from megatron_gift.comm.hierarchical import TwoLevelReduce
from megatron_gift.comm.instances import AcrossInstances
from megatron_gift.comm.layout import BucketLayout
from megatron_gift.comm.ledger import CommLedger
from megatron_gift.comm.output_side import OutputSide
from megatron_gift.comm.param_delta import DeltaGather
from megatron_gift.comm.quantized import QuantizedReduce
from megatron_gift.comm.schedule import Reduction, ReductionQueue, StageResult, StageStreams, reduce_now
from megatron_gift.comm.sum_first import FP4SumFirstReduce
from megatron_gift.comm.topology import build_groups
from megatron_gift.config import IntraNode, Schedule
from megatron_gift.numerics import CodecConfig
from megatron_gift.numerics.fp4 import FP4_FORMATS
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.dispatch import Lifetimes
from tests.dist import test_fp4_exchange as fp4
from tests.dist.test_comm import _bucket_grads, _transforms, checked_transforms
from tests.dist.test_output_side import NUMEL, SEGS, _grads, _outputs

WORLD = 4  # two simulated nodes of two ranks


class _Toy(Reduction):
    """Stage 0 makes a temporary that stage 2 reads; ``hand``: the stages whose handoff holds it."""

    def __init__(self, hand: set):
        self.hand = hand

    def stages(self):
        return [self._make, lambda prev: self._pass(1), self._read]

    def _make(self, prev):
        self.tmp = torch.arange(8.0)  # kept outside the handoff: what the check must catch
        return StageResult(tmp=self.tmp) if 0 in self.hand else StageResult()

    def _pass(self, s):
        return StageResult(tmp=self.tmp) if s in self.hand else StageResult()

    def _read(self, prev):
        self.tmp.sum()
        return StageResult()


class _Dropped(OutputSide):
    """The race of issue 35: ``P`` (``proj``) left out of the last inner stage's handoff (kept aside, given to
    the output stage past the queue)."""

    def _projections(self, step):
        step = super()._projections(step)
        self.proj = step.proj
        del step.proj
        return step

    def _output(self, prev):
        return super()._output(StageResult(works=prev.works, **prev.handoff, proj=self.proj))


def _caught(fn) -> str | None:
    """The lifetime check's complaint about ``fn()`` (None: none)."""
    try:
        fn()
    except RuntimeError as e:
        if "handoff" not in str(e):
            raise
        return str(e)
    return None


def _delta_gather(group) -> tuple[int, str | None]:
    """One delta all-gather of two BF16 buckets watched as two stages: the encode and collective (its
    handoff: what the gather keeps until the current stream has waited for the decode) and the decode."""
    gen = torch.Generator().manual_seed(group.rank())
    buffers = [torch.randn(WORLD * n, generator=gen).bfloat16() for n in (64, 40)]
    gather = DeltaGather(buffers, group)
    gather.start(async_op=False, full=True)
    for i in range(2):
        gather.own(i).add_(0.01)
    watch, flight = Lifetimes(), type("Flight", (), {"count": 2})()

    def run():
        with watch.stage(flight, 0):
            pending = gather.start(async_op=True)
        watch.handed(flight, 0, StageResult(works=[], keep=pending.keep))
        with watch.stage(flight, 1):
            pending.wait()
        watch.handed(flight, 1, StageResult())
        gather.ready()

    complaint = _caught(run)
    return watch.stages, complaint


def _worker(rank, world):
    (placed,) = build_groups([dist.group.WORLD], 2)
    singles = [dist.new_group([r]) for r in range(world)]  # groups of one rank
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # two distributed-optimizer instances...
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # ...and the ranks holding the same shard
    ts = [c.w if c is not None else None for c in checked_transforms(SEGS)]
    outputs = [o[0] if o is not None else None for o in _outputs()]
    codec = CodecConfig("e4m3", "block")
    layouts = {n: BucketLayout(NUMEL, n, SEGS, codec, torch.float32) for n in (1, 2, world)}
    out = {
        "toy_unheld": _caught(lambda: reduce_now(_Toy({0}), "cpu", watch=Lifetimes())),
        "toy_held": _caught(lambda: reduce_now(_Toy({0, 1}), "cpu", watch=Lifetimes())),
    }

    def flat(g, all_reduce, group=dist.group.WORLD):
        return QuantizedReduce(g, layouts[group.size()], group, ts, all_reduce=all_reduce)

    def two_level(g, all_reduce):
        return TwoLevelReduce(g, layouts[world], placed, ts, all_reduce=all_reduce)

    def instances(g, all_reduce):
        half = halves[rank // 2]
        layout = layouts[2]
        shard = g[layout.shards[half.rank()].lo : layout.shards[half.rank()].hi]
        return AcrossInstances(flat(g, False, half), shard, across[rank % 2], True, CommLedger())

    makers = {
        "flat": flat,
        "flat/one-rank": lambda g, ar: flat(g, ar, singles[rank]),
        "two-level": two_level,
        "output-side/flat": lambda g, ar: OutputSide(flat(g, ar), outputs, CommLedger()),
        "output-side/one-rank": lambda g, ar: OutputSide(flat(g, ar, singles[rank]), outputs, CommLedger()),
        "output-side/two-level": lambda g, ar: OutputSide(two_level(g, ar), outputs, CommLedger()),
        "across-instances": instances,
    }
    queue = ReductionQueue(StageStreams("cpu"), Schedule.LAGGED, watch=Lifetimes())
    flights = []
    for name, make in makers.items():
        for all_reduce in (False, True):
            if name == "across-instances" and all_reduce:
                continue
            watch, plain, checked = Lifetimes(), _grads(rank), _grads(rank)
            reduce_now(make(plain, all_reduce), "cpu")
            out[(name, all_reduce)] = _caught(lambda: reduce_now(make(checked, all_reduce), "cpu", watch=watch))
            out[(name, all_reduce, "same")] = torch.equal(plain, checked)
            out[(name, all_reduce, "watched")] = watch.stages
            lagged = _grads(rank)
            key = (name, all_reduce, "lagged")
            out[key + ("start",)] = _caught(
                lambda: flights.append((key, lagged, plain, queue.start(make(lagged, all_reduce))))
            )
    for key, lagged, plain, flight in flights:
        out[key] = _caught(lambda: queue.wait(flight))
        out[key + ("same",)] = torch.equal(lagged, plain)
    nvfp4 = FP4_FORMATS["nvfp4"]
    # four bits between nodes: flat, whitening first, sum first (cut rows of two GIFT segments)
    for rotation in (False, True):
        (numel, segs), at = fp4._bucket(rotation), fp4._layout(rotation)
        whitenings, rot = _transforms(segs), fp4.ROTATION if rotation else None
        fp4_makers = {
            "fp4/flat": lambda g, ar: FP4Reduce(
                g, at, dist.group.WORLD, whitenings, nvfp4, all_reduce=ar, rotation=rot, topology=placed.topology
            ),
            "fp4/two-level": lambda g, ar: FP4TwoLevelReduce(
                g, at, placed, whitenings, nvfp4, IntraNode.FP32, all_reduce=ar, rotation=rot
            ),
            "fp4/sum-first": lambda g, ar: FP4SumFirstReduce(
                g, at, placed, whitenings, nvfp4, all_reduce=ar, rotation=rot
            ),
        }
        for name, make in fp4_makers.items():
            for all_reduce in (False, True):
                key = (name, rotation, all_reduce)
                watch, plain, checked = Lifetimes(), _bucket_grads(numel, segs, rank), _bucket_grads(numel, segs, rank)
                reduce_now(make(plain, all_reduce), "cpu")
                out[key] = _caught(lambda: reduce_now(make(checked, all_reduce), "cpu", watch=watch))
                out[key + ("same",)] = torch.equal(plain, checked)
                out[key + ("watched",)] = watch.stages
    for all_reduce in (False, True):
        for name, group in (("flat", dist.group.WORLD), ("one-rank", singles[rank])):
            g = _grads(rank)
            dropped = _Dropped(flat(g, all_reduce, group), outputs, CommLedger())
            out[("dropped", name, all_reduce)] = _caught(lambda: reduce_now(dropped, "cpu", watch=Lifetimes()))
        dropped = _Dropped(two_level(_grads(rank), all_reduce), outputs, CommLedger())
        out[("dropped", "two-level", all_reduce)] = _caught(lambda: reduce_now(dropped, "cpu", watch=Lifetimes()))
    out["delta"] = _delta_gather(dist.group.WORLD)
    return out


def test_every_stage_hands_on_what_a_later_stage_uses():
    """Issue 35's race: with all-reduce (or a group of one rank) the output side's ``P``, allocated on
    its stage's stream and read by the next stage, was in no handoff: the caching allocator could give
    its block to the next bucket's ``torch.zeros`` while the output stage still read it (wrong
    gradients, on a GPU only). The check raises for a toy temporary read two stages on and held by one
    handoff only, and for ``P`` left out (flat, one rank, two-level; all-reduce: the race; reduce-scatter:
    ``P``'s all-reduce given a tensor its handoff does not hold); every path (flat, groups of one rank,
    two-level, output side on each, across instances, the delta gather; eager and lagged; four bits flat,
    whitening first and sum first, with and without the rotation) passes, its results unchanged by the
    watch. Sum first's batched cut pieces (created by its rows stage, read by its node sums) were once
    in no handoff."""
    for rank, r in enumerate(run_on_ranks(_worker, WORLD, timeout=600)):
        assert r.pop("toy_unheld") is not None and r.pop("toy_held") is None, rank
        stages, complaint = r.pop("delta")
        assert stages == 2 and complaint is None, (rank, complaint)
        for key in [k for k in r if k[0] == "dropped"]:
            assert r.pop(key) is not None, (rank, key)
        for key in [k for k in r if k[-1] == "watched"]:
            assert r.pop(key) >= 3, (rank, key)  # the watch saw every stage
        failed = {k: v for k, v in r.items() if (v is not None if k[-1] != "same" else not v)}
        assert not failed, (rank, failed)
