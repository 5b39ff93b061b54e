"""The PyTorch path's placement index (``kernels.placement.Placement.index``): where a range of a source
sequence goes in a buffer of messages, in the narrowest integer type that holds every position and step."""

import random

import torch

from megatron_gift.kernels.placement import Placement
from megatron_gift.testing.dispatch import LiveBytes


def _by_hand(sizes, starts, lo, hi):
    """Element ``k``'s position: its offset in its shard plus the shard's start in the buffer."""
    out, first = [], 0
    for size, start in zip(sizes, starts):
        out += [start + i for i in range(size) if lo <= first + i < hi]
        first += size
    return out


def test_index_is_int32_where_positions_fit_and_int64_beyond():
    """Each element of a range at its shard's buffer position (a hand list), as int32 while every position
    is below 2^31 (half the transient of int64: the two-level node sums' peak), steps between shards of
    nearly -2^31 and 2^31 included, as int64 once a shard sits past 2^31 (an int32 index would wrap to a
    negative position, before the message). Bugs caught: an int32 index for a buffer past 2^31, a
    position off its shard's delta, a shard taken one element late, a table without shards failing."""
    table = Placement([3, 2, 4], [10, 0, 20], "cpu")  # shard 0 at 10, shard 1 at 0, shard 2 at 20
    index = table.index(1, 8)
    assert index.dtype == torch.int32
    assert index.tolist() == [11, 12, 0, 1, 20, 21, 22]
    far = Placement([3, 2], [0, 2**31 + 5], "cpu")
    index = far.index(0, 5)
    assert index.dtype == torch.int64
    assert index.tolist() == [0, 1, 2, 2**31 + 5, 2**31 + 6]
    # steps of 3 - 2^31 (down to 0) and 2^31 - 4 (back up): the extremes int32 must hold
    extremes = Placement([2, 3, 1], [2**31 - 4, 0, 2**31 - 2], "cpu")
    index = extremes.index(0, 6)
    assert index.dtype == torch.int32
    assert index.tolist() == [2**31 - 4, 2**31 - 3, 0, 1, 2, 2**31 - 2]
    assert Placement.whole(100, "cpu").index(3, 6).tolist() == [3, 4, 5]
    assert Placement.whole(2**31, "cpu").index(0, 2).dtype == torch.int64  # its end, 2^31, is no int32
    assert Placement([], [], "cpu").index(0, 0).tolist() == []


def test_index_matches_a_hand_placement_over_random_tables():
    """Ranges starting and ending inside shards, exactly at their boundaries, across empty shards and
    shards placed out of order, against positions listed by hand. Bugs caught: a jump applied one element
    early or late, an empty shard's jump lost or counted twice, the range's first position taken from the
    wrong shard, a jump past the range's end written into it."""
    rng = random.Random(0)
    checked = 0
    for _ in range(600):
        sizes = [rng.choice([0, 0, 1, 2, 5, 17]) for _ in range(rng.randint(1, 7))]
        total = sum(sizes)
        if total == 0:
            continue
        starts = [rng.randrange(0, 200) for _ in sizes]
        bounds = sorted({0, total, *[sum(sizes[:j]) for j in range(len(sizes))], rng.randrange(total)})
        lo = rng.choice(bounds[:-1])
        hi = rng.choice([b for b in bounds if b >= lo] + [rng.randint(lo, total)])
        index = Placement(sizes, starts, "cpu").index(lo, hi)
        assert index.tolist() == _by_hand(sizes, starts, lo, hi), (sizes, starts, lo, hi)
        checked += 1
    assert checked > 400


def test_index_holds_four_bytes_per_element():
    """The index of a range peaks at one int32 tensor of it (the running sum made in place): the two-level
    path's refresh peak is the FP32 node sums beside this index. Bug caught: the index built from a
    position range and a shard lookup alive at once (8 B per element, 16 in int64)."""
    table = Placement([10**6, 3 * 10**6, 0, 5], [5, 2 * 10**6, 7, 0], "cpu")
    n = 4 * 10**6 - 15  # elements 10 to 5 before the end
    with LiveBytes() as live:
        index = table.index(10, 10 + n)
    assert index.dtype == torch.int32
    assert live.peak <= 4 * n + 64
