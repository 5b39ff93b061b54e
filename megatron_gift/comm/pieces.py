"""``T⁻¹`` of the GIFT rows a shard boundary cuts, from an r-float exchange with the ranks that
hold the rest of each row (the neighbours: one network latency, whatever the group size).

Rank ``i`` of the group holds shard ``i``. For a row cut into pieces (``U`` restricted to columns
``C_k`` of the pieces, ``k`` in shard order), ``U T⁻¹ = (U + (U Q) diag(c') Qᵀ) D^{1/2}`` needs the
whole row's ``U Q = Σ_k U[:, C_k] Q[C_k]``: every holder sends its pieces' partial projections
``[max_pieces, r]`` to the others in one all-to-all whose splits are zero for every other rank,
then sums each row's partials in shard order (zeros first, the same sum on every holder) and
finishes its own pieces' columns (``LowRankWhitening.inverse_piece``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import BucketLayout, RowPiece
from .ledger import CommLedger


def _plan(layout: BucketLayout, rank: int):
    """``peers``: the ranks sharing a cut row with ``rank``, in order; ``sums[k]``: the
    ``(shard, piece index)`` partials of own piece ``k``'s row, in shard order; ``cut``: the
    segments with a cut row in any shard."""

    def build():
        rows = {}
        for j, plan in enumerate(layout.shards):
            for k, p in enumerate(plan.pieces):
                rows.setdefault((p.seg, p.row), []).append((j, k))
        own = layout.shards[rank].pieces
        sums = [rows[(p.seg, p.row)] for p in own]
        peers = sorted({j for holders in sums for j, _ in holders if j != rank})
        return peers, sums, {seg for seg, _ in rows}

    return layout.cached(("pieces", rank), build)


class PieceExchange:
    """The cut rows of shard ``rank``: ``start`` launches the exchange, ``finish`` transforms.

    ``values[k]``: own piece ``k``'s summed (still whitened) values ``[1, c1 - c0]``."""

    def __init__(self, layout: BucketLayout, rank: int, transforms, group, ledger: CommLedger, links):
        self.layout, self.rank, self.transforms = layout, rank, transforms
        self.pieces: list[RowPiece] = layout.shards[rank].pieces
        self.peers, self.sums, cut = _plan(layout, rank)
        self.group, self.ledger, self.links = group, ledger, links
        # any cut row with a T in any shard: the same answer on every rank (T is everywhere the same)
        self.needed = any(transforms[seg] is not None for seg in cut)
        self.r_max = max((t.rank for t in transforms if t is not None), default=0)

    def start(self, values: list[torch.Tensor], device):
        """Send this rank's partial projections to its peers; returns the work (None: nothing to send)."""
        self.values, self.buffers = values, []
        if not self.needed:
            return None
        own = torch.zeros(self.layout.max_pieces, self.r_max, device=device)
        for k, (p, v) in enumerate(zip(self.pieces, values)):
            t = self.transforms[p.seg]
            if t is not None:
                own[k, : t.rank] = t.projection(v, slice(p.c0, p.c1))[0]
        world, block = self.group.size(), own.numel()
        self.own = own
        self.recv = torch.empty(len(self.peers), *own.shape, device=device)
        send = own.expand(len(self.peers), *own.shape).contiguous()
        self.buffers = [own, self.recv, send]  # the stage's handoff: every tensor the collective is given
        splits = [block if j in self.peers else 0 for j in range(world)]
        sent = 4 * block * len(self.peers)
        self.ledger.add("all_to_all", "fp32", sent, self.links([4 * s for s in splits]))
        return dist.all_to_all_single(
            self.recv.view(-1), send.view(-1), splits, splits, group=self.group, async_op=True
        )

    def tensors(self) -> list[torch.Tensor]:
        """What the stage that started it hands on (``schedule.StageResult``): the values ``finish`` reads and
        every tensor the collective was given."""
        return [v for v in self.values if v is not None] + self.buffers

    def finish(self) -> list[torch.Tensor]:
        """Own pieces' columns of ``U T⁻¹`` (the values as they were where a row has no ``T``)."""
        out = []
        for k, (p, v) in enumerate(zip(self.pieces, self.values)):
            t = self.transforms[p.seg]
            if t is None or not self.needed:
                out.append(v)
                continue
            proj = torch.zeros(1, t.rank, device=v.device)
            for j, q in self.sums[k]:
                partials = self.own if j == self.rank else self.recv[self.peers.index(j)]
                proj += partials[q, : t.rank]
            out.append(t.inverse_piece(v, proj, slice(p.c0, p.c1)))
        return out
