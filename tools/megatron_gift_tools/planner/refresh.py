"""A GIFT refresh as the planner prices it (``RefreshSync``): each layer's statistics and record bytes
(``numerics.refresh.RecordLayout`` at each side's ``factor_rank``), the owners, and the refresh's chain of
collectives and factor builds."""

from __future__ import annotations

import heapq

from megatron_gift.numerics.kfac import KFACStatistics
from megatron_gift.numerics.refresh import RecordLayout
from megatron_gift.refresh_sync import GATHER_BOUND
from megatron_gift_tools.planner import nccl
from megatron_gift_tools.planner.options import Options
from megatron_gift_tools.planner.tasks import Context, Kind, Task


def factor_rank(d: int, opts: Options) -> int:
    """The rank of one side's factor of size ``d`` (``KFACStatistics.factor_rank``): the configured rank, at most
    ``d`` or the sketch."""
    return min(opts.rank, d if not 0 < opts.sketch < d else opts.sketch)


def statistics_sides(shape: tuple[int, int], opts: Options) -> list[int]:
    """The statistics sizes of one GIFT layer ``(rows, cols)``: its input side's ``cols``, and with output
    statistics (``Options.side`` both or auto) its output side's ``rows``."""
    rows, cols = shape
    return [cols] + ([rows] if opts.side != "input" else [])


def record_bytes(shape: tuple[int, int], x: Context) -> int:
    """One layer's refresh record: ``numerics.refresh.RecordLayout`` at each side's ``factor_rank``."""
    sides = statistics_sides(shape, x.opts)
    d_out = sides[1] if len(sides) > 1 else 0
    r_out = factor_rank(d_out, x.opts) if d_out else 0
    return RecordLayout(sides[0], factor_rank(sides[0], x.opts), d_out, r_out).nbytes


def statistics_bytes(shape: tuple[int, int], x: Context) -> int:
    """One layer's FP32 statistics a refresh sums (EMA sums and token count, each side)."""
    return sum(4 * KFACStatistics.summed_numel(d, x.opts.sketch) for d in statistics_sides(shape, x.opts))


def owners(sizes: list[int], p: int) -> list[list[int]]:
    """The refresh's owners (``RefreshSync.assign_owners``): largest record first, to the rank that owns the fewest
    bytes so far, lowest rank on ties; the layers each of the ``p`` ranks builds."""
    heap, owned = [(0, r) for r in range(p)], [[] for _ in range(p)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: layer order on ties
        load, r = heapq.heappop(heap)
        owned[r].append(i)
        heapq.heappush(heap, (load + sizes[i], r))
    return owned


def refresh_chain(shapes: list[tuple[int, int]], x: Context) -> list[Task]:
    """A GIFT refresh of the layers ``(rows, cols)`` (``RefreshSync``): the statistics (each side's EMA sums
    and token count, FP32) reduce-scattered onto each layer's owner (``owners``) in one call, the layers
    packed by owner into equal slots (the most statistics bytes any rank owns; all-reduced instead where
    the slots would hold more than twice the statistics), the factors built on their
    owners, then one all-gather of a fixed-size record slot per rank (the most record bytes any rank
    owns), or, where those slots would hold more than ``GATHER_BOUND`` times the records (more ranks than
    layers), one ring broadcast per owning rank of its share, all in one coalesced group
    (``RefreshSync._broadcast_records``), priced as one ring broadcast of every share plus the ring's
    latency once more (assumed: each rank forwards the group's broadcasts in order, so they follow one
    another around the ring rather than each waiting for the last to go round). The busiest rank's builds
    (one per side) set the time. Only the data-parallel group is priced: a sequence-parallel layer's TP sum
    (an all-reduce over TP before the reduce-scatter) is not."""
    if x.p == 1 or not shapes:
        return []
    sizes = [record_bytes(s, x) for s in shapes]
    stats = [statistics_bytes(s, x) for s in shapes]
    owned = owners(sizes, x.p)
    slot = max(sum(sizes[i] for i in mine) for mine in owned)
    stats_slot = max(sum(stats[i] for i in mine) for mine in owned)
    builds = max(sum(len(statistics_sides(shapes[i], x.opts)) for i in mine) for mine in owned) * x.costs.factor_build_s
    # the runtime's choice (``RefreshSync.sum_statistics``): equal slots, or a ring all-reduce where they would
    # send more
    scatter = x.p * stats_slot <= 2 * sum(stats)
    summed = (
        x.ring("statistics reduce-scatter", "reduce_scatter", x.p * stats_slot, "refresh", 1)
        if scatter
        else x.ring("statistics all-reduce", "all_reduce", sum(stats), "refresh", 1)
    )
    shares = [sum(sizes[i] for i in mine) for mine in owned]
    if x.p * slot > GATHER_BOUND * sum(sizes):  # the runtime's broadcasts: equal slots would be mostly padding
        ring = lambda nbytes: nccl.ring_time("broadcast", nbytes, x.p, x.g, x.c)  # noqa: E731
        seconds = ring(sum(shares)) + ring(0.0)
        total = (x.p - 1) / x.p * sum(shares)  # every rank but the last forwards each share once
        nic = total / x.g if x.p > x.g else 0.0
        records = Task("record broadcasts", Kind.COMM, seconds, "refresh", x.links(x.p, x.g), 1, total - nic, nic)
    else:
        records = x.ring("record all-gather", "all_gather", x.p * slot, "refresh", 1)
    return [summed, Task("factor builds", Kind.GPU, builds, "refresh-build", ("gpu",), 1), records]
