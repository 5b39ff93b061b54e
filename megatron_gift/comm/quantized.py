"""Quantized reduce-scatter and all-reduce of a flat gradient bucket (FP8 payload + scales).

Sender (every rank, ``start_quantized_reduce``)::

    G_s ← G_s · T_s               for each GIFT segment s (whitened, in place)
    x̃  = coded(G) + e             error feedback, optional
    send message_j(x̃) to rank j   one all-to-all: FP8 payload + scales + plain (off, bf16) values

Receiver (``QuantizedReduce.wait``), for its shard j::

    Σ_i dec(message_j from rank i)   in FP32, in rank order; ÷ R if averaging
    shard ← Σ · T_s⁻¹               per GIFT row; a row cut by a shard boundary gets its
                                    ``U Q`` from the r-float partials of every piece

All-reduce = the same reduce-scatter, then each rank re-encodes its reduced shard (still
whitened) and an all-gather moves the FP8 messages; every rank decodes the same bytes and
applies ``T⁻¹`` to whole rows, so all ranks hold bit-identical gradients.

Fused kernels (``megatron_gift.kernels``, where the ``kernels`` setting allows them): a *block* is the
whole rows of a GIFT or Euclidean parameter inside one shard whose scaling groups in the layout
are exactly the codec's groups of that ``[rows, cols]`` matrix (rows never cut by the shard for
BLOCK/MX/ROW scaling; for TENSOR scaling only a parameter the shard boundaries do not cut
inside). The sender encodes a block with ``kernels.whiten_encode`` (``G T`` and FP8 in one
pass), the receiver sums it with ``kernels.decode_sum_unwhiten`` (decode, rank-order sum and
``T⁻¹`` in one pass; the all-reduce's first sum leaves it whitened, the all-gather's decode
unwhitens it); everything else takes the PyTorch path above. Blocks depend only on the layout,
so every rank takes the same path and all-reduce results stay bit-identical across ranks. The
kernels' ``G T`` and ``T⁻¹`` equal PyTorch's to FP32 rounding, their codes, scales and sums are
PyTorch's bit for bit. With error feedback the sender stays on the PyTorch path (the kernel
cannot add the residual before encoding); the receiver still uses the kernels.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .. import kernels
from ..config import Mode
from ..numerics.error_feedback import ErrorFeedback
from ..numerics.fp8 import CodecConfig, Encoded, decode_flat, encode_flat, group_lengths
from ..numerics.whitening import LowRankWhitening
from .layout import BucketLayout, ShardPlan, _complement, _merge

Whitenings = list[LowRankWhitening | None]  # per segment, None where not whitened

class CommLedger:
    """Bytes this rank sent, by ``(collective, dtype)``: all-to-all counts what leaves the rank,
    ring all-gather ``(R-1)·chunk``, ring reduce-scatter ``(R-1)/R·buffer``, ring all-reduce twice that.

    ``links`` splits the quantized exchanges' bytes by ``(link, dtype)``, the link being the one
    they cross (``intra``: to a rank on the same node, ``inter``: through the NIC), as if each
    peer's bytes went to it directly."""

    def __init__(self):
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.links: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, collective: str, dtype: str, nbytes: int, links: dict[str, int] | None = None) -> None:
        self.bytes[(collective, dtype)] += int(nbytes)
        for link, n in (links or {}).items():
            self.links[(link, dtype)] += int(n)

    def by_link(self) -> dict[str, int]:
        """Bytes per link (``intra``, ``inter``), every dtype together."""
        out: dict[str, int] = defaultdict(int)
        for (link, _), n in self.links.items():
            out[link] += n
        return dict(out)

    def total(self) -> int:
        return sum(self.bytes.values())

    def as_dict(self) -> dict[str, int]:
        return {f"{c}/{d}": n for (c, d), n in sorted(self.bytes.items())}

    def reset(self) -> None:
        self.bytes.clear()
        self.links.clear()


# torch >= 2.10 renamed all_gather_into_tensor; NGC containers may carry either.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _gather_runs(flat: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    if len(runs) == 1:
        return flat[runs[0][0] : runs[0][1]]
    return torch.cat([flat[a:b] for a, b in runs]) if runs else flat.new_zeros(0)


def _scatter_runs(flat: torch.Tensor, runs: list[tuple[int, int]], values: torch.Tensor) -> None:
    pos = 0
    for a, b in runs:
        flat[a:b].copy_(values[pos : pos + b - a])
        pos += b - a


def _kernels_on(device: torch.device, use: bool | None) -> bool:
    """Whether a reduction uses the fused kernels, by the ``kernels`` setting ``use`` (``GiftConfig.kernels``:
    None on CUDA where they are ``kernels.available``; True wherever they are available, the CPU included
    when Triton's interpreter is on (slow: for tests); False never). Every rank of a group passes the same."""
    if use is False or (use is None and device.type != "cuda"):
        return False
    return kernels.available(device)


@dataclass(frozen=True)
class _Block:
    """Rows ``[r0, r1)`` of segment ``seg`` (``cols`` wide): coded elements ``[c, c + n)`` that are
    exactly the groups ``[g, g + n_groups)``, the codec's groups of the ``[r1 - r0, cols]`` matrix;
    ``c`` and ``g`` count from the start of the enclosing range (bucket or shard)."""

    seg: int
    r0: int
    r1: int
    cols: int
    c: int
    g: int
    n_groups: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.r1 - self.r0, self.cols

    @property
    def n(self) -> int:
        return (self.r1 - self.r0) * self.cols


@dataclass(frozen=True)
class _KernelSplit:
    """A range of coded values (the bucket's or one shard's) split into kernel ``blocks`` and the
    rest: coded runs ``rest_runs`` and group runs ``rest_groups`` (relative to the range) for the
    flat codec, and the GIFT rows ``(seg, r0, r1)`` of the range outside blocks whose transform the
    PyTorch path applies (``rest_rows``)."""

    blocks: tuple[_Block, ...]
    rest_runs: list[tuple[int, int]]
    rest_groups: list[tuple[int, int]]
    rest_rows: list[tuple[int, int, int]]


@dataclass(frozen=True)
class _Plan:
    """The split of the whole bucket (sender, all-gather) and of each shard (receiver)."""

    bucket: _KernelSplit
    shards: list[_KernelSplit]


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layout -> {use kernels: _Plan}


def _plan(layout: BucketLayout, use_kernels: bool) -> _Plan:
    """The layout's split, with no blocks unless ``use_kernels`` (computed once per layout)."""
    plans = _PLANS.setdefault(layout, {})
    if use_kernels not in plans:
        plans[use_kernels] = _make_plan(layout, use_kernels)
    return plans[use_kernels]


def _shard_blocks(layout: BucketLayout, plan: ShardPlan, starts: torch.Tensor) -> list[_Block]:
    """Each GIFT/Euclidean segment's whole rows inside the shard, where their groups in the layout
    are the matrix codec's groups (shard-relative coordinates)."""
    out = []
    for i, s in enumerate(layout.segments):
        if s.mode not in (Mode.EUCLIDEAN, Mode.GIFT) or s.end <= plan.lo or s.start >= plan.hi:
            continue
        r0, r1 = -(-(max(s.start, plan.lo) - s.start) // s.cols), (min(s.end, plan.hi) - s.start) // s.cols
        if r1 <= r0:
            continue
        c = layout.coded_index(s.start + r0 * s.cols)
        g = int(torch.searchsorted(starts, c))
        want = group_lengths(r1 - r0, s.cols, layout.codec)
        have = layout.group_lengths[g : g + want.numel()]
        if g < starts.numel() and int(starts[g]) == c and torch.equal(have, want):
            out.append(_Block(i, r0, r1, s.cols, c - plan.coded_lo, g - plan.group_lo, want.numel()))
    return out


def _make_plan(layout: BucketLayout, use_kernels: bool) -> _Plan:
    starts = torch.cumsum(layout.group_lengths, 0) - layout.group_lengths
    shards = []
    for p in layout.shards:
        blocks = _shard_blocks(layout, p, starts) if use_kernels else []
        in_blocks = {b.seg for b in blocks}
        shards.append(
            _KernelSplit(
                blocks=tuple(blocks),
                rest_runs=_complement([(b.c, b.c + b.n) for b in blocks], p.coded_hi - p.coded_lo),
                rest_groups=_complement([(b.g, b.g + b.n_groups) for b in blocks], p.group_hi - p.group_lo),
                rest_rows=[rows for rows in p.gift_rows if rows[0] not in in_blocks],
            )
        )
    pairs = list(zip(layout.shards, shards))
    blocks = [replace(b, c=b.c + p.coded_lo, g=b.g + p.group_lo) for p, sp in pairs for b in sp.blocks]
    rest_rows = []
    for i, s in enumerate(layout.segments):
        if s.mode is Mode.GIFT:
            covered = [(b.r0, b.r1) for b in blocks if b.seg == i]
            rest_rows += [(i, r0, r1) for r0, r1 in _complement(covered, s.rows)]
    bucket = _KernelSplit(
        blocks=tuple(blocks),
        rest_runs=_merge([(a + p.coded_lo, b + p.coded_lo) for p, sp in pairs for a, b in sp.rest_runs]),
        rest_groups=_merge([(a + p.group_lo, b + p.group_lo) for p, sp in pairs for a, b in sp.rest_groups]),
        rest_rows=rest_rows,
    )
    return _Plan(bucket=bucket, shards=shards)


def _encode(
    coded: torch.Tensor, lengths: torch.Tensor, split: _KernelSplit, cfg: CodecConfig, whitenings: Whitenings | None
) -> Encoded:
    """``encode_flat(coded, lengths)`` with the split's blocks encoded by the fused kernel, which
    first whitens block rows by ``whitenings[seg]`` when ``whitenings`` is given."""
    enc = encode_flat(_gather_runs(coded, split.rest_runs), _gather_runs(lengths, split.rest_groups), cfg)
    if not split.blocks:
        return enc
    payload = torch.empty(coded.numel(), dtype=torch.uint8, device=coded.device)
    scales = torch.empty(lengths.numel(), dtype=cfg.scale_dtype(), device=coded.device)
    _scatter_runs(payload, split.rest_runs, enc.payload)
    _scatter_runs(scales, split.rest_groups, enc.scales)
    for b in split.blocks:
        w = whitenings[b.seg] if whitenings is not None else None
        block = kernels.whiten_encode(coded[b.c : b.c + b.n].view(b.shape), w, cfg)
        payload[b.c : b.c + b.n] = block.payload.view(-1)
        scales[b.g : b.g + b.n_groups] = block.scales.view(-1)
    return Encoded(payload=payload, scales=scales)


class _Codec:
    """Packs shard messages ``[scales | off | bf16 | payload]`` for one layout and reduces them."""

    def __init__(self, layout: BucketLayout):
        self.layout = layout
        self.cfg = layout.codec

    def plain_sections(self, flat: torch.Tensor, plan: ShardPlan) -> list[torch.Tensor]:
        """This shard's plain values from ``flat``, each class in its wire dtype."""
        return [_gather_runs(flat, runs).to(dt) for runs, dt in zip(plan.plain_runs, self.layout.plain_dtypes)]

    def plain_values(self, plan: ShardPlan, msg: torch.Tensor, start: int | None = None) -> list[torch.Tensor]:
        """Each plain class of one message ``[≥ message_bytes]`` (uint8) as FP32 (may alias ``msg``);
        the classes start at byte ``start`` (default: after the scales)."""
        out, off = [], plan.scale_bytes if start is None else start
        for runs, dt, size in zip(plan.plain_runs, self.layout.plain_dtypes, plan.plain_bytes):
            n = sum(b - a for a, b in runs)
            out.append(msg[off : off + n * dt.itemsize].view(dt).float())
            off += size
        return out

    def pack(self, plan: ShardPlan, enc: Encoded, plain_sections: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Message ``[message_bytes]`` of shard ``plan``, written into ``out`` when given."""
        if out is None:
            out = torch.zeros(plan.message_bytes, dtype=torch.uint8, device=enc.payload.device)
        off = 0
        for section, size in zip([enc.scales, *plain_sections], [plan.scale_bytes, *plan.plain_bytes]):
            b = _bytes(section)
            out[off : off + b.numel()] = b
            off += size
        out[off : off + enc.payload.numel()] = enc.payload
        return out

    def message(self, plan: ShardPlan, split: _KernelSplit, coded_sum: torch.Tensor, plain_sums: list[torch.Tensor], width: int) -> torch.Tensor:
        """The FP8 message ``[width]`` (zero-padded) of a reduced, still whitened shard, for the all-gather."""
        msg = torch.zeros(width, dtype=torch.uint8, device=coded_sum.device)
        plain_sections = [t.to(dt) for t, dt in zip(plain_sums, self.layout.plain_dtypes)]
        lengths = self.layout.group_lengths_on(coded_sum.device)[plan.group_lo : plan.group_hi]
        self.pack(plan, _encode(coded_sum, lengths, split, self.cfg, None), plain_sections, out=msg[: plan.message_bytes])
        return msg

    def _sections(self, plan: ShardPlan, msgs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The payload ``[k, n_coded]`` (uint8) and scales ``[k, n_groups]`` sections of ``msgs``."""
        n_groups, n_coded = plan.group_hi - plan.group_lo, plan.coded_hi - plan.coded_lo
        scale_dtype = self.cfg.scale_dtype()
        payload_at = plan.scale_bytes + sum(plan.plain_bytes)
        scales = msgs[:, : n_groups * scale_dtype.itemsize].contiguous().view(-1).view(scale_dtype)
        return msgs[:, payload_at : payload_at + n_coded], scales.view(msgs.shape[0], n_groups)

    def reduce(
        self, plan: ShardPlan, split: _KernelSplit, msgs: torch.Tensor, average: bool, whitenings: Whitenings | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``Σ_i dec(msgs[i])`` (``÷ k`` if ``average``) of ``k`` messages ``[k, ≥ message_bytes]`` of
        shard ``plan``, FP32 in rank order: coded values ``[n_coded]`` and each plain class. Blocks
        go through the fused kernel, which also applies ``T⁻¹`` of ``whitenings[seg]`` when
        ``whitenings`` is given; the rest stays as summed (still whitened)."""
        k = msgs.shape[0]
        payloads, scales = self._sections(plan, msgs)
        lengths = _gather_runs(self.layout.group_lengths_on(msgs.device)[plan.group_lo : plan.group_hi], split.rest_groups)
        sums: list[torch.Tensor] = []
        for i in range(k):  # one FP32 accumulator per section, peers added in rank order
            enc = Encoded(_gather_runs(payloads[i], split.rest_runs), _gather_runs(scales[i], split.rest_groups))
            parts = [decode_flat(enc, lengths, self.cfg), *self.plain_values(plan, msgs[i])]
            if not sums:
                sums = [t.clone() for t in parts]
            else:
                for acc, t in zip(sums, parts):
                    acc += t
        if average:
            for t in sums:
                t /= k
        if not split.blocks:
            return sums[0], sums[1:]
        coded = torch.empty(plan.coded_hi - plan.coded_lo, device=msgs.device)
        _scatter_runs(coded, split.rest_runs, sums[0])
        for b in split.blocks:
            w = whitenings[b.seg] if whitenings is not None else None
            g = slice(b.g, b.g + b.n_groups)
            block = kernels.decode_sum_unwhiten(
                payloads[:, b.c : b.c + b.n], scales[:, g], *b.shape, w, self.cfg, average
            )
            coded[b.c : b.c + b.n] = block.view(-1)
        return coded, sums[1:]


class QuantizedReduce:
    """One bucket's quantized reduction in flight; ``wait()`` completes it in place in ``flat``.

    ``nonfinite`` (a bool tensor), when given, is set if the reduced shard holds NaN/Inf.
    ``topology``, when given, splits the ledger's bytes into intra- and inter-node links.
    ``kernels``: whether blocks use the fused kernels (``GiftConfig.kernels``, see ``_kernels_on``).
    With the distributed optimizer, ``flat`` outside this rank's shard is left as it was."""

    def __init__(
        self,
        flat: torch.Tensor,
        layout: BucketLayout,
        group,
        transforms: list[LowRankWhitening | None],
        error_feedback: ErrorFeedback | None = None,
        average: bool = False,
        all_reduce: bool = False,
        ledger: CommLedger | None = None,
        async_op: bool = False,
        nonfinite: torch.Tensor | None = None,
        topology: Topology | None = None,
        kernels: bool | None = None,
    ):
        self.flat, self.layout, self.group = flat, layout, group
        self.topology = topology
        self.transforms, self.average, self.all_reduce = transforms, average, all_reduce
        self.ledger = ledger if ledger is not None else CommLedger()
        self.nonfinite = nonfinite
        self.codec = _Codec(layout)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.world != layout.num_shards:
            raise ValueError(f"layout has {layout.num_shards} shards but the group has {self.world} ranks")
        use_kernels = _kernels_on(flat.device, kernels)
        self.plan = _plan(layout, use_kernels)
        # The kernel cannot add the error-feedback residual between G T and the encoding.
        split = _plan(layout, use_kernels and error_feedback is None).bucket
        order = list(range(self.world))
        send, sizes = encode_messages(self.codec, split, flat, transforms, order, error_feedback, keep=not all_reduce)
        own_plan = layout.shards[self.rank]
        self.recv = torch.empty(self.world * own_plan.message_bytes, dtype=torch.uint8, device=flat.device)
        links = topology.link_bytes(self.rank, sizes) if topology is not None else None
        self.ledger.add("all_to_all", "fp8+scales", sum(sizes) - sizes[self.rank], links)
        self.work = dist.all_to_all_single(
            self.recv,
            send,
            output_split_sizes=[own_plan.message_bytes] * self.world,
            input_split_sizes=sizes,
            group=group,
            async_op=async_op,
        )

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        plan, split = self.layout.shards[self.rank], self.plan.shards[self.rank]
        msgs = self.recv.view(self.world, plan.message_bytes)
        whitenings = None if self.all_reduce else self.transforms  # the all-reduce sends the sum whitened
        coded_sum, plain_sums = self.codec.reduce(plan, split, msgs, self.average, whitenings)
        # Device-side flag, no host sync; blocks are checked after T⁻¹, which keeps NaN and Inf non-finite.
        flag_nonfinite(self.nonfinite, [coded_sum, *plain_sums])
        if self.all_reduce:
            width = max(p.message_bytes for p in self.layout.shards)
            msg = self.codec.message(plan, split, coded_sum, plain_sums, width)
            gathered = torch.empty(self.world * width, dtype=torch.uint8, device=self.flat.device)
            self.ledger.add("all_gather", "fp8+scales", (self.world - 1) * width, self._links(width))
            _all_gather(gathered, msg, group=self.group)
            decode_gathered(self.codec, self.plan, self.transforms, gathered.view(self.world, width), self.flat)
            return
        transform_rows(self.layout, self.transforms, coded_sum, plan.coded_lo, split.rest_rows, inverse=True)
        PieceExchange(self.layout, self.transforms, [self.rank], [coded_sum], self.group, lambda m: [m],
                      self.ledger, self._links, inverse=True).finish()  # fmt: skip
        write_shard(self.flat, plan, coded_sum, plain_sums)

    def _links(self, chunk: int) -> dict[str, int] | None:
        """Links crossed by ``chunk`` bytes sent to every other rank of the group."""
        return self.topology.link_bytes(self.rank, [chunk] * self.world) if self.topology is not None else None


def encode_messages(codec: "_Codec", split: _KernelSplit, flat: torch.Tensor, transforms: Whitenings, order: list[int],
                    error_feedback: ErrorFeedback | None = None, keep: bool = True) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
    """The FP8 messages of shards ``order`` (whitened, error-compensated) one after another in one
    buffer, and their sizes. ``keep``: leave ``flat`` as it was (else ``G T`` may be written into it)."""
    layout = codec.layout
    coded = _gather_runs(flat, layout.coded_runs).float()  # aliases flat when FP32 and contiguous
    if keep and coded.data_ptr() == flat.data_ptr() and _whitens(split.rest_rows, transforms):
        coded = coded.clone()  # G T in place would overwrite the shards other ranks own
    transform_rows(layout, transforms, coded, 0, split.rest_rows, inverse=False)
    if error_feedback is not None:
        coded = error_feedback.compensate(coded)
    lengths = layout.group_lengths_on(flat.device)
    enc = _encode(coded, lengths, split, layout.codec, transforms)
    if error_feedback is not None:
        error_feedback.stage(coded, decode_flat(enc, lengths, layout.codec))
    sizes = [layout.shards[j].message_bytes for j in order]
    send = torch.zeros(sum(sizes), dtype=torch.uint8, device=flat.device)
    for j, at, size in zip(order, _starts(sizes), sizes):
        plan = layout.shards[j]
        shard_enc = Encoded(enc.payload[plan.coded_lo : plan.coded_hi], enc.scales[plan.group_lo : plan.group_hi])
        codec.pack(plan, shard_enc, codec.plain_sections(flat, plan), out=send[at : at + size])
    return send, sizes


def _starts(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _whitens(rows, transforms: Whitenings) -> bool:
    return any(transforms[i] is not None for i, _, _ in rows)


def flag_nonfinite(nonfinite: torch.Tensor | None, tensors: list[torch.Tensor]) -> None:
    """Set ``nonfinite`` (device-side, no host sync) if any of ``tensors`` holds NaN/Inf."""
    if nonfinite is not None:
        for t in tensors:
            nonfinite |= ~torch.isfinite(t).all()


def write_shard(flat: torch.Tensor, plan: ShardPlan, coded: torch.Tensor, plain_sections: list[torch.Tensor]) -> None:
    """Scatter a reduced shard's coded values and plain classes into the bucket ``flat``."""
    _scatter_runs(flat, plan.coded_runs, coded)
    for runs, values in zip(plan.plain_runs, plain_sections):
        _scatter_runs(flat, runs, values)


def transform_rows(layout: BucketLayout, transforms: Whitenings, coded: torch.Tensor, base: int, whole_rows, inverse: bool) -> None:
    """Apply ``T`` (or ``T⁻¹``) in place to rows ``[r0, r1)`` of GIFT segments; ``coded`` starts
    at coded index ``base``."""
    for i, r0, r1 in whole_rows:
        t, s = transforms[i], layout.segments[i]
        if t is None:
            continue
        c = layout.coded_index(s.start + r0 * s.cols) - base
        view = coded[c : c + (r1 - r0) * s.cols].view(r1 - r0, s.cols)
        view.copy_(t.inverse(view) if inverse else t.apply(view))


class PieceExchange:
    """``T`` (or ``T⁻¹``) of the rows cut by shard boundaries, in place, from r-float exchanges.

    This rank holds shards ``held`` (their coded values ``coded[h]``); member ``m`` of ``group``
    holds ``held_by(m)`` (as many), and together they hold every shard. Each piece's partial
    projection (``U[:, cols] Q[cols]``, or ``G'[:, cols] Q[cols]`` with ``G' = G D^{-1/2}`` for ``T``)
    goes out in one all-gather (``work``, asynchronous if ``async_op``); ``finish()`` then sums each
    row's partials in shard order (the same sum on every rank) and transforms each piece's columns.
    ``links(chunk)``: the ledger's link split of ``chunk`` bytes sent to every other member."""

    def __init__(self, layout: BucketLayout, transforms: Whitenings, held: list[int], coded: list[torch.Tensor],
                 group, held_by, ledger: CommLedger, links, inverse: bool, async_op: bool = False):  # fmt: skip
        self.layout, self.transforms, self.inverse = layout, transforms, inverse
        self.views, self.work, self.where = [], None, {}
        ts = transforms
        if not any(ts[q.seg] is not None for other in layout.shards for q in other.pieces):
            return
        r_max = max(t.rank for t in ts if t is not None)
        own_partials = torch.zeros(len(held), layout.max_pieces, r_max, device=coded[0].device)
        for h, (j, values) in enumerate(zip(held, coded)):
            plan = layout.shards[j]
            for k, p in enumerate(plan.pieces):
                a, b = p.flat(layout.segments[p.seg])
                c = layout.coded_index(a) - plan.coded_lo
                self.views.append((p, values[c : c + b - a].view(1, -1)))
                if ts[p.seg] is not None:
                    project = ts[p.seg].projection if inverse else ts[p.seg].apply_projection
                    own_partials[h, k, : ts[p.seg].rank] = project(self.views[-1][1], slice(p.c0, p.c1))[0]
        world = group.size()
        self.shape = (world, *own_partials.shape)
        self.all_partials = torch.empty(world * own_partials.numel(), device=own_partials.device)
        ledger.add("all_gather", "fp32", (world - 1) * own_partials.numel() * 4, links(own_partials.numel() * 4))
        self.work = _all_gather(self.all_partials, own_partials.view(-1), group=group, async_op=async_op)
        self.where = {j: (m, h) for m in range(world) for h, j in enumerate(held_by(m))}

    def finish(self) -> None:
        if not self.views:
            return
        if self.work is not None:
            self.work.wait()
        all_partials = self.all_partials.view(self.shape)
        for p, view in self.views:
            t = self.transforms[p.seg]
            if t is None:
                continue
            proj = torch.zeros(1, t.rank, device=view.device)
            for j, other in enumerate(self.layout.shards):
                for k, q in enumerate(other.pieces):
                    if (q.seg, q.row) == (p.seg, p.row):
                        proj += all_partials[self.where[j]][k, : t.rank]
            finish = t.inverse_piece if self.inverse else t.apply_piece
            view.copy_(finish(view, proj, slice(p.c0, p.c1)))


def decode_gathered(codec: "_Codec", plan: _Plan, transforms: Whitenings, gathered: torch.Tensor, flat: torch.Tensor) -> None:
    """Decode every shard's reduced message ``gathered [shards, ≥ message_bytes]`` (whitened sums)
    into ``flat`` and apply ``T⁻¹`` to whole rows: the same bytes give the same bits everywhere."""
    layout = codec.layout
    coded_all = torch.empty(layout.n_coded, device=flat.device)
    for j, (p, sp) in enumerate(zip(layout.shards, plan.shards)):
        coded, plain_sections = codec.reduce(p, sp, gathered[j : j + 1], False, transforms)
        coded_all[p.coded_lo : p.coded_hi] = coded
        for runs, values in zip(p.plain_runs, plain_sections):
            _scatter_runs(flat, runs, values)
    transform_rows(layout, transforms, coded_all, 0, plan.bucket.rest_rows, inverse=True)
    _scatter_runs(flat, layout.coded_runs, coded_all)
