"""Flat quantized reduce-scatter and all-reduce of one gradient bucket: one all-to-all over the group.

Stages (run by ``comm.schedule.ReductionQueue``), on rank ``r`` of ``p``:

0. *send*: ``G T`` (GIFT rows; ``G`` elsewhere) encoded into every shard's message
   (``codec.encode_bucket``, with the plain values); one all-to-all of the ``p - 1`` others'
   messages (the own one never leaves the rank).
1. *reduce*, shard ``r``::

       Σ_i dec(message_r from rank i)   FP32, ranks in order (kernels.ordered_sum); ÷ p if averaging
       shard ← Σ · T⁻¹                  whole GIFT rows, written into the bucket

   the cut rows' partial projections go to the neighbours (``pieces.PieceExchange``). All-reduce:
   the sum (still whitened, ÷ p) is encoded into one message instead, all-gathered over the group.
2. *finish*: the cut rows' ``T⁻¹`` (reduce-scatter); all-reduce: every shard's message decoded
   and ``T⁻¹`` applied to whole rows on every rank: the same bytes give the same bits everywhere.

With the distributed optimizer, the bucket outside shard ``r`` is left as it was. Each stage reads
what the last one handed it (``schedule.StageResult``); two entries a wrapper (``comm.output_side``)
may add change what is sent and where results land, per coded segment: ``outputs`` in the first
stage's (a ``T_out`` whose ``T_outᵀ`` the sender applies in its encode pass, ``T_outᵀ G T``) and
``targets`` in the later ones' (FP32 tensors that receive the segment's results instead of the
bucket; ``destination``). ``nonfinite`` (``schedule.StageFlags``), when given, has the flag of the
stage that wrote a NaN/Inf set on the device. ``topology``, when given, splits the ledger's bytes
into intra- and inter-node links.
``kernels``: the fused kernels' setting (``GiftConfig.exchange.kernels``), resolved once into ``ops``
(``kernels.CodecOps``), which every stage calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import kernels as _kernels
from .._compat import all_gather as _all_gather
from ..numerics.error_feedback import ErrorFeedback
from ..numerics.whitening import LowRankWhitening
from .codec import CHUNK, encode_bucket, part_chunks, plain_bucket, reduce_coded, spans, sum_plain, views
from .layout import BucketLayout
from .ledger import CommLedger, message_label
from .packing import Received, packing
from .pieces import PieceExchange
from .schedule import Reduction, StageFlags, StageResult, taken
from .topology import Topology

Whitenings = list[LowRankWhitening | None]  # per segment, None where not whitened


def with_self(sizes: list[int], rank: int, own: int = 0) -> list[int]:
    """Split sizes per rank from the peers' ``sizes`` (rank order without ``rank``), ``own`` for ``rank``."""
    return [*sizes[:rank], own, *sizes[rank:]]


def destination(flat: torch.Tensor, targets: dict, seg: int, lo: int, hi: int) -> torch.Tensor:
    """Where the results for bucket positions ``[lo, hi)`` of segment ``seg`` are written: ``targets[seg] =
    (tensor, first position)`` where the segment has a target, else the bucket ``flat``."""
    if seg in targets:
        t, at = targets[seg]
        return t[lo - at : hi - at]
    return flat[lo:hi]


class ShardReduction(Reduction):
    """What the flat and two-level reductions share: the own shard's reduction from the messages
    of every sender, the cut rows, the all-reduce's gathered decode (construction does no work).

    ``divide_first``: averaging divides the sum before ``T⁻¹`` (flat: by the number of messages,
    the group size) or after it (two-level: by the group size, the messages being one per node)."""

    divide_first = True

    def __init__(
        self,
        flat: torch.Tensor,
        layout: BucketLayout,
        group,
        transforms: Whitenings,
        average: bool,
        all_reduce: bool,
        ledger: CommLedger | None,
        nonfinite: StageFlags | None,
        topology: Topology | None,
        kernels: bool | None,
    ):
        self.flat, self.layout, self.group, self.transforms = flat, layout, group, transforms
        self.average, self.all_reduce = average, all_reduce
        self.ledger = ledger if ledger is not None else CommLedger()
        self.nonfinite, self.topology = nonfinite, topology
        self.world, self.rank = group.size(), group.rank()
        if self.world != layout.num_shards:
            raise ValueError(f"layout has {layout.num_shards} shards but the group has {self.world} ranks")
        self.ops = _kernels.CodecOps.resolve(flat.device, kernels, layout.codec)
        self.chunk = None if self.ops.fused else CHUNK
        self.coded_label = message_label(layout)  # the ledger's name of the bucket's messages

    def _message_bytes(self, shards: tuple[int, ...], wire: torch.dtype | None = None) -> int:
        """Bytes of the message of ``shards`` (``BucketLayout.message``), once per layout."""
        return self.layout.cached(("message-bytes", shards, wire), lambda: self.layout.message(shards, wire).nbytes)

    def footprint(self) -> int:
        """``_footprint()`` (the arena bytes its message buffers take, the most on any rank: the same
        on every rank), once per layout and kind of reduction."""
        key = ("footprint", type(self).__name__, self.all_reduce, self.world, *self._footprint_key())
        return self.layout.cached(key, self._footprint)

    def _footprint_key(self) -> tuple:
        return ()

    def _gathered_bytes(self) -> list[int]:
        """The all-reduce's buffers after the own shard's sum: its message and the gathered ones."""
        return [self.layout.max_message_bytes, self.world * self.layout.max_message_bytes] if self.all_reduce else []

    def _links(self, per_peer: list[int]) -> dict[str, int] | None:
        """Links crossed by ``per_peer[j]`` bytes sent to rank ``j`` of the group."""
        return self.topology.link_bytes(self.rank, per_peer) if self.topology is not None else None

    def _reduced(self, values: torch.Tensor) -> torch.Tensor:
        """A finished sum as it is written: divided by the group size where averaging divides after
        ``T⁻¹`` (not ``divide_first``), then the running stage's flag of ``nonfinite`` set (on the
        device) if it holds NaN/Inf. Stages of consecutive buckets run on their streams at once: a
        flag shared by two streams could lose a set value to a concurrent read-modify-write."""
        if self.average and not self.divide_first:
            values.div_(self.world)
        if self.nonfinite is not None:  # the running stage's own flag: one stream writes each
            self.nonfinite.mark(self.stage, values)
        return values

    def _target(self, dest: torch.Tensor) -> torch.Tensor:
        """Where a sum bound for ``dest`` (a bucket slice, a message section) is computed: ``dest``
        itself, unless ``_reduced`` divides it afterwards and ``dest`` is narrower than FP32 (the
        quotient is rounded once, from FP32, as everywhere else): then an FP32 temporary."""
        if self.average and not self.divide_first and dest.dtype != torch.float32:
            return torch.empty(dest.shape, device=dest.device)
        return dest

    def _store(self, dest: torch.Tensor, values: torch.Tensor) -> None:
        """``values`` (computed into ``_target(dest)``) finished (``_reduced``) and left in ``dest``."""
        values = self._reduced(values)
        if values is not dest:
            dest.copy_(values)

    def _reduce_own(self, rows: Received, targets: dict | None = None) -> StageResult:
        """Reduce-scatter: the own shard's sum of ``rows``' messages, ``T⁻¹`` of whole rows, written
        into the bucket (or ``targets``) (one decode, or plain sum, per segment part on the fused path);
        the cut rows' partials sent to the neighbours."""
        targets = targets or {}
        layout, plan, flat = self.layout, self.layout.shards[self.rank], self.flat
        first = self.average and self.divide_first
        for c, parts in enumerate(plan.plain_parts):
            for part in parts:
                at = part.at - plan.plain_lo[c]
                for a, b in spans(at, part.hi - part.lo, self.chunk):
                    dest = flat[part.lo + a - at : part.lo + b - at]
                    self._store(dest, sum_plain(rows, layout, c, a, b, first, self.ops, out=self._target(dest)))
        for part in plan.coded_parts:
            t = self.transforms[part.seg]
            for k0, k1, n_rows, cols in part_chunks(layout, part, self.chunk, t is not None):
                dest = destination(flat, targets, part.seg, part.lo + k0 - part.at, part.lo + k1 - part.at).view(
                    n_rows, cols
                )
                out = self._target(dest)
                self._store(dest, reduce_coded(rows, layout, plan, k0, k1, (n_rows, cols), t, first, self.ops, out))
        values = []
        for p in plan.pieces:
            if self.transforms[p.seg] is None:  # reduced with its part
                values.append(None)
                continue
            k0 = layout.seg_at[p.seg] + p.row * layout.segments[p.seg].cols + p.c0
            values.append(
                reduce_coded(rows, layout, plan, k0, k0 + p.c1 - p.c0, (1, p.c1 - p.c0), None, first, self.ops)
            )
        exchange = PieceExchange(layout, self.rank, self.transforms, self.group, self.ledger, self._links)
        work = exchange.start(values, flat.device)
        return StageResult(works=[work] if work is not None else [], exchange=exchange)

    def _finish(self, prev: StageResult) -> StageResult:
        """The cut rows' ``T⁻¹``, written into the bucket."""
        layout, targets = self.layout, getattr(prev, "targets", {})
        for p, values in zip(layout.shards[self.rank].pieces, prev.exchange.finish()):
            if values is not None:
                values = self._reduced(values)
                destination(self.flat, targets, p.seg, *p.flat(layout.segments[p.seg])).copy_(values.reshape(-1))
        return StageResult()

    def _own_message(self, rows: Received) -> torch.Tensor:
        """All-reduce: the own shard's sum of ``rows``' messages (whitened, ÷ the group size when
        averaging) encoded into one message of ``max_message_bytes``."""
        layout, r, device = self.layout, self.rank, self.flat.device
        plan = layout.shards[r]
        own = layout.cached(
            ("own", r, str(device)), lambda: packing(layout, [r], [[r]], None, device, layout.max_message_bytes)
        )
        msg = self.space.zeros(layout.max_message_bytes, device=device)
        out = views(msg, layout)
        first = self.average and self.divide_first
        for part in plan.coded_parts:
            for k0, k1, _, _ in part_chunks(layout, part, self.chunk, False):
                values = self._reduced(reduce_coded(rows, layout, plan, k0, k1, (1, k1 - k0), None, first, self.ops))
                g0, g1 = layout.group_range(k0, k1)
                into = _kernels.Placed(
                    own.place["coded"].at(out["coded"], k0 - plan.coded_lo),
                    own.place["groups"].at(out["groups"], g0 - plan.group_lo),
                )
                self.ops.whiten_encode(values, None, layout.codec, lengths=layout.lengths(g0, g1, device), into=into)
        for c, name in enumerate(("off", "bf16")):
            at = own.own.plain_at[c] // layout.plain_dtypes[c].itemsize  # the own shard's values, one after another
            for a, b in spans(0, plan.plain_hi[c] - plan.plain_lo[c], self.chunk):
                dest = out[name][at + a : at + b]
                self._store(dest, sum_plain(rows, layout, c, a, b, first, self.ops, out=self._target(dest)))
        return msg


class QuantizedReduce(ShardReduction):
    """One bucket's flat quantized reduction (module doc); construction does no work."""

    def __init__(
        self,
        flat: torch.Tensor,
        layout: BucketLayout,
        group,
        transforms: Whitenings,
        error_feedback: ErrorFeedback | None = None,
        average: bool = False,
        all_reduce: bool = False,
        ledger: CommLedger | None = None,
        nonfinite: StageFlags | None = None,
        topology: Topology | None = None,
        kernels: bool | None = None,
    ):
        super().__init__(flat, layout, group, transforms, average, all_reduce, ledger, nonfinite, topology, kernels)
        self.error_feedback = error_feedback

    def stages(self) -> list:
        if self.all_reduce:
            return [self._send, self._gather, self._decode_all]
        return [self._send, self._reduce, self._finish]

    def _footprint(self) -> int:
        """Send buffer (every shard's message) and receive buffer ((p - 1) own messages), the most on any rank."""
        sizes = [self._message_bytes((j,)) for j in range(self.world)]
        return taken(sum(sizes), (self.world - 1) * max(sizes), *self._gathered_bytes())

    def _send(self, prev: StageResult) -> StageResult:
        layout, r, device = self.layout, self.rank, self.flat.device
        pk = layout.cached(
            ("flat", r, str(device)),
            lambda: packing(
                layout, list(range(self.world)), [[j] for j in range(self.world) if j != r] + [[r]], None, device
            ),
        )
        buf = self.space.empty(pk.nbytes, device=device)
        outputs = getattr(prev, "outputs", {})
        encode_bucket(buf, pk, self.flat, layout, self.transforms, self.ops, self.error_feedback, outputs)
        plain_bucket(buf, pk, self.flat, layout, self.ops)
        recv = self.space.empty((self.world - 1) * pk.own.nbytes, device=device)
        works = []
        if self.world > 1:
            per_peer = with_self(pk.peer_bytes, r)
            self.ledger.add("all_to_all", self.coded_label, pk.sent_bytes, self._links(per_peer))
            recv_sizes = with_self([pk.own.nbytes] * (self.world - 1), r)
            works.append(
                dist.all_to_all_single(
                    recv, buf[: pk.sent_bytes], recv_sizes, per_peer, group=self.group, async_op=True
                )
            )
        return StageResult(works=works, pk=pk, buf=buf, recv=recv)

    def _rows(self, prev: StageResult) -> Received:
        return prev.pk.received(prev.recv, prev.buf, self.rank, self.world, self.space)

    def _reduce(self, prev: StageResult) -> StageResult:
        return self._reduce_own(self._rows(prev), getattr(prev, "targets", None))

    def _gather(self, prev: StageResult) -> StageResult:
        msg = self._own_message(self._rows(prev))
        width = self.layout.max_message_bytes
        gathered = self.space.empty(self.world * width, device=msg.device)
        self.ledger.add("all_gather", self.coded_label, (self.world - 1) * width, self._links([width] * self.world))
        return StageResult(
            works=[_all_gather(gathered, msg, group=self.group, async_op=True)], gathered=gathered, msg=msg
        )

    def _decode_all(self, prev: StageResult) -> StageResult:
        slots = list(range(self.world))
        targets = getattr(prev, "targets", None)
        decode_gathered(prev.gathered, self.layout, self.transforms, self.flat, slots, self.ops, targets)
        return StageResult()


def decode_gathered(
    gathered: torch.Tensor,
    layout: BucketLayout,
    transforms: Whitenings,
    flat: torch.Tensor,
    slots: list[int],
    ops: _kernels.CodecOps,
    targets: dict | None = None,
) -> None:
    """Every shard's reduced message (shard ``j`` in slot ``slots[j]`` of ``gathered``, slots of
    ``max_message_bytes``) decoded into ``flat``, ``T⁻¹`` applied to whole rows: the same bytes give
    the same bits on every rank. Per segment one placed decode (``kernels.decode_placed``: codes and
    scales read at the packing's table positions) or one placed read of its plain values, written
    into the bucket in its dtype (the PyTorch path: chunks of ``CHUNK`` coded elements), or into a
    segment's ``targets`` (``destination``)."""
    width, device = layout.max_message_bytes, flat.device
    order = sorted(range(layout.num_shards), key=lambda j: slots[j])
    gp = layout.cached(
        ("gathered", tuple(slots), str(device)),
        lambda: packing(layout, list(range(layout.num_shards)), [[j] for j in order], None, device, width),
    )
    src = views(gathered, layout)
    chunk = None if ops.fused else CHUNK
    for i in layout.coded_segments:
        s, at, t = layout.segments[i], layout.seg_at[i], transforms[i]
        end = at + s.rows * s.cols
        for k0, k1 in [(at, end)] if chunk is None else layout.chunks(i, at, end, chunk, whole_rows=t is not None):
            g0, g1 = layout.group_range(k0, k1)
            shape = ((k1 - k0) // s.cols, s.cols) if t is not None else (1, k1 - k0)
            placed = _kernels.Placed(gp.place["coded"].at(src["coded"], k0), gp.place["groups"].at(src["groups"], g0))
            ops.decode_placed(
                placed,
                *shape,
                t,
                layout.codec,
                lengths=layout.lengths(g0, g1, device),
                out=destination(flat, targets or {}, i, s.start + k0 - at, s.start + k1 - at),
            )
    for c, name in enumerate(("off", "bf16")):
        for i in layout.plain_segments[c]:
            s, at = layout.segments[i], layout.seg_at[i]
            ops.take(gp.place[name].at(src[name], at), flat[s.start : s.end])
