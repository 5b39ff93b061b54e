"""Where a sequence's elements go in a buffer of messages: the placement table of a packing
(``comm.packing``), built once per layout, and a kernel's view of it. Plan-time host work lives here
(``Placement.__init__`` copies a few integers per shard to the device), nothing of the steady path."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class Placement:
    """Where the shards of a source sequence sit in a buffer of messages (``comm.packing``'s module
    doc): ``ends`` and ``delta``, int64 on the device, one per shard (element ``k`` of the source at
    ``k + delta[j]``, ``j`` its shard); ``index(lo, hi)``: the buffer positions of ``[lo, hi)``."""

    def __init__(self, sizes: list[int], buffer_starts: list[int], device):
        lengths = torch.tensor(sizes, dtype=torch.int64)  # host side, once per layout (plans are cached)
        ends = lengths.cumsum(0)
        delta = torch.tensor(buffer_starts, dtype=torch.int64) - (ends - lengths)
        self.ends, self.delta = ends.to(device), delta.to(device)

    def index(self, lo: int, hi: int) -> torch.Tensor:
        k = torch.arange(lo, hi, device=self.ends.device)
        return k + self.delta[torch.searchsorted(self.ends, k, right=True)]

    def at(self, out: torch.Tensor, lo: int) -> Place:
        """Source elements from ``lo`` on into ``out`` (the buffer in the sequence's dtype), for the
        kernels, which look the table up themselves."""
        return Place(out, self, lo)


@dataclass(frozen=True)
class Place:
    """Where a sequence's elements go in a buffer: element ``i`` to ``out[k + delta[j]]``, ``k = at + i``
    and ``j`` the shard of ``table`` with ``ends[j-1] <= k < ends[j]``. ``out``: the buffer viewed in
    the sequence's dtype."""

    out: torch.Tensor
    table: Placement
    at: int


@dataclass(frozen=True)
class RowsAt:
    """A matrix ``[len(starts), cols]`` whose row ``i`` is ``buffer[starts[i] : starts[i] + cols]``: whole rows
    scattered in a flat buffer (the node's sums of ``comm.sum_first``), which the kernels read in place
    instead of from a gathered copy. ``starts``: int64 on the buffer's device."""

    buffer: torch.Tensor
    starts: torch.Tensor
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.starts.numel(), self.cols

    def numel(self) -> int:
        return self.starts.numel() * self.cols

    def gathered(self) -> torch.Tensor:
        """The rows as a contiguous ``[rows, cols]`` copy (what the reference reads)."""
        if self.buffer.numel() < self.cols:
            return self.buffer.new_zeros(0, self.cols)
        return self.buffer.unfold(0, self.cols, 1).index_select(0, self.starts)
