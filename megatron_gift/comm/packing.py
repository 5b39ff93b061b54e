"""Where the elements of a bucket's sequences go in a buffer of messages, and where they come from:
a fixed number of ops per bucket, whatever the number of messages (peers).

A *source* is a sequence of shards one after another (a class sequence of the whole bucket, or of
the shards a rank holds after the two-level exchange's intra-node stage); a *buffer* is messages
one after another (``layout.Message``), the messages to the peers in rank order and the rank's
own message last (it never crosses a link). Element ``k`` of shard ``j`` of the source sits in the
buffer, viewed in its section's dtype, at ``k + delta[j]``. The fused kernels take the table
(``kernels.placement.Placement.at``: ``ends`` and ``delta`` on the device) and look each unit's shard up themselves;
on the PyTorch path ``kernels.placement.Placement.index`` computes the positions of a range of ``k`` on the device
(a running sum of steps, one except where a shard starts; which shards the range crosses is looked up
in the table's host copy), so scattering a chunk into every message, or gathering it back, is one
``index_put_`` / ``index_select``. The index is transient (4 bytes per element of the chunk where every
position and step fits in int32, else 8; chunks are bounded); the per-layout state is a few integers
per shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.placement import Placement
from .layout import BucketLayout, Message

SEQUENCES = ("coded", "groups", "off", "bf16")  # the coded values, their scales, the two plain classes


@dataclass(frozen=True)
class Packing:
    """The messages of one exchange and the placement of each sequence of ``source`` in them."""

    source: tuple[int, ...]  # shards of the source, in order
    messages: tuple[Message, ...]  # to the peers in rank order, then the own one
    starts: tuple[int, ...]  # byte offset of each message in the buffer
    nbytes: int
    place: dict  # sequence name -> Placement

    @property
    def own(self) -> Message:
        return self.messages[-1]

    @property
    def own_at(self) -> int:
        return self.starts[-1]

    @property
    def sent_bytes(self) -> int:
        return self.starts[-1]

    @property
    def peer_bytes(self) -> list[int]:
        return [m.nbytes for m in self.messages[:-1]]

    def received(self, recv: torch.Tensor, buf: torch.Tensor, own_index: int, count: int, space) -> Received:
        """The ``count`` messages the rank has after the all-to-all of ``buf``: the peers' rows of ``recv``
        and its own message in ``buf`` (``space.keep``: read in place in an arena region, else a copy)."""
        own = space.keep(buf[self.own_at : self.own_at + self.own.nbytes])
        return Received(recv, own, own_index, self.own, count)


def packing(
    layout: BucketLayout,
    source: list[int],
    messages: list[list[int]],
    wire: torch.dtype | None,
    device,
    width: int | None = None,
) -> Packing:
    """The packing of ``messages`` (each a list of shards; the last one the rank's own) filled from
    ``source`` (every shard of every message, in source order); ``wire``: the coded values' dtype
    (None: the format's codes and scales). ``width``: every message in a slot of that many bytes (an
    all-gather's equal chunks), else one right after the other."""
    msgs = [layout.message(shards, wire) for shards in messages]
    starts = [m * width if width else sum(x.nbytes for x in msgs[:m]) for m in range(len(msgs))]
    where = {j: (m, k) for m, shards in enumerate(messages) for k, j in enumerate(shards)}
    plans = [layout.shards[j] for j in source]
    scale_size = layout.codec.scale_dtype().itemsize
    coded_size = layout.coded_dtype(wire).itemsize
    sizes = {
        "coded": [p.n_coded for p in plans],
        "groups": [p.n_groups for p in plans],
        "off": [p.plain_hi[0] - p.plain_lo[0] for p in plans],
        "bf16": [p.plain_hi[1] - p.plain_lo[1] for p in plans],
    }
    buffer_starts = {name: [] for name in SEQUENCES}
    for j in source:
        m, k = where[j]
        msg, at = msgs[m], starts[m]
        buffer_starts["coded"].append((at + msg.coded_at) // coded_size + msg.shard_coded[k])
        buffer_starts["groups"].append((at + msg.scales_at) // scale_size + msg.shard_group[k])
        for c, (name, dt) in enumerate(zip(("off", "bf16"), layout.plain_dtypes)):
            buffer_starts[name].append((at + msg.plain_at[c]) // dt.itemsize + msg.shard_plain[c][k])
    place = {name: Placement(sizes[name], buffer_starts[name], device) for name in SEQUENCES}
    return Packing(tuple(source), tuple(msgs), tuple(starts), starts[-1] + (width or msgs[-1].nbytes), place)


class Received:
    """The ``count`` messages a rank receives for one ``Message`` layout: the peers' rows of a
    receive buffer and its own message, as parts in rank order (the own one at ``own_index``).
    A message may be empty (a shard of padding): its rows are then ``[k, 0]``."""

    def __init__(self, recv: torch.Tensor, own: torch.Tensor, own_index: int, msg: Message, count: int):
        width = msg.nbytes
        peers = recv.view(count - 1, width)
        self.parts = [peers[:own_index], own.view(1, width), peers[own_index:]]  # some may be empty
        self.count = count
        self.msg = msg

    def section(self, lo: int, hi: int, dtype: torch.dtype = torch.uint8) -> list[torch.Tensor]:
        """Bytes ``[lo, hi)`` of every message, viewed as ``dtype``: ``[k, (hi - lo) / itemsize]`` per part
        (an empty range as a fresh ``[k, 0]``: rows of an empty message cannot be viewed in a wider dtype)."""
        if hi == lo:
            return [p.new_empty((p.shape[0], 0), dtype=dtype) for p in self.parts]
        return [p[:, lo:hi].view(dtype) for p in self.parts]

    def coded(self, c0: int, c1: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Coded values ``[c0, c1)`` of every message in ``dtype`` (``BucketLayout.coded_dtype``)."""
        size = dtype.itemsize
        at = self.msg.coded_at
        return self.section(at + c0 * size, at + c1 * size, dtype)

    def scales(self, g0: int, g1: int, dtype: torch.dtype) -> list[torch.Tensor]:
        size = dtype.itemsize
        return self.section(self.msg.scales_at + g0 * size, self.msg.scales_at + g1 * size, dtype)

    def plain(self, c: int, k0: int, k1: int, dtype: torch.dtype) -> list[torch.Tensor]:
        at = self.msg.plain_at[c]
        return self.section(at + k0 * dtype.itemsize, at + k1 * dtype.itemsize, dtype)
