"""Two-level quantized reduce-scatter and all-reduce of a flat gradient bucket (as ZeRO++'s qgZ).

A data-parallel group of ``p = n·g`` ranks on ``n`` nodes (``topology.Topology``): rank
``i = k·g + l`` is local index ``l`` on node ``k``. The bucket ``G_i [N]`` is cut into Megatron's
``p`` shards (``comm.layout``), shard ``j`` owned by rank ``j``. Rank ``i`` *holds* the shards
``H(l) = {m·g + l : m = 0..n-1}``, those owned by the ranks with its local index.

Reduce-scatter, on rank ``i = k·g + l`` (stages, run by ``comm.schedule.ReductionQueue``)::

    0 U_i = G_i T per GIFT row (whole rows, the sender has them all; G elsewhere); intra-node
      all-to-all (the g ranks of node k, the own part kept): to local rank l' the shards H(l'),
      sections [off values | bf16 values | coded values of U_i in the intra dtype (fp32/bf16)],
      or for fp8 the flat path's FP8 codes and scales of U_i.
      Leaves the rank over intra-node links: (g-1)/g · N elements.
    1 P_{k,j} = Σ_{l'} dec(msg from l')   FP32, local ranks in order, for j ∈ H(l) at once; encoded
      (FP8 payload + scales: 1/g of the bucket), all-to-all among the n ranks with local index l:
      shard m·g + l to node m. Leaves the rank through its NIC: (n-1)/n · (FP8 payload + scales)/g.
    2 S_i = Σ_k dec(msg from node k)   FP32, nodes in order; S_i T⁻¹ per whole row; the cut rows'
      partials to the neighbours (``pieces``); ÷ p when averaging; shard i of the bucket ← S_i.
    3 the cut rows' T⁻¹ (÷ p), written. Nothing outside shard i is written.

Whitening at the sender keeps every transform on whole rows (no cut rows inside the node) and puts
the intra-node dtype's rounding on ``G T``: ~2^-9 relative for bf16, 1/16 of FP8's.

All-reduce: step 2 without ``T⁻¹`` (÷ p first), re-encode ``S_i``, all-gather over the n ranks with
local index l (inter-node: shards H(l)), then over the node's g ranks (intra-node: all p shards),
decode every shard and apply ``T⁻¹`` to whole rows: the same bytes everywhere, bit-identical results.
Every step runs a fixed number of ops whatever ``n`` and ``g`` (``packing``, ``codec``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import kernels as _kernels
from .._compat import all_gather as _all_gather
from ..config import IntraNode
from .codec import cast_bucket, encode_bucket, plain_bucket, spans, sum_plain, views
from .layout import BucketLayout, group_chunks
from .ledger import CommLedger
from .packing import Received, packing
from .quantized import ShardReduction, Whitenings, decode_gathered, with_self
from .schedule import StageFlags, StageResult, taken
from .topology import TwoLevelGroups

# reduce-scatter (``comm.sum_first``): the bucket's own dtype, which FP32 never widens
_WIRE = {
    IntraNode.FP32: torch.float32,
    IntraNode.BF16: torch.bfloat16,
    IntraNode.FP8: None,
    IntraNode.REDUCE_SCATTER: torch.float32,
}
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}  # the ledger's names of the float intra dtypes


def intra_wire(intra: IntraNode, bucket_dtype: torch.dtype) -> torch.dtype | None:
    """Wire dtype of coded values in the intra-node stage (None: FP8); a BF16 bucket is never widened."""
    wire = _WIRE[IntraNode(intra)]
    return bucket_dtype if wire is not None and bucket_dtype.itemsize < wire.itemsize else wire


class TwoLevelReduce(ShardReduction):
    """One bucket's two-level quantized reduction (module doc); construction does no work.

    Same contract as ``QuantizedReduce``; ``intra`` is the intra-node dtype (``IntraNode`` or its spelling)."""

    divide_first = False

    def __init__(
        self,
        flat: torch.Tensor,
        layout: BucketLayout,
        groups: TwoLevelGroups,
        transforms: Whitenings,
        intra: IntraNode = IntraNode.BF16,
        average: bool = False,
        all_reduce: bool = False,
        ledger: CommLedger | None = None,
        nonfinite: StageFlags | None = None,
        kernels: bool | None = None,
    ):
        topo = groups.topology
        if not topo.two_level or topo.world != layout.num_shards or groups.group.size() != topo.world:
            raise ValueError(
                f"a two-level reduction needs >1 node of >1 ranks and one shard per rank, got {topo}, "
                f"{layout.num_shards} shards, {groups.group.size()} ranks"
            )
        super().__init__(flat, layout, groups.group, transforms, average, all_reduce, ledger, nonfinite, topo, kernels)
        self.groups, self.topo = groups, topo
        self.local, self.node = topo.local(self.rank), topo.node(self.rank)
        self.held = topo.inter_ranks(self.rank)
        self.wire = intra_wire(intra, flat.dtype)

    def stages(self) -> list:
        if self.all_reduce:
            return [self._intra, self._node_sums, self._gather_inter, self._gather_intra, self._decode_all]
        return [self._intra, self._node_sums, self._reduce, self._finish]

    def _footprint_key(self) -> tuple:
        return (self.wire, self.topo.ranks_per_node)

    def _footprint(self) -> int:
        """The most any rank takes: the intra-node send (every shard, in the intra dtype) and receive
        ((g - 1) messages of the held shards), the inter-node send (the held shards' messages) and
        receive ((n - 1) own messages); the all-reduce's gathers."""
        topo = self.topo
        held = [tuple(topo.inter_ranks(lp)) for lp in range(topo.ranks_per_node)]
        intra = [self._message_bytes(h, self.wire) for h in held]
        return max(
            taken(sum(intra), (topo.ranks_per_node - 1) * intra[topo.local(r)], *self._inter_bytes(r))
            for r in range(self.world)
        ) + taken(*self._gathered_bytes())

    def _inter_bytes(self, r: int) -> list[int]:
        """Rank ``r``'s inter-node send and receive buffers."""
        held = self.topo.inter_ranks(r)
        return [sum(self._message_bytes((j,)) for j in held), (self.topo.nodes - 1) * self._message_bytes((r,))]

    def _gathered_bytes(self) -> list[int]:
        width = self.layout.max_message_bytes
        return [width, self.topo.nodes * width, self.world * width] if self.all_reduce else []

    # -- 0: intra-node ----------------------------------------------------------------------------
    def _intra(self, prev: StageResult) -> StageResult:
        layout, topo, device = self.layout, self.topo, self.flat.device
        g, local, outputs = topo.ranks_per_node, self.local, getattr(prev, "outputs", {})
        key = ("intra", self.rank, str(device), self.wire)
        messages = [topo.inter_ranks(lp) for lp in range(g) if lp != local] + [self.held]
        pk = layout.cached(key, lambda: packing(layout, list(range(self.world)), messages, self.wire, device))
        buf = self.space.empty(pk.nbytes, device=device)
        if self.wire is None:
            encode_bucket(buf, pk, self.flat, layout, self.transforms, self.ops, outputs=outputs)
        else:
            cast_bucket(buf, pk, self.flat, layout, self.transforms, self.wire, self.ops, outputs)
        plain_bucket(buf, pk, self.flat, layout, self.ops)
        own = pk.own.nbytes
        recv = self.space.empty((g - 1) * own, device=device)
        sent = pk.sent_bytes
        self.ledger.add("all_to_all", _NAMES.get(self.wire, self.coded_label), sent, {"intra": sent})
        work = dist.all_to_all_single(
            recv,
            buf[:sent],
            with_self([own] * (g - 1), local),
            with_self(pk.peer_bytes, local),
            group=self.groups.intra,
            async_op=True,
        )
        return StageResult(works=[work], pk=pk, buf=buf, recv=recv)

    # -- 1: node sums, inter-node ------------------------------------------------------------------
    def _intra_rows(self, prev: StageResult) -> Received:
        """The node's messages of the held shards (stage 0's)."""
        return prev.pk.received(prev.recv, prev.buf, self.local, self.topo.ranks_per_node, self.space)

    def _node_sums(self, prev: StageResult) -> StageResult:
        layout, device, cfg = self.layout, self.flat.device, self.layout.codec
        rows = self._intra_rows(prev)
        n, k = self.topo.nodes, self.node
        key = ("inter", self.rank, str(device))
        pk = layout.cached(
            key,
            lambda: packing(
                layout, self.held, [[j] for j in self.held if j != self.rank] + [[self.rank]], None, device
            ),
        )
        buf = self.space.empty(pk.nbytes, device=device)
        out = views(buf, layout)
        chunks, counts = self._held(device)
        for (c0, c1), (g0, g1), lengths in chunks:
            coded = rows.coded(c0, c1, layout.coded_dtype(self.wire))
            if self.wire is None:
                values = self.ops.decode_sum_unwhiten(
                    coded, rows.scales(g0, g1, cfg.scale_dtype()), 1, c1 - c0, None, cfg, False, lengths=lengths
                )
            else:
                values = self.ops.sum_rows(coded, False)
            into = _kernels.Placed(pk.place["coded"].at(out["coded"], c0), pk.place["groups"].at(out["groups"], g0))
            self.ops.whiten_encode(values.view(1, -1), None, cfg, lengths=lengths, into=into)
        for c, name in enumerate(("off", "bf16")):
            for a, b in spans(0, counts[c], self.chunk):
                sum_plain(rows, layout, c, a, b, False, self.ops, out=pk.place[name].at(out[name], a))
        own = pk.own.nbytes
        recv = self.space.empty((n - 1) * own, device=device)
        sent = pk.sent_bytes
        self.ledger.add("all_to_all", self.coded_label, sent, {"inter": sent})
        work = dist.all_to_all_single(
            recv,
            buf[:sent],
            with_self([own] * (n - 1), k),
            with_self(pk.peer_bytes, k),
            group=self.groups.inter,
            async_op=True,
        )
        return StageResult(works=[work], pk=pk, buf=buf, recv=recv)

    def _held(self, device):
        """The chunks of the held shards' coded values one after another, aligned to their groups
        (one chunk on the fused path, ``CHUNK``): ``((c0, c1), (g0, g1), group lengths on the
        device)``; and their plain counts."""
        layout = self.layout

        def build():
            plans = [layout.shards[j] for j in self.held]
            lengths = torch.cat([layout.group_lengths[p.group_lo : p.group_hi] for p in plans])
            starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            n = int(starts[-1])
            chunks = ([(0, n)] if self.chunk is None else group_chunks(starts, self.chunk)) if lengths.numel() else []
            on_device = lengths.to(device=device, dtype=torch.int32)
            pairs = []
            for a, b in chunks:
                g0, g1 = int(torch.searchsorted(starts, a)), int(torch.searchsorted(starts, b))
                pairs.append(((a, b), (g0, g1), on_device[g0:g1]))
            counts = [sum(p.plain_hi[c] - p.plain_lo[c] for p in plans) for c in range(2)]
            return pairs, counts

        return layout.cached(("held", self.local, str(device), self.chunk), build)

    def _inter_rows(self, prev: StageResult) -> Received:
        return prev.pk.received(prev.recv, prev.buf, self.node, self.topo.nodes, self.space)

    # -- 2-3: reduce-scatter --------------------------------------------------------------------------
    def _reduce(self, prev: StageResult) -> StageResult:
        return self._reduce_own(self._inter_rows(prev), getattr(prev, "targets", None))

    # -- 2-4: all-reduce --------------------------------------------------------------------------------
    def _gather_inter(self, prev: StageResult) -> StageResult:
        msg = self._own_message(self._inter_rows(prev))
        width, n = self.layout.max_message_bytes, self.topo.nodes
        gathered = self.space.empty(n * width, device=msg.device)
        self.ledger.add("all_gather", self.coded_label, (n - 1) * width, {"inter": (n - 1) * width})
        work = _all_gather(gathered, msg, group=self.groups.inter, async_op=True)
        return StageResult(works=[work], gathered=gathered, msg=msg)

    def _gather_intra(self, prev: StageResult) -> StageResult:
        g, first = self.topo.ranks_per_node, prev.gathered
        gathered = self.space.empty(g * first.numel(), device=first.device)
        self.ledger.add("all_gather", self.coded_label, (g - 1) * first.numel(), {"intra": (g - 1) * first.numel()})
        work = _all_gather(gathered, first, group=self.groups.intra, async_op=True)
        return StageResult(works=[work], gathered=gathered, first=first)

    def _decode_all(self, prev: StageResult) -> StageResult:
        """Every shard's message: shard ``m·g + l'`` came from local rank l' (row l'), node m (column m)."""
        g, n = self.topo.ranks_per_node, self.topo.nodes
        slots = [(j % g) * n + j // g for j in range(self.world)]
        targets = getattr(prev, "targets", None)
        decode_gathered(prev.gathered, self.layout, self.transforms, self.flat, slots, self.ops, targets)
        return StageResult()
