"""Four-bit gradient exchange (``--gift-inter-node-format nvfp4|mxfp4``, ``comm.fp4_reduce``) on 4 gloo
ranks simulated as 2 nodes x 2: the flat and the two-level reduction (the intra-node stage in FP32 or
FP8, or a plain reduce-scatter with whitening on the node's sums: ``comm.sum_first``), reduce-scatter
and all-reduce, Euclidean and GIFT parameters, ``--gift-rotation hadamard``,
against an FP32 reduction computed here by hand from independently quantized values (each sender's
values through ``numerics.fp4.roundtrip_fp4``, whose own tests pin its numerics; summed in FP32 in
rank order by tests/reference.py; untransformed), every rank bit-identical, and the ledger's
inter-node bytes against a hand count."""

import pytest
import torch
import torch.distributed as dist

from megatron_gift.comm.fp4_reduce import FP4Reduce, FP4TwoLevelReduce
from megatron_gift.comm.layout import BucketLayout, Segment
from megatron_gift.comm.ledger import CommLedger
from megatron_gift.comm.schedule import reduce_now
from megatron_gift.comm.sum_first import FP4SumFirstReduce
from megatron_gift.comm.topology import Topology, build_groups
from megatron_gift.config import IntraNode, Mode
from megatron_gift.kernels import reference
from megatron_gift.numerics import CodecConfig
from megatron_gift.numerics.fp4 import FP4_FORMATS, roundtrip_fp4
from megatron_gift.numerics.rotation import BlockHadamard
from megatron_gift.testing import run_on_ranks
from tests.dist.test_comm import _bucket_grads, _transforms
from tests.dist.test_two_level import _roundtrip
from tests.reference import ordered_sum

WORLD, PER_NODE = 4, 2
ROTATION = BlockHadamard(64, seed=7)
# shards of 1024: the first and the second each cut a row 64 columns in (a whole MXFP4 block), of "a"
# and of "c", of a's shape (sum-first: the cut pieces of two segments batched together), the third
# falls on a parameter boundary; "norm" is sent in the bucket's dtype in the same messages.
NUMEL = 4096
SEGMENTS = [
    Segment(0, 12, 96, Mode.GIFT, "a"),
    Segment(1152, 8, 32, Mode.OFF, "norm"),
    Segment(1408, 12, 96, Mode.GIFT, "c"),
    Segment(2560, 24, 64, Mode.EUCLIDEAN, "b"),
]
# --gift-rotation hadamard: GIFT rows of whole 64-column blocks, a shard boundary 64 columns into a row
ROT_NUMEL = 2816
ROT_SEGMENTS = [
    Segment(0, 12, 128, Mode.GIFT, "a"),
    Segment(1536, 4, 32, Mode.OFF, "norm"),
    Segment(1664, 8, 64, Mode.EUCLIDEAN, "b"),
    Segment(2176, 5, 128, Mode.GIFT, "c"),
]
CASES = [(fmt, two, ar, False, "fp32") for fmt in FP4_FORMATS for two in (False, True) for ar in (False, True)]
CASES += [
    ("nvfp4", False, False, True, "fp32"),
    ("mxfp4", True, False, True, "fp32"),
    ("nvfp4", True, True, True, "fp32"),
]
CASES += [("nvfp4", True, False, False, "fp8"), ("mxfp4", True, False, True, "fp8")]  # FP8 inside the node
# a plain reduce-scatter inside the node, T and H on the node's sums: a cut GIFT row whitened from two ranks' pieces
CASES += [(fmt, True, ar, rot, "reduce-scatter") for fmt, ar, rot in [("nvfp4", False, False), ("mxfp4", True, False)]]
CASES += [(fmt, True, ar, True, "reduce-scatter") for fmt, ar in [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)]]


def _bucket(rotation):
    return (ROT_NUMEL, ROT_SEGMENTS) if rotation else (NUMEL, SEGMENTS)


def _layout(rotation=False):
    numel, segments = _bucket(rotation)
    return BucketLayout(numel, WORLD, segments, CodecConfig(), torch.float32)


def _worker(rank, world):
    (placed,) = build_groups([dist.group.WORLD], PER_NODE)
    assert placed.topology == Topology(2, 2)
    out = {}
    for fmt, two_level, all_reduce, rotation, intra in CASES:
        (numel, segments), layout = _bucket(rotation), _layout(rotation)
        layout.check_blocks(64 if rotation else FP4_FORMATS[fmt].block, "test")
        ts = _transforms(segments)
        flat, ledger = _bucket_grads(numel, segments, rank), CommLedger()
        common = dict(average=True, all_reduce=all_reduce, ledger=ledger, rotation=ROTATION if rotation else None)
        if intra == "reduce-scatter":
            red = FP4SumFirstReduce(flat, layout, placed, ts, FP4_FORMATS[fmt], **common)
        elif two_level:
            red = FP4TwoLevelReduce(flat, layout, placed, ts, FP4_FORMATS[fmt], IntraNode(intra), **common)
        else:
            red = FP4Reduce(flat, layout, dist.group.WORLD, ts, FP4_FORMATS[fmt], topology=placed.topology, **common)
        reduce_now(red, "cpu")
        out[(fmt, two_level, all_reduce, rotation, intra)] = (flat, dict(ledger.links))
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_worker, WORLD)


def _sent(x, segments, ts):
    """The bucket's coded sequence as a sender whitens it: ``G T`` for GIFT parameters, ``G`` else."""
    out = []
    for s, t in zip(segments, ts):
        if s.mode is Mode.OFF:
            continue
        g = x[s.start : s.end].view(s.rows, s.cols)
        u = g if t is None else t.apply(g)
        out.append(u.reshape(-1))
    return torch.cat(out)


def _rotated(u, segments, inverse=False, names=None):
    """``U H`` (``inverse``: ``U Hᵀ``) for every parameter of a coded sequence ``u``, whitened or not
    (``names``: only those parameters)."""
    out, at = u.clone(), 0
    for s in segments:
        if s.mode is Mode.OFF:
            continue
        n = s.rows * s.cols
        rotate = ROTATION.inverse if inverse else ROTATION.apply
        if names is None or s.name in names:
            out[at : at + n] = rotate(u[at : at + n].view(s.rows, s.cols)).reshape(-1)
        at += n
    return out


def _quantized(u, layout, fmt):
    """``u`` (a coded sequence) through FP4 shard by shard, one segment per parameter part of a shard."""
    pieces = []
    for plan in layout.shards:
        lengths = torch.tensor([p.hi - p.lo for p in plan.coded_parts], dtype=torch.int64)
        pieces.append(roundtrip_fp4(u[plan.coded_lo : plan.coded_hi], FP4_FORMATS[fmt], lengths))
    return torch.cat(pieces)


def _fp8_shards(u, layout):
    """A sender's coded sequence through the intra-node stage's FP8, shard by shard in the shards'
    scaling groups (tests/dist/test_two_level.py's ``_roundtrip``: tests/reference.py's FP8)."""
    return torch.cat([_roundtrip(u[p.coded_lo : p.coded_hi], layout, j) for j, p in enumerate(layout.shards)])


def expected(fmt, two_level, rotation, intra="fp32", names=None, dtype=torch.float32):
    """The averaged reduction by hand: each sender's (two-level: each node's FP32 sum's) coded values
    quantized (``intra`` fp8: each sender's values through FP8 first; reduce-scatter: ``T`` on each
    node's FP32 sum of ``G``, not summed after it), summed in FP32 in rank order,
    ÷ 4, untransformed (``Hᵀ`` then ``T⁻¹``); plain values summed in FP32. ``dtype``: the bucket's (the
    gradients in it; a node's sums rounded to it, as the reduce-scatter sums in it)."""
    (numel, segments), layout = _bucket(rotation), _layout(rotation)
    ts = _transforms(segments)
    grads = [_bucket_grads(numel, segments, r).to(dtype).float() for r in range(WORLD)]

    def node_sum(xs):
        return ordered_sum(xs).to(dtype).float()

    if intra == "reduce-scatter":  # each node's sum of G in the bucket's dtype, then T on it
        sums = [node_sum(grads[k * PER_NODE : (k + 1) * PER_NODE]) for k in range(WORLD // PER_NODE)]
        sent = [_sent(s, segments, ts) for s in sums]
    else:
        sent = [_sent(g, segments, ts) for g in grads]  # G T: H comes after the intra-node stage
    if intra == "fp8":
        sent = [_fp8_shards(u, layout) for u in sent]
    if two_level and intra != "reduce-scatter":
        sent = [ordered_sum(sent[k * PER_NODE : (k + 1) * PER_NODE]) for k in range(WORLD // PER_NODE)]
    if rotation:  # H on each sender's (node sum's) coded rows, whitened or not: H is linear
        sent = [_rotated(u, segments, names=names) for u in sent]
    total = ordered_sum([_quantized(u, layout, fmt) for u in sent]) / WORLD
    if rotation:
        total = _rotated(total, segments, inverse=True, names=names)
    want, at = torch.zeros(numel), 0
    for s, t in zip(segments, ts):
        if s.mode is Mode.OFF:
            plain = [g[s.start : s.end] for g in grads]
            if two_level:  # each node's sum, then the nodes' in order
                plain = [node_sum(plain[k * PER_NODE : (k + 1) * PER_NODE]) for k in range(WORLD // PER_NODE)]
            want[s.start : s.end] = ordered_sum(plain) / WORLD
            continue
        x = total[at : at + s.rows * s.cols].view(s.rows, s.cols)
        if t is not None:
            x = t.inverse(x)
        want[s.start : s.end] = x.reshape(-1)
        at += s.rows * s.cols
    return want


@pytest.mark.parametrize("fmt, two_level, all_reduce, rotation, intra", CASES)
def test_fp4_reduction_matches_a_hand_reduction(results, fmt, two_level, all_reduce, rotation, intra):
    """Bug caught: FP4 codes, block or segment scales misplaced in the messages, a sender's message
    decoded with another's scales, a sum out of rank order or outside FP32, the average or ``T⁻¹``
    applied twice or not at all, the cut rows' finish wrong; all-reduce: a rank holding other bits.
    Euclidean and plain values bit for bit; GIFT's within FP32 roundings of the hand ``T⁻¹`` (the
    runtime finishes cut rows from partial projections). Rotation: ``H`` missing, applied twice, not
    undone before ``T⁻¹``, or with other signs on some rank; a cut row rotated across the cut; a
    Euclidean parameter left unrotated (``--gift-rotation`` rotates every coded parameter)."""
    (numel, segments), layout = _bucket(rotation), _layout(rotation)
    want = expected(fmt, two_level, rotation, intra)
    got = [r[(fmt, two_level, all_reduce, rotation, intra)][0] for r in results]
    for j, plan in enumerate(layout.shards):
        holders = range(WORLD) if all_reduce else [j]
        for r in holders:
            assert torch.equal(got[r][plan.lo : plan.hi], got[j][plan.lo : plan.hi])  # bit-identical
        for s in segments:
            lo, hi = max(s.start, plan.lo), min(s.end, plan.hi)
            if lo >= hi:
                continue
            have, ref = got[j][lo:hi], want[lo:hi]
            if s.mode is Mode.GIFT:
                tol = 1e-5 * float(ref.abs().max())
                assert torch.allclose(have, ref, rtol=1e-5, atol=tol), (s.name, j, (have - ref).abs().max())
            else:
                assert torch.equal(have, ref), (s.name, j, (have - ref).abs().max())
    # the quantization did happen: FP4 is far from the exact FP32 average
    exact = torch.stack([_bucket_grads(numel, segments, r) for r in range(WORLD)]).sum(0) / WORLD
    b = next(s for s in segments if s.name == "b")
    assert not torch.equal(want[b.start : b.end], exact[b.start : b.end])


def _blocks_worker(rank, world):
    reference.DECODE_VALUES = 64  # every receive decodes its senders a row or less at a time (blocks mostly empty)
    return _worker(rank, world)


def test_decoding_in_blocks_of_senders_changes_no_bit(results):
    """Bug caught: a receive decoding its senders in blocks (``kernels.reference.DECODE_VALUES``) that pairs a
    block's codes with another block's block, segment scales or lengths, skips or repeats a sender, or sums
    in another order, or fails on an empty block: with a budget of 64 values every case above holds the
    bits of the whole-part decode (itself held to the hand reduction)."""
    for r, got in enumerate(run_on_ranks(_blocks_worker, WORLD)):
        for case in CASES:
            assert torch.equal(got[case][0], results[r][case][0]), (r, case)


BF16_CASES = [("nvfp4", False, True), ("mxfp4", True, False)]  # (format, all-reduce, rotation)


def _bf16_worker(rank, world):
    """The sum-first exchange on BF16 buckets (Megatron's ``--grad-reduce-in-bf16``)."""
    (placed,) = build_groups([dist.group.WORLD], PER_NODE)
    out = {}
    for fmt, all_reduce, rotation in BF16_CASES:
        numel, segments = _bucket(rotation)
        layout = BucketLayout(numel, WORLD, segments, CodecConfig(), torch.bfloat16)
        flat = _bucket_grads(numel, segments, rank).bfloat16()
        common = dict(average=True, all_reduce=all_reduce, rotation=ROTATION if rotation else None)
        reduce_now(FP4SumFirstReduce(flat, layout, placed, _transforms(segments), FP4_FORMATS[fmt], **common), "cpu")
        out[(fmt, all_reduce, rotation)] = flat
    return out


@pytest.mark.parametrize("fmt, all_reduce, rotation", BF16_CASES)
def test_sum_first_on_a_bf16_bucket_matches_a_hand_reduction(fmt, all_reduce, rotation):
    """``--gift-intra-node reduce-scatter`` where Megatron reduces in BF16: the node's sums in BF16 (the
    collective's), ``T``, the rotation and FP4 on them in FP32, the result rounded once into the bucket.
    Bugs caught: BF16 sums read as FP32 bytes (or whole GIFT rows read in the wrong dtype where they lie),
    the plain values sent or summed in the wrong dtype, the result rounded twice or written as FP32;
    Euclidean and plain values bit for bit the hand reduction rounded to BF16, GIFT's within one BF16
    rounding of it; every rank bit-identical."""
    numel, segments = _bucket(rotation)
    layout = BucketLayout(numel, WORLD, segments, CodecConfig(), torch.bfloat16)
    want = expected(fmt, True, rotation, "reduce-scatter", dtype=torch.bfloat16)
    got = [r[(fmt, all_reduce, rotation)] for r in run_on_ranks(_bf16_worker, WORLD)]
    for j, plan in enumerate(layout.shards):
        for r in range(WORLD) if all_reduce else [j]:
            assert got[r].dtype == torch.bfloat16 and torch.equal(got[r][plan.lo : plan.hi], got[j][plan.lo : plan.hi])
        for s in segments:
            lo, hi = max(s.start, plan.lo), min(s.end, plan.hi)
            if lo >= hi:
                continue
            have, ref = got[j][lo:hi].float(), want[lo:hi]
            if s.mode is Mode.GIFT:  # FP32 roundings of T⁻¹ apart, then one BF16 rounding (2^-8 relative)
                tol = 2**-8 * float(ref.abs().max())
                assert torch.allclose(have, ref, rtol=2**-8, atol=tol), (s.name, j, (have - ref).abs().max())
            else:
                assert torch.equal(have, ref.bfloat16().float()), (s.name, j, (have - ref).abs().max())


@pytest.mark.parametrize("fmt, two_level", [(f, t) for f in FP4_FORMATS for t in (False, True)])
def test_inter_node_bytes_are_the_hand_count(results, fmt, two_level):
    """Bug caught: the ledger counting FP4 messages as FP8 (1 byte per element) or leaving out the
    block or segment scales: inter-node bytes of rank r are, per message to the other node, 0.5 byte
    per coded element plus a block scale per 16 (NVFP4) or 32 (MXFP4) elements plus (NVFP4) a 4-byte
    segment scale per parameter part, plus the plain values (4 bytes each); this layout needs no padding."""
    layout, block = _layout(), {"nvfp4": 16, "mxfp4": 32}[fmt]

    def message(j):
        plan = layout.shards[j]
        n = plan.n_coded
        segs = 4 * len(plan.coded_parts) if fmt == "nvfp4" else 0
        return n // 2 + n // block + segs + 4 * sum(p.hi - p.lo for p in plan.plain_parts[0])

    for r, res in enumerate(results):
        node, local = divmod(r, PER_NODE)
        other = [j for j in range(WORLD) if j // PER_NODE != node]
        want = message((1 - node) * PER_NODE + local) if two_level else sum(message(j) for j in other)
        assert res[(fmt, two_level, False, False, "fp32")][1][("inter", f"{fmt}+scales")] == want


EF_STEPS = 3


def _ef_worker(rank, world):
    """The flat FP4 exchange with error feedback (``--gift-error-feedback``), with and without the
    rotation: each step's reduced shard and the committed residual; then the running sum of 8 steps
    of one gradient with and without the residual, relative to FP64's."""
    from megatron_gift.numerics import ErrorFeedback

    (placed,) = build_groups([dist.group.WORLD], PER_NODE)
    fmt, out = FP4_FORMATS["nvfp4"], {}
    for rotation in (False, True):
        (numel, segments), layout = _bucket(rotation), _layout(rotation)
        ts, ef = _transforms(segments), ErrorFeedback(layout.n_coded)
        common = dict(average=True, rotation=ROTATION if rotation else None, topology=placed.topology)
        for step in range(EF_STEPS):
            flat = _bucket_grads(numel, segments, rank + WORLD * step)
            reduce_now(FP4Reduce(flat, layout, dist.group.WORLD, ts, fmt, error_feedback=ef, **common), "cpu")
            ef.commit()
            out[("step", rotation, step)] = (flat, ef.residual.clone())
        for use_ef in (False, True):
            ef = ErrorFeedback(layout.n_coded) if use_ef else None
            acc = torch.zeros(numel, dtype=torch.float64)
            for _ in range(8):
                flat = _bucket_grads(numel, segments, rank)
                reduce_now(
                    FP4Reduce(flat, layout, dist.group.WORLD, ts, fmt, error_feedback=ef, all_reduce=True, **common),
                    "cpu",
                )
                if ef is not None:
                    ef.commit()
                acc += flat.double()
            exact = 8 * torch.stack([_bucket_grads(numel, segments, r).double() for r in range(WORLD)]).mean(0)
            out[("drift", rotation, use_ef)] = float((acc - exact).norm() / exact.norm())
    return out


def _ef_expected(rotation):
    """Every step's averaged reduction, each sender's residual and the largest ``|Ũ|`` by hand:
    ``Ũ = G T + e``, sent ``Ũ H`` (shard by shard through ``roundtrip_fp4``), the residual
    ``Ũ - dec(Ũ H) Hᵀ``; the sum in rank order, ÷ 4, ``Hᵀ``, ``T⁻¹``."""
    (numel, segments), layout = _bucket(rotation), _layout(rotation)
    ts = _transforms(segments)
    residual = [torch.zeros(layout.n_coded) for _ in range(WORLD)]
    steps = []
    for step in range(EF_STEPS):
        grads = [_bucket_grads(numel, segments, r + WORLD * step) for r in range(WORLD)]
        decoded, largest = [], 0.0
        for r in range(WORLD):
            u = _sent(grads[r], segments, ts) + residual[r]
            largest = max(largest, float(u.abs().max()))
            q = _quantized(_rotated(u, segments) if rotation else u, layout, "nvfp4")
            decoded.append(q)
            residual[r] = u - (_rotated(q, segments, inverse=True) if rotation else q)
        total = ordered_sum(decoded) / WORLD
        if rotation:
            total = _rotated(total, segments, inverse=True)
        want, at = torch.zeros(numel), 0
        for s, t in zip(segments, ts):
            if s.mode is Mode.OFF:
                want[s.start : s.end] = ordered_sum([g[s.start : s.end] for g in grads]) / WORLD
                continue
            x = total[at : at + s.rows * s.cols].view(s.rows, s.cols)
            want[s.start : s.end] = (t.inverse(x) if t is not None else x).reshape(-1)
            at += s.rows * s.cols
        steps.append((want, [e.clone() for e in residual], largest))
    return steps


@pytest.fixture(scope="module")
def ef_results():
    return run_on_ranks(_ef_worker, WORLD)


@pytest.mark.parametrize("rotation", [False, True])
def test_fp4_error_feedback_matches_a_hand_reduction(ef_results, rotation):
    """Bug caught: the residual not added, added with the wrong sign, staged from the unrotated values
    against rotated codes (or rotated), taken from another sender's or shard's decode, or not carried
    from step to step; every shard's owner and every rank's residual against the hand steps (Euclidean
    and plain values bit for bit, GIFT within FP32 roundings of the hand ``T⁻¹``). The residual bit
    for bit without the rotation; with it, within the roundings of the runtime's and the hand's ``Hᵀ``
    of the decoded values (6 butterfly stages, each within an FP32 ulp of the largest ``|Ũ|``), which
    carry into the next steps' ``Ũ``: 2 x 6 ulps."""
    (_, segments), layout = _bucket(rotation), _layout(rotation)
    eps = torch.finfo(torch.float32).eps
    for step, (want, residuals, largest) in enumerate(_ef_expected(rotation)):
        tol = 2 * 6 * eps * largest if rotation else 0.0
        for r, res in enumerate(ef_results):
            flat, residual = res[("step", rotation, step)]
            assert torch.allclose(residual, residuals[r], rtol=0, atol=tol), (step, r)
            plan = layout.shards[r]
            for s in segments:
                lo, hi = max(s.start, plan.lo), min(s.end, plan.hi)
                if lo >= hi:
                    continue
                have, ref = flat[lo:hi], want[lo:hi]
                if s.mode is Mode.GIFT:
                    tol = 1e-5 * float(ref.abs().max())
                    assert torch.allclose(have, ref, rtol=1e-5, atol=tol), (s.name, step, r)
                else:
                    assert torch.equal(have, ref), (s.name, step, r, (have - ref).abs().max())
        assert any(bool(e.abs().max() > 0) for e in residuals)  # the residual is live


@pytest.mark.parametrize("rotation", [False, True])
def test_fp4_error_feedback_keeps_the_running_sum_close(ef_results, rotation):
    """Bug caught: a residual that does not cancel the rounding (a sign error doubles it, a stale one
    repeats it): over 8 steps of one gradient the running sum with error feedback is at most half as
    far from FP64's as without; every rank holds the same all-reduced bits (checked by the first test's
    owners; here the drift is rank 0's)."""
    without, with_ef = ef_results[0][("drift", rotation, False)], ef_results[0][("drift", rotation, True)]
    assert with_ef < 0.5 * without, (with_ef, without)


# --gift-rotation auto: the refresh chose the rotation for GIFT parameter "a" only
AUTO_CASES = [("flat", "fp32"), ("two-level", "fp32"), ("two-level", "reduce-scatter")]


def _auto_worker(rank, world):
    (placed,) = build_groups([dist.group.WORLD], PER_NODE)
    (numel, segments), layout = _bucket(True), _layout(True)
    ts, fmt, out = _transforms(segments), FP4_FORMATS["nvfp4"], {}
    rotated = tuple(s.name == "a" for s in segments)
    for path, intra in AUTO_CASES:
        flat = _bucket_grads(numel, segments, rank)
        common = dict(average=True, rotation=ROTATION, rotated=rotated)
        if intra == "reduce-scatter":
            red = FP4SumFirstReduce(flat, layout, placed, ts, fmt, **common)
        elif path == "two-level":
            red = FP4TwoLevelReduce(flat, layout, placed, ts, fmt, IntraNode(intra), **common)
        else:
            red = FP4Reduce(flat, layout, dist.group.WORLD, ts, fmt, topology=placed.topology, **common)
        reduce_now(red, "cpu")
        out[(path, intra)] = flat
    return out


@pytest.fixture(scope="module")
def auto_results():
    return run_on_ranks(_auto_worker, WORLD)


@pytest.mark.parametrize("path, intra", AUTO_CASES)
def test_a_rotated_subset_matches_a_hand_reduction(auto_results, path, intra):
    """``--gift-rotation auto`` hands the exchange the parameters to rotate: ``H`` on those alone, at
    every sender (node sum) and undone at the owner. Bug caught: the choice ignored (every parameter
    rotated, or none), or the owner undoing ``H`` on another set than the senders applied it to."""
    (_, segments), layout = _bucket(True), _layout(True)
    want = expected("nvfp4", path == "two-level", True, intra, names={"a"})
    for j, plan in enumerate(layout.shards):
        have = auto_results[j][(path, intra)]
        for s in segments:
            lo, hi = max(s.start, plan.lo), min(s.end, plan.hi)
            if lo >= hi:
                continue
            if s.mode is Mode.GIFT:
                tol = 1e-5 * float(want[lo:hi].abs().max())
                assert torch.allclose(have[lo:hi], want[lo:hi], rtol=1e-5, atol=tol), (s.name, j)
            else:
                assert torch.equal(have[lo:hi], want[lo:hi]), (s.name, j)
