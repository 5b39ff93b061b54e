"""The PyTorch path's placement index (``kernels.placement.Placement.index``): where a range of a source
sequence goes in a buffer of messages, in the narrowest integer type that holds every position."""

import torch

from megatron_gift.kernels.placement import Placement


def test_index_is_int32_where_positions_fit_and_int64_beyond():
    """Each element of a range at its shard's buffer position (a hand list), as int32 while every position
    is below 2^31 (half the transient of int64: the two-level node sums' peak), as int64 once a shard sits
    past 2^31 (an int32 index would wrap to a negative position, before the message). Bugs caught: an
    int32 index for a buffer past 2^31, a position off its shard's delta, a shard taken one element late."""
    table = Placement([3, 2, 4], [10, 0, 20], "cpu")  # shard 0 at 10, shard 1 at 0, shard 2 at 20
    index = table.index(1, 8)
    assert index.dtype == torch.int32
    assert index.tolist() == [11, 12, 0, 1, 20, 21, 22]
    far = Placement([3, 2], [0, 2**31 + 5], "cpu")
    index = far.index(0, 5)
    assert index.dtype == torch.int64
    assert index.tolist() == [0, 1, 2, 2**31 + 5, 2**31 + 6]
    assert Placement.whole(100, "cpu").index(3, 6).tolist() == [3, 4, 5]
    assert Placement.whole(2**31, "cpu").narrow is None  # the end of its range, 2^31, is no int32
