"""The stage protocol under CUDA's lifetime rules, checked on a CPU: every tensor a collective is
given stays in its stage's handoff until the next stage's stream waits on it (``ReductionQueue``'s
check mode), and each non-finite flag is written from one stage's stream only."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_gift.comm.hierarchical import TwoLevelReduce
from megatron_gift.comm.layout import BucketLayout
from megatron_gift.comm.quantized import QuantizedReduce
from megatron_gift.comm.schedule import Reduction, ReductionQueue, StageFlags, StageResult, StageStreams, reduce_now
from megatron_gift.comm.topology import build_groups
from megatron_gift.config import Schedule
from megatron_gift.numerics import CodecConfig
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.dispatch import Lifetimes
from tests.dist.test_comm import LAYOUTS as FLAT_LAYOUTS
from tests.dist.test_comm import _bucket_grads, _transforms
from tests.dist.test_two_level import LAYOUTS as TWO_LEVEL_LAYOUTS

WORLD = 4  # two simulated nodes of two ranks; 4 shards cut the long GIFT row three times


class _Toy(Reduction):
    """Stage 0 sends a fresh temporary (a view of it, when ``view``) in an all-to-all; ``keep``:
    whether the handoff holds it."""

    def __init__(self, keep: bool, view: bool = False):
        self.keep, self.view = keep, view

    def stages(self):
        return [self._send, lambda prev: StageResult()]

    def _send(self, prev):
        world = dist.get_world_size()
        tmp = torch.arange(2.0 * world)
        recv = torch.empty(2 * world)
        sent = tmp[:world] if self.view else tmp
        work = dist.all_to_all_single(recv[: sent.numel()], sent, async_op=True)
        return StageResult(works=[work], recv=recv, tmp=tmp) if self.keep else StageResult(works=[work], recv=recv)


def _raises(fn) -> bool:
    try:
        fn()
    except RuntimeError as e:
        assert "handoff does not hold" in str(e), e
        return True
    return False


def _layouts(world):
    """(name, flat or two-level, layout, transforms) of the buckets the tests reduce."""
    out = []
    for kind, layouts in (("flat", FLAT_LAYOUTS), ("two_level", TWO_LEVEL_LAYOUTS)):
        for name, (numel, segs) in layouts.items():
            out.append(
                (
                    f"{kind}/{name}",
                    kind,
                    BucketLayout(numel, world, segs, CodecConfig("e4m3", "block"), torch.float32),
                    _transforms(segs),
                )
            )
    return out


def _handoff_worker(rank, world):
    (placed,) = build_groups([dist.group.WORLD], 2)
    out = {
        "toy_dropped": _raises(lambda: reduce_now(_Toy(keep=False), "cpu", watch=Lifetimes())),
        "toy_kept": _raises(lambda: reduce_now(_Toy(keep=True), "cpu", watch=Lifetimes())),
        "toy_view_kept": _raises(lambda: reduce_now(_Toy(keep=True, view=True), "cpu", watch=Lifetimes())),
        "toy_unchecked": _raises(lambda: reduce_now(_Toy(keep=False), "cpu")),
    }
    queue, lagged = ReductionQueue(StageStreams("cpu"), Schedule.LAGGED, watch=Lifetimes()), []
    for name, kind, layout, ts in _layouts(world):
        for all_reduce in (False, True):
            grads = _bucket_grads(layout.numel, layout.segments, rank)

            def make(flat):
                if kind == "flat":
                    return QuantizedReduce(flat, layout, dist.group.WORLD, ts, all_reduce=all_reduce)
                return TwoLevelReduce(flat, layout, placed, ts, all_reduce=all_reduce)

            checked, plain, again = grads.clone(), grads.clone(), grads.clone()
            out[(name, all_reduce)] = _raises(lambda: reduce_now(make(checked), "cpu", watch=Lifetimes()))
            reduce_now(make(plain), "cpu")
            out[(name, all_reduce, "same")] = torch.equal(checked, plain)
            lagged.append(((name, all_reduce, "lagged"), again, plain, queue.start(make(again))))
    for key, again, plain, flight in lagged:
        out[key] = _raises(lambda: queue.wait(flight))
        out[key + ("same",)] = torch.equal(again, plain)
    return out


@pytest.mark.slow
def test_every_collective_tensor_is_held_by_its_stage_until_the_wait():
    """Since PyTorch 2.7 ProcessGroupNCCL drops a collective's tensors at ``work.wait()``, which runs
    on the next stage's stream: a temporary held by nothing else (the cut rows' ``.contiguous()``
    send of the partial projections was one) returns to its stream's pool while NCCL still reads
    it. The check mode finds such a tensor on a CPU; every flat and two-level reduction (cut rows,
    reduce-scatter and all-reduce, eager and lagged) passes it with unchanged results."""
    for rank, r in enumerate(run_on_ranks(_handoff_worker, WORLD, timeout=600)):
        assert r.pop("toy_dropped") and not r.pop("toy_kept") and not r.pop("toy_view_kept"), rank
        assert not r.pop("toy_unchecked"), rank  # only the check mode looks
        failed = [k for k, v in r.items() if (v if k[-1] != "same" else not v)]
        assert not failed, (rank, failed)


# -- the non-finite flags ---------------------------------------------------------------------------
class _FlagWrites(TorchDispatchMode):
    """Which stage (``stage[0]``, kept by the test's own wrappers) wrote which flag of ``flags``
    (``StageFlags``: flag i is ``flags.flags[i]``, created when first set)."""

    def __init__(self, flags, stage):
        super().__init__()
        self.flags, self.stage, self.writes = flags, stage, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a, t in zip(func._schema.arguments, args):
            if isinstance(t, torch.Tensor) and a.alias_info is not None and a.alias_info.is_write:
                ptr = t.untyped_storage().data_ptr()
                for e, f in enumerate(self.flags.flags):
                    if f.untyped_storage().data_ptr() == ptr:
                        self.writes.add((e, self.stage[0]))
        return func(*args, **(kwargs or {}))


def _tracked(reduction, stage):
    """``reduction`` whose stages first note their index in ``stage[0]``."""

    def run(s, fn, prev):
        stage[0] = s
        return fn(prev)

    stages = reduction.stages()
    reduction.stages = lambda: [functools.partial(run, s, fn) for s, fn in enumerate(stages)]
    return reduction


def _flag_worker(rank, world):
    (placed,) = build_groups([dist.group.WORLD], 2)
    flag, stage = StageFlags("cpu"), [None]
    queue, flights = ReductionQueue(StageStreams("cpu"), Schedule.LAGGED), []
    mode = _FlagWrites(flag, stage)
    with mode:
        for _name, kind, layout, ts in _layouts(world):
            for all_reduce in (False, True):
                flat = _bucket_grads(layout.numel, layout.segments, rank)
                if kind == "flat":
                    red = QuantizedReduce(flat, layout, dist.group.WORLD, ts, all_reduce=all_reduce, nonfinite=flag)
                else:
                    red = TwoLevelReduce(flat, layout, placed, ts, all_reduce=all_reduce, nonfinite=flag)
                flights.append(queue.start(_tracked(red, stage)))
        for f in flights:
            queue.wait(f)
        clean = [bool(f) for f in flag.flags]
        # a NaN in the long row that every shard cuts: only the cut rows' stage (the last) sees it
        numel, segs = FLAT_LAYOUTS["long_row"]
        layout = BucketLayout(numel, world, segs, CodecConfig("e4m3", "block"), torch.float32)
        flat = _bucket_grads(numel, segs, rank)
        if rank == 1:
            flat[310] = float("nan")
        reduce_now(
            _tracked(QuantizedReduce(flat, layout, dist.group.WORLD, _transforms(segs), nonfinite=flag), stage), "cpu"
        )
    by_element = {}
    for e, s in mode.writes:
        by_element.setdefault(e, set()).add(s)
    return dict(
        clean=clean,
        flag=[bool(f) for f in flag.flags],
        by_element=by_element,
        nan=bool(torch.isnan(flat[layout.shards[rank].lo : layout.shards[rank].hi]).any()),
    )


@pytest.mark.slow
def test_each_nonfinite_flag_is_written_by_one_stage():
    """The reduced values' NaN/Inf check ran from the stage streams of consecutive buckets at once,
    each a read-modify-write of one shared flag: one could overwrite another's set value. Each flag
    is now written from one stage (its stream) only, flat and two-level, reduce-scatter and
    all-reduce interleaved on a lagged queue; a NaN seen by the last stage alone still sets one."""
    for rank, r in enumerate(run_on_ranks(_flag_worker, WORLD, timeout=600)):
        assert r["by_element"] and all(len(s) == 1 for s in r["by_element"].values()), (rank, r["by_element"])
        assert not any(r["clean"]), rank
        assert r["nan"] and r["flag"][2], (
            rank
        )  # the flat reduce-scatter's last stage: the cut row's T⁻¹ spreads the NaN over every piece
