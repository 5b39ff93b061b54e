"""Two-level quantized reduce-scatter / all-reduce on simulated nodes (gloo, ranks grouped as nodes
by index): bitwise against a pure-PyTorch simulation of the same algorithm and summation order,
within FP8's bound of an FP32 reduction computed by hand, ranks bit-identical, NaN propagation,
the link ledger, and the topology rules.

The simulation shares neither codec nor whitening with the runtime unchecked: its FP8 roundings are
tests/reference.py's (torch's FP8 cast, groups written out, rank sums in order), and every ``T`` /
``T⁻¹`` it applies goes through tests/reference.py's ``CheckedWhitening``, which holds the runtime
transform's FP32 result (the simulation is bitwise, so it must round as the runtime does) to a dense
FP64 ``T`` built from the definition in numerics/whitening.py, within the componentwise FP32 bound
of tests/bounds.py: a wrong ``T``, ``T⁻¹`` or piece finish fails here even though it would show on
both sides of the bitwise comparison."""

import itertools
import time

import pytest
import torch
import torch.distributed as dist

from megatron_gift.arguments import gift_config_from_args, validate_gift_args
from megatron_gift.comm.hierarchical import TwoLevelReduce
from megatron_gift.comm.layout import BucketLayout, Segment
from megatron_gift.comm.ledger import CommLedger
from megatron_gift.comm.quantized import QuantizedReduce
from megatron_gift.comm.schedule import ReductionQueue, StageFlags, StageStreams, reduce_now
from megatron_gift.comm.topology import Topology, build_groups, topology_of
from megatron_gift.config import Exchange, IntraNode, Mode, Schedule
from megatron_gift.numerics import CodecConfig
from megatron_gift.testing import run_on_ranks
from tests.dist.test_comm import _bucket_grads, _codec_args, _coded_groups, _transforms, checked_transforms
from tests.reference import fp8_roundtrip_groups, ordered_sum
from tests.unit.test_arguments import megatron_parse_args, parse  # noqa: F401  (fixtures)

WIRE = {"fp32": torch.float32, "bf16": torch.bfloat16}

# 2304 elements divide into 4, 6 and 8 shards. "mixed": every mode, shard boundaries cut GIFT rows;
# "gift": one GIFT weight whose rows (72 wide) the boundaries of 6 and 8 shards cut.
LAYOUTS = {
    "mixed": (
        2304,
        [
            Segment(0, 20, 40, Mode.GIFT, "a"),
            Segment(800, 1, 7, Mode.OFF, "norm"),
            Segment(832, 9, 33, Mode.EUCLIDEAN, "b"),
            Segment(1152, 10, 100, Mode.GIFT, "c"),
            Segment(2200, 1, 100, Mode.BF16, "bias"),
        ],
    ),
    "gift": (2304, [Segment(0, 32, 72, Mode.GIFT, "w")]),
}


# -- the independent simulation ------------------------------------------------------------------
def _runs(values, runs):
    return torch.cat([values[a:b] for a, b in runs]) if runs else values.new_zeros(0)


def _roundtrip(x, layout, j):
    """Shard ``j``'s coded values through FP8 by tests/reference.py, in the shard's scaling groups
    (test_comm._coded_groups: each parameter's groups cut at shard boundaries, written out there)."""
    lo, hi = layout.shards[j].lo, layout.shards[j].hi
    lengths = []
    for s, groups in _coded_groups(layout.numel, layout.num_shards, layout.segments, layout.codec.name):
        pos = s.start
        for n in groups:
            if lo <= pos < hi:
                lengths.append(n)
            pos += n
    dtype, _, pow2 = _codec_args(layout.codec.name)
    return fp8_roundtrip_groups(x, lengths, dtype, pow2)


def _rows(layout, ts, j, coded, fn):
    """``fn(t, [rows, cols])`` on the whole GIFT rows inside shard ``j`` (``coded``: shard j's coded values)."""
    plan = layout.shards[j]
    for i, r0, r1 in plan.gift_rows:
        if ts[i] is None:
            continue
        s = layout.segments[i]
        c = layout.coded_index(s.start + r0 * s.cols) - plan.coded_lo
        view = coded[c : c + (r1 - r0) * s.cols].view(r1 - r0, s.cols)
        view.copy_(fn(ts[i], view))


def _pieces(layout, ts, coded, project, finish):
    """Rows cut by shard boundaries, with every shard's coded values ``coded[j]`` at hand: each
    row's projection summed over its pieces in shard order, then each piece finished."""

    def piece_views():
        for j, plan in enumerate(layout.shards):
            for p in plan.pieces:
                s = layout.segments[p.seg]
                a = layout.coded_index(s.start + p.row * s.cols + p.c0) - plan.coded_lo
                yield p, coded[j][a : a + p.c1 - p.c0].view(1, -1)

    views = [(p, v) for p, v in piece_views() if ts[p.seg] is not None]
    proj = {}
    for p, v in views:
        key = (p.seg, p.row)
        part = project(ts[p.seg], v, slice(p.c0, p.c1))
        proj[key] = proj.get(key, torch.zeros_like(part)) + part
    for p, v in views:
        v.copy_(finish(ts[p.seg], v, proj[(p.seg, p.row)], slice(p.c0, p.c1)))


def simulate(layout, ts, grads, nodes, intra, average, all_reduce):
    """What every rank must hold after the two-level reduction (full bucket; shard j is rank j's)."""
    g = len(grads) // nodes
    p = len(grads)
    shards = layout.shards
    plain_dtypes = layout.plain_dtypes
    sent = [[None] * p for _ in range(nodes)]  # node k's FP8-decoded partial of shard j (coded, plain_sections)
    for k in range(nodes):
        members = grads[k * g : (k + 1) * g]
        whitened = []  # the senders whiten whole rows before the intra-node stage, whatever its dtype
        for x in members:
            x = x.clone()
            for s, t in zip(layout.segments, ts):
                if t is not None:
                    x[s.start : s.end] = t.apply(x[s.start : s.end].view(s.rows, s.cols)).flatten()
            whitened.append(x)
        coded, plain_sections = [], []
        for j, plan in enumerate(shards):
            if intra == "fp8":
                coded.append(ordered_sum([_roundtrip(_runs(x, plan.coded_runs), layout, j) for x in whitened]))
            else:
                coded.append(ordered_sum([_runs(x, plan.coded_runs).to(WIRE[intra]).float() for x in whitened]))
            plain_sections.append(
                [
                    ordered_sum([_runs(x, runs).to(dt).float() for x in members])
                    for runs, dt in zip(plan.plain_runs, plain_dtypes)
                ]
            )
        for j in range(p):
            sent[k][j] = (
                _roundtrip(coded[j], layout, j),
                [v.to(dt).float() for v, dt in zip(plain_sections[j], plain_dtypes)],
            )
    total = [
        (
            ordered_sum([sent[k][j][0] for k in range(nodes)]),
            [ordered_sum([sent[k][j][1][c] for k in range(nodes)]) for c in range(2)],
        )
        for j in range(p)
    ]
    out = torch.zeros(layout.numel)
    if all_reduce:
        for j, (coded, plain_sections) in enumerate(total):
            if average:
                coded, plain_sections = coded / p, [v / p for v in plain_sections]
            total[j] = (_roundtrip(coded, layout, j), [v.to(dt).float() for v, dt in zip(plain_sections, plain_dtypes)])
        coded_all = torch.cat([c for c, _ in total])
        for s, t in zip(layout.segments, ts):
            if t is not None:
                c = layout.coded_index(s.start)
                view = coded_all[c : c + s.rows * s.cols].view(s.rows, s.cols)
                view.copy_(t.inverse(view))
        _write(out, layout, coded_all, [pl for _, pl in total])
        return out
    for j in range(p):
        _rows(layout, ts, j, total[j][0], lambda t, v: t.inverse(v))
    _pieces(
        layout,
        ts,
        [c for c, _ in total],
        lambda t, v, c: t.projection(v, c),
        lambda t, v, pr, c: t.inverse_piece(v, pr, c),
    )
    if average:
        total = [(c / p, [v / p for v in pl]) for c, pl in total]
    _write(out, layout, torch.cat([c for c, _ in total]), [pl for _, pl in total])
    return out


def _write(out, layout, coded_all, plain_sections):
    pos = 0
    for a, b in layout.coded_runs:
        out[a:b] = coded_all[pos : pos + b - a]
        pos += b - a
    for plan, pl in zip(layout.shards, plain_sections):
        for runs, values in zip(plan.plain_runs, pl):
            at = 0
            for a, b in runs:
                out[a:b] = values[at : at + b - a]
                at += b - a


# -- the ranks -------------------------------------------------------------------------------------
def _cases(world):
    """(layout, codec, intra, all_reduce, average): every combination at 4 ranks, fewer at 6 and 8."""
    if world == 4:
        every = itertools.product(LAYOUTS, ["e4m3-block"], ["fp32", "bf16", "fp8"], [False, True], [False, True])
        return [*every, *itertools.product(LAYOUTS, ["e5m2-tensor"], ["bf16"], [False, True], [True])]
    return list(
        itertools.product(LAYOUTS, ["e4m3-block"], ["bf16", "fp8"] if world == 6 else ["bf16"], [False, True], [True])
    )


def _worker(rank, world, ranks_per_node):
    """Every case reduced eagerly (one after the other), then all of them again started one after
    another on a lagged queue (their stages interleaved, as in the backward) and waited at the end."""
    (placed,) = build_groups([dist.group.WORLD], ranks_per_node)
    assert placed.topology == Topology(world // ranks_per_node, ranks_per_node)
    out, lagged, queue = {}, [], ReductionQueue(StageStreams("cpu"), Schedule.LAGGED)
    for name, codec, intra, all_reduce, average in _cases(world):
        numel, segs = LAYOUTS[name]
        layout = BucketLayout(numel, world, segs, CodecConfig(*codec.split("-")), torch.float32)
        checked = checked_transforms(segs)
        ts = [c.w if c is not None else None for c in checked]  # the runtime's own transforms
        grads = [_bucket_grads(numel, segs, r) for r in range(world)]
        flat = grads[rank].clone()
        ledger = CommLedger()
        nonfinite = StageFlags("cpu")
        common = dict(intra=intra, average=average, all_reduce=all_reduce)
        reduce_now(TwoLevelReduce(flat, layout, placed, ts, ledger=ledger, nonfinite=nonfinite, **common), "cpu")
        again = grads[rank].clone()
        lagged.append((again, queue.start(TwoLevelReduce(again, layout, placed, ts, **common))))
        lo, hi = (0, numel) if all_reduce else (layout.shards[rank].lo, layout.shards[rank].hi)
        want = simulate(layout, checked, grads, world // ranks_per_node, intra, average, all_reduce)
        dense_checks = sum(c.checked for c in checked if c is not None)
        ref = torch.stack(grads).double().sum(0) / (world if average else 1)
        untouched = all_reduce or (
            torch.equal(flat[:lo], grads[rank][:lo]) and torch.equal(flat[hi:], grads[rank][hi:])
        )
        out[(name, codec, intra, all_reduce, average)] = dict(
            result=flat[lo:hi].clone(),
            full=flat,
            bitwise=torch.equal(flat[lo:hi], want[lo:hi]),
            rel=((flat[lo:hi].double() - ref[lo:hi]).norm() / ref[lo:hi].norm()).item(),
            untouched=untouched,
            links=dict(ledger.links),
            message_bytes=sum(s.message_bytes for s in layout.shards),
            nonfinite=bool(nonfinite.any()),
            dense_checks=dense_checks,
        )
    for key, (again, flight) in zip(out, lagged):
        queue.wait(flight)
        out[key]["lagged_same"] = torch.equal(out[key].pop("full"), again)
    return out


def _check(results, world, ranks_per_node):
    n, g = world // ranks_per_node, ranks_per_node
    for key, r0 in results[0].items():
        name, codec, intra, all_reduce, average = key
        # FP8 rounding: E4M3 keeps 3 mantissa bits (relative step 2^-4), E5M2 2 (2^-3), per
        # quantization of node partials (two with fp8 intra); GIFT's T⁻¹ maps the whitened error
        # back with its condition number (the test factors span 10^3, T's κ ~ 30).
        tol = (0.08 if codec.startswith("e4m3") else 0.16) * (2 if intra == "fp8" or all_reduce else 1)
        for rank, res in enumerate(results):
            r = res[key]
            assert r["bitwise"], (key, rank)
            assert r["lagged_same"], (key, rank)  # interleaved with other buckets' stages: the same bits
            assert r["rel"] < tol, (key, rank, r["rel"])
            assert r["untouched"], (key, rank)  # nothing outside the rank's shard is written
            assert not r["nonfinite"], (key, rank)
            assert r["dense_checks"] > 0, (key, rank)  # the simulation's T, T⁻¹ held to the dense FP64 ones
            if name == "gift":  # equal shards: FP8 bytes through the NIC per rank = (n-1)/n · S_fp8 / g
                target = (n - 1) / n * r["message_bytes"] / g * (2 if all_reduce else 1)  # + the all-gather
                assert abs(r["links"][("inter", "fp8+scales")] - target) <= 0.01 * target, (
                    key,
                    rank,
                    r["links"],
                    target,
                )
            if all_reduce:
                assert torch.equal(r["result"], r0["result"]), (key, rank)


@pytest.mark.slow
@pytest.mark.parametrize("world,ranks_per_node", [(4, 2), (6, 2), (8, 4)])
def test_two_level_against_simulation(world, ranks_per_node):
    _check(run_on_ranks(_worker, world, ranks_per_node, timeout=900), world, ranks_per_node)


# -- the flat reduce-scatter: one rank per node ----------------------------------------------------
def _flat_worker(rank, world):
    out = {}
    for name, codec, average in itertools.product(LAYOUTS, ["e4m3-block", "e5m2-tensor", "e4m3-mx"], [False, True]):
        numel, segs = LAYOUTS[name]
        layout = BucketLayout(numel, world, segs, CodecConfig(*codec.split("-")), torch.float32)
        checked = checked_transforms(segs)
        grads = [_bucket_grads(numel, segs, r) for r in range(world)]
        flat = grads[rank].clone()
        reduce_now(
            QuantizedReduce(
                flat, layout, dist.group.WORLD, [c.w if c is not None else None for c in checked], average=average
            ),
            "cpu",
        )
        lo, hi = layout.shards[rank].lo, layout.shards[rank].hi
        want = simulate(layout, checked, grads, world, "fp32", average, False)
        out[(name, codec, average)] = torch.equal(flat[lo:hi], want[lo:hi])
    return out


def test_flat_reduce_scatter_against_simulation():
    """The flat reduce-scatter is the simulation's two-level one with one rank per node and an FP32
    (lossless) intra-node stage: one FP8 rounding of each rank's ``G T``, the FP32 sum in rank order,
    ``T⁻¹`` of the shard's whole rows and of its cut rows from their pieces' projections summed in
    shard order; bit for bit on every rank (averaging divides before ``T⁻¹`` on the flat path, after
    it in the simulation: the same bits for 4 ranks, a power of two). test_comm holds it only to
    FP32 orders of the unsplit rows; bugs caught: a cut row's projections summed in another order or
    from another piece, a whole row finished through the pieces' path, a scale of other groups."""
    for rank, res in enumerate(run_on_ranks(_flat_worker, 4, timeout=600)):
        assert all(res.values()), (rank, [k for k, v in res.items() if not v])


# -- NaN, the flat path's untouched regions -----------------------------------------------------------
def _nan_worker(rank, world):
    (placed,) = build_groups([dist.group.WORLD], 2)
    numel, segs = LAYOUTS["mixed"]
    layout = BucketLayout(numel, world, segs, CodecConfig("e4m3", "block"), torch.float32)
    ts = _transforms(segs)
    out = {}
    for all_reduce in (False, True):
        grads = _bucket_grads(numel, segs, rank)
        if rank == 1:
            grads[5] = float("nan")  # a GIFT row of the first weight, in shard 0
        flag = StageFlags("cpu")
        reduce_now(TwoLevelReduce(grads, layout, placed, ts, all_reduce=all_reduce, nonfinite=flag), "cpu")
        out[all_reduce] = (bool(torch.isnan(grads).any()), bool(flag.any()))
    # defect 8: the flat reduce-scatter with GIFT writes nothing outside the rank's shard (a bucket
    # of one GIFT weight: its coded values are one run, which aliases the FP32 bucket)
    numel, segs = LAYOUTS["gift"]
    layout = BucketLayout(numel, world, segs, CodecConfig("e4m3", "block"), torch.float32)
    ts = _transforms(segs)
    flat = _bucket_grads(numel, segs, rank)
    before = flat.clone()
    reduce_now(QuantizedReduce(flat, layout, dist.group.WORLD, ts), "cpu")
    lo, hi = layout.shards[rank].lo, layout.shards[rank].hi
    out["flat_untouched"] = torch.equal(flat[:lo], before[:lo]) and torch.equal(flat[hi:], before[hi:])
    return out


def test_nan_reaches_every_rank_and_non_owned_regions_stay():
    results = run_on_ranks(_nan_worker, 4, timeout=300)
    assert results[0][False] == (True, True)  # reduce-scatter: the owner of shard 0
    assert all(r[True][0] for r in results)  # all-reduce: NaN in every rank's result
    assert results[0][True][1]  # flagged where the reduced shard holds it
    assert all(r["flat_untouched"] for r in results)


# -- topology rules ------------------------------------------------------------------------------------
def test_topology_of_placements():
    assert topology_of(list(range(8)), 4) == Topology(2, 4)
    assert topology_of([0, 2, 4, 6], 2) == Topology(4, 1)  # TP 2 fills each node: one DP rank per node
    assert topology_of([1, 3, 5, 7], 4) == Topology(2, 2)
    assert topology_of(list(range(8)), None) == Topology(1, 8)  # no launcher info: one node, flat
    assert not Topology(4, 1).two_level and not Topology(1, 8).two_level and Topology(3, 2).two_level
    with pytest.raises(ValueError, match="unequal ranks per node"):
        topology_of([0, 1, 2, 4], 3)
    with pytest.raises(ValueError, match="consecutively"):
        topology_of([0, 2, 1, 3], 2)
    assert Topology(2, 2).link_bytes(1, [10, 20, 30, 40]) == {"intra": 10, "inter": 70}


# -- launch order ---------------------------------------------------------------------------------
def _order_worker(rank, world):
    """Buckets started one after another with random delays between them (as backward hooks fire)
    on lagged and eager queues, waited at the end: the collectives each rank issues, by communicator."""
    (placed,) = build_groups([dist.group.WORLD], 2)
    kinds = {id(placed.intra): "intra", id(placed.inter): "inter", id(placed.group): "group"}
    issued = []

    def recording(name, fn):
        def call(*args, group=None, **kwargs):
            splits = [list(a) for a in args[2:4] if isinstance(a, (list, tuple))]
            issued.append((kinds.get(id(group), "group"), name, *[tuple(x) for x in splits]))
            return fn(*args, group=group, **kwargs)

        return call

    dist.all_to_all_single = recording("all_to_all", dist.all_to_all_single)
    import megatron_gift.comm.hierarchical as hierarchical
    import megatron_gift.comm.quantized as quantized

    for module in (hierarchical, quantized):
        module._all_gather = recording("all_gather", module._all_gather)
    gen = torch.Generator().manual_seed(rank)
    for schedule in Schedule:
        queue = ReductionQueue(StageStreams("cpu"), schedule)
        flights = []
        for _k, (name, all_reduce) in enumerate(itertools.product(LAYOUTS, (False, True))):
            numel, segs = LAYOUTS[name]
            layout = BucketLayout(numel, world, segs, CodecConfig("e4m3", "block"), torch.float32)
            time.sleep(float(torch.rand((), generator=gen)) * 0.05)
            flat = _bucket_grads(numel, segs, rank)
            flights.append(queue.start(TwoLevelReduce(flat, layout, placed, _transforms(segs), all_reduce=all_reduce)))
        for f in flights:
            queue.wait(f)
    return issued


def test_every_rank_issues_the_same_collectives_in_the_same_order():
    """A rank whose collectives on the intra-node, inter-node and whole-group communicators came in
    another order than its peers' (launch decided by timing, e.g. polling for completion) could
    deadlock under NCCL: with random delays between bucket starts, every rank issues the same
    sequence, and inside each communicator the split sizes match pairwise."""
    issued = run_on_ranks(_order_worker, 4, timeout=600)
    kinds = [[(kind, name) for kind, name, *_ in seq] for seq in issued]
    assert all(k == kinds[0] for k in kinds) and len(kinds[0]) > 8, kinds
    for step in range(len(kinds[0])):
        kind, name = kinds[0][step]
        if name != "all_to_all":
            continue
        members = {"intra": lambda r: [r - r % 2, r - r % 2 + 1], "inter": lambda r: [r % 2, r % 2 + 2]}.get(
            kind, lambda r: [0, 1, 2, 3]
        )
        for a in range(4):
            _out_a, in_a = issued[a][step][2], issued[a][step][3]  # output (received) and input (sent) splits
            for i, b in enumerate(members(a)):
                assert in_a[i] == issued[b][step][2][members(b).index(a)], (step, kind, a, b)


# -- the fused kernels (Triton's interpreter on the CPU) -----------------------------------------
# (intra dtype, all-reduce, codec): "e5m2-tensor" sends the weights cut by shards as groups of many rows.
KERNEL_CASES = [("bf16", False, "e4m3-block"), ("bf16", True, "e4m3-block"), ("fp8", False, "e4m3-block")]
KERNEL_CASES += [("fp8", False, "e5m2-tensor")]


def _kernel_worker(rank, world):
    from megatron_gift import kernels

    calls = {"whiten_encode": 0, "decode_sum_unwhiten": 0}
    for name in calls:

        def counted(*args, _f=getattr(kernels, name), _name=name, **kwargs):
            calls[_name] += 1
            return _f(*args, **kwargs)

        setattr(kernels, name, counted)
    forced = [False]
    for name in ("reference_whiten_encode", "reference_decode_sum_unwhiten", "reference_decode_placed"):

        def fallback(*args, _f=getattr(kernels, name), **kwargs):
            assert not forced[0], "fell back to the PyTorch reference with the kernels on"
            return _f(*args, **kwargs)

        setattr(kernels, name, fallback)
    (placed,) = build_groups([dist.group.WORLD], 2)
    numel, segs = LAYOUTS["mixed"]
    ts = _transforms(segs)
    out = {"calls": calls}
    for (intra, all_reduce, codec), use in itertools.product(KERNEL_CASES, (False, True)):
        layout = BucketLayout(numel, world, segs, CodecConfig(*codec.split("-")), torch.float32)
        flat = _bucket_grads(numel, segs, rank)
        forced[0] = use
        reduce_now(
            TwoLevelReduce(flat, layout, placed, ts, intra=intra, average=True, all_reduce=all_reduce, kernels=use),
            "cpu",
        )
        out[(intra, all_reduce, codec, use)] = flat
    return out


@pytest.mark.slow
def test_two_level_with_kernels(monkeypatch):
    """Kernel path (whiten+encode of the node partials, decode+sum+unwhiten of the shard) against the
    PyTorch path, per-tensor groups cut by shards included: non-GIFT values bit for bit; GIFT values differ
    only where FP32 rounding of G T flips an FP8 code (one E4M3 step, 2^-4 relative, on few elements). A
    fall back to the PyTorch reference with the kernels on fails."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the ranks' processes inherit it
    results = run_on_ranks(_kernel_worker, 4, timeout=900)
    numel, segs = LAYOUTS["mixed"]
    gift = torch.zeros(numel, dtype=torch.bool)
    for s in segs:
        gift[s.start : s.end] = s.mode is Mode.GIFT
    layout = BucketLayout(numel, 4, segs, CodecConfig("e4m3", "block"), torch.float32)
    for rank, res in enumerate(results):
        assert res["calls"]["whiten_encode"] > 0 and res["calls"]["decode_sum_unwhiten"] > 0, res["calls"]
        for intra, all_reduce, codec in KERNEL_CASES:
            lo, hi = (0, numel) if all_reduce else (layout.shards[rank].lo, layout.shards[rank].hi)
            torch_path, kernel_path = (res[(intra, all_reduce, codec, use)][lo:hi] for use in (False, True))
            mask = gift[lo:hi]
            assert torch.equal(torch_path[~mask], kernel_path[~mask]), (rank, intra, all_reduce)
            diff = (torch_path[mask] - kernel_path[mask]).norm() / torch_path[mask].norm()
            assert diff < 2**-4, (rank, intra, all_reduce, diff.item())


# -- flags ---------------------------------------------------------------------------------------------
def test_exchange_flags(parse):  # noqa: F811  (the fixture)
    cfg = gift_config_from_args(
        parse(
            "--gift-mode", "gift", "--gift-exchange", "flat", "--gift-intra-node", "fp8", "--gift-ranks-per-node", "4"
        )
    )
    assert (cfg.exchange.topology, cfg.exchange.intra_node, cfg.exchange.ranks_per_node) == (
        Exchange.FLAT,
        IntraNode.FP8,
        4,
    )
    default = gift_config_from_args(parse("--gift-mode", "gift"))
    assert (default.exchange.topology, default.exchange.intra_node, default.exchange.ranks_per_node) == (
        Exchange.AUTO,
        IntraNode.BF16,
        None,
    )
    with pytest.raises(ValueError, match="--gift-ranks-per-node must be an integer >= 1"):
        validate_gift_args(parse("--gift-mode", "gift", "--gift-ranks-per-node", "0"))
