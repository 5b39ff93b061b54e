"""Static plan of one flat gradient bucket for quantized collectives (no torch.distributed here).

A bucket ``[numel]`` holds parameters (*segments*) at known offsets and is cut into ``num_shards``
shards ``[j·S, (j+1)·S)``, ``S = ceil(numel / num_shards)``, as Megatron's distributed optimizer
cuts it (its buckets divide evenly; an all-reduce bucket's last shard may be short); a sub-bucket's
layout (``comm.rounds``) names its shards' ranges instead (``bounds``: a piece of each of the
bucket's shards, its segments the parameters' rows inside them). Elements of ``off`` parameters are
sent in the bucket's dtype and those of ``bf16`` parameters in BF16 (the two *plain* classes);
those of Euclidean and GIFT parameters are *coded* in FP8. Padding between parameters is neither:
it is not sent and not written (Megatron keeps it zero). The coded elements in bucket order form
the *coded sequence* (``n_coded``), each plain class its own sequence; a shard's elements are a
contiguous range of each.

Scaling groups follow each parameter's granularity (``fp8.group_lengths``) and are additionally
cut at shard boundaries, so every group lives in one shard and each shard's message is
self-contained. A message holding shards ``J`` (one shard for the flat exchange; several for the
two-level exchange's intra-node stage) is, each section padded to 4 bytes::

    [scales of J | off values of J | bf16 values of J | coded values of J]

with the coded values as codes of the codec's wire format (``wire=None``; ``codec.fmt``, the
table ``numerics.wire``: its bytes per element) or in a float wire dtype (no scales section);
within a section the shards follow one another in ``J``'s order. GIFT rows cut by a shard
boundary are recorded as ``RowPiece``s so the receiver can apply ``T⁻¹`` with only an r-float
exchange per piece.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property

import torch

from ..config import Mode
from ..numerics.fp8 import CodecConfig, group_lengths

FP8_MODES = (Mode.EUCLIDEAN, Mode.GIFT)


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4


def values_bytes(mode: Mode, n: int, codec: CodecConfig, raw_itemsize: float | None = None) -> int:
    """Bytes of ``n`` gradient values of a ``mode`` parameter on the wire, their scales aside: codes of the
    codec's format (FP8 modes), BF16, or the bucket's dtype of ``raw_itemsize`` bytes (``off``)."""
    if mode in FP8_MODES:
        return codec.fmt.payload_bytes(n)
    return n * (2 if mode is Mode.BF16 else raw_itemsize)


def wire_bytes(mode: Mode, rows: int, cols: int, codec: CodecConfig, raw_itemsize: float | None = None) -> int:
    """Bytes of one ``[rows, cols]`` parameter's gradient in a rank's messages (before a collective's
    ``(R-1)/R``): its values and, coded, the scales of its groups; the one count the telemetry and the
    planner take."""
    scales = codec.scale_bytes(rows, cols) if mode in FP8_MODES else 0
    return values_bytes(mode, rows * cols, codec, raw_itemsize) + scales


@dataclass(frozen=True)
class Segment:
    """One parameter's gradient: bucket elements ``[start, start + rows·cols)`` viewed ``[rows, cols]``."""

    start: int
    rows: int
    cols: int
    mode: Mode
    name: str = ""

    @property
    def end(self) -> int:
        return self.start + self.rows * self.cols


@dataclass(frozen=True)
class RowPiece:
    """Columns ``[c0, c1)`` of row ``row`` of GIFT segment ``seg``, inside one shard."""

    seg: int
    row: int
    c0: int
    c1: int

    def flat(self, segment: Segment) -> tuple[int, int]:
        base = segment.start + self.row * segment.cols
        return base + self.c0, base + self.c1


@dataclass(frozen=True)
class Part:
    """Segment ``seg``'s bucket elements ``[lo, hi)`` inside one shard; ``at``: the index of
    ``lo`` in the segment's class sequence (coded, or its plain class)."""

    seg: int
    lo: int
    hi: int
    at: int


@dataclass
class ShardPlan:
    """What shard ``j`` holds: bucket ``[lo, hi)``, its ranges of the coded sequence, of the
    groups and of each plain class, its segments' parts and GIFT rows, and its own message."""

    lo: int
    hi: int
    coded_lo: int
    coded_hi: int
    group_lo: int
    group_hi: int
    plain_lo: list[int]
    plain_hi: list[int]
    coded_parts: list[Part]
    plain_parts: list[list[Part]]  # per plain class (off, bf16)
    gift_rows: list[tuple[int, int, int]]  # (segment, first full row, end row)
    pieces: list[RowPiece]
    scale_bytes: int
    plain_bytes: list[int]
    payload_bytes: int

    @property
    def n_coded(self) -> int:
        return self.coded_hi - self.coded_lo

    @property
    def n_groups(self) -> int:
        return self.group_hi - self.group_lo

    @property
    def coded_runs(self) -> list[tuple[int, int]]:
        return [(p.lo, p.hi) for p in self.coded_parts]

    @property
    def plain_runs(self) -> list[list[tuple[int, int]]]:
        return [[(p.lo, p.hi) for p in parts] for parts in self.plain_parts]

    @property
    def message_bytes(self) -> int:
        """Bytes of this shard's coded message (the flat exchange's)."""
        return self.scale_bytes + sum(self.plain_bytes) + self.payload_bytes


@dataclass(frozen=True)
class Message:
    """The byte layout of one message holding ``shards`` (module doc): section offsets, and where
    each shard's coded values, scales and plain values start inside their sections (in elements
    of the section's dtype)."""

    shards: tuple[int, ...]
    scales_at: int
    plain_at: tuple[int, ...]
    coded_at: int
    nbytes: int
    shard_coded: tuple[int, ...]  # per shard of ``shards``: its first coded value's index in the section
    shard_group: tuple[int, ...]
    shard_plain: tuple[tuple[int, ...], ...]  # [class][shard]


class BucketLayout:
    """The plan for one bucket; identical on every rank since it depends only on static shapes."""

    def __init__(
        self,
        numel: int,
        num_shards: int,
        segments: list[Segment],
        codec: CodecConfig,
        raw_dtype: torch.dtype,
        align: int = 1,
        bounds: list[tuple[int, int]] | None = None,
    ):
        segs = sorted(segments, key=lambda s: s.start)
        for a, b in zip(segs, segs[1:]):
            if a.end > b.start:
                raise ValueError(f"parameters {a.name!r} and {b.name!r} overlap in the bucket")
        if segs and segs[-1].end > numel:
            raise ValueError(f"parameter {segs[-1].name!r} ends beyond the bucket")
        self.numel = numel
        self.num_shards = num_shards
        if bounds is None:
            # ``align``: shards of a multiple of it (an all-reduce's shards are the plugin's own: with four
            # bits on the wire, whole blocks); the reduce-scatter's are Megatron's, ``align`` 1
            base = -(-numel // num_shards)
            size = -(-base // align) * align
            bounds = [(min(j * size, numel), min((j + 1) * size, numel)) for j in range(num_shards)]
        else:  # a sub-bucket's (``comm.rounds``): a piece of each shard, in bucket order
            if (
                len(bounds) != num_shards
                or any(not (0 <= a <= b <= numel) for a, b in bounds)
                or any(b > c for (_, b), (c, _) in zip(bounds, bounds[1:]))
            ):
                raise ValueError(f"shard bounds {bounds} are not {num_shards} ordered ranges of the bucket")
            size = max(b - a for a, b in bounds)
        # ``bounds``: shard ``j`` is bucket ``[lo, hi)``; ``shard_size``: the longest (an all-gather's slots)
        self.bounds, self.shard_size = [tuple(b) for b in bounds], size
        self._edges = sorted({x for lo_hi in self.bounds for x in lo_hi})
        self.segments = segs
        self.codec = codec
        self.plain_dtypes = [raw_dtype, torch.bfloat16]
        self.plain_modes = (Mode.OFF, Mode.BF16)
        classes = [[i for i, s in enumerate(segs) if s.mode is m] for m in self.plain_modes]
        self.coded_segments = [i for i, s in enumerate(segs) if s.mode in FP8_MODES]
        self.plain_segments = classes
        self.coded_runs = _merge([(segs[i].start, segs[i].end) for i in self.coded_segments])
        self.plain_runs = [_merge([(segs[i].start, segs[i].end) for i in cls]) for cls in classes]
        self.n_coded = sum(segs[i].rows * segs[i].cols for i in self.coded_segments)
        self.n_plain = [sum(segs[i].rows * segs[i].cols for i in cls) for cls in classes]
        self.seg_at = self._class_offsets()  # each segment's first index in its class sequence
        lengths, self.seg_groups = self._groups()
        self.group_lengths = lengths
        self.n_groups = lengths.numel()
        self._group_starts = torch.cumsum(lengths, 0) - lengths
        self._cache: dict[tuple, object] = {}
        self.shards = [self._shard(j) for j in range(num_shards)]
        self.max_pieces = max((len(p.pieces) for p in self.shards), default=0)

    def check(self, reduce_scatter: bool) -> None:
        """``ValueError`` for a plan the reduction cannot run, raised where the plan is made (start-up):
        the layout is the same on every rank, so every rank refuses with the same message before any
        collective, never one rank inside a stage. ``reduce_scatter``: the distributed optimizer's
        collective, whose shards must be Megatron's (``numel / num_shards`` elements each: it pads its
        buckets to a multiple of the group size)."""
        if reduce_scatter and self.numel % self.num_shards:
            raise ValueError(
                f"megatron-gift: a bucket of {self.numel} elements does not split into {self.num_shards} "
                "equal shards, as the distributed optimizer's reduce-scatter needs (Megatron pads its "
                "buckets to a multiple of the data-parallel size)"
            )

    def check_blocks(self, block: int, flag: str) -> None:
        """``ValueError`` (at plan time, the same on every rank) unless every boundary of the coded
        sequence falls on a whole ``block``-element block of a four-bit format (``flag`` names it, e.g.
        ``--gift-inter-node-format nvfp4``): two codes share a byte and a block shares a scale, so a
        block straddling a shard (hence a message) or a row would be split between two owners.
        Checked: each coded parameter's rows are whole blocks (so are its segment ends and, with
        whitening, its row-aligned chunks) and each shard boundary inside one is. The FP8 groups of
        ``block`` scaling (1x128 by default) are 8 NVFP4 or 4 MXFP4 blocks, so the chunks cut at them
        stay aligned; Megatron pads parameter starts and buckets to multiples of 64 and 128 elements."""
        for i in self.coded_segments:
            s = self.segments[i]
            if s.cols % block:
                raise ValueError(
                    f"megatron-gift: {flag} needs every coded parameter's rows to be whole {block}-element "
                    f"blocks, but {s.name or f'parameter {i}'!r} is [{s.rows}, {s.cols}] ({s.cols} % {block} = "
                    f"{s.cols % block}): leave it out of --gift-layers/--gift-euclidean-layers or use "
                    "--gift-inter-node-format fp8"
                )
            for cut in self._cuts(s):
                if (cut - s.start) % block:
                    raise ValueError(
                        f"megatron-gift: {flag} needs every shard boundary on a whole {block}-element block, but "
                        f"the boundary at bucket element {cut} (shards of {self.shard_size}) falls "
                        f"{(cut - s.start) % block} elements into a block of {s.name or f'parameter {i}'!r} "
                        f"(starting at {s.start}): add Megatron's --ddp-pad-buckets-for-high-nccl-busbw (buckets "
                        f"padded to multiples of 65536 elements: shards of whole blocks up to {65536 // block} "
                        "data-parallel ranks), or use --gift-inter-node-format fp8"
                    )

    # -- the sequences ----------------------------------------------------------------------------
    def _class_offsets(self) -> list[int]:
        out, pos = [0] * len(self.segments), {}
        for i, s in enumerate(self.segments):
            key = "coded" if s.mode in FP8_MODES else s.mode
            out[i] = pos.get(key, 0)
            pos[key] = out[i] + s.rows * s.cols
        return out

    def coded_index(self, pos: int) -> int:
        """Index in the coded sequence of bucket position ``pos`` (an element of an FP8 segment)."""
        for i in self.coded_segments:
            s = self.segments[i]
            if s.start <= pos < s.end:
                return self.seg_at[i] + pos - s.start
        raise ValueError(f"bucket position {pos} holds no FP8 parameter")

    def _groups(self) -> tuple[torch.Tensor, list[tuple[int, int] | None]]:
        """Scaling groups over the coded sequence, segment by segment, cut at shard boundaries;
        and each segment's range of them."""
        out, ranges, n = [torch.zeros(0, dtype=torch.int64)], [None] * len(self.segments), 0
        for i in self.coded_segments:
            s = self.segments[i]
            ends = s.start + torch.cumsum(group_lengths(s.rows, s.cols, self.codec), 0)
            cuts = torch.tensor(self._cuts(s), dtype=torch.int64)
            bounds = torch.unique(torch.cat([torch.tensor([s.start]), ends, cuts]))
            lengths = torch.diff(bounds)
            ranges[i] = (n, n + lengths.numel())
            n += lengths.numel()
            out.append(lengths)
        return torch.cat(out), ranges

    def _cuts(self, s: Segment) -> list[int]:
        """The shard boundaries strictly inside segment ``s``, in order."""
        return self._edges[bisect.bisect_right(self._edges, s.start) : bisect.bisect_left(self._edges, s.end)]

    def cached(self, key: tuple, build):
        """``build()``, once per layout and ``key``: what reductions derive from the layout (packings,
        device copies) is built on first use and kept with it."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def group_lengths_on(self, device) -> torch.Tensor:
        """``group_lengths`` as int32 on ``device``, copied there once."""
        return self.cached(
            ("group_lengths", str(device)), lambda: self.group_lengths.to(device=device, dtype=torch.int32)
        )

    def group_range(self, coded_lo: int, coded_hi: int) -> tuple[int, int]:
        """Groups ``[g0, g1)`` covering the coded range ``[coded_lo, coded_hi)`` (aligned to groups).
        Like every plan of a layout, computed on first use (host only) and kept."""

        def build():
            g0 = int(torch.searchsorted(self._group_starts, coded_lo))
            return g0, int(torch.searchsorted(self._group_starts, coded_hi))

        return self.cached(("group_range", coded_lo, coded_hi), build)

    def group_slice(self, k0: int, k1: int, device) -> tuple[int, int, torch.Tensor]:
        """The groups ``[g0, g1)`` that coded range ``[k0, k1)`` overlaps and their lengths inside it
        (the first and last clipped where the range starts or ends inside a group), on ``device``."""

        def build():
            starts = self._group_starts
            g0 = int(torch.searchsorted(starts, k0, right=True)) - 1
            g1 = int(torch.searchsorted(starts, k1 - 1, right=True))
            lengths = self.group_lengths[g0:g1].clone()
            lengths[0] -= k0 - int(starts[g0])
            lengths[-1] -= int(starts[g1 - 1] + self.group_lengths[g1 - 1]) - k1
            return g0, g1, lengths.to(device=device, dtype=torch.int32)

        return self.cached(("group_slice", k0, k1, str(device)), build)

    def lengths(self, g0: int, g1: int, device) -> torch.Tensor:
        """``group_lengths[g0:g1]`` on ``device`` (int32), kept."""
        return self.cached(("lengths", g0, g1, str(device)), lambda: self.group_lengths_on(device)[g0:g1])

    # -- shards -----------------------------------------------------------------------------------
    def _shard(self, j: int) -> ShardPlan:
        lo, hi = self.bounds[j]
        coded, plain = [], [[], []]
        gift_rows, pieces = [], []
        for i, s in enumerate(self.segments):
            a, b = max(s.start, lo), min(s.end, hi)
            if a >= b:
                continue
            part = Part(i, a, b, self.seg_at[i] + a - s.start)
            if s.mode in FP8_MODES:
                coded.append(part)
            else:
                plain[0 if s.mode is Mode.OFF else 1].append(part)
            if s.mode is Mode.GIFT:
                gift_rows_i, pieces_i = _rows_of(i, s, a - s.start, b - s.start)
                gift_rows += gift_rows_i
                pieces += pieces_i
        coded_lo = self._class_start(coded, "coded", lo)
        coded_hi = coded_lo + sum(p.hi - p.lo for p in coded)
        group_lo, group_hi = self.group_range(coded_lo, coded_hi)
        plain_lo = [self._class_start(parts, c, lo) for c, parts in enumerate(plain)]
        plain_n = [sum(p.hi - p.lo for p in parts) for parts in plain]
        return ShardPlan(
            lo=lo,
            hi=hi,
            coded_lo=coded_lo,
            coded_hi=coded_hi,
            group_lo=group_lo,
            group_hi=group_hi,
            plain_lo=plain_lo,
            plain_hi=[a + n for a, n in zip(plain_lo, plain_n)],
            coded_parts=coded,
            plain_parts=plain,
            gift_rows=gift_rows,
            pieces=pieces,
            scale_bytes=_pad4((group_hi - group_lo) * self.codec.scale_dtype().itemsize),
            plain_bytes=[_pad4(self._plain_bytes(c, n)) for c, n in enumerate(plain_n)],
            payload_bytes=_pad4(self.coded_bytes(coded_hi - coded_lo)),
        )

    def _plain_bytes(self, c: int, n: int) -> int:
        return values_bytes(self.plain_modes[c], n, self.codec, self.plain_dtypes[0].itemsize)

    def coded_bytes(self, n: int, wire: torch.dtype | None = None) -> int:
        """Bytes of ``n`` coded values in a message: the format's codes (``wire=None``), else in ``wire``."""
        return self.codec.fmt.payload_bytes(n) if wire is None else n * wire.itemsize

    def coded_dtype(self, wire: torch.dtype | None = None) -> torch.dtype:
        """Dtype of the coded values in a message: the format's codes (``wire=None``), else ``wire``."""
        return self.codec.fmt.code_dtype if wire is None else wire

    def _class_start(self, parts: list[Part], cls, lo: int) -> int:
        """Index in a class sequence of the first element at or after bucket position ``lo``."""
        if parts:
            return parts[0].at
        members = self.coded_segments if cls == "coded" else self.plain_segments[cls]
        return sum(
            min(self.segments[i].end, lo) - self.segments[i].start for i in members if self.segments[i].start < lo
        )

    # -- messages ---------------------------------------------------------------------------------
    def message(self, shards, wire: torch.dtype | None = None) -> Message:
        """The layout of a message holding ``shards`` (module doc), coded values as the format's codes
        plus scales (``wire=None``) or in the float dtype ``wire``."""
        plans = [self.shards[j] for j in shards]
        scale_size = self.codec.scale_dtype().itemsize

        def starts(sizes):
            return tuple(sum(sizes[:k]) for k in range(len(sizes)))

        groups = [p.n_groups for p in plans]
        scale_bytes = 0 if wire is not None else _pad4(sum(groups) * scale_size)
        plain_n = [[p.plain_hi[c] - p.plain_lo[c] for p in plans] for c in range(2)]
        plain_bytes = [_pad4(self._plain_bytes(c, sum(n))) for c, n in enumerate(plain_n)]
        coded_n = [p.n_coded for p in plans]
        coded_bytes = _pad4(self.coded_bytes(sum(coded_n), wire))
        plain_at = (scale_bytes, scale_bytes + plain_bytes[0])
        coded_at = plain_at[1] + plain_bytes[1]
        return Message(
            shards=tuple(shards),
            scales_at=0,
            plain_at=plain_at,
            coded_at=coded_at,
            nbytes=coded_at + coded_bytes,
            shard_coded=starts(coded_n),
            shard_group=starts(groups),
            shard_plain=tuple(starts(n) for n in plain_n),
        )

    @cached_property
    def max_message_bytes(self) -> int:
        return max(p.message_bytes for p in self.shards)

    def chunks(self, seg: int, k0: int, k1: int, budget: int, whole_rows: bool) -> list[tuple[int, int]]:
        """Coded range ``[k0, k1)`` of segment ``seg`` (with ``whole_rows``, its ends row boundaries) in
        chunks (``group_chunks``) cut at group boundaries, which with ``whole_rows`` are row
        boundaries too (a transform needs whole rows)."""

        def build():
            s, at = self.segments[seg], self.seg_at[seg]
            g0, g1 = self.group_range(k0 + 1, k1)
            bounds = torch.cat([torch.tensor([k0]), self._group_starts[g0:g1], torch.tensor([k1])])
            if whole_rows:
                bounds = bounds[(bounds - at) % s.cols == 0]
            return group_chunks(bounds, budget)

        return self.cached(("chunks", seg, k0, k1, budget, whole_rows), build)


def group_chunks(bounds: torch.Tensor, budget: int) -> list[tuple[int, int]]:
    """Consecutive chunks between the sorted admissible boundaries ``bounds`` (first and last: the
    range's ends), each at most about ``budget`` elements (a cut is the last boundary before each
    multiple of ``budget``) and never less than from one boundary to
    the next (so a group, or row, larger than the budget stays whole)."""
    lo, hi = int(bounds[0]), int(bounds[-1])
    if hi <= lo:
        return []
    targets = torch.arange(lo + budget, max(hi, lo + budget), budget)
    picked = bounds[(torch.searchsorted(bounds, targets, right=True) - 1).clamp_min(0)]
    cuts = torch.unique(torch.cat([bounds[:1], picked, bounds[-1:]])).tolist()
    return list(zip(cuts[:-1], cuts[1:]))


def _rows_of(i: int, s: Segment, a: int, b: int) -> tuple[list, list]:
    """Whole rows and cut-row pieces of segment ``s``'s elements ``[a, b)`` (segment-relative)."""
    rows, pieces = [], []
    r0, r1 = -(-a // s.cols), b // s.cols  # full rows [r0, r1)
    if r1 > r0:
        rows.append((i, r0, r1))
    if a % s.cols:  # the shard starts inside a row (and may end in it too)
        row = a // s.cols
        pieces.append(RowPiece(i, row, a % s.cols, min(b - row * s.cols, s.cols)))
    if b % s.cols and (a % s.cols == 0 or b // s.cols != a // s.cols):  # ends inside another row
        pieces.append(RowPiece(i, b // s.cols, 0, b % s.cols))
    return rows, pieces


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(runs):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return out
