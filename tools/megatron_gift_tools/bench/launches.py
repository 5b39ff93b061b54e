"""``megatron-gift bench launches``: ATen ops, Triton launches and bytes per stage of one bucket
reduction, against the bytes a fused pass must move, and the plugin's host time per bucket.

Each record is one bucket reduced by rank 0 of a simulated group (``testing.simulate``: a fake
process group, recorded collectives) and metered stage by stage (``testing.meter``):

- ``path``: ``flat`` or ``two-level/<intra dtype>`` (``bf16``, ``fp8``), ``-rs`` (reduce-scatter,
  the distributed optimizer) or ``-ar`` (all-reduce); ``-nvfp4-rs``: the four-bit exchange between
  nodes (``comm.fp4_reduce``, NVFP4: ``euclidean`` buckets unrotated, the planner's Euclidean rows;
  ``gift`` buckets with the Hadamard rotation, GIFT + Hadamard; both of ``[rows, 1536]`` parameters,
  the rotation's whole 64-column blocks, rows cut by the shards; its messages
  in the essential bytes are the FP4 ones, the rotation's passes are not); ``two-level/reduce-scatter-nvfp4-rs``: the
  same after a plain reduce-scatter inside the node (``comm.sum_first``); ``kernels``: ``fused`` (the Triton path CUDA
  takes, launches recorded by stubs on ``meta`` tensors: nothing is computed) or ``pytorch``
  (the reference path);
- ``bucket``: the same segment structure at every size (four ``[rows, 1000]`` parameters, rows
  scaled with the bucket, padding after them): ``euclidean``, ``gift`` (each a parameter's
  whitening of rank 8), ``plain`` (GIFT, Euclidean, an ``off`` and a ``bf16`` parameter),
  ``euclidean+ef`` (error feedback), ``gift+out`` (two-sided: ``gift`` with an output-side
  whitening of rank 8 per parameter, ``comm.output_side``: ``T_outᵀ`` in the send's encode pass,
  ``P``'s partials after the last inner stage, and the ``output`` stage);
- per stage: ``aten_ops``, ``triton_launches``, ``bytes_read`` / ``bytes_written`` (ATen ops by
  the tensors they touch, kernels by their ``TRAFFIC`` formulas), ``essential_read`` /
  ``essential_written`` (what one fused pass must move: below) and ``ratio`` (moved / essential);
- ``host_ms``: the plugin's own host time per bucket, kernels stubbed: the stages' thread CPU
  time (other processes' time on a shared machine is not in it) less the time inside ATen
  dispatch (``testing.meter``'s ``python_s``: on ``meta`` tensors an op's shape function costs
  more than a CUDA launch's host side, so it is left out; it keeps Python's own cost of each
  torch call, ~5-9 µs, ``machine.probe_overhead_us``; on a GPU add each launch's dispatch);
- ``delta-gather`` (the parameter all-gather as coded changes: encode, decode), ``refresh`` (one
  GIFT refresh of the demo model's layers on real CPU tensors) and ``launcher`` (ops dispatched
  from the plugin's frames in a steady step of the real launcher on 2 gloo ranks).

Essential bytes (``b``: the bucket's bytes per element; messages in the wire format,
``comm.layout``; a GIFT parameter's input is read twice, once for its projection ``G Q`` or
``S Q`` and once for the pass, and so is a two-sided parameter's at the send (``Pre = c ⊙ Q_outᵀ
D_out^{-1/2} G``, a sum over all rows, from the read that gives ``G Q``), or, where that is less,
the receiver's FP32 sum is read twice and rewritten instead of its senders' messages read again):
send / intra-node stage: read the bucket, write every message; node sums: read the node's messages
of the held shards, write their FP8 messages; reduce: read every sender's message of the own shard,
write the shard (``b`` per element); cut rows: their values read and written; all-reduce gather:
read the senders' messages, write one; decode of all: read every shard's message, write the
bucket; an all-gather's own stage moves nothing. Summing first (``reduce-scatter``): the collective's
stage moves nothing; the held sums' one pass is split at the cut rows' exchange: ``rows`` reads the
held sums (a GIFT parameter's twice), ``node_sums`` writes their FP4 messages.
Error feedback adds the residual read and written (FP32). The output side's stage reads its FP32
``W`` and writes the rank's elements (``b`` per element; ``P`` aside); its other work (``W``
through FP32 targets, ``P``'s partials) is not counted as essential: a fused pass would fold it
into the existing ones, so the ratios show its cost. Delta gather (``comm.param_delta``, a
shard of ``S`` BF16 elements, message ``m``): encode reads ``new`` and ``prev`` (``4S``), writes
the message; decode reads the ``p`` messages and every shard's base (``2pS``, the owner's from
``prev``), writes the parameters and the owner's ``prev`` (``2pS + 2S``).

Buckets ``euclidean/8`` and ``gift/8`` (eight parameters instead of four, at one size and two
group sizes) give each stage's launches per parameter segment (the planner's launch count for
a bucket of any number of parameters: ``planner.metered``); on the FP4 paths ``gift/2w`` (four GIFT
parameters of two widths, ``[rows, 1536]`` and ``[rows, 768]``) gives those per width beyond the first
(the sum-first exchange batches the parameters of one shape).

The JSON records ``date`` (UTC) and ``sources``: the SHA-256 of the files metered (``SOURCES``:
the kernels, the reduction and gather code, the numerics they call, this meter). A test
(``tests/tools/test_planner_meter.py``) fails when the committed JSON's hash is not the checkout's:
regenerate it with ``REGENERATE`` (about two minutes on two cores).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from megatron_gift.comm.fp4_reduce import ROTATION_BLOCK, FP4Reduce, FP4TwoLevelReduce, fp4_message
from megatron_gift.comm.hierarchical import TwoLevelReduce, intra_wire
from megatron_gift.comm.layout import BucketLayout, Segment
from megatron_gift.comm.ledger import CommLedger
from megatron_gift.comm.output_side import OutputSide
from megatron_gift.comm.quantized import QuantizedReduce
from megatron_gift.comm.schedule import ReductionQueue, StageStreams
from megatron_gift.comm.sum_first import FP4SumFirstReduce
from megatron_gift.comm.topology import Topology, TwoLevelGroups
from megatron_gift.config import IntraNode, Mode, Schedule
from megatron_gift.numerics.error_feedback import ErrorFeedback
from megatron_gift.numerics.fp4 import FP4_FORMATS
from megatron_gift.numerics.fp8 import CodecConfig
from megatron_gift.numerics.rotation import BlockHadamard
from megatron_gift.numerics.whitening import LowRankWhitening
from megatron_gift.testing.simulate import FakeGroup, kernels_on, recorded_collectives
from megatron_gift_tools.meter import Meter, probe_overhead

SIZES = {"1M": 1 << 20, "10M": 10 << 20, "40M": 40 << 20, "200M": 200 << 20}
DPS = (2, 8, 64, 512)
COLS, RANK = 1000, 8
# an FP4 path's parameters: rows of whole 64-column rotation blocks (the layout's block rule), not dividing
# the shards, so that shard boundaries cut GIFT rows as a model's do (1024 columns never did: their cut-row
# work went unseen)
FP4_COLS = 1536
FP4_PATHS = ("flat-nvfp4-rs", "two-level/bf16-nvfp4-rs", "two-level/fp8-nvfp4-rs", "two-level/reduce-scatter-nvfp4-rs")
BUCKETS = {
    "euclidean": (Mode.EUCLIDEAN,) * 4,
    "gift": (Mode.GIFT,) * 4,
    "plain": (Mode.GIFT, Mode.EUCLIDEAN, Mode.OFF, Mode.BF16),
    "euclidean+ef": (Mode.EUCLIDEAN,) * 4,
    "gift+out": (Mode.GIFT,) * 4,
    "euclidean/8": (Mode.EUCLIDEAN,) * 8,
    "gift/8": (Mode.GIFT,) * 8,
    "gift/2w": (Mode.GIFT,) * 4,
}
WIDTHS = {"gift/2w": (1, 2, 1, 2)}
"""a bucket's parameters' widths, as divisors of the path's columns (other buckets: one width)."""
SEGMENT_SCAN = ("10M", (64, 512))
"""size and group sizes of the ``*/8`` buckets (launches per segment)."""
RANKS_PER_NODE = 8  # two-level: min(8, p/2) ranks per node
ROOT = Path(__file__).resolve().parents[3]
SOURCES = (
    "megatron_gift/kernels/*.py",
    "megatron_gift/comm/*.py",
    "megatron_gift/numerics/fp8.py",
    "megatron_gift/numerics/wire.py",
    "megatron_gift/numerics/whitening.py",
    "megatron_gift/numerics/two_sided.py",
    "megatron_gift/numerics/error_feedback.py",
    "megatron_gift/testing/simulate.py",
    "tools/megatron_gift_tools/meter.py",
    "tools/megatron_gift_tools/bench/launches.py",
)
"""the files whose launches and bytes the JSON records (globs under the repository root)."""
REGENERATE = "megatron-gift bench launches --json bench/results/launches-cpu.json"
"""the command that rewrites the committed JSON (the full scan)."""


def source_hash() -> dict:
    """``files`` (``SOURCES`` expanded, sorted) and the SHA-256 of their paths and bytes."""
    files = sorted({f.relative_to(ROOT).as_posix() for pat in SOURCES for f in ROOT.glob(pat)})
    h = hashlib.sha256()
    for name in files:
        h.update(name.encode() + b"\0" + (ROOT / name).read_bytes() + b"\0")
    return dict(files=files, sha256=h.hexdigest())


def segments(numel: int, modes, cols: int | tuple[int, ...] = COLS) -> list[Segment]:
    """A ``[rows, cols]`` parameter per mode (``cols``: one width, or one per parameter), each an equal share
    of ``numel`` in whole rows (the rest padding), the same structure at every size."""
    widths = (cols,) * len(modes) if isinstance(cols, int) else cols
    out, at = [], 0
    for i, (m, c) in enumerate(zip(modes, widths)):
        rows = numel // (len(modes) * c)
        out.append(Segment(at, rows, c, m, f"p{i}"))
        at += rows * c
    return out


def _whitenings(segs, device, output: bool = False):
    """A rank-``RANK`` whitening per GIFT parameter (input side: ``cols``; ``output``:
    ``rows``), random finite values."""
    out = []
    for s in segs:
        if s.mode is not Mode.GIFT:
            out.append(None)
            continue
        w = LowRankWhitening.empty(s.rows if output else s.cols, RANK, device=device)
        if device.type != "meta":  # finite values for a real run
            gen = torch.Generator().manual_seed(s.start + output)
            for t in w.tensors().values():
                t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
        out.append(w)
    return out


def _two_level_groups(p: int, rank: int) -> TwoLevelGroups:
    g = min(RANKS_PER_NODE, p // 2)
    topo = Topology(p // g, g)
    return TwoLevelGroups(FakeGroup(p, rank), topo, FakeGroup(g, topo.local(rank)), FakeGroup(p // g, topo.node(rank)))


class Case:
    """One bucket reduction to meter: its layout and how to build the reduction."""

    def __init__(
        self,
        path: str,
        bucket: str,
        numel: int,
        p: int,
        kernels: str,
        device: str = "meta",
        rank: int = 0,
        layout: BucketLayout | None = None,
    ):
        self.path, self.bucket, self.numel, self.p, self.kernels = path, bucket, numel, p, kernels
        self.device, self.rank = torch.device(device), rank
        fmt = next((f for name, f in FP4_FORMATS.items() if f"-{name}-" in path), None)
        self.fmt = fmt  # the FP4 format between nodes (``-nvfp4-`` in the path), rotated where whitened
        cols = COLS if fmt is None else FP4_COLS
        cols = tuple(cols // k for k in WIDTHS[bucket]) if bucket in WIDTHS else cols
        self.layout = layout or BucketLayout(
            numel, p, segments(numel, BUCKETS[bucket], cols), CodecConfig(), torch.float32
        )
        self.transforms = _whitenings(self.layout.segments, self.device)
        self.outputs = _whitenings(self.layout.segments, self.device, output=True) if bucket.endswith("+out") else None
        self.flat = torch.empty(numel, device=self.device)
        if self.device.type != "meta":
            self.flat.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(rank)))
        self.error_feedback = ErrorFeedback(numel, device=self.device) if bucket.endswith("+ef") else None

    @property
    def two_level(self) -> bool:
        return self.path.startswith("two-level")

    @property
    def all_reduce(self) -> bool:
        return self.path.endswith("-ar")

    @property
    def intra(self) -> IntraNode | None:
        """``two-level/<intra>[-<fp4 format>]-rs|ar``'s intra-node stage."""
        if not self.two_level:
            return None
        name = self.path.split("/")[1].removesuffix("-rs").removesuffix("-ar")
        return IntraNode(name.removesuffix(f"-{self.fmt.name}") if self.fmt is not None else name)

    def reduction(self):
        fused = self.kernels == "fused"
        if self.fmt is not None:
            # GIFT buckets with the rotation (GIFT + Hadamard), Euclidean ones without (Euclidean NVFP4)
            whitened = any(t is not None for t in self.transforms)
            rotation = BlockHadamard(ROTATION_BLOCK, 0) if whitened else None
            common = dict(average=True, all_reduce=self.all_reduce, rotation=rotation, kernels=fused)
            if self.intra is IntraNode.REDUCE_SCATTER:
                groups = _two_level_groups(self.p, self.rank)
                return FP4SumFirstReduce(self.flat, self.layout, groups, self.transforms, self.fmt, **common)
            if self.two_level:
                groups = _two_level_groups(self.p, self.rank)
                return FP4TwoLevelReduce(
                    self.flat, self.layout, groups, self.transforms, self.fmt, self.intra, **common
                )
            return FP4Reduce(self.flat, self.layout, FakeGroup(self.p, self.rank), self.transforms, self.fmt, **common)
        if self.two_level:
            inner = TwoLevelReduce(
                self.flat,
                self.layout,
                _two_level_groups(self.p, self.rank),
                self.transforms,
                intra=self.intra,
                average=True,
                all_reduce=self.all_reduce,
                kernels=fused,
            )
        else:
            inner = QuantizedReduce(
                self.flat,
                self.layout,
                FakeGroup(self.p, self.rank),
                self.transforms,
                error_feedback=self.error_feedback,
                average=True,
                all_reduce=self.all_reduce,
                kernels=fused,
            )
        return inner if self.outputs is None else OutputSide(inner, self.outputs, CommLedger())

    def run(self, meter: Meter) -> None:
        """One reduction through a ``ReductionQueue``, every stage inside ``meter.probe``."""
        reduction = self.reduction()
        meter.names = [getattr(s, "__name__", f"stage {k}").lstrip("_") for k, s in enumerate(reduction.stages())]
        queue = ReductionQueue(StageStreams(self.device), Schedule.EAGER)
        queue.probe = meter.probe
        queue.wait(queue.start(reduction))


def essential(case: Case, stage: str) -> tuple[int, int] | None:
    """The module doc's essential ``(read, written)`` of ``stage`` for rank ``case.rank``; None for a
    stage this model does not know."""
    layout, r, b = case.layout, case.rank, 4
    segs = layout.segments
    code = layout.coded_dtype().itemsize

    def msg(shards, wire=None) -> int:  # the FP4 path's: its inter-node messages, the intra-node stage's as FP8's
        if case.fmt is not None and wire is None:
            return sum(fp4_message(layout, j, case.fmt).nbytes for j in shards)
        return layout.message(list(shards), wire).nbytes

    def gift_codes(j: int) -> int:  # the second read of a GIFT parameter's codes in shard j
        return code * sum(p.hi - p.lo for p in layout.shards[j].coded_parts if segs[p.seg].mode is Mode.GIFT)

    def shard_elements(j: int) -> int:
        plan = layout.shards[j]
        return plan.n_coded + sum(h - lo for lo, h in zip(plan.plain_lo, plan.plain_hi))

    two_sided = case.outputs or [None] * len(segs)
    bucket_read = sum(
        s.rows * s.cols * b * (2 if s.mode is Mode.GIFT or w is not None else 1) for s, w in zip(segs, two_sided)
    )
    ef = 8 * layout.n_coded if case.error_feedback is not None else 0
    p = layout.num_shards
    if case.two_level:
        topo = _two_level_groups(p, r).topology
        senders, held = topo.nodes, topo.inter_ranks(r)
        wire = intra_wire(case.intra, torch.float32)
    else:
        senders, held, wire = p, None, None
    pieces = sum(x.c1 - x.c0 for x in layout.shards[r].pieces)
    if stage == "send":
        return bucket_read + ef // 2, sum(msg([j]) for j in range(p)) + ef // 2
    if case.intra is IntraNode.REDUCE_SCATTER:  # the collective sums; the held sums' one pass is split in two
        if stage == "intra":
            return 0, 0
        if stage == "rows":  # the held sums read (GIFT rows twice: their projections)
            return sum(shard_elements(j) * b + 4 * gift_codes(j) // code for j in held), 0
        if stage == "node_sums":  # the held shards' FP4 messages written
            return 0, sum(msg([j]) for j in held)
    if stage == "intra":
        g = topo.ranks_per_node
        return bucket_read, sum(msg(topo.inter_ranks(lp), wire) for lp in range(g))
    if stage == "node_sums":
        return topo.ranks_per_node * msg(held, wire), sum(msg([j]) for j in held)
    if stage == "reduce":  # GIFT's S Q: the messages read again, or the FP32 sum read twice and rewritten
        again = gift_codes(r) // code
        codes = again * (code if case.fmt is None else 0.5)  # FP4: half a byte per code
        twice = (senders * codes, 0) if senders * codes <= 3 * 4 * again else (2 * 4 * again, 4 * again)
        return senders * msg([r]) + twice[0], shard_elements(r) * b + twice[1]
    if stage == "finish":
        return 4 * pieces, b * pieces
    if stage in ("gather", "gather_inter"):
        return senders * msg([r]), msg([r])
    if stage == "gather_intra":
        return 0, 0
    if stage == "output":
        own = sum(hi - lo for lo, hi in case.reduction().owned.values())  # the OutputSide's elements of rank r
        return 4 * own, b * own
    if stage == "decode_all":
        return sum(msg([j]) + gift_codes(j) for j in range(p)), sum(shard_elements(j) for j in range(p)) * b
    return None


def _with_essentials(stages: list[dict], ess: list) -> list[dict]:
    for s, e in zip(stages, ess):
        s["essential_read"], s["essential_written"] = e if e is not None else (None, None)
        moved, need = s["bytes_read"] + s["bytes_written"], (sum(e) if e is not None else 0)
        s["ratio"] = round(moved / need, 2) if need else None
    return stages


def counted(case: Case) -> tuple[list, list]:
    """The metered stages (``meter.StageCount``) of one steady reduction of ``case`` (a first,
    uncounted run builds the layout's plans) and the collectives it issued. On ``meta`` tensors the
    kernels are stubbed; on CPU tensors they run (``fused``: under Triton's interpreter only)."""
    stub = case.device.type == "meta"
    with recorded_collectives() as calls, kernels_on(case.device) if stub else contextlib.nullcontext():
        with Meter(stub=stub, count_ops=False) as warm:
            case.run(warm)
        n_calls = len(calls)
        with Meter(stub=stub) as meter:
            case.run(meter)
    return meter.stages, calls[n_calls:]


def host_seconds(case: Case, reps: int = 2) -> list[float]:
    """Per stage, the least over ``reps`` runs of its host CPU time outside ATen dispatch (``python_s``)."""
    stub = case.device.type == "meta"
    best = None
    with recorded_collectives(), kernels_on(case.device) if stub else contextlib.nullcontext():
        for _ in range(reps):
            with Meter(stub=stub, count_ops=False) as timer:
                case.run(timer)
            run = [s.python_s for s in timer.stages]
            best = run if best is None else [min(a, b) for a, b in zip(best, run)]
    return best


def measure(case: Case, timing_reps: int = 2) -> dict:
    """One record: ``counted`` and ``host_seconds`` of ``case`` with its essential bytes."""
    counts, collectives = counted(case)
    stages = [s.as_dict() for s in counts]
    for s, t in zip(stages, host_seconds(case, timing_reps)):
        s["host_ms"] = round(1e3 * t, 3)
    _with_essentials(stages, [essential(case, s["stage"]) for s in stages])
    segs = case.layout.segments
    return dict(
        kind="reduction",
        path=case.path,
        kernels=case.kernels,
        bucket=case.bucket,
        elements=case.numel,
        parameter_elements=sum(s.rows * s.cols for s in segs),
        segments=len(segs),
        dp=case.p,
        rank=case.rank,
        stages=stages,
        launches=sum(s["launches"] for s in stages),
        host_ms=round(sum(s["host_ms"] for s in stages), 3),
        collectives=[list(c) for c in collectives],
    )


def scan(quick: bool) -> list[tuple]:
    """``(path, bucket, size, dp, kernels)`` of every reduction record."""
    sizes = ("1M", "10M") if quick else tuple(SIZES)
    dps = (2, 64) if quick else DPS
    torch_sizes = ("1M",) if quick else ("1M", "10M")  # the PyTorch path (the reference, CPU): two sizes
    out = []
    paths = ["flat-rs", "flat-ar", "two-level/bf16-rs", "two-level/fp8-rs", "two-level/bf16-ar", "two-level/fp8-ar"]
    paths += list(FP4_PATHS)
    if quick:
        paths = ["flat-rs", "two-level/bf16-rs"]  # Megatron's distributed optimizer, flat and the default two-level
    for bucket in ("euclidean", "gift", "plain", "euclidean+ef", "gift+out") + (
        () if quick else ("euclidean/8", "gift/8", "gift/2w")
    ):
        for size in sizes:
            for dp in dps:
                for path in paths:
                    if path in FP4_PATHS and bucket not in ("euclidean", "gift", "euclidean/8", "gift/8", "gift/2w"):
                        continue  # FP4 refuses error feedback and the output side at start-up
                    if bucket in WIDTHS and path not in FP4_PATHS:
                        continue  # launches per width: the FP4 paths' (the sum-first exchange's batches)
                    if bucket.endswith("+ef") and (path != "flat-rs" or SIZES[size] > SIZES[torch_sizes[-1]]):
                        # error feedback: the flat reduce-scatter's sender (the same encode elsewhere),
                        # at the PyTorch path's sizes
                        continue
                    if path.startswith("two-level") and dp < 4:
                        continue  # two levels need >1 node of >1 ranks
                    scan_only = bucket.endswith("/8") or bucket in WIDTHS
                    if scan_only and (size, dp) not in [(SEGMENT_SCAN[0], d) for d in SEGMENT_SCAN[1]]:
                        continue
                    out.append((path, bucket, size, dp, "fused"))
    for bucket in ("euclidean", "gift"):
        for size in torch_sizes:
            for dp in (2, 8) if quick else (2, 512):
                out.append(("flat-rs", bucket, size, dp, "pytorch"))
    # the quick cases first (on meta tensors each op costs ~0.1-4 ms of shape functions: the BF16
    # intra-node cast, error feedback and the PyTorch path dispatch the most), each from the smallest bucket up
    slow = lambda c: c[4] != "fused" or c[0].startswith("two-level/bf16") or c[1].endswith("+ef")  # noqa: E731
    return sorted(out, key=lambda c: (slow(c), SIZES[c[2]], c[4] != "fused"))


def delta_gather(numel: int, p: int, kernels: str = "fused") -> dict:
    """The delta parameter gather of one BF16 bucket of ``numel`` elements at ``p`` ranks, metered
    (encode: ``start``; decode: the handle's ``wait``), on ``meta`` tensors; ``kernels``: ``fused``
    (``kernels.delta``, stubbed, as CUDA runs it) or ``pytorch``."""
    from megatron_gift.comm.param_delta import DeltaGather, message_bytes

    buf = torch.empty(numel, dtype=torch.bfloat16, device="meta")
    fused = kernels == "fused"
    with recorded_collectives() as calls, kernels_on("meta") if fused else contextlib.nullcontext():
        dg = DeltaGather([buf], FakeGroup(p, 0), fused=fused)
        dg.start(async_op=False, full=True)
        for warm in (True, False):
            meter = Meter(stub=True, count_ops=not warm)
            with meter:
                with meter.stage("encode"):
                    handle = dg.start(async_op=True)
                with meter.stage("decode"):
                    handle.wait()
    s = numel // p
    ess = [(2 * 2 * s, message_bytes(s)), (p * message_bytes(s) + 2 * numel, 2 * numel + 2 * s)]
    stages = _with_essentials([st.as_dict() for st in meter.stages], ess)
    return dict(
        kind="delta-gather",
        path="param-gather",
        kernels=kernels,
        elements=numel,
        dp=p,
        stages=stages,
        launches=sum(x["launches"] for x in stages),
        collectives=[list(c) for c in calls[-1:]],
    )


def refresh(dp: int) -> dict:
    """One GIFT refresh of the demo model's linear layers as rank 0 of ``dp`` (``bench.refresh``'s
    four calls), metered on real CPU tensors; no essential bytes (its work is small matrices)."""
    from megatron_gift.config import GiftConfig
    from megatron_gift.refresh_sync import RefreshSync
    from megatron_gift.state import GiftState
    from megatron_gift_tools.bench import refresh as bench_refresh

    cfg = GiftConfig(mode=Mode.GIFT)
    device = torch.device("cpu")
    layers = bench_refresh._layers(bench_refresh.MODELS["demo"], dp, device, cfg)
    st = RefreshSync(GiftState(cfg, device))
    st.assign_owners([(g, grp) for g, grp, _ in layers])  # the owners _layers assigned, and the layers kept
    st.state.open_step()
    remap = lambda g, old, new: None  # noqa: E731
    steps = (
        ("start", lambda: st.at_sync([(g, grp, gr) for g, grp, gr in layers if gr is not None], remap)),
        ("cores", st.after_reductions),
        ("send", lambda: st.close_step([])),
        ("install", lambda: (st.state.open_step(), st.install(remap))),
    )
    calls: list = []
    meter = Meter(stub=False)
    with bench_refresh._counted_collectives(calls), meter:
        for name, fn in steps:
            with meter.stage(name):
                fn()
    stages = [s.as_dict() for s in meter.stages]
    for s, m in zip(stages, meter.stages):
        s["host_ms"] = round(1e3 * m.host_s, 3)  # with the probe: an upper bound
        s["essential_read"] = s["essential_written"] = s["ratio"] = None
    return dict(
        kind="refresh",
        path="refresh",
        model="demo",
        gift_layers=len(layers),
        dp=dp,
        stages=stages,
        launches=sum(x["launches"] for x in stages),
    )


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return dict(
        cpu=cpu,
        cpus=os.cpu_count(),
        platform=platform.platform(),
        torch=torch.__version__,
        load_average=os.getloadavg()[0],
    )


def run(
    quick: bool,
    json_path: str | None,
    command: str | None = None,
    launcher: bool = True,
    budget_s: float | None = None,
    resume: bool = False,
) -> dict:
    """The scan (``--quick``: its subset): the launcher, delta-gather and refresh records first,
    then the reductions (``scan``'s order), the JSON rewritten after each record; past ``budget_s``
    seconds the remaining reductions are listed as ``skipped``. ``resume``: the records already in
    ``json_path`` are kept and not measured again (their essential bytes recomputed)."""
    t0 = time.time()
    threads = torch.get_num_threads()
    doc = dict(
        benchmark="launches",
        command=command or "megatron-gift bench launches" + (" --quick" if quick else ""),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        sources=source_hash(),
        machine=dict(machine(), probe_overhead_us=round(1e6 * probe_overhead(), 2)),
        wall_seconds=0.0,
        budget_s=budget_s,
        schema=__doc__,
        records=[],
        skipped=[],
    )
    records = doc["records"]
    done = set()
    if resume and json_path and os.path.exists(json_path):
        with open(json_path) as f:
            old = json.load(f)
        if old.get("sources", {}).get("sha256") != doc["sources"]["sha256"]:
            raise SystemExit(
                f"bench launches --resume: {json_path} metered other sources than the checkout's; "
                "run the scan without --resume"
            )
        doc["date"] = old["date"]  # the first part's
        records += old["records"]
        doc["wall_seconds_before_resume"] = old["wall_seconds"] + old.get("wall_seconds_before_resume", 0)
        done = {(r["path"], r.get("bucket"), r.get("size"), r["dp"], r.get("kernels")) for r in records}
        for r in records:  # the counts kept, the essential bytes by the current model
            if r["kind"] == "reduction":
                case = Case(r["path"], r["bucket"], r["elements"], r["dp"], r["kernels"])
                _with_essentials(r["stages"], [essential(case, st["stage"]) for st in r["stages"]])
        launcher = launcher and not any(r["kind"] == "launcher" for r in records)

    def save():
        doc["wall_seconds"] = round(time.time() - t0, 1)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(doc, f, indent=1)

    if launcher and torch.cuda.is_available():
        doc["launcher_skipped"] = "CUDA is available: the CPU launcher (--gift-cpu) refuses to run"
    elif launcher:
        from megatron_gift_tools.bench.launcher_ops import launcher_records

        records += launcher_records(quick)
    torch.set_num_threads(1)
    try:
        gathers = (("1M", "fused"),) if quick else (("1M", "fused"), ("200M", "fused"), ("1M", "pytorch"))
        for size, kernels in () if resume and done else gathers:
            for dp in (2, 64) if quick else DPS:
                print(f"[bench launches] delta gather {size} dp={dp} {kernels} ...", file=sys.stderr, flush=True)
                records.append(dict(delta_gather(SIZES[size], dp, kernels), size=size))
        for dp in () if resume and done else (2,) if quick else (2, 8):
            print(f"[bench launches] refresh dp={dp} ...", file=sys.stderr, flush=True)
            records.append(refresh(dp))
        save()
        layouts: dict = {}
        for path, bucket, size, dp, kernels in scan(quick):
            if (path, bucket, size, dp, kernels) in done:
                continue
            if budget_s is not None and time.time() - t0 > budget_s:
                doc["skipped"].append([path, bucket, size, dp, kernels])
                continue
            print(f"[bench launches] {path} {bucket} {size} dp={dp} {kernels} ...", file=sys.stderr, flush=True)
            # one layout (and its cached plans) per bucket, size, group and parameter width (FP4: FP4_COLS)
            key = (BUCKETS[bucket], WIDTHS.get(bucket), size, dp, "fp4" in path)
            layouts = {k: v for k, v in layouts.items() if k[2] == size}
            case = Case(path, bucket, SIZES[size], dp, kernels, layout=layouts.get(key))
            layouts[key] = case.layout
            t = time.time()
            rec = measure(case, 1 if quick else 2)
            rec["size"], rec["meter_seconds"] = size, round(time.time() - t, 1)
            records.append(rec)
            save()
    finally:
        torch.set_num_threads(threads)
    save()
    print(format_table(doc), end="")
    return doc


def _corners(records: list[dict]) -> tuple[dict, dict]:
    """The record of the smallest bucket at the smallest DP and of the largest at the largest."""
    key = lambda r: (r["elements"], r["dp"])  # noqa: E731
    return min(records, key=key), max(records, key=key)


def format_table(doc: dict) -> str:
    """Per path, kernels, bucket and stage: GPU launches (ATen ops that touch memory + Triton) of
    the smallest and the largest case scanned, the largest's ATen ops / Triton launches, bytes moved
    over essential, and host ms per bucket; then the delta gather, the refresh and the launcher."""
    groups: dict = {}
    for r in doc["records"]:
        if r["kind"] == "reduction":
            groups.setdefault((r["path"], r["kernels"], r["bucket"]), []).append(r)
    lines = [
        "| path | kernels | bucket | stage | launches (small) | launches (large) | ATen ops / Triton (large) | "
        "ratio (small, large) | host ms (small, large) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (path, kernels, bucket), recs in groups.items():
        small, large = _corners(recs)
        tag = lambda r: f"{r['size']}/DP{r['dp']}"  # noqa: E731
        for s0, s1 in zip(small["stages"], large["stages"]):
            lines.append(
                f"| {path} | {kernels} | {bucket} | {s0['stage']} | {s0['launches']} ({tag(small)}) | "
                f"{s1['launches']} ({tag(large)}) | {s1['aten_ops']} / {s1['triton_launches']} | "
                f"{s0['ratio'] or '-'}, {s1['ratio'] or '-'} | {s0['host_ms']:.2f}, {s1['host_ms']:.2f} |"
            )
    lines += [
        "",
        "| record | DP | stage | launches | ATen ops / Triton | MB moved | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["records"]:
        if r["kind"] in ("delta-gather", "refresh"):
            what = f"{r['kind']} {r.get('size', r.get('model', ''))} {r.get('kernels', '')}".rstrip()
            for s in r["stages"]:
                lines.append(
                    f"| {what} | {r['dp']} | {s['stage']} | {s['launches']} | "
                    f"{s['aten_ops']} / {s['triton_launches']} | "
                    f"{(s['bytes_read'] + s['bytes_written']) / 1e6:.1f} | {s['ratio'] or '-'} |"
                )
    for r in doc["records"]:
        if r["kind"] == "launcher":
            lines.append(
                f"| launcher {r['parameters'] / 1e6:.2f}M params ({r['mode']}) | 2 | steady step | - | "
                f"{r['plugin_ops']} plugin ops | - | {r.get('ratio_to_smaller', '-')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_gift_tools.bench.launches", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--no-launcher", action="store_true")
    ap.add_argument("--budget", type=float, default=None, metavar="S", help="stop adding reductions after S seconds")
    ap.add_argument("--resume", action="store_true", help="keep the records already in --json, measure the rest")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    run(
        args.quick,
        args.json,
        "python -m megatron_gift_tools.bench.launches " + " ".join(argv),
        not args.no_launcher,
        args.budget,
        args.resume,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
