"""The arena that bounds the reductions' message buffers in flight (``comm.schedule.Arena``): a region
is reused only after the reductions that held it are done, every rank reserves alike, and results
are those of reductions with buffers of their own."""

import gc
import random

import pytest
import torch
import torch.distributed as dist

from megatron_gift.comm import schedule as schedule_module
from megatron_gift.comm.fp4_reduce import FP4Reduce, FP4TwoLevelReduce
from megatron_gift.comm.hierarchical import TwoLevelReduce
from megatron_gift.comm.layout import BucketLayout
from megatron_gift.comm.quantized import QuantizedReduce
from megatron_gift.comm.schedule import ALIGN, Arena, ReductionQueue, Space, StageStreams, reduce_now
from megatron_gift.comm.sum_first import FP4SumFirstReduce
from megatron_gift.comm.topology import build_groups
from megatron_gift.config import IntraNode, Schedule
from megatron_gift.numerics import CodecConfig
from megatron_gift.numerics.fp4 import FP4_FORMATS
from megatron_gift.testing import run_on_ranks
from tests.dist.test_comm import LAYOUTS as FLAT_LAYOUTS
from tests.dist.test_comm import _bucket_grads, _transforms
from tests.dist.test_fp4_exchange import NUMEL as FP4_NUMEL
from tests.dist.test_fp4_exchange import SEGMENTS as FP4_SEGMENTS
from tests.dist.test_two_level import LAYOUTS as TWO_LEVEL_LAYOUTS

WORLD, PER_NODE = 4, 2


# -- the ring, alone ---------------------------------------------------------------------------------
def test_a_reused_byte_always_names_its_earlier_holder():
    """Bug caught: after a wrap to the buffer's start, only the oldest region was checked for overlap:
    a younger region there (the oldest lying in the skipped tail) was handed out again while its
    reduction still used it. Checked against a byte-by-byte owner map over random sizes."""
    rng = random.Random(0)
    for trial in range(200):
        size = rng.choice([4096, 10_000, 65_536])
        arena = Arena(size, "cpu")
        owner = [None] * size  # flight id holding each byte, None when free or released
        for flight in range(60):
            need = rng.randint(1, size)
            block, earlier = arena.reserve(need, flight)
            lo = block.storage_offset()
            assert block.numel() == need and lo + need <= size, (trial, flight)
            earlier = [f for _, f in earlier]
            held = {owner[b] for b in range(lo, lo + need)} - {None}
            assert held <= set(earlier), (trial, flight, held, earlier)
            for f in earlier:  # done: every byte it held is free again
                owner = [None if o == f else o for o in owner]
            owner[lo : lo + need] = [flight] * need


def test_a_bucket_over_a_stated_bound_is_warned_and_runs_outside():
    """Bug caught: a bucket whose buffers exceed ``--gift-inflight-mb`` silently unbounded, or given
    a region past the buffer's end; without a stated bound the arena holds two of the largest
    bucket's buffers but never more than all of a step's (one bucket: one), and grows to two of a
    bucket larger than planned."""
    said = []
    fixed = Arena(1 << 20, "cpu", said.append)
    fixed.plan([1000, (1 << 20) + 1])  # at start-up, from the buckets' footprints
    assert len(said) == 1 and "--gift-inflight-mb 1" in said[0] and "--ddp-bucket-size" in said[0]
    assert fixed.nbytes == 1 << 20  # a stated size stays
    assert fixed.reserve((1 << 20) + 1, "big") == (None, [])
    assert fixed.reserve((1 << 20) + 1, "big2") == (None, [])
    assert fixed.over == 2 and len(said) == 1  # warned once
    block, _ = fixed.reserve(1 << 19, "fits")
    assert block is not None and fixed.buffer.numel() == 1 << 20
    planned = Arena(None, "cpu")
    planned.plan([100, 300, 50])
    assert planned.nbytes == 450  # all of them: never more than a step's buffers
    planned.plan([100, 300, 50, 400])
    assert planned.nbytes == 800  # two of the largest
    grown = Arena(None, "cpu")
    grown.reserve(1000, "a")
    assert grown.nbytes == 2000
    block, earlier = grown.reserve(3000, "b")  # a new buffer: the first flight keeps its view of the old
    assert grown.nbytes == 6000 and earlier == [] and block.storage_offset() == 0


def test_the_model_chunks_of_a_process_share_one_arena_per_device(monkeypatch):
    """Bug caught: one arena per DDP, so a virtual pipeline's model chunks (one DDP each) hold one arena
    each, their sum instead of the largest; chunks with different bounds sharing one; or its buffer
    kept after the last DDP that used it is gone."""
    # this process's, without other tests' DDPs
    monkeypatch.setattr(schedule_module, "_SHARED", type(schedule_module._SHARED)())
    a, b = Arena.shared("cpu", None), Arena.shared("cpu", None)
    assert a is b and Arena.shared("cpu", 1 << 20) is not a
    a.plan([100, 300])
    b.plan([50])  # a second chunk with smaller buckets: the first's plan stands
    assert a.nbytes == 400
    queue = ReductionQueue(StageStreams("cpu"), Schedule.LAGGED, arena=a)
    queue.cycle = queue  # as a DDP's hooks hold theirs: freed by the collector
    a.reserve(100, "x", queue)
    assert a.buffer is not None
    del queue
    gc.collect()
    assert a.buffer is None  # the memory goes with the last queue that used it
    block, _ = Arena.shared("cpu", None).reserve(100, "y")
    assert block.storage_offset() == 100 and a.buffer.numel() == 400  # the ring goes on where it was
    Arena.forget_shared()  # tools measuring models one by one
    assert Arena.shared("cpu", None) is not a


def test_a_later_ddp_continues_the_ring_whether_or_not_the_earlier_was_collected(monkeypatch):
    """Bug caught: the process's shared arena lived only while a DDP's queue did, which a reference
    cycle keeps until the garbage collector runs, so a later DDP (the tests build one per case) got
    the earlier ring on a rank that had not collected yet and a fresh one on a rank that had: the
    ranks reused regions, and completed earlier reductions, at different points, their collectives
    paired up wrong and two ranks deadlocked (tests/megatron/test_megatron_ddp.py, in CI). Both
    DDPs' places must be those of one ring that saw all their plans and reservations in order."""

    def places(ring, queues):
        out = []
        for name, plan, needs in (("a", [600, 700], [600, 700, 600]), ("b", [500, 600], [500, 600, 500])):
            arena = ring() if queues else ring
            queue = ReductionQueue(StageStreams("cpu"), Schedule.LAGGED, arena=arena) if queues else None
            if queue is not None:
                queue.cycle = queue
            arena.plan(plan)
            for i, need in enumerate(needs):
                block, earlier = arena.reserve(need, f"{name}{i}", queue)
                out.append((block.storage_offset(), block.numel(), sorted(f for _, f in earlier)))
            del queue, arena, block, earlier  # this DDP is gone
            if queues == "collect":
                gc.collect()
        return out

    reference = places(Arena(None, "cpu"), None)  # one ring, both DDPs' calls in order
    assert reference[3][2] == ["a1"]  # the second DDP's first region reuses the first's bytes
    gc.disable()
    try:
        for when in ("later", "collect"):
            monkeypatch.setattr(schedule_module, "_SHARED", type(schedule_module._SHARED)())
            assert places(lambda: Arena.shared("cpu", None), when) == reference, when
    finally:
        gc.enable()


def test_space_takes_aligned_views_and_refuses_beyond_its_region():
    """Bug caught: a buffer viewed in a wider dtype at an unaligned offset, or a reduction whose
    ``footprint()`` undercounts writing past its region into the next reduction's."""
    space = Space(torch.zeros(3 * ALIGN, dtype=torch.uint8))
    a = space.empty(3)
    b = space.empty(5, torch.float32)
    assert a.numel() == 3 and b.dtype == torch.float32 and b.storage_offset() * 4 == ALIGN
    with pytest.raises(RuntimeError, match="footprint"):
        space.empty(ALIGN + 1)


# -- reductions through a small arena ------------------------------------------------------------------
def _cases():
    """(name, make(flat, layout, groups, ts, all_reduce), layout, numel, segments)."""
    fp8 = CodecConfig("e4m3", "block")
    out = []
    for name, (numel, segs) in FLAT_LAYOUTS.items():
        layout = BucketLayout(numel, WORLD, segs, fp8, torch.float32)
        out.append((f"flat/{name}", "flat", layout, numel, segs))
    for name, (numel, segs) in TWO_LEVEL_LAYOUTS.items():
        layout = BucketLayout(numel, WORLD, segs, fp8, torch.float32)
        out.append((f"two-level/{name}", "two", layout, numel, segs))
    fp4 = BucketLayout(FP4_NUMEL, WORLD, FP4_SEGMENTS, CodecConfig(), torch.float32)
    fp4.check_blocks(FP4_FORMATS["nvfp4"].block, "test")
    out += [
        ("fp4-flat", "fp4", fp4, FP4_NUMEL, FP4_SEGMENTS),
        ("fp4-two-level", "fp4two", fp4, FP4_NUMEL, FP4_SEGMENTS),
        ("fp4-sum-first", "fp4sum", fp4, FP4_NUMEL, FP4_SEGMENTS),
    ]
    return out


def _make(kind, flat, layout, placed, ts, all_reduce, kernels=None):
    common = dict(average=True, all_reduce=all_reduce, kernels=kernels)
    if kind == "flat":
        return QuantizedReduce(flat, layout, dist.group.WORLD, ts, **common)
    if kind == "two":
        return TwoLevelReduce(flat, layout, placed, ts, intra=IntraNode.BF16, **common)
    if kind == "fp4":
        return FP4Reduce(flat, layout, dist.group.WORLD, ts, FP4_FORMATS["nvfp4"], topology=placed.topology, **common)
    if kind == "fp4sum":
        return FP4SumFirstReduce(flat, layout, placed, ts, FP4_FORMATS["nvfp4"], **common)
    return FP4TwoLevelReduce(flat, layout, placed, ts, FP4_FORMATS["nvfp4"], IntraNode.BF16, **common)


def _worker(rank, world):
    (placed,) = build_groups([dist.group.WORLD], PER_NODE)
    jobs = []
    for name, kind, layout, numel, segs in _cases():
        ts = _transforms(segs)
        for all_reduce in (False, True):
            grads = [_bucket_grads(numel, segs, r) for r in range(world)]
            own = grads[rank].clone()
            reduce_now(_make(kind, own, layout, placed, ts, all_reduce), "cpu")  # buffers of its own
            jobs.append(((name, all_reduce), kind, layout, ts, grads, own))
    out = {}
    needs = [_make(k, g[rank].clone(), lay, placed, ts, ar).footprint() for (_, ar), k, lay, ts, g, _ in jobs]
    for schedule in (Schedule.EAGER, Schedule.LAGGED):
        # room for the largest reduction and little more: nearly every reduction reuses an earlier one's bytes
        arena = Arena(max(needs) + ALIGN, "cpu")
        queue = ReductionQueue(StageStreams("cpu"), schedule, arena=arena)
        flights = []
        for (key, kind, layout, ts, grads, own), need in zip(jobs, needs):
            flat = grads[rank].clone()
            red = _make(kind, flat, layout, placed, ts, key[1])
            flights.append((key, layout, grads, flat, own, red, need, queue.start(red)))
        for key, layout, grads, flat, own, red, need, flight in flights:
            queue.wait(flight)
            lo, hi = (0, layout.numel) if key[1] else (layout.shards[rank].lo, layout.shards[rank].hi)
            exact = torch.stack(grads).double().mean(0)
            out[(schedule.value, *key)] = dict(
                same=torch.equal(flat, own),
                rel=((flat.double() - exact)[lo:hi].norm() / exact[lo:hi].norm()).item(),
                result=flat.clone() if key[1] else None,
                need=need,
                used=red.space.used,
                over=arena.over,
                arena=arena.nbytes,
            )
        out[(schedule.value, "reused")] = len(arena.regions) < len(jobs)
    return out


def _shared_worker(rank, world):
    """Two queues (two model chunks' DDPs) on one arena that holds about one reduction, their starts
    interleaved on the lagged schedule."""
    (placed,) = build_groups([dist.group.WORLD], PER_NODE)
    cases = [c for c in _cases() if c[1] in ("flat", "two")]
    jobs = []
    for name, kind, layout, numel, segs in cases:
        ts, grads = _transforms(segs), [_bucket_grads(numel, segs, r) for r in range(world)]
        own = grads[rank].clone()
        reduce_now(_make(kind, own, layout, placed, ts, False), "cpu")
        jobs.append((name, kind, layout, ts, grads, own))
    needs = [_make(k, g[rank].clone(), lay, placed, ts, False).footprint() for _, k, lay, ts, g, _ in jobs]
    arena = Arena(max(needs) + ALIGN, "cpu")
    queues = [ReductionQueue(StageStreams("cpu"), Schedule.LAGGED, arena=arena) for _ in range(2)]
    flights = []
    for i, (name, kind, layout, ts, grads, own) in enumerate(jobs * 2):
        flat = grads[rank].clone()
        queue = queues[i % 2]
        flights.append((name, flat, own, queue, queue.start(_make(kind, flat, layout, placed, ts, False))))
    out = {}
    for i, (name, flat, own, queue, flight) in enumerate(flights):
        queue.wait(flight)
        out[(i, name)] = torch.equal(flat, own)
    return out


@pytest.mark.slow
def test_two_queues_sharing_an_arena_complete_each_others_reductions():
    """Bug caught: a queue reusing a region that a reduction of another queue (another model chunk's
    DDP) still holds: it can only enqueue that reduction's remaining stages through the queue that
    started it. Each result bit for bit the reduction with buffers of its own."""
    for rank, res in enumerate(run_on_ranks(_shared_worker, WORLD, timeout=600)):
        assert all(res.values()), (rank, [k for k, v in res.items() if not v])


@pytest.mark.slow
def test_reductions_through_a_small_arena_are_bit_for_bit_their_own():
    """Bug caught: a reduction writing a region an earlier one still reads (its receive buffer not yet
    decoded: the lagged schedule leaves it pending), a footprint that differs between ranks (the
    ranks would reserve, and complete earlier reductions, in different orders) or undercounts what a
    rank takes, a region given to two reductions at once. Flat and two-level FP8, flat, two-level and
    sum-first NVFP4, reduce-scatter and all-reduce, eager and lagged, in an arena that holds about one of them:
    each result is bit for bit that of the same reduction with buffers of its own, near the FP32
    average (the format's bound), the same on every rank for all-reduce."""
    results = run_on_ranks(_worker, WORLD, timeout=600)
    for key, r0 in results[0].items():
        if key[-1] == "reused":
            assert all(res[key] for res in results), key  # the arena was indeed reused
            continue
        for rank, res in enumerate(results):
            r = res[key]
            assert r["same"], (key, rank)
            assert r["over"] == 0 and r["arena"] == r0["arena"], (key, rank)
            # FP8 E4M3: 2^-4 relative per quantization, twice in the two-level path; NVFP4: E2M1's
            # half step of ~1/6 of a block's range, GIFT's T⁻¹ raising it by its condition number
            assert r["rel"] < (0.5 if key[1].startswith("fp4") else 0.16), (key, rank, r["rel"])
            assert r["need"] == r0["need"], (key, rank)  # every rank reserves alike
            if key[2]:
                assert torch.equal(r["result"], r0["result"]), (key, rank)
        assert max(res[key]["used"] for res in results) == r0["need"], key  # footprint: exactly the most taken
