"""The sender's placed kernels vs the PyTorch path: codes, scales, residuals and casts written
straight into the messages at the packing's table positions, bit for bit; and a sender stage's
ATen ops and Triton launches the same at two bucket sizes and two data-parallel sizes.

The kernels run on the CPU under Triton's interpreter, which must be on when they are defined:
``test_send_under_interpreter`` runs this file again in a fresh process with ``TRITON_INTERPRET=1``
(as ``test_kernels.py`` does), where the tests below run."""

import collections
import os

import pytest
import torch

from megatron_gift import kernels
from megatron_gift.comm import codec
from megatron_gift.comm.layout import BucketLayout, Segment
from megatron_gift.comm.packing import packing
from megatron_gift.comm.topology import Topology
from megatron_gift.config import Mode
from megatron_gift.numerics.error_feedback import ErrorFeedback
from megatron_gift.numerics.fp8 import CodecConfig, FP8Format, Scaling
from megatron_gift.testing.dispatch import OpCounter
from megatron_gift.testing.kernel_log import assert_passes_under_interpreter
from tests.unit.test_kernels import _assert_fp32_close, _gradient, _whitening

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# 2100 elements: with 3 shards (700) "b" and "d" are cut mid-row and mid-group; with 7 shards (300)
# the rows of "a" are cut too, and the last shard holds only the "emb" values and padding (no coded
# values, no groups); every shard of 3 holds plain values of one class only.
SEGMENTS = [
    Segment(0, 12, 40, Mode.GIFT, "a"),
    Segment(480, 1, 7, Mode.OFF, "norm"),
    Segment(512, 5, 50, Mode.EUCLIDEAN, "b"),
    Segment(780, 5, 100, Mode.GIFT, "c"),
    Segment(1300, 1, 6, Mode.BF16, "bias"),
    Segment(1320, 3, 90, Mode.EUCLIDEAN, "d"),
    Segment(1600, 1, 450, Mode.OFF, "emb"),
]
NUMEL = 2100
CONFIGS = [CodecConfig(fmt=f, scaling=s) for f in FP8Format for s in Scaling] + [CodecConfig(block=32)]


def _packings(layout, wire=None):
    """``(name, packing)`` of rank 1's sends: the flat exchange's (one message per shard) and, with
    an even number of shards, the two-level intra-node stage's (2 ranks per node: several shards a
    message, in node order)."""
    world, r = layout.num_shards, 1
    out = [("flat", packing(layout, list(range(world)), [[j] for j in range(world) if j != r] + [[r]], wire, "cpu"))]
    if world % 2 == 0:
        topo = Topology(world // 2, 2)
        lp = topo.local(r)
        messages = [topo.inter_ranks(m) for m in range(2) if m != lp] + [topo.inter_ranks(r)]
        out.append(("intra", packing(layout, list(range(world)), messages, wire, "cpu")))
    return out


def _bucket(seed=0, special=True):
    flat = torch.zeros(NUMEL)
    for k, s in enumerate(SEGMENTS):
        # GIFT rows without NaN/Inf (whitening spreads one over the row, and FP32 closeness needs finite rows)
        odd = special and s.mode is not Mode.GIFT
        flat[s.start : s.end] = _gradient(s.rows, s.cols, 10 * seed + k, "cpu", special=odd).view(-1)
    return flat


def _assert_same_placed(bufs, pk, layout, wire, key):
    """Two buffers of a float-wire packing hold the same values bit for bit, any NaN counting as
    any NaN (torch's own BF16 NaN differs between its CPU code paths and CUDA), and nothing else differs."""
    sequences = [("coded", layout.n_coded, lambda b: b.view(wire))]
    for c, name in enumerate(("off", "bf16")):
        sequences.append((name, layout.n_plain[c], lambda b, name=name: codec.views(b, layout)[name]))
    bufs = [b.clone() for b in bufs]
    for name, n, view in sequences:
        index = pk.place[name].index(0, n).long()
        a, b = (view(buf)[index] for buf in bufs)
        nan = torch.isnan(a)
        assert torch.equal(torch.isnan(b), nan), (key, name)
        for buf in bufs:  # NaN bits aside
            view(buf).index_fill_(0, index[nan], 0)
    assert torch.equal(bufs[0], bufs[1]), key


class _Launches:
    """Counts the calls of the kernel modules' wrappers (so a test can tell a fallback)."""

    def __init__(self, monkeypatch):
        from megatron_gift.kernels import fused, place

        self.calls = collections.Counter()
        for module, name in ((fused, "whiten_encode"), (place, "whiten_place")):
            monkeypatch.setattr(module, name, self._counted(getattr(module, name), name))

    def _counted(self, f, name):
        def call(*args, **kwargs):
            self.calls[name] += 1
            return f(*args, **kwargs)

        return call


if INTERPRET:

    @pytest.mark.parametrize("world", [3, 4, 7])
    @pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
    def test_placed_encode_is_the_reference(world, cfg, monkeypatch):
        """``whiten_encode(..., into=...)`` per segment, fused vs the reference (encode, then
        ``index_copy_`` by ``Placement.index``) into the same buffer: bit for bit, with and without
        error feedback (``e`` added before encoding, ``e'`` written), on shards with cut rows, groups cut
        at shard boundaries, empty shards, flat and two-level messages. With whitening, the kernel's
        ``U`` (``out``) is within FP32 rounding of the reference's and its encoding and residual are the
        reference's of that ``U``. A unit placed by the wrong shard's delta, a scale written at its
        unplaced index, a residual taken before the sum or from the code's value rounded differently fails."""
        layout = BucketLayout(NUMEL, world, SEGMENTS, cfg, torch.float32)
        launches = _Launches(monkeypatch)
        flat = _bucket()
        for name, pk in _packings(layout):
            for feedback in (False, True):
                bufs = [torch.zeros(pk.nbytes, dtype=torch.uint8) for _ in range(2)]
                e = torch.randn(layout.n_coded, generator=torch.Generator().manual_seed(world)) * 0.01
                new = [torch.full((layout.n_coded,), float("nan")) for _ in range(2)]
                for i in layout.coded_segments:
                    s, at = layout.segments[i], layout.seg_at[i]
                    n = s.rows * s.cols
                    g0, g1 = layout.group_range(at, at + n)
                    lengths = layout.lengths(g0, g1, "cpu")
                    x = flat[s.start : s.end].view(s.rows, s.cols)
                    w = _whitening(s.cols, 4, "cpu", seed=i) if s.mode is Mode.GIFT else None

                    def into(buf):
                        views = codec.views(buf, layout)
                        place = pk.place
                        return kernels.Placed(
                            place["coded"].at(views["coded"], at), place["groups"].at(views["groups"], g0)
                        )

                    fb = [(e[at : at + n], new[k][at : at + n]) if feedback else None for k in range(2)]
                    u = torch.empty(s.rows, s.cols)
                    assert (
                        kernels.whiten_encode(x, w, cfg, out=u, lengths=lengths, into=into(bufs[0]), feedback=fb[0])
                        is None
                    )
                    if w is None:
                        kernels.reference_whiten_encode(
                            x, None, cfg, lengths=lengths, into=into(bufs[1]), feedback=fb[1]
                        )
                    else:  # the encoding of the kernel's U (+ e): the reference's
                        u_ref = torch.empty_like(u)
                        kernels.reference_whiten_encode(x, w, cfg, out=u_ref, lengths=lengths, feedback=fb[1])
                        _assert_fp32_close(u, u_ref, w)
                        zero = (torch.zeros(n), fb[1][1]) if feedback else None
                        kernels.reference_whiten_encode(
                            u, None, cfg, lengths=lengths, into=into(bufs[1]), feedback=zero
                        )
                key = (name, feedback)
                assert torch.equal(bufs[0], bufs[1]), key
                if feedback:
                    nan = torch.isnan(new[1])
                    assert torch.equal(torch.isnan(new[0]), nan), key
                    assert torch.equal(new[0][~nan].view(torch.int32), new[1][~nan].view(torch.int32)), key
        cut_tensor = cfg.scaling is Scaling.TENSOR  # a per-tensor group cut by a shard: the reference alone
        assert launches.calls["whiten_encode"] > 0 or cut_tensor

    PLACE_CASES = [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.bfloat16),
        (torch.float16, torch.float16),
    ]

    @pytest.mark.parametrize("world", [3, 4, 7])
    @pytest.mark.parametrize("dtype,wire", PLACE_CASES, ids=str)
    def test_placed_cast_and_plain(world, dtype, wire, monkeypatch):
        """``cast_bucket`` (the float intra-node wire, no whitening) and ``plain_bucket`` (``off`` in the
        bucket's dtype, ``bf16``), fused vs the PyTorch path: the buffers bit for bit (round to nearest
        even, NaN and Inf included) whatever the shards. A truncating cast, a value placed by the wrong
        shard, or a plain segment placed from its bucket offset instead of its class offset fails."""
        launches = _Launches(monkeypatch)
        layout = BucketLayout(NUMEL, world, SEGMENTS, CodecConfig(), dtype)
        flat = _bucket().to(dtype)
        for name, pk in _packings(layout, wire):
            bufs = []
            for fused in (False, True):
                buf = torch.zeros(pk.nbytes, dtype=torch.uint8)
                codec.cast_bucket(buf, pk, flat, layout, [None] * len(SEGMENTS), wire, kernels.CodecOps(fused))
                codec.plain_bucket(buf, pk, flat, layout, kernels.CodecOps(fused))
                bufs.append(buf)
            _assert_same_placed(bufs, pk, layout, wire, name)
        assert launches.calls["whiten_place"] == len(_packings(layout)) * len(SEGMENTS)

    @pytest.mark.parametrize("wire", [torch.bfloat16, torch.float32], ids=str)
    def test_placed_cast_with_whitening(wire, monkeypatch):
        """``cast_bucket`` with GIFT's ``G T`` (``G Q``, then the placed cast): within FP32 rounding of
        the reference's ``U`` plus the wire's rounding (one BF16 unit in the last place, 2^-8 relative,
        as two nearby values may round apart); with a rank-0 whitening (``U = G D^{-1/2}``, one rounded
        product) bit for bit. ``U`` placed by its unwhitened positions or with the wrong row's ``P`` fails."""
        launches = _Launches(monkeypatch)
        layout = BucketLayout(NUMEL, 4, SEGMENTS, CodecConfig(), torch.float32)
        flat = _bucket(special=False)
        ulp = 2.0**-8 if wire is torch.bfloat16 else 0.0
        for rank in (0, 4):
            ts = [
                _whitening(s.cols, rank, "cpu", seed=i) if s.mode is Mode.GIFT else None for i, s in enumerate(SEGMENTS)
            ]
            for name, pk in _packings(layout, wire):
                bufs = []
                for fused in (False, True):
                    buf = torch.zeros(pk.nbytes, dtype=torch.uint8)
                    codec.cast_bucket(buf, pk, flat, layout, ts, wire, kernels.CodecOps(fused))
                    bufs.append(buf)
                if rank == 0:
                    assert torch.equal(bufs[0], bufs[1]), name
                    continue
                spans = [
                    (layout.seg_at[i], layout.seg_at[i] + SEGMENTS[i].rows * SEGMENTS[i].cols)
                    for i in layout.coded_segments
                ]
                index = torch.cat([pk.place["coded"].index(a, b) for a, b in spans])
                ref, got = (b.view(wire)[index].float() for b in bufs)
                for i in layout.coded_segments:
                    s, at = SEGMENTS[i], layout.seg_at[i]
                    r, k = (v[at : at + s.rows * s.cols].view(s.rows, s.cols) for v in (ref, got))
                    if ts[i] is None:
                        assert torch.equal(r, k), (name, s.name)
                    else:
                        from tests.unit.test_whitening import fp32_bound

                        bound = 2 * fp32_bound(ts[i].dense()[0], 2) + ulp
                        assert ((k - r).norm(dim=1) <= bound * r.norm(dim=1)).all(), (name, s.name)
        assert launches.calls["whiten_place"] > 0

    @pytest.mark.parametrize("cfg", [CodecConfig(), CodecConfig(FP8Format.E5M2, Scaling.MX)], ids=lambda c: c.name)
    def test_encode_bucket_with_error_feedback(cfg):
        """``encode_bucket`` + ``plain_bucket`` with error feedback on the fused path vs the PyTorch path
        (rank-0 whitening: one rounded product, so both compute the same ``U``): the buffer and the
        new residual bit for bit. On each path the residual written in place is the one written to a
        buffer of its own (``StagedResidual``), which every coded element reaches. Bugs caught: an
        element read after the in-place write (a pass reading ``e`` again), a coded element never
        written. The kernels ran (error feedback no longer turns them off)."""
        from tests.staged_residual import StagedResidual

        layout = BucketLayout(NUMEL, 4, SEGMENTS, cfg, torch.float32)
        ts = [_whitening(s.cols, 0, "cpu", seed=i) if s.mode is Mode.GIFT else None for i, s in enumerate(SEGMENTS)]
        flat = _bucket(special=False)
        old = torch.randn(layout.n_coded, generator=torch.Generator().manual_seed(3)) * 0.01
        for name, pk in _packings(layout):
            out = []
            for fused in (False, True):
                efs, bufs = (ErrorFeedback(layout.n_coded), StagedResidual(old)), []
                for ef in efs:
                    ef.residual.copy_(old)
                    buf = torch.zeros(pk.nbytes, dtype=torch.uint8)
                    codec.encode_bucket(buf, pk, flat, layout, ts, kernels.CodecOps(fused), ef)
                    codec.plain_bucket(buf, pk, flat, layout, kernels.CodecOps(fused))
                    ef.commit()
                    bufs.append(buf)
                in_place, staged = efs[0].residual, efs[1].staged
                assert torch.isfinite(staged).all() and torch.equal(efs[1].residual, old), name  # e only read
                assert torch.equal(in_place.view(torch.int32), staged.view(torch.int32)), name
                assert torch.equal(bufs[0], bufs[1]), name
                out.append((bufs[0], staged))
            assert torch.equal(out[0][0], out[1][0]), name
            assert torch.equal(out[0][1].view(torch.int32), out[1][1].view(torch.int32)), name

    # -- launch counts -----------------------------------------------------------------------------
    def _scaled_segments(rows):
        """The same segment structure at any size: two GIFT weights, a Euclidean one, two plain ones."""
        cols = 256
        a = 0
        b = a + rows * cols + 320
        c = b + rows * cols + 256
        return [
            Segment(a, rows, cols, Mode.GIFT, "a"),
            Segment(a + rows * cols, 1, 300, Mode.OFF, "norm"),
            Segment(b, rows, cols, Mode.EUCLIDEAN, "b"),
            Segment(b + rows * cols, 1, 200, Mode.BF16, "bias"),
            Segment(c, 2 * rows, cols, Mode.GIFT, "c"),
        ]

    class _Stub:
        """A recording stand-in for a Triton kernel: ``kernel[grid](...)`` counts, runs nothing."""

        def __init__(self, log, name):
            self.log, self.name = log, name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                self.log[self.name] += 1

            return launch

    def _stage_counts(monkeypatch, elements, world, stage, fused, scaling=Scaling.BLOCK):
        """``(ATen ops, Triton launches)`` of one sender stage (``stage``: flat FP8 send, flat send with
        error feedback, two-level intra-node stage in BF16 or FP8; the buffer and packing as the
        stages build them), the second run of it (the first builds the layout's plans)."""
        from megatron_gift.kernels import fused as fused_module
        from megatron_gift.kernels import place as place_module

        log = collections.Counter()
        stubbed = ((fused_module, "_encode_kernel"), (fused_module, "_project_kernel"), (place_module, "_place_kernel"))
        for module, name in stubbed:
            monkeypatch.setattr(module, name, _Stub(log, name))
        segs = _scaled_segments(elements // (4 * 256))
        numel = -(-segs[-1].end // world) * world
        layout = BucketLayout(numel, world, segs, CodecConfig(scaling=scaling), torch.float32)
        ts = [_whitening(s.cols, 8, "cpu", seed=i) if s.mode is Mode.GIFT else None for i, s in enumerate(segs)]
        wire = torch.bfloat16 if stage == "intra-bf16" else None
        name, pk = _packings(layout, wire)[0 if stage.startswith("flat") else 1]
        flat = torch.randn(numel)
        ef = ErrorFeedback(layout.n_coded) if stage == "flat-ef" else None

        def run():
            buf = torch.empty(pk.nbytes, dtype=torch.uint8)
            if wire is None:
                codec.encode_bucket(buf, pk, flat, layout, ts, kernels.CodecOps(fused), ef)
            else:
                codec.cast_bucket(buf, pk, flat, layout, ts, wire, kernels.CodecOps(fused))
            codec.plain_bucket(buf, pk, flat, layout, kernels.CodecOps(fused))

        run()
        log.clear()
        with OpCounter() as ops:
            run()
        return ops.total, sum(log.values())

    STAGES = ["flat", "flat-ef", "intra-bf16", "intra-fp8"]

    @pytest.mark.parametrize("fused", [True, False], ids=["fused", "pytorch"])
    @pytest.mark.parametrize("stage", STAGES)
    def test_sender_launches_do_not_grow(stage, fused, monkeypatch):
        """A sender stage's ATen ops plus Triton launches are the same for buckets of 64K and 1M
        elements (the same five segments) and at 2 and 8 ranks, the fused path within
        ``4 + 3 x segments`` launches. A chunk loop over elements, or a loop over the messages, fails.
        (Recording stubs stand for the kernels on the fused path: only launches are counted.)"""
        counts = {}
        for elements in (1 << 16, 1 << 20):
            for world in (2, 8):
                counts[(elements, world)] = _stage_counts(monkeypatch, elements, world, stage, fused)
        print(stage, "fused" if fused else "pytorch", counts)
        assert len(set(counts.values())) == 1, counts
        ops, launches = counts[(1 << 16, 2)]
        assert (launches > 0) == fused
        assert launches <= 4 + 3 * len(_scaled_segments(1)), launches

    @pytest.mark.parametrize("scaling", [Scaling.ROW, Scaling.MX])
    def test_other_scalings_sender_launches_do_not_grow(scaling, monkeypatch):
        """The same on the fused path for ROW scaling (one pass by the layout's groups) and MX (two
        passes: the maxima, a few ops turning them into E8M0 scales, the encode)."""
        counts = {
            (e, w): _stage_counts(monkeypatch, e, w, "flat", True, scaling) for e in (1 << 16, 1 << 20) for w in (2, 8)
        }
        assert len(set(counts.values())) == 1, counts

else:  # the outer run only, so that the interpreter run's summary has no skips

    def test_send_under_interpreter():
        """The tests of this file on the CPU, in Triton's interpreter, in a fresh process."""
        assert_passes_under_interpreter(__file__, limit=1200)
