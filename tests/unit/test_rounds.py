"""Sub-buckets (``comm.rounds.split``): every shard's elements in exactly one round, in that
shard's piece, every row whole in one round, pieces of about equal size."""

import random

import torch

from megatron_gift.comm.layout import BucketLayout, Segment
from megatron_gift.comm.rounds import split
from megatron_gift.config import Mode
from megatron_gift.numerics import CodecConfig


def _random_layout(rng: random.Random) -> BucketLayout:
    """Parameters of random shapes and modes with padding between some, cut into 1-8 shards."""
    segs, at = [], 0
    for i in range(rng.randint(1, 7)):
        at += rng.choice([0, 0, 3, 64])
        rows, cols = rng.choice([1, 2, 5, 9, 16]), rng.choice([1, 4, 7, 32, 100])
        segs.append(Segment(at, rows, cols, rng.choice(list(Mode)[1:] if i % 2 else [Mode.GIFT]), f"p{i}"))
        at += rows * cols
    shards = rng.randint(1, 8)
    numel = -(-(at + rng.choice([0, 5])) // shards) * shards
    return BucketLayout(numel, shards, segs, CodecConfig("e4m3", "block"), torch.float32)


def test_rounds_partition_every_shard_and_keep_rows_whole():
    """Bug caught: a round that skips or repeats a shard's elements (a gradient never reduced, or
    reduced twice), puts one shard's elements in another's piece (written by the wrong owner), or
    splits a parameter row between two rounds (its whitening needs the whole row in one reduction;
    the halves of a row cut by a shard boundary must meet in one round). Checked element by element
    against the bucket's own shards, over random layouts and round counts."""
    rng = random.Random(0)
    checked = 0
    for trial in range(400):
        layout = _random_layout(rng)
        rounds = rng.randint(1, 5)
        out = split(layout, rounds)
        if out is None:
            continue
        checked += 1
        assert len(out) == rounds
        owner = torch.full((layout.numel,), -1)  # the round holding each bucket element, by its pieces
        for k, r in enumerate(out):
            for j, (a, b) in enumerate(r.layout.bounds):
                whole = layout.bounds[j]
                assert whole[0] <= a <= b <= whole[1], (trial, k, j)  # inside the bucket's shard j
                assert (owner[a:b] == -1).all(), (trial, k, j)  # no element in two rounds
                owner[a:b] = k
        assert (owner >= 0).all(), trial  # every element of every shard in some round
        for s in layout.segments:
            rows = owner[s.start : s.end].view(s.rows, s.cols)
            assert (rows == rows[:, :1]).all(), (trial, s)  # each row in one round
        for k, r in enumerate(out):
            for seg, i in zip(r.layout.segments, r.origin):
                s = layout.segments[i]
                assert (seg.mode, seg.name, seg.cols) == (s.mode, s.name, s.cols)
                assert s.start <= seg.start and seg.end <= s.end and (seg.start - s.start) % s.cols == 0
                assert (owner[seg.start : seg.end] == k).all(), (trial, k, seg)
            # the round's segments are exactly its elements of the bucket's parameters
            mine = torch.zeros(layout.numel, dtype=torch.bool)
            for seg in r.layout.segments:
                mine[seg.start : seg.end] = True
            params = torch.zeros(layout.numel, dtype=torch.bool)
            for s in layout.segments:
                params[s.start : s.end] = True
            assert torch.equal(mine, params & (owner == k)), (trial, k)
    assert checked > 300


def test_a_shard_inside_one_row_is_not_split():
    """Bug caught: rounds that cut a row no round holds whole (a shard lying inside one row, whose
    halves are cut on both sides): ``split`` says it cannot (None) rather than split it."""
    layout = BucketLayout(1000, 4, [Segment(0, 1, 1000, Mode.GIFT, "wide")], CodecConfig(), torch.float32)
    assert split(layout, 2) is None
    assert split(layout, 1) is not None


def test_rounds_share_a_shards_bytes_not_its_elements():
    """Bug caught: pieces of equal element counts, whose rounds take unequal bytes where parameters
    sent in FP32 (4 B each) sit beside FP8-coded ones (about 1 B): the round holding the FP32 ones
    would need several times the others' buffers, and more rounds than the bound asks. One shard:
    1024 FP32 values (4096 B), then 4096 E4M3 values (4096 B and their scales): two rounds cut at the
    FP32 parameter's end, a row either way (not at 2560, half the elements)."""
    segs = [Segment(0, 8, 128, Mode.OFF, "norm"), Segment(1024, 32, 128, Mode.EUCLIDEAN, "w")]
    layout = BucketLayout(5120, 1, segs, CodecConfig("e4m3", "block"), torch.float32)
    first, second = split(layout, 2)
    (a, b), (c, d) = first.layout.bounds[0], second.layout.bounds[0]
    assert a == 0 and b == c and d == 5120 and abs(b - 1024) <= 128, (b, c)
