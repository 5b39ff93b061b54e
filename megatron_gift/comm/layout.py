"""Static plan of one flat gradient bucket for quantized collectives (no torch.distributed here).

A bucket ``[numel]`` holds parameters at known offsets and is cut into ``num_shards``
shards ``[j·S, (j+1)·S)``, ``S = ceil(numel / num_shards)``, as Megatron's distributed
optimizer cuts it (its buckets divide evenly; an all-reduce bucket's last shard may be short).
Elements of ``off`` parameters are sent in the bucket's dtype and those of ``bf16``
parameters in BF16 (the *plain* sections); everything else, padding included, is *coded*
in FP8. Scaling groups follow each parameter's granularity
(``fp8.group_lengths``) and are additionally cut at shard boundaries, so every group lives in
one shard and each shard's message is self-contained::

    message_j = [scales_j | off_j | bf16_j | payload_j]   (each section padded to 4 bytes)

GIFT rows cut by a shard boundary are recorded as ``RowPiece``s so the receiver can apply
the inverse transform with only an r-float exchange per piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import Mode
from ..numerics.fp8 import CodecConfig, group_lengths


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4


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


@dataclass
class ShardPlan:
    """What shard ``j`` holds and how its message is laid out."""

    lo: int
    hi: int
    coded_runs: list[tuple[int, int]]
    plain_runs: list[list[tuple[int, int]]]  # per plain class (off, bf16)
    coded_lo: int  # the shard's coded values: [coded_lo, coded_hi) of the bucket's coded sequence
    coded_hi: int
    group_lo: int  # its scaling groups: [group_lo, group_hi) of the layout's groups
    group_hi: int
    scale_bytes: int
    plain_bytes: list[int]
    payload_bytes: int
    gift_rows: list[tuple[int, int, int]]  # (segment, first full row, end row)
    pieces: list[RowPiece]

    @property
    def message_bytes(self) -> int:
        return self.scale_bytes + sum(self.plain_bytes) + self.payload_bytes


class BucketLayout:
    """The plan for one bucket; identical on every rank since it depends only on static shapes."""

    def __init__(self, numel: int, num_shards: int, segments: list[Segment], codec: CodecConfig, raw_dtype: torch.dtype):
        segs = sorted(segments, key=lambda s: s.start)
        for a, b in zip(segs, segs[1:]):
            if a.end > b.start:
                raise ValueError(f"parameters {a.name!r} and {b.name!r} overlap in the bucket")
        if segs and segs[-1].end > numel:
            raise ValueError(f"parameter {segs[-1].name!r} ends beyond the bucket")
        self.numel = numel
        self.num_shards = num_shards
        self.shard_size = -(-numel // num_shards)
        self.segments = segs
        self.codec = codec
        self.plain_dtypes = [raw_dtype, torch.bfloat16]
        self.plain_runs = [_merge([(s.start, s.end) for s in segs if s.mode is m]) for m in (Mode.OFF, Mode.BF16)]
        self.coded_runs = _complement(_merge([r for runs in self.plain_runs for r in runs]), numel)
        self.group_lengths = self._group_lengths()
        self._lengths_on: dict[str, torch.Tensor] = {}
        self.n_coded = sum(b - a for a, b in self.coded_runs)
        self.shards = [self._shard(j) for j in range(num_shards)]
        self.max_pieces = max((len(p.pieces) for p in self.shards), default=0)

    def group_lengths_on(self, device) -> torch.Tensor:
        """``group_lengths`` on ``device``, copied there once."""
        key = str(device)
        if key not in self._lengths_on:
            self._lengths_on[key] = self.group_lengths.to(device)
        return self._lengths_on[key]

    def coded_index(self, pos: int) -> int:
        """Index in the coded-element order of bucket position ``pos`` (a coded element)."""
        return pos - sum(min(b, pos) - a for runs in self.plain_runs for a, b in runs if a < pos)

    def _group_lengths(self) -> torch.Tensor:
        """Scaling groups over the coded elements, in bucket order, cut at shard boundaries.

        Padding between parameters forms groups of its own (zeros, sent exactly)."""
        out = [torch.zeros(0, dtype=torch.int64)]
        for a, b in self.coded_runs:
            first_cut = min(-(-a // self.shard_size) * self.shard_size, b)
            cuts = [torch.tensor([a]), torch.arange(first_cut, b, self.shard_size)]
            for s in self.segments:
                if s.mode in (Mode.EUCLIDEAN, Mode.GIFT) and a <= s.start < b:
                    lengths = group_lengths(s.rows, s.cols, self.codec)
                    cuts.append(s.start + torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), lengths]), 0))
            bounds = torch.unique(torch.cat(cuts))
            bounds = bounds[(bounds >= a) & (bounds < b)]
            out.append(torch.diff(torch.cat([bounds, torch.tensor([b])])))
        return torch.cat(out)

    def _shard(self, j: int) -> ShardPlan:
        lo, hi = min(j * self.shard_size, self.numel), min((j + 1) * self.shard_size, self.numel)
        coded = _clip(self.coded_runs, lo, hi)
        plain = [_clip(runs, lo, hi) for runs in self.plain_runs]
        coded_lo = sum(min(b, lo) - a for a, b in self.coded_runs if a < lo)
        coded_hi = coded_lo + sum(b - a for a, b in coded)
        ends = torch.cumsum(self.group_lengths, 0)
        group_lo = int(torch.searchsorted(ends, coded_lo, right=True))
        group_hi = int(torch.searchsorted(ends, coded_hi, right=True))
        n_groups = group_hi - group_lo
        scale_size = torch.tensor([], dtype=self.codec.scale_dtype()).element_size()
        gift_rows, pieces = [], []
        for i, s in enumerate(self.segments):
            if s.mode is not Mode.GIFT or s.end <= lo or s.start >= hi:
                continue
            a, b = max(s.start, lo) - s.start, min(s.end, hi) - s.start
            r0, r1 = -(-a // s.cols), b // s.cols  # full rows [r0, r1)
            if r1 > r0:
                gift_rows.append((i, r0, r1))
            if a % s.cols:  # the shard starts inside a row (and may end in it too)
                row = a // s.cols
                pieces.append(RowPiece(i, row, a % s.cols, min(b - row * s.cols, s.cols)))
            if b % s.cols and (a % s.cols == 0 or b // s.cols != a // s.cols):  # ends inside another row
                pieces.append(RowPiece(i, b // s.cols, 0, b % s.cols))
        return ShardPlan(
            lo=lo,
            hi=hi,
            coded_runs=coded,
            plain_runs=plain,
            coded_lo=coded_lo,
            coded_hi=coded_hi,
            group_lo=group_lo,
            group_hi=group_hi,
            scale_bytes=_pad4(n_groups * scale_size),
            plain_bytes=[
                _pad4(sum(b - a for a, b in runs) * dtype.itemsize) for runs, dtype in zip(plain, self.plain_dtypes)
            ],
            payload_bytes=_pad4(coded_hi - coded_lo),
            gift_rows=gift_rows,
            pieces=pieces,
        )


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(runs):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return out


def _complement(runs: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    out, pos = [], 0
    for a, b in runs:
        if a > pos:
            out.append((pos, a))
        pos = b
    if pos < numel:
        out.append((pos, numel))
    return out


def _clip(runs: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    return [(max(a, lo), min(b, hi)) for a, b in runs if a < hi and b > lo]
