"""Quantized reductions with four-bit codes between nodes (``--gift-inter-node-format nvfp4|mxfp4``):
the flat one (``FP4Reduce``, one all-to-all over the group) and the two-level one
(``FP4TwoLevelReduce``: ``comm.hierarchical``'s intra-node stage, then the node sums of the held
shards in FP4 among the nodes). The FP4 encode into the messages and the decode-sum of the own
shard run as Triton kernels where the reduction's kernels do (``kernels/fp4.py``, bit for bit
``numerics.fp4``); ``T``, ``T⁻¹`` and the rotation stay PyTorch's.

The flat one on rank ``r`` of ``p``, for one bucket whose layout passed ``BucketLayout.check_blocks``:

0. *send*: ``U = G T`` (GIFT, whole parameters; ``G`` elsewhere), the bucket's coded sequence; shard ``j``'s
   range of it encoded with ``numerics.fp4.encode_fp4``, one *segment* (an NVFP4 FP32 segment scale) per
   coded parameter part of the shard, into message ``j``::

       [segment scales (FP32) | off values | bf16 values | block scales | packed codes]

   each section padded to 4 bytes (``fp4_message``); every sender's message to ``j`` has the same
   size. Where the kernels run without error feedback, ``G T`` is made in FP32 (the encode reads ``G`` of
   the Euclidean parameters in the bucket, ``kernels.placement.Source``) and the whole sequence encoded
   in one launch; else each coded parameter is made and encoded by itself (its parts are whole
   segments: the same codes and scales), one parameter's FP32 values at a time.
   Each section is placed into every message by one index (``FP4Packing``): the ops grow with neither
   ``p`` nor the bucket's size. One all-to-all of the ``p - 1`` others' messages.
1. *reduce*: every sender's message decoded (``decode_fp4``, the messages as one sequence), summed in FP32 in rank order
   (``kernels.reference.ordered_sum``), ÷ p when averaging, ``T⁻¹`` of whole rows written into the
   bucket; the cut rows' partial projections go to the neighbours (``pieces.PieceExchange``).
2. *finish*: the cut rows' ``T⁻¹``. All-reduce: then every rank's shard, as the bucket holds it,
   all-gathered in the bucket's dtype (each shard is reduced once, by its owner: the same bits on
   every rank).

Every block lies inside one part (the layout's block rule), so codes and block scales never
straddle a message. With a rotation (``--gift-rotation hadamard``, ``numerics.rotation``) the senders
send ``G T H`` of every coded parameter (``G H`` where Euclidean; two-level: ``H`` on the node sums,
``H`` being linear) and the owner applies ``Hᵀ`` to the decoded sum before ``T⁻¹``; ``H`` acts on
64-column blocks of a row, so a row cut by a shard is rotated piece by piece (the layout's check puts
cuts on 64-column blocks): inside the sender's FP4 encode passes and the owner's decode pass where the
kernels run (a table of each 64-element chunk's sign row, ``_chunk_rows``), else the rotated 64-blocks
of all the shards at hand gathered, rotated and scattered back in a fixed number of calls
(``_rotate_shards``), whatever the number of nodes.
With error feedback (``--gift-error-feedback``, the flat exchange only) each sender adds its residual
``e`` to ``U`` and keeps ``e' = Ũ - dec(enc(Ũ H)) Hᵀ`` (``Ũ = U + e``), decoded from the message's own
encode (``_encode_parameter``): the residual stays in the whitened coordinates, before the rotation,
where a refresh carries it over and a checkpoint keeps it.
The output side is refused at start-up with FP4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._compat import all_gather as _all_gather
from ..config import IntraNode, Rotation
from ..kernels import reference
from ..kernels.placement import Placement, Source
from ..kernels.reference import ordered_sum, reference_rotate_blocks, reference_sum_rows, sender_values
from ..numerics.error_feedback import ErrorFeedback
from ..numerics.fp4 import FP4Encoded, FP4Format, decode_fp4, encode_fp4
from ..numerics.rotation import BlockHadamard
from .codec import CHUNK, spans, sum_plain
from .hierarchical import TwoLevelReduce
from .layout import BucketLayout, _pad4
from .ledger import CommLedger, dtype_label
from .pieces import PieceExchange
from .quantized import ShardReduction, Whitenings, destination
from .schedule import StageFlags, StageResult, taken
from .topology import Topology, TwoLevelGroups

ROTATION_BLOCK = 64  # columns per block of ``--gift-rotation hadamard`` (issue 36's measurement)


def exchange_rotation(rotation: Rotation, seed: int) -> BlockHadamard | None:
    """The rotation the four-bit exchange applies (``--gift-rotation``; None: none): the same signs on
    every rank, from ``seed``; with ``auto`` to the GIFT layers whose refresh chose it."""
    return None if rotation is Rotation.NONE else BlockHadamard(ROTATION_BLOCK, seed)


@dataclass(frozen=True)
class FP4Message:
    """Byte layout of the message every sender sends for one shard (module doc): section offsets
    and each coded part's length (the segments of ``encode_fp4``)."""

    seg_at: int
    plain_at: tuple[int, int]
    scales_at: int
    codes_at: int
    nbytes: int
    lengths: tuple[int, ...]


def fp4_message(layout: BucketLayout, j: int, fmt: FP4Format) -> FP4Message:
    """The message of shard ``j`` in format ``fmt`` (module doc)."""
    plan = layout.shards[j]
    lengths = tuple(p.hi - p.lo for p in plan.coded_parts)
    n = plan.n_coded
    plain = [(plan.plain_hi[c] - plan.plain_lo[c]) * layout.plain_dtypes[c].itemsize for c in range(2)]
    seg_bytes = _pad4(4 * len(lengths)) if fmt.segment_scale else 0
    plain_at = (seg_bytes, seg_bytes + _pad4(plain[0]))
    scales_at = plain_at[1] + _pad4(plain[1])
    codes_at = scales_at + _pad4(n // fmt.block)
    return FP4Message(0, plain_at, scales_at, codes_at, codes_at + _pad4(fmt.payload_bytes(n)), lengths)


def fp4_wire_bytes(layout: BucketLayout, j: int, fmt: FP4Format) -> int:
    """Bytes of shard ``j``'s coded values in one message, padding aside: the packed codes
    (``0.5`` byte per element), one block scale per block and, NVFP4, a segment scale per part."""
    plan = layout.shards[j]
    return fmt.payload_bytes(plan.n_coded) + fmt.scale_bytes(plan.n_coded, len(plan.coded_parts))


@dataclass(frozen=True)
class FP4Packing:
    """The messages of one FP4 exchange in its buffer: the messages of a *source*'s shards (the
    bucket's, or the two-level exchange's held shards) in the source's order, the own one included; per
    section a ``kernels.placement.Placement`` from the source's sequence (codes and block scales
    in bytes, segment scales in FP32, each plain class in its dtype) to the buffer, so that a whole
    exchange is encoded once and placed with a few ops, whatever the number of messages."""

    place: dict[str, Placement]  # "coded", "groups", "segments", "off", "bf16"
    lengths: torch.Tensor  # the coded parts' lengths of the shards one after another (the segments)
    ends: torch.Tensor  # their cumulative sum (the kernels' segment search)
    nbytes: int


def fp4_packing(layout: BucketLayout, fmt: FP4Format, shards: tuple[int, ...], device) -> FP4Packing:
    """The packing of the messages of ``shards`` (the source's shards), one after another in that order: the
    all-to-all's input in destination order, the own message included (the collective copies it into place)."""
    msgs = [fp4_message(layout, j, fmt) for j in shards]
    plans = [layout.shards[j] for j in shards]
    start, at = [0] * len(shards), 0
    for i in range(len(shards)):
        start[i], at = at, at + msgs[i].nbytes

    def table(sizes: list[int], offsets: list[int], itemsize: int) -> Placement:
        return Placement(sizes, [(a + o) // itemsize for a, o in zip(start, offsets)], device)

    place = {
        "coded": table([fmt.payload_bytes(p.n_coded) for p in plans], [m.codes_at for m in msgs], 1),
        "groups": table([p.n_coded // fmt.block for p in plans], [m.scales_at for m in msgs], 1),
        "segments": table([len(m.lengths) for m in msgs], [m.seg_at for m in msgs], 4),
    }
    for c, name in enumerate(("off", "bf16")):
        sizes = [p.plain_hi[c] - p.plain_lo[c] for p in plans]
        place[name] = table(sizes, [m.plain_at[c] for m in msgs], layout.plain_dtypes[c].itemsize)
    lengths = torch.tensor([n for m in msgs for n in m.lengths], dtype=torch.int64)
    return FP4Packing(place, lengths.to(device), lengths.cumsum(0).to(device), at)


def _place(out: torch.Tensor, table: Placement, values: torch.Tensor, at: int = 0) -> None:
    """``values`` (the source's sequence of one section from its element ``at`` on, in ``out``'s dtype)
    into ``out`` at the table's positions, ``CHUNK`` at a time (``Placement.index``: 4 bytes per element,
    8 past 2^31)."""
    for a, b in spans(0, values.numel(), CHUNK):
        out.index_put_((table.index(at + a, at + b),), values[a:b])


class _FP4Stages:
    """What the flat and two-level FP4 reductions share: the messages' encode, the own shard's
    decode and sum, the all-reduce's gather. ``_messages(prev)``: every sender's message for the own
    shard, ``[senders, nbytes]`` in rank (node) order, from what the sending stage handed on."""

    def _fp4(self, fmt: FP4Format, rotation: BlockHadamard | None, rotated: tuple[bool, ...] | None) -> None:
        """``rotated``: per segment, whether ``rotation`` applies (``--gift-rotation auto``); None: to every
        coded segment."""
        self.fmt, self.rotation = fmt, rotation
        self.rotated_segments = tuple(i for i in self.layout.coded_segments if rotated is None or rotated[i])
        self.fp4_label = f"{fmt.label}+scales"  # the ledger's name of the FP4 messages
        layout = self.layout
        self.msgs = layout.cached(("fp4", fmt.name), lambda: [fp4_message(layout, j, fmt) for j in range(self.world)])

    def _gathered_bytes(self) -> list[int]:
        """The all-reduce's own shard and the gathered shards, in the bucket's dtype."""
        nbytes = self.layout.shard_size * self.flat.element_size()
        return [nbytes, self.world * nbytes] if self.all_reduce else []

    def _lengths(self, j: int, device) -> torch.Tensor:
        """Shard ``j``'s segment lengths (its coded parts) on ``device``, copied there once per layout."""
        m = self.msgs[j]
        return self.layout.cached(
            ("fp4-lengths", j, str(device)), lambda: torch.tensor(m.lengths, dtype=torch.int64).to(device)
        )

    def _rotate_shards(self, x: torch.Tensor, shards: tuple[int, ...], inverse: bool = False) -> torch.Tensor:
        """``x``, the coded values of ``shards`` one after another (FP32), with every part of a rotated
        segment times ``H`` (``inverse``: ``Hᵀ``) in place where a rotation is on: ``H`` is block-diagonal
        along each row, ``fwht(x ⊙ s)`` per 64-column block with the block's column signs ``s``
        (``Hᵀ``: ``fwht(x) ⊙ s``), so a piece of a row cut by a shard is rotated by itself. A fixed
        number of calls whatever the shards and parts: one launch where the kernels run
        (``kernels.fp4.rotate_blocks``), else the blocks gathered, rotated and scattered back."""
        if self.rotation is None or not self.rotated_segments or x.numel() == 0:
            return x
        fp4 = self.ops.fp4(x.device)
        rotate = reference_rotate_blocks if fp4 is None else fp4.rotate_blocks
        return rotate(x, *self._rotation_table(shards, x.device), inverse)

    def _rotation_table(self, shards: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``_rotate_shards``' tables, built once per layout, shards and rotated set: the start in the
        shards' coded values of each rotated 64-block (in order), its row in ``signs`` and ``signs`` (the
        signs of each width of the rotated parameters, 64 per row, one width after another:
        ``BlockHadamard.signs`` depends on the width only)."""
        layout, block, rotated = self.layout, self.rotation.block, set(self.rotated_segments)

        def build():
            first, table, starts, rows, base = {}, [], [], [], 0
            for cols in sorted({layout.segments[i].cols for i in rotated}):  # signs per width
                first[cols] = sum(t.numel() for t in table) // block
                table.append(self.rotation.signs(cols))
            for j in shards:
                plan = layout.shards[j]
                for part in plan.coded_parts:
                    if part.seg not in rotated:
                        continue
                    s, at = layout.segments[part.seg], layout.seg_at[part.seg]
                    nb = (part.hi - part.lo) // block
                    starts.append(base + part.at - plan.coded_lo + block * torch.arange(nb))
                    col0 = (part.at - at) % s.cols // block  # the part's first block's column block
                    rows.append(first[s.cols] + (col0 + torch.arange(nb)) % (s.cols // block))
                base += plan.n_coded

            def cat(ts, dt):
                return torch.cat(ts).to(device) if ts else torch.zeros(0, dtype=dt, device=device)

            return cat(starts, torch.int64), cat(rows, torch.int64), cat(table, torch.float32).view(-1, block)

        return layout.cached(("fp4-rotation", shards, self.rotated_segments, str(device)), build)

    def _chunk_rows(self, shards: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
        """``kernels.fp4.encode_placed``'s rotation: each 64-element chunk of the shards' coded values, the
        sign row of a rotated block starting there or -1 (every rotated block starts on a chunk: the
        layout's block rule), and the signs; built once per layout, shards and rotated set."""

        def build():
            starts, rows, signs = self._rotation_table(shards, device)
            n = sum(self.layout.shards[j].n_coded for j in shards)
            chunk = torch.full((n // self.rotation.block,), -1, dtype=torch.int64, device=device)
            return chunk.index_copy_(0, starts // self.rotation.block, rows), signs

        return self.layout.cached(("fp4-rotation-chunks", shards, self.rotated_segments, str(device)), build)

    def _packing(self, shards: tuple[int, ...], device) -> FP4Packing:
        """``fp4_packing`` of ``shards``, built once per layout."""
        key = ("fp4-packing", self.fmt.name, shards, str(device))
        return self.layout.cached(key, lambda: fp4_packing(self.layout, self.fmt, shards, device))

    def _encode_placed(
        self,
        pk: FP4Packing,
        coded: torch.Tensor,
        plain: list[torch.Tensor],
        rotate: tuple[int, ...],
        source: Source | None = None,
    ) -> torch.Tensor:
        """The buffer of ``pk``'s messages: the source's coded values ``coded`` (FP32, its shards one
        after another; ``rotate``: those shards, whose rotated parts are sent times ``H``, in the encode's
        passes where the kernels run, else by ``_rotate_shards`` first) encoded in one call (every block
        and segment lies inside one shard's part, so the codes and scales are those of one call per
        message) and placed, the plain values ``plain[c]`` (class ``c``'s, the shards one after another)
        cast into place; padding zero. ``source`` (where the kernels run): the runs of the coded values
        that the encode reads where they lie, not in ``coded``. ``coded`` is the calling stage's own: the
        PyTorch path's encode overwrites it."""
        buf = self.space.zeros(pk.nbytes, device=coded.device)
        fp4 = self.ops.fp4(coded.device)
        rotating = self.rotation is not None and bool(self.rotated_segments)
        n = coded.numel() if source is None else source.n  # with a source ``coded`` holds its own part alone
        if n and fp4 is not None:
            rotation = self._chunk_rows(rotate, coded.device) if rotating else None
            fp4.encode_placed(coded, self.fmt, pk.ends, buf, pk.place, rotation, source)
        elif n:
            assert source is None, "a source is read by the kernels only"
            if rotating:
                coded = self._rotate_shards(coded, rotate)
            enc = encode_fp4(coded, self.fmt, pk.lengths, scratch=True)  # the stage's own values: scaled in place
            self._place_encoded(buf, pk, enc, 0, 0)
        self._place_plain(buf, pk, plain)
        return buf

    def _place_encoded(self, buf: torch.Tensor, pk: FP4Packing, enc: FP4Encoded, at: int, part: int) -> None:
        """``enc``, the encode of the source's coded values from element ``at`` on, whose first segment is the
        source's part ``part``, into ``pk``'s messages in ``buf``: codes, block scales, segment scales."""
        _place(buf, pk.place["coded"], enc.codes, at // 2)
        _place(buf, pk.place["groups"], enc.block_scales, at // self.fmt.block)
        if self.fmt.segment_scale:
            _place(buf.view(torch.float32), pk.place["segments"], enc.segment_scales, part)

    def _place_plain(self, buf: torch.Tensor, pk: FP4Packing, plain: list[torch.Tensor]) -> None:
        """The plain values ``plain[c]`` (class ``c``'s, the source's shards one after another) cast into
        ``pk``'s messages in ``buf``."""
        fp4 = self.ops.fp4(buf.device)
        for c, name in enumerate(("off", "bf16")):
            dt = self.layout.plain_dtypes[c]
            if plain[c].numel() == 0:  # a class the source lacks (a layout fact): nothing to place
                continue
            if fp4 is not None:  # one placed cast (kernels/place.py)
                self.ops.whiten_place(plain[c].view(1, -1), None, pk.place[name].at(buf.view(dt), 0))
            else:
                _place(buf.view(dt), pk.place[name], plain[c].to(dt))

    # -- the own shard ----------------------------------------------------------------------------------
    def _reduce(self, prev: StageResult) -> StageResult:
        layout, r, flat, targets = self.layout, self.rank, self.flat, getattr(prev, "targets", {})
        plan, m = layout.shards[r], self.msgs[r]
        msgs = self._messages(prev)
        first = self.average and self.divide_first
        for c, parts in enumerate(plan.plain_parts):
            dt = layout.plain_dtypes[c]
            for part in parts:
                k = m.plain_at[c] + (part.at - plan.plain_lo[c]) * dt.itemsize
                n = (part.hi - part.lo) * dt.itemsize
                values = msgs[:, k : k + n].contiguous().view(dt)
                dest = flat[part.lo : part.hi]
                self._store(dest, reference_sum_rows([values], first, out=self._target(dest)))
        total = self._decoded_sum(msgs, plan.n_coded, m)  # times Hᵀ (H is linear: Hᵀ of the sum)
        if first and total is not None:
            total /= self.world
        values = []
        for part in plan.coded_parts:
            s, at, t = layout.segments[part.seg], layout.seg_at[part.seg], self.transforms[part.seg]
            x = total[part.at - plan.coded_lo : part.at - plan.coded_lo + part.hi - part.lo]
            if t is None:
                dest = destination(flat, targets, part.seg, part.lo, part.hi)
                self._store(dest, x)  # a view of the sum: nothing reads it after
                continue
            r0, r1 = -(-(part.at - at) // s.cols), (part.at + part.hi - part.lo - at) // s.cols
            if r1 > r0:  # whole rows: T⁻¹ here
                k0 = at + r0 * s.cols - part.at
                rows = x[k0 : k0 + (r1 - r0) * s.cols].view(r1 - r0, s.cols)
                lo = s.start + r0 * s.cols
                dest = destination(flat, targets, part.seg, lo, lo + (r1 - r0) * s.cols)
                target = self._target(dest)
                self.ops.unwhiten(rows, t, target.view(r1 - r0, s.cols))  # T⁻¹: the kernels' two launches
                self._store(dest, target)
        for p in plan.pieces:
            if self.transforms[p.seg] is None:
                values.append(None)
                continue
            k0 = layout.seg_at[p.seg] + p.row * layout.segments[p.seg].cols + p.c0 - plan.coded_lo
            values.append(total[k0 : k0 + p.c1 - p.c0].view(1, -1).clone())
        exchange = PieceExchange(layout, r, self.transforms, self.group, self.ledger, self._links)
        work = exchange.start(values, flat.device)
        return StageResult(works=[work] if work is not None else [], exchange=exchange)

    def _decoded_sum(self, msgs: torch.Tensor, n: int, m: FP4Message) -> torch.Tensor | None:
        """``Σ_i dec(message_i)`` of the own shard's coded values, FP32, senders in rank order, times ``Hᵀ``
        where a rotation is on: the senders' messages decoded as one sequence (their segments one after
        another), summed, rotated back (in the decode's pass where the kernels run)."""
        if n == 0:
            return None
        fp4, r, dev = self.ops.fp4(msgs.device), self.rank, msgs.device
        if fp4 is not None:
            ends = self.layout.cached(("fp4-ends", r, str(dev)), lambda: self._lengths(r, dev).cumsum(0))
            rotating = self.rotation is not None and bool(self.rotated_segments)
            rotation = self._chunk_rows((r,), dev) if rotating else None
            return fp4.decode_sum(msgs, n, self.fmt, m.codes_at, m.scales_at, m.seg_at, ends, rotation)
        senders, parts = msgs.shape[0], len(m.lengths)
        segments = (
            msgs[:, : 4 * parts].contiguous().view(torch.float32).reshape(-1)
            if self.fmt.segment_scale
            else torch.ones(senders * parts, dtype=torch.float32, device=msgs.device)
        )
        lengths = self._lengths(self.rank, msgs.device)

        def rows(_, a: int, b: int) -> torch.Tensor:  # senders [a, b) decoded, the budget's blocks at a time
            enc = FP4Encoded(  # the messages' codes and block scales where they lie (the decode reads rows)
                codes=msgs[a:b, m.codes_at : m.codes_at + n // 2],
                block_scales=msgs[a:b, m.scales_at : m.scales_at + n // self.fmt.block],
                segment_scales=segments[a * parts : b * parts],
            )
            return decode_fp4(enc, self.fmt, lengths.repeat(b - a)).view(b - a, n)

        total = ordered_sum([msgs], rows, reference.DECODE_VALUES, width=n, blocks=reference.DECODE_BLOCKS)
        return self._rotate_shards(total, (r,), inverse=True)  # Hᵀ on the sum (H is linear)

    # -- 2-3: all-reduce --------------------------------------------------------------------------------
    def _finish_gather(self, prev: StageResult) -> StageResult:
        """The cut rows' ``T⁻¹``, then every rank's shard of the bucket all-gathered (bucket dtype)."""
        self._finish(prev)
        layout, flat = self.layout, self.flat
        size = layout.shard_size
        lo, hi = layout.shards[self.rank].lo, layout.shards[self.rank].hi
        mine = self.space.zeros(size, flat.dtype, flat.device)
        mine[: hi - lo].copy_(flat[lo:hi])
        gathered = self.space.empty(self.world * size, flat.dtype, flat.device)
        nbytes = size * flat.element_size()
        self.ledger.add(
            "all_gather",
            dtype_label(flat.dtype),
            (self.world - 1) * nbytes,
            self._links([nbytes] * self.world),
        )
        work = _all_gather(gathered, mine, group=self.group, async_op=True)
        return StageResult(works=[work], gathered=gathered, mine=mine)

    def _land(self, prev: StageResult) -> StageResult:
        """Every other shard's reduced values written into the bucket (only where parameters are)."""
        layout, flat, targets = self.layout, self.flat, getattr(prev, "targets", {})
        for j, plan in enumerate(layout.shards):
            if j == self.rank:
                continue
            base = j * layout.shard_size
            for parts in [plan.coded_parts, *plan.plain_parts]:
                for part in parts:
                    src = prev.gathered[base + part.lo - plan.lo : base + part.hi - plan.lo]
                    destination(flat, targets, part.seg, part.lo, part.hi).copy_(src)
        return StageResult()


class FP4Reduce(_FP4Stages, ShardReduction):
    """One bucket's flat reduction in FP4 (module doc), with ``error_feedback``'s residual where given;
    construction does no work."""

    def __init__(
        self,
        flat: torch.Tensor,
        layout: BucketLayout,
        group,
        transforms: Whitenings,
        fmt: FP4Format,
        average: bool = False,
        all_reduce: bool = False,
        ledger: CommLedger | None = None,
        nonfinite: StageFlags | None = None,
        topology: Topology | None = None,
        rotation: BlockHadamard | None = None,
        kernels: bool | None = None,
        error_feedback: ErrorFeedback | None = None,
        rotated: tuple[bool, ...] | None = None,
    ):
        super().__init__(flat, layout, group, transforms, average, all_reduce, ledger, nonfinite, topology, kernels)
        self._fp4(fmt, rotation, rotated)
        self.error_feedback = error_feedback

    def stages(self) -> list:
        if self.all_reduce:
            return [self._send, self._reduce, self._finish_gather, self._land]
        return [self._send, self._reduce, self._finish]

    def _footprint_key(self) -> tuple:
        return (self.fmt.name,)

    def _footprint(self) -> int:
        """Send buffer (every shard's FP4 message) and receive buffer (p own messages), the most on any rank."""
        sizes = [m.nbytes for m in self.msgs]
        return taken(sum(sizes), self.world * max(sizes), *self._gathered_bytes())

    # -- 0: send --------------------------------------------------------------------------------------
    def _coded_values(self) -> tuple[torch.Tensor, Source | None]:
        """The kernels' input (without error feedback): ``G T`` of the GIFT parameters in FP32, one after
        another, and the Euclidean parameters as a ``Source`` read in the bucket, which places those
        values in the coded sequence (packed: ``u`` holds ``G T`` alone, no FP32 copy of ``G``)."""
        layout, flat = self.layout, self.flat
        euclid = tuple(i for i in layout.coded_segments if self.transforms[i] is None)
        segs = layout.segments

        def runs() -> Source | None:  # (position in the coded sequence, length, start in the bucket)
            runs = [(layout.seg_at[i], segs[i].end - segs[i].start, segs[i].start) for i in euclid]
            return Source.runs(runs, layout.n_coded, flat.device, packed=True)

        source = layout.cached(("fp4-source", euclid, str(flat.device)), runs) if euclid else None
        u = torch.empty(
            max(1, layout.n_coded if source is None else source.own), dtype=torch.float32, device=flat.device
        )
        at = 0
        for i in layout.coded_segments:
            s = layout.segments[i]
            if i not in euclid:  # the GIFT parameters' G T one after another (the packed source's own runs)
                g = flat[s.start : s.end].view(s.rows, s.cols)
                u[at : at + s.rows * s.cols].copy_(sender_values(g, self.transforms[i], None).reshape(-1))
                at += s.rows * s.cols
        return u, source.on(flat) if source is not None else None

    def _class_values(self, c: int) -> torch.Tensor:
        """Plain class ``c``'s sequence: its parameters' values one after another (the shards' parts
        of it one after another)."""
        layout, flat = self.layout, self.flat
        values = [flat[layout.segments[i].start : layout.segments[i].end] for i in layout.plain_segments[c]]
        return torch.cat(values) if values else flat[:0]

    def _segment_parts(self) -> dict[int, tuple[int, int]]:
        """Per coded parameter, the range of its parts among the coded sequence's parts (the segments of
        the encode: the shards' coded parts one after another), built once per layout."""

        def build():
            parts = [p for plan in self.layout.shards for p in plan.coded_parts]
            ranges = {}
            for k, p in enumerate(parts):
                ranges[p.seg] = (ranges.get(p.seg, (k, k))[0], k + 1)
            return ranges

        return self.layout.cached(("fp4-segment-parts",), build)

    def _encode_parameters(self, pk: FP4Packing, buf: torch.Tensor) -> None:
        """The PyTorch path's sender: each coded parameter by itself (``_encode_parameter``), one
        parameter's FP32 values and its encode's temporaries at a time, not the bucket's."""
        ranges, ef = self._segment_parts(), self.error_feedback
        for i in self.layout.coded_segments:
            self._encode_parameter(pk, buf, i, ranges[i], ef)

    def _encode_parameter(self, pk: FP4Packing, buf: torch.Tensor, i: int, parts: tuple[int, int], ef) -> None:
        """Parameter ``i``'s ``U = G T`` (``G`` where Euclidean), with error feedback ``Ũ = U + e`` made where
        ``e`` (its part of ``ef``'s residual) lies, times ``H`` where rotated, encoded by itself (``parts``: the
        range of its parts, whole segments and blocks: the codes and scales of one call on the whole sequence)
        and placed into the messages; with error feedback ``e' = Ũ - dec(enc(Ũ H)) Hᵀ`` from that same encode,
        written over ``e``."""
        s, at, fmt = self.layout.segments[i], self.layout.seg_at[i], self.fmt
        n, lengths = s.rows * s.cols, pk.lengths[parts[0] : parts[1]]
        g = self.flat[s.start : s.end].view(s.rows, s.cols)
        u = sender_values(g, self.transforms[i], None)  # ``g`` itself where Euclidean in FP32
        e = ef.feedback(at, n)[0].view_as(u) if ef is not None else None
        if e is not None:
            u = torch.add(u, e, out=e)
        rotated = self.rotation is not None and i in self.rotated_segments
        v = self.rotation.apply(u, scratch=u is not g and e is None) if rotated else u  # ``G T``, ours, in place
        if e is None:
            del u  # not read again: rotated, the encode's input alone is held
        # the encode scales its input in place where nothing reads it after: not the gradient, not Ũ
        enc = encode_fp4(v.reshape(-1), fmt, lengths, scratch=v is not g and (e is None or rotated))
        del v
        self._place_encoded(buf, pk, enc, at, parts[0])
        if e is not None:
            sent = decode_fp4(enc, fmt, lengths).view_as(u)
            u.sub_(self.rotation.inverse(sent) if rotated else sent)

    def _send(self, prev: StageResult) -> StageResult:
        device, r = self.flat.device, self.rank
        pk = self._packing(tuple(range(self.world)), device)  # every rank's message, in rank order
        plain = [self._class_values(c) for c in range(2)]
        if self.ops.fp4(device) is not None and self.error_feedback is None:
            coded, source = self._coded_values()
            buf = self._encode_placed(pk, coded, plain, tuple(range(self.world)), source)
        else:  # error feedback takes the next residual from the message's own encode (on either path)
            buf = self.space.zeros(pk.nbytes, device=device)
            self._encode_parameters(pk, buf)
            self._place_plain(buf, pk, plain)
        if self.world == 1:  # the own message is all the receive buffer would hold
            return StageResult(works=[], recv=buf)
        own = self.msgs[r].nbytes
        recv = self.space.empty(self.world * own, device=device)
        per_peer = [self.msgs[j].nbytes if j != r else 0 for j in range(self.world)]  # what leaves the rank
        self.ledger.add("all_to_all", self.fp4_label, sum(per_peer), self._links(per_peer))
        work = dist.all_to_all_single(
            recv,
            buf,
            [own] * self.world,
            [m.nbytes for m in self.msgs],
            group=self.group,
            async_op=True,
        )
        return StageResult(works=[work], buf=buf, recv=recv)

    def _messages(self, prev: StageResult) -> torch.Tensor:
        """Every sender's message for the own shard, ``[p, nbytes]`` in rank order: the receive buffer (the
        own message copied there by the all-to-all), no copy of its own."""
        return prev.recv.view(self.world, self.msgs[self.rank].nbytes)


class FP4TwoLevelReduce(_FP4Stages, TwoLevelReduce):
    """The two-level reduction with FP4 between nodes: the intra-node stage as ``TwoLevelReduce``'s
    (``--gift-intra-node``), the node sums of the held shards encoded in FP4 (one message per held
    shard, as the flat FP4 exchange's) for the all-to-all among the ranks with the same local index,
    then the own shard decoded and summed, nodes in order (``_FP4Stages``)."""

    def __init__(
        self,
        flat: torch.Tensor,
        layout: BucketLayout,
        groups: TwoLevelGroups,
        transforms: Whitenings,
        fmt: FP4Format,
        intra: IntraNode = IntraNode.BF16,
        average: bool = False,
        all_reduce: bool = False,
        ledger: CommLedger | None = None,
        nonfinite: StageFlags | None = None,
        rotation: BlockHadamard | None = None,
        kernels: bool | None = None,
        rotated: tuple[bool, ...] | None = None,
    ):
        super().__init__(flat, layout, groups, transforms, intra, average, all_reduce, ledger, nonfinite, kernels)
        self._fp4(fmt, rotation, rotated)

    def stages(self) -> list:
        if self.all_reduce:
            return [self._intra, self._node_sums, self._reduce, self._finish_gather, self._land]
        return [self._intra, self._node_sums, self._reduce, self._finish]

    def _footprint_key(self) -> tuple:
        return (self.fmt.name, self.wire, self.topo.ranks_per_node)

    def _inter_bytes(self, r: int) -> list[int]:
        """Rank ``r``'s inter-node send (its held shards' FP4 messages) and receive buffers."""
        held = self.topo.inter_ranks(r)
        return [sum(self.msgs[j].nbytes for j in held), self.topo.nodes * self.msgs[r].nbytes]

    def _node_sums(self, prev: StageResult) -> StageResult:
        """``P_{k,j}`` for the held shards ``j`` (FP32 sums of the node's messages, local ranks in
        order), each encoded into its FP4 message; the all-to-all among the nodes."""
        layout, device, cfg = self.layout, self.flat.device, self.layout.codec
        rows = self._intra_rows(prev)
        chunks, counts = self._held(device)
        plans = [layout.shards[j] for j in self.held]
        sums = torch.empty(sum(p.n_coded for p in plans), dtype=torch.float32, device=device)
        for (c0, c1), (g0, g1), lengths in chunks:  # decoded and summed by the codec ops, into place
            coded = rows.coded(c0, c1, layout.coded_dtype(self.wire))
            if self.wire is None:
                scales = rows.scales(g0, g1, cfg.scale_dtype())
                self.ops.decode_sum_unwhiten(
                    coded, scales, 1, c1 - c0, None, cfg, False, lengths=lengths, out=sums[c0:c1]
                )
            else:
                self.ops.sum_rows(coded, False, out=sums[c0:c1])
        # a class the held shards lack (a layout fact) costs no ops
        plain = [sum_plain(rows, layout, c, 0, counts[c], False, self.ops) if counts[c] else sums[:0] for c in range(2)]
        return self._send_inter(sums, plain)

    def _send_inter(self, sums: torch.Tensor, plain: list[torch.Tensor], source: Source | None = None) -> StageResult:
        """The held shards' node sums (``sums``: coded values, whitened, FP32, but ``source``'s runs where given;
        ``plain[c]``: class ``c``'s), ``H`` on the coded parts, encoded into their FP4 messages; the all-to-all
        among the nodes."""
        device, n = sums.device, self.topo.nodes
        pk = self._packing(tuple(self.held), device)  # the held shards' messages, in node order
        buf = self._encode_placed(pk, sums, plain, tuple(self.held), source)  # H on the held shards' rotated parts
        own = self.msgs[self.rank].nbytes
        recv = self.space.empty(n * own, device=device)
        sent = pk.nbytes - own
        self.ledger.add("all_to_all", self.fp4_label, sent, {"inter": sent})
        work = dist.all_to_all_single(
            recv,
            buf,
            [own] * n,
            [self.msgs[j].nbytes for j in self.held],
            group=self.groups.inter,
            async_op=True,
        )
        return StageResult(works=[work], buf=buf, recv=recv)

    def _messages(self, prev: StageResult) -> torch.Tensor:
        """Every node's message for the own shard, ``[n, nbytes]`` in node order: the receive buffer (the own
        message copied there by the all-to-all), no copy of its own."""
        return prev.recv.view(self.topo.nodes, self.msgs[self.rank].nbytes)
