"""Where a sequence's elements go in a buffer of messages: the placement table of a packing
(``comm.packing``), built once per layout, and a kernel's view of it. Plan-time host work lives here
(``Placement.__init__`` copies a few integers per shard to the device and keeps them on the host, where
the PyTorch path's ``index`` looks its range up), nothing of the steady path's device work."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


class Placement:
    """Where the shards of a source sequence sit in a buffer of messages (``comm.packing``'s module
    doc): ``ends`` and ``delta``, int64 on the device, one per shard (element ``k`` of the source at
    ``k + delta[j]``, ``j`` its shard); ``index(lo, hi)``: the buffer positions of ``[lo, hi)``, int32
    where every position and shard-to-shard step fits, else int64; ``bound``: above every source element
    and position."""

    def __init__(self, sizes: list[int], buffer_starts: list[int], device):
        lengths = torch.tensor(sizes, dtype=torch.int64)  # host side, once per layout (plans are cached)
        ends = lengths.cumsum(0)
        delta = torch.tensor(buffer_starts, dtype=torch.int64) - (ends - lengths)
        self.ends, self.delta = ends.to(device), delta.to(device)
        # above every source element and buffer position
        self.bound = max(sum(sizes), max((b + n for b, n in zip(buffer_starts, sizes)), default=0))
        # for ``index``: the host's copy of the table, and where the position jumps (at the start of each
        # non-empty shard after the first, by its delta minus the previous non-empty shard's) on both sides
        self._ends, self._delta = ends.tolist(), delta.tolist()
        full = [j for j, n in enumerate(sizes) if n]
        self._starts = [self._ends[j] - sizes[j] for j in full[1:]]
        steps = [1 + self._delta[j] - self._delta[i] for i, j in zip(full, full[1:])]
        self._jumps = (
            torch.tensor(self._starts, dtype=torch.int64).to(device),
            torch.tensor(steps, dtype=self._dtype).to(device),
        )

    @property
    def _dtype(self) -> torch.dtype:
        """int32 where every position fits (``bound`` below 2^31), else int64: each step is the difference of
        two positions (the first of a shard and the last of the one before), so it fits too."""
        return torch.int32 if self.bound < 2**31 else torch.int64

    @classmethod
    def whole(cls, n: int, device, shards: int = 1) -> Placement:
        """Element ``k`` at ``k``: shard 0 of ``n`` elements at the buffer's start, then ``shards - 1`` empty
        ones (for a kernel that reads this table's ``delta`` at another table's shard). Built on the device
        (no copy from the host: usable in a steady step)."""
        table = cls.__new__(cls)
        table.ends = torch.full((shards,), n, dtype=torch.int64, device=device)
        table.delta = torch.zeros(shards, dtype=torch.int64, device=device)
        table.bound, table._ends, table._delta, table._starts = n, [n] * shards, [0] * shards, []
        none = torch.empty(0, dtype=torch.int64, device=device)
        table._jumps = (none, none.to(table._dtype))
        return table

    def index(self, lo: int, hi: int) -> torch.Tensor:
        """Positions ``k + delta[shard(k)]`` of source elements ``k`` in ``[lo, hi)`` for the PyTorch path's
        placed reads and writes (``index_select``, ``index_put_``), in one tensor of the range (4 B per
        element in int32): consecutive positions step by one except where a shard starts (by one plus the
        jump between the two shards' deltas), so the index is the running sum of its steps from element
        ``lo``'s position on, made in place. Which shards the range crosses is plan-time host data: the
        device sees a fixed few ops, no lookup."""
        n = hi - lo
        starts, steps = self._jumps
        index = torch.ones(n, dtype=steps.dtype, device=steps.device)  # an empty range runs the same ops
        a, b = bisect.bisect_right(self._starts, lo), bisect.bisect_left(self._starts, hi)  # the shards starting inside
        index.index_put_((starts[a:b] - lo,), steps[a:b])  # also where none does: the same ops at any DP size
        shard = min(bisect.bisect_right(self._ends, lo), len(self._ends) - 1)
        index[:1].fill_(lo + self._delta[shard] if self._delta else lo)  # a scalar fill: no tensor from Python data
        return index.cumsum_(0)

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
class Source:
    """Runs of a coded sequence read where they lie (``kernels.fp4.encode_placed``): the sequence cut into
    runs of whole blocks (``table``'s shards, covering it), run ``j``'s element ``k`` at ``tensor[k + delta[j]]``
    where ``held[j]`` (int64, nonzero), at ``k + delta[j]`` of the encode's own FP32 sequence elsewhere (at
    ``k``, or packed: ``runs``); ``elements``: how many come from ``tensor`` (the traffic count's); ``n``: the
    sequence's length; ``own``: how much the own sequence must hold (the end of its last run not read from
    ``tensor``, or packed their total: either may be less than ``n``). Built once per layout without its
    tensor (``runs``), bound to each step's buffer by ``on``."""

    tensor: torch.Tensor | None
    table: Placement
    held: torch.Tensor
    elements: int
    n: int
    own: int

    @classmethod
    def runs(cls, runs: list[tuple[int, int, int]], n: int, device, packed: bool = False) -> Source | None:
        """From the runs ``(position in the sequence, length, start in the tensor)`` (disjoint), the rest of the
        ``n`` elements left to the sequence's own buffer, at their positions or, ``packed``, one run after
        another from its start (it then holds those alone); None without runs. Plan-time host work."""
        runs = sorted(r for r in runs if r[1])
        if not runs:
            return None
        sizes, starts, held, at, own = [], [], [], 0, 0
        for pos, length, start in [*runs, (n, 0, 0)]:
            if pos > at:  # an own run
                sizes.append(pos - at), starts.append(own if packed else at), held.append(0)
                own = own + pos - at if packed else pos
            if length:
                sizes.append(length), starts.append(start), held.append(1)
            at = pos + length
        flags = torch.tensor(held, dtype=torch.int64).to(device)
        return cls(None, Placement(sizes, starts, device), flags, sum(length for _, length, _ in runs), n, own)

    def on(self, tensor: torch.Tensor) -> Source:
        """These runs read from ``tensor`` (a step's buffer)."""
        return Source(tensor, self.table, self.held, self.elements, self.n, self.own)


@dataclass(frozen=True)
class RowsAt:
    """A matrix ``[len(starts), cols]`` whose row ``i`` is ``buffer[starts[i] : starts[i] + cols]``: whole rows
    scattered in a flat buffer (the node's sums of ``comm.sum_first``), which the kernels read in place
    instead of from a gathered copy. ``starts``: int64 on the buffer's device. The rows of one or more matrices
    of that width (``kernels.whiten_place``): ``spans``, each matrix's ``(first row, rows)``, each starting at a
    multiple of ``ROW_ALIGN`` rows, the rows between spans padding (start -1, never read or written);
    ``matrix``: each row's matrix (int64, the device's), which the kernels read once per block of rows."""

    buffer: torch.Tensor
    starts: torch.Tensor
    cols: int
    matrix: torch.Tensor
    spans: tuple[tuple[int, int], ...]

    @classmethod
    def of_one(cls, buffer: torch.Tensor, starts: torch.Tensor, cols: int) -> RowsAt:
        """The rows of one matrix."""
        return cls(buffer, starts, cols, torch.zeros_like(starts), ((0, starts.numel()),))

    @property
    def shape(self) -> tuple[int, int]:
        return self.starts.numel(), self.cols

    @property
    def live(self) -> int:
        """The rows that are not padding."""
        return sum(n for _, n in self.spans)

    def numel(self) -> int:
        return self.starts.numel() * self.cols

    @staticmethod
    def kernel_args(x: torch.Tensor, rows: int, rows_at: RowsAt | None) -> tuple:
        """The ``row_ptr, mat_ptr, live`` launch arguments of the kernels that read rows where they lie (placeholders
        that are not read where ``rows_at`` is None: ``x`` and ``rows``)."""
        return (x, x, rows) if rows_at is None else (rows_at.starts, rows_at.matrix, rows_at.live)

    def gathered(self, r0: int = 0, n: int | None = None) -> torch.Tensor:
        """Rows ``[r0, r0 + n)`` (all by default) as a contiguous ``[n, cols]`` copy (what the reference reads)."""
        starts = self.starts[r0:] if n is None else self.starts[r0 : r0 + n]
        if self.buffer.numel() < self.cols:
            return self.buffer.new_zeros(0, self.cols)
        return self.buffer.unfold(0, self.cols, 1).index_select(0, starts)


ROW_ALIGN = 128
"""rows per matrix span of a ``RowsAt`` (a multiple of every block of rows the kernels take: 16 and up to 128)."""


def aligned_rows(counts: list[int], device) -> tuple[list[int], torch.Tensor, tuple[tuple[int, int], ...]]:
    """For matrices of ``counts`` rows one after another: the padding after each (``ROW_ALIGN`` alignment, none
    after the last), each row's matrix (int64 on ``device``, padding rows their matrix's) and the spans."""
    pads, spans, at = [], [], 0
    if not counts:
        return [], torch.zeros(0, dtype=torch.int64, device=device), ()
    for k, n in enumerate(counts):
        spans.append((at, n))
        pad = 0 if k == len(counts) - 1 else -n % ROW_ALIGN
        pads.append(pad)
        at += n + pad
    matrix = torch.cat([torch.full((n + pad,), k, dtype=torch.int64) for k, (n, pad) in enumerate(zip(counts, pads))])
    return pads, matrix.to(device), tuple(spans)
