"""The two-level FP4 reduction that sums inside the node first (``--gift-intra-node reduce-scatter``).

Whitening and the rotation are linear, ``Σ_l G_l T H = (Σ_l G_l) T H``: the intra-node stage can be a
plain reduce-scatter of the gradient in the bucket's dtype (NCCL's, on NVLink: no pass of the plugin
over the whole bucket), and ``T``, ``H`` and the FP4 encode run on the node's sums of the held shards
alone, ``1/g`` of the bucket. On rank ``i = k·g + l`` holding shards ``j = m·g + l``
(``comm.hierarchical``'s notation; every node's ``g`` ranks together hold every shard):

0. *intra*: one coalesced reduce-scatter over the node of the bucket's ``n`` rows of ``g`` shards:
   rank ``i`` receives ``P_{k,j} = Σ_{l'} G_{k·g+l'}[shard j]`` for its held shards, in the bucket's
   dtype (the collective's order; an FP32 bucket sums in FP32).
1. *rows*: the whole GIFT rows times ``T``, read where they lie by ``kernels.whiten_place`` (``RowsAt``: one
   pass where the kernels run) into the held coded sequence (FP32); the Euclidean values gathered there in
   FP32 on the PyTorch path, read by the kernels' encode where they lie in the held sums (a
   ``kernels.placement.Source``: no gathered copy). A row a shard boundary cuts has its other pieces on
   other ranks of the same node: each piece's part of the row's ``(P D^{-1/2}) Q`` (r floats) goes to them
   in one all-to-all over the node, as the owner's ``pieces.PieceExchange`` does for ``T⁻¹``.
2. *node sums*: each cut piece's columns of ``P T = P D^{-1/2} + ((P D^{-1/2}) Q ⊙ c) Qᵀ`` from its
   row's summed projections (holders in shard order), then ``H``, the FP4 messages and the
   all-to-all among the nodes (``FP4TwoLevelReduce._send_inter``).
3. the owner's decode-sum, ``Hᵀ``, ``T⁻¹``, cut rows (and the all-reduce's gather): ``_FP4Stages``'.

Every step runs a fixed number of ops per whitened segment (its whole rows) and per shape of them (their
cut pieces, batched: one matmul each way) whatever ``n`` and ``g`` (index tables built once per layout).
Needs the distributed optimizer's layout: ``n·g`` shards of equal size tiling the bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import IntraNode
from ..kernels import StackedWhitening
from ..kernels.placement import Placement, RowsAt, Source, aligned_rows
from ..numerics.fp4 import FP4Format
from ..numerics.rotation import BlockHadamard
from ..numerics.whitening import ieee_fp32
from .fp4_reduce import FP4TwoLevelReduce
from .layout import BucketLayout
from .ledger import CommLedger, dtype_label
from .quantized import Whitenings
from .schedule import StageFlags, StageResult, taken
from .topology import TwoLevelGroups


@dataclass(frozen=True)
class _WholeRows:
    """The whole rows in the held shards of the whitened segments ``segs`` of one shape (``cols`` columns,
    factor ``rank``), one matrix each: ``starts``, the held sums' position of each row's first element (-1
    for the padding between matrices, ``kernels.placement.aligned_rows``), ``matrix`` and ``spans`` as
    ``RowsAt`` has them; ``place``, where the rows go in the held coded sequence (a run of rows per held
    shard and segment)."""

    segs: tuple[int, ...]
    cols: int
    starts: torch.Tensor
    matrix: torch.Tensor
    spans: tuple[tuple[int, int], ...]
    place: Placement


@dataclass(frozen=True)
class _Pieces:
    """The cut pieces of the whitened segments ``segs`` of one shape (``cols`` columns, factor ``rank``),
    batched: segment ``c``'s pieces are rows ``c·k ...`` of a ``[C, k, cols]`` stack, zeros elsewhere.
    ``src``/``dense``/``held``: the pieces' elements in the held coded sequence, in the stack and in the held
    sums (where they are read); ``rows``/``slots``:
    the stack rows holding a piece and their rows in the exchange; ``gather``: each stack row's row of the
    summed projections (a zero row for padding)."""

    segs: tuple[int, ...]
    cols: int
    rank: int
    k: int
    src: torch.Tensor
    dense: torch.Tensor
    held: torch.Tensor
    rows: torch.Tensor
    slots: torch.Tensor
    gather: torch.Tensor


@dataclass(frozen=True)
class _Gather:
    """Runs of the held sums gathered into one sequence, ``granule`` elements at a time (the largest
    power of two up to 16 dividing every run's start and length: FP4 blocks keep coded runs whole),
    ``index`` the held sums' granule of each: one index per granule, not per element. With ``place``
    (the sequence's granule of each) into an FP32 sequence of ``size`` elements whose other elements
    the caller writes (the whole GIFT rows, which ``whiten_place`` reads where they lie)."""

    index: torch.Tensor
    granule: int
    place: torch.Tensor | None = None
    size: int = 0

    def __call__(self, sums: torch.Tensor) -> torch.Tensor:
        taken = sums.view(-1, self.granule).index_select(0, self.index)
        if self.place is None:
            return taken.view(-1)
        out = torch.empty(self.size, device=sums.device)
        return out.view(-1, self.granule).index_copy_(0, self.place, taken.float()).view(-1)


def _gather(runs: list[tuple], total: int, device, size: int | None = None) -> _Gather:
    """``_Gather`` of the runs ``(start, length)`` of a held sums' buffer of ``total`` elements, or with
    ``size`` of the runs ``(start, length, position in the sequence)``."""
    granule = 16
    while granule > 1 and (total % granule or any(n % granule for run in runs for n in run)):
        granule //= 2
    index = [run[0] // granule + torch.arange(run[1] // granule) for run in runs]
    if size is None:
        return _Gather(_cat(index, device), granule)
    place = [run[2] // granule + torch.arange(run[1] // granule) for run in runs]
    return _Gather(_cat(index, device), granule, _cat(place, device), size)


def _without(runs: list[tuple[int, int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The runs ``(start, length, position)`` less the intervals ``cut`` ``(start, length)`` of their starts'
    space (each inside one run), the positions shifted with the starts."""
    out, cut = [], sorted(cut)
    for a, n, b in runs:
        at = a
        for c, m in cut:
            if a <= c and c + m <= a + n:
                if c > at:
                    out.append((at, c - at, b + at - a))
                at = c + m
        if a + n > at:
            out.append((at, a + n - at, b + at - a))
    return out


@dataclass(frozen=True)
class _Tables:
    """What stage 1 gathers and the cut rows' exchange, built once per layout, rank and whitened set."""

    coded: _Gather  # the held shards' coded values in order from the held sums, but for the GIFT rows and pieces
    n_coded: int  # the held coded sequence's length
    source: Source | None  # where the kernels run: the runs they read in the held sums (all but GIFT rows)
    plain: tuple[_Gather, _Gather]  # the same per plain class
    segments: tuple[_WholeRows, ...]  # one per shape
    pieces: tuple[_Pieces, ...]  # one batch per shape
    peers: tuple[int, ...]  # the node's local ranks sharing a cut row with this one
    slots: int  # pieces per local rank's block in the exchange (the most any holds)
    sums: torch.Tensor  # [own pieces, holders]: rows of [own | peers' blocks | a zero row] summed per piece


def _pieces(layout: BucketLayout, held: list[int], whitened: tuple[int, ...]) -> list[tuple]:
    """The cut pieces of a local rank's held shards ``held``: ``(seg, row, c0, c1, shard)``, whitened
    segments in order, then the shards in ``held``'s order."""
    return [
        (p.seg, p.row, p.c0, p.c1, j) for seg in whitened for j in held for p in layout.shards[j].pieces if p.seg == seg
    ]


def _tables(
    layout: BucketLayout, topo, local: int, whitened: tuple[int, ...], ranks: tuple[int, ...], device
) -> _Tables:
    S, g = layout.shard_size, topo.ranks_per_node
    held = [m * g + local for m in range(topo.nodes)]
    coded, plain = [], ([], [])  # runs (start in the held sums, length[, position in the coded sequence])
    base, at = {}, 0  # each held shard's first position in the held coded sequence
    for m, j in enumerate(held):
        plan, base[j] = layout.shards[j], at
        for part in plan.coded_parts:  # the coded sequence: the held shards' coded parts in order
            coded.append((m * S + part.lo - plan.lo, part.hi - part.lo, at))
            at += part.hi - part.lo
        for c in range(2):
            plain[c].extend((m * S + part.lo - plan.lo, part.hi - part.lo) for part in plan.plain_parts[c])
        assert at == base[j] + plan.n_coded

    def position(j: int, seg: int, row: int, c0: int) -> int:
        s = layout.segments[seg]
        return base[j] + layout.seg_at[seg] + row * s.cols + c0 - layout.shards[j].coded_lo

    def held_at(j: int, seg: int, row: int, c0: int) -> int:
        s = layout.segments[seg]
        return held.index(j) * S + s.start + row * s.cols + c0 - layout.shards[j].lo

    every = [_pieces(layout, [m * g + lp for m in range(topo.nodes)], whitened) for lp in range(g)]
    mine = every[local]
    rows_of, shapes = {}, {}  # per shape (cols, rank): [(seg, starts, sizes, runs)]; [(seg, own pieces (slot, piece))]
    whole = []  # the whole rows' runs (start in the held sums, length): not gathered
    for seg, rank in zip(whitened, ranks):
        cols = layout.segments[seg].cols
        starts, sizes, runs = [], [], []  # per held shard: its whole rows' starts in the held sums, their run
        for m, j in enumerate(held):
            for s, r0, r1 in layout.shards[j].gift_rows:
                if s == seg and r1 > r0:
                    row0 = m * S + layout.segments[seg].start + r0 * cols - layout.shards[j].lo
                    starts.append(row0 + cols * torch.arange(r1 - r0))
                    sizes.append((r1 - r0) * cols)
                    runs.append(position(j, seg, r0, 0))
                    whole.append((row0, (r1 - r0) * cols))
        rows_of.setdefault((cols, rank), []).append((seg, starts, sizes, runs))
        own = [(k, p) for k, p in enumerate(mine) if p[0] == seg]
        if own:  # the held shards cut rows of it (a layout fact)
            shapes.setdefault((cols, rank), []).append((seg, own))
    segments = []
    for (cols, _), members in rows_of.items():  # one RowsAt per shape: its segments' rows, spans aligned
        pads, matrix, spans = aligned_rows([sum(sizes) // cols for _, _, sizes, _ in members], device)
        starts, sizes, runs = [], [], []
        for (_, st, sz, ru), pad in zip(members, pads):
            starts += st + [torch.full((pad,), -1, dtype=torch.int64)]
            sizes += sz + ([pad * cols] if pad else [])
            runs += ru + ([0] if pad else [])  # padding: never written
        place = Placement(sizes, runs, device)
        segments.append(_WholeRows(tuple(seg for seg, *_ in members), cols, _cat(starts, device), matrix, spans, place))
    batches = []
    for (cols, rank), members in shapes.items():
        k = max(len(own) for _, own in members)
        src, dense, at_held, rows, slots, gather = [], [], [], [], [], []
        for c, (_, own) in enumerate(members):
            for i, (slot, (seg, row, c0, c1, j)) in enumerate(own):
                src.append(position(j, seg, row, c0) + torch.arange(c1 - c0))
                dense.append((c * k + i) * cols + torch.arange(c0, c1))
                at_held.append(held_at(j, seg, row, c0) + torch.arange(c1 - c0))
                rows.append(c * k + i)
                slots.append(slot)
            gather += [slot for slot, _ in own] + [len(mine)] * (k - len(own))
        segs = tuple(seg for seg, _ in members)
        batches.append(
            _Pieces(
                segs,
                cols,
                rank,
                k,
                _cat(src, device),
                _cat(dense, device),
                _cat(at_held, device),
                _long(rows, device),
                _long(slots, device),
                _long(gather, device),
            )
        )
    # each own piece's row: every holder's piece of it, in shard order, as rows of [own | peers | zero]
    holders = {}
    for lp, pieces in enumerate(every):
        for k, (seg, row, _, _, j) in enumerate(pieces):
            holders.setdefault((seg, row), []).append((j, lp, k))
    peers = tuple(sorted({lp for seg, row, *_ in mine for _, lp, _ in holders[(seg, row)] if lp != local}))
    slots = max((len(p) for p in every), default=0)
    zero = (1 + len(peers)) * slots
    table = [
        [k if lp == local else (1 + peers.index(lp)) * slots + k for _, lp, k in sorted(holders[(seg, row)])]
        for seg, row, *_ in mine
    ]
    width = max((len(t) for t in table), default=0)
    sums = torch.tensor([t + [zero] * (width - len(t)) for t in table], dtype=torch.int64).view(len(table), width)
    total = topo.nodes * S
    cut = [(held_at(j, seg, row, c0), c1 - c0) for seg, row, c0, c1, j in mine]
    rest = _without(_without(coded, whole), cut)  # the Euclidean parts: gathered, or read by the kernels' encode
    return _Tables(
        _gather(rest, total, device, at) if whole or cut else _gather([r[:2] for r in coded], total, device),
        at,
        Source.runs([(pos, n, start) for start, n, pos in rest], at, device),
        (_gather(plain[0], total, device), _gather(plain[1], total, device)),
        tuple(segments),
        tuple(batches),
        peers,
        slots,
        sums.to(device),
    )


def _long(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device)


def _cat(ts: list[torch.Tensor], device) -> torch.Tensor:
    return torch.cat(ts).to(device) if ts else torch.zeros(0, dtype=torch.int64, device=device)


class FP4SumFirstReduce(FP4TwoLevelReduce):
    """The two-level FP4 reduction with a plain reduce-scatter inside the node (module doc); the same
    contract as ``FP4TwoLevelReduce``. Construction does no work."""

    def __init__(
        self,
        flat: torch.Tensor,
        layout: BucketLayout,
        groups: TwoLevelGroups,
        transforms: Whitenings,
        fmt: FP4Format,
        average: bool = False,
        all_reduce: bool = False,
        ledger: CommLedger | None = None,
        nonfinite: StageFlags | None = None,
        rotation: BlockHadamard | None = None,
        kernels: bool | None = None,
        rotated: tuple[bool, ...] | None = None,
    ):
        super().__init__(
            flat,
            layout,
            groups,
            transforms,
            fmt,
            IntraNode.FP32,
            average,
            all_reduce,
            ledger,
            nonfinite,
            rotation,
            kernels,
            rotated,
        )
        if layout.shard_size * self.world != flat.numel():
            raise ValueError(
                f"--gift-intra-node reduce-scatter needs {self.world} equal shards tiling the bucket, got "
                f"{self.world} x {layout.shard_size} for {flat.numel()} elements"
            )

    def stages(self) -> list:
        if self.all_reduce:
            return [self._intra, self._rows, self._node_sums, self._reduce, self._finish_gather, self._land]
        return [self._intra, self._rows, self._node_sums, self._reduce, self._finish]

    def _footprint_key(self) -> tuple:
        return (self.fmt.name, "sum-first", self.topo.ranks_per_node)

    def _footprint(self) -> int:
        """The held sums (``1/g`` of the bucket, its dtype), then the inter-node send and receive buffers."""
        held = self.topo.nodes * self.layout.shard_size * self.flat.element_size()
        return max(taken(held, *self._inter_bytes(r)) for r in range(self.world)) + taken(*self._gathered_bytes())

    def _tables(self, device) -> _Tables:
        whitened = tuple(i for i, t in enumerate(self.transforms) if t is not None)
        ranks = tuple(self.transforms[i].rank for i in whitened)
        key = ("sum-first", self.local, whitened, ranks, str(device))
        return self.layout.cached(key, lambda: _tables(self.layout, self.topo, self.local, whitened, ranks, device))

    def _stacked(self, segs: tuple[int, ...], device) -> StackedWhitening:
        """The whitenings of ``segs`` with their factors stacked, built again only when one of them changed (a
        refresh, a transform written in place) and kept with the layout: not four stacking launches per step.
        The factors' memory is held twice for them. The stacks a refresh replaces are freed on the host after
        every earlier step's reductions were waited on (the step's order), so no stream still reads them."""
        ws = tuple(self.transforms[seg] for seg in segs)
        held = self.layout.cached(("sum-first-stack", segs, str(device)), dict)
        versions = tuple((w.d_inv_sqrt._version, w.q._version, w.c._version) for w in ws)
        if held.get("of") is None or any(a is not b for a, b in zip(held["of"], ws)) or held["versions"] != versions:
            held.update(of=ws, versions=versions, stacked=StackedWhitening.of(ws))
        return held["stacked"]

    # -- 0: intra-node ------------------------------------------------------------------------------
    def _intra(self, prev: StageResult) -> StageResult:
        """The node's reduce-scatter of the held shards: row ``m`` of the bucket's ``[n, g·S]`` onto row
        ``m`` of the held sums ``[n, S]``, local rank ``l`` taking shard ``m·g + l``; one coalesced call."""
        n, g, size, flat = self.topo.nodes, self.topo.ranks_per_node, self.layout.shard_size, self.flat
        held_sums = self.space.empty(n * size, flat.dtype, flat.device)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        sent = (g - 1) * n * size * flat.element_size()  # a ring's: (g-1)/g of the bucket
        self.ledger.add("reduce_scatter", dtype_label(flat.dtype), sent, {"intra": sent})
        work = self.groups.intra.reduce_scatter_tensor_coalesced(
            list(held_sums.view(n, size).unbind(0)), list(flat.view(n, g * size).unbind(0)), opts
        )
        return StageResult(works=[work], held_sums=held_sums, bucket=flat)

    # -- 1: whole rows, the cut rows' projections -----------------------------------------------------
    def _rows(self, prev: StageResult) -> StageResult:
        """The held coded values in FP32 with whole GIFT rows times ``T``; each cut piece's projection sent
        to the node's other holders of its row."""
        sums, t = prev.held_sums, self._tables(self.flat.device)
        in_place = self.ops.fp4(sums.device) is not None and t.source is not None
        if in_place:  # the encode reads the Euclidean parts in the held sums; the GIFT values written below
            coded, source = torch.empty(max(1, t.source.own), device=sums.device), t.source.on(sums)
        else:
            coded, source = t.coded(sums).float(), None
        plain = [t.plain[c](sums) for c in range(2)]
        r_max = max((self.transforms[seg].rank for s in t.segments for seg in s.segs), default=0)
        own = torch.zeros(t.slots, r_max, device=sums.device)
        for s in t.segments:  # the whole rows of one shape, each contiguous in the held sums, read there
            rows = RowsAt(sums, s.starts, s.cols, s.matrix, s.spans)
            ws = [self.transforms[seg] for seg in s.segs]
            self.ops.whiten_place(rows, ws, s.place.at(coded, 0), stacked=self._stacked(s.segs, sums.device))
        stacks = []
        for p in t.pieces:  # each cut piece's part of its row's (P D^{-1/2}) Q, one batch per shape
            m, st = len(p.segs), self._stacked(p.segs, sums.device)
            y = torch.zeros(m * p.k * p.cols, device=sums.device)
            y[p.dense] = sums.index_select(0, p.held).float()
            q = st.q.view(m, p.cols, p.rank)
            with ieee_fp32(sums.device):
                yd = y.view(m, p.k, p.cols) * st.d_inv_sqrt.view(m, 1, p.cols)
                own[p.slots, : p.rank] = torch.bmm(yd, q).view(-1, p.rank)[p.rows]
            stacks.append((yd, q, st.c.view(m, 1, p.rank)))
        # the held sums: read by the encode where it reads them in place
        kept = dict(coded=coded, plain=plain, source=source, held_sums=sums if in_place else None)
        if not t.slots:  # no whitened row of the node's shards is cut (a layout fact: the same on its ranks)
            return StageResult(works=[], **kept)
        recv = torch.empty(len(t.peers), *own.shape, device=sums.device)
        block = own.numel()
        splits = [block if lp in t.peers else 0 for lp in range(self.topo.ranks_per_node)]
        send = own.expand(len(t.peers), *own.shape).contiguous()
        sent = 4 * block * len(t.peers)
        self.ledger.add("all_to_all", "fp32", sent, {"intra": sent})
        work = dist.all_to_all_single(
            recv.view(-1), send.view(-1), splits, splits, group=self.groups.intra, async_op=True
        )
        return StageResult(works=[work], **kept, own=own, recv=recv, send=send, stacks=stacks)

    # -- 2: node sums -------------------------------------------------------------------------------
    def _node_sums(self, prev: StageResult) -> StageResult:
        """Each cut piece's columns of ``P T`` (its row's projections summed, holders in shard order),
        then ``_send_inter``."""
        t, coded = self._tables(self.flat.device), prev.coded
        if t.slots:
            r_max = prev.own.shape[1]
            rows = torch.cat([prev.own, prev.recv.view(-1, r_max), prev.own.new_zeros(1, r_max)])
            proj = rows[t.sums].sum(1)
            proj = torch.cat([proj, proj.new_zeros(1, r_max)])  # padding rows of the stacks read the zero row
            for p, (yd, q, c) in zip(t.pieces, prev.stacks):
                # the pieces' columns of P T (module doc), the row's projection summed over its holders
                with ieee_fp32(coded.device):
                    pt = torch.baddbmm(
                        yd, proj[p.gather, : p.rank].view(len(p.segs), p.k, p.rank) * c, q.transpose(1, 2)
                    )
                coded[p.src] = pt.view(-1)[p.dense]
        return self._send_inter(coded, prev.plain, prev.source)
