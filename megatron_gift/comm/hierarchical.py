"""Two-level quantized reduce-scatter and all-reduce of a flat gradient bucket (as ZeRO++'s qgZ).

A data-parallel group of ``p = n·g`` ranks on ``n`` nodes (``topology.Topology``): rank
``i = k·g + l`` is local index ``l`` on node ``k``. The bucket ``G_i [N]`` is cut into Megatron's
``p`` shards (``comm.layout``), shard ``j`` owned by rank ``j``. Rank ``i`` *holds* the shards
``H(l) = {m·g + l : m = 0..n-1}``, those owned by the ranks with its local index.

Reduce-scatter, on rank ``i = k·g + l``::

    1 intra-node all-to-all (the g ranks of node k): to local rank l' go shards H(l'), m = 0..n-1,
      each as [off values (bucket dtype) | bf16 values | coded values in the intra dtype]
      (fp32 / bf16), or for fp8 as the flat path's FP8 message of G_i T.
      Leaves the rank over intra-node links: (g-1)/g · N elements.
    2 node partial sums  P_{k,j} = Σ_{l'=0..g-1} dec(msg from l')   FP32, local ranks in order, j ∈ H(l)
    3 whiten (fp32 / bf16 intra): P_{k,j} T per GIFT row inside a shard; rows cut by shard boundaries
      have all their pieces on node k: their G'Q comes from an r-float all-gather among its ranks
    4 encode P_{k,j} (FP8 payload + scales: 1/g of the bucket, 1/g of the codec and T work), all-to-all
      among the n ranks with local index l: shard m·g + l to node m.
      Leaves the rank through its NIC: (n-1)/n · (FP8 payload + scales)/g of the bucket.
    5 S_i = Σ_{k=0..n-1} dec(msg from node k)   FP32, nodes in order; S_i T⁻¹ per row (cut rows: r-float
      all-gather over the group); ÷ p when averaging. Shard i of the bucket ← S_i; nothing else is written.

All-reduce: step 5 without ``T⁻¹`` (÷ p first), re-encode ``S_i``, all-gather over the n ranks with
local index l (inter-node: shards H(l)), then over the node's g ranks (intra-node: all p shards),
decode every shard and apply ``T⁻¹`` to whole rows: the same bytes everywhere, bit-identical results.

Decode off the critical path: steps 2-4 run once step 1's all-to-all has completed, step 5 once
step 4's has (each step's small exchanges are asynchronous too, finished by the next step). ``TwoLevelReduce.advance`` runs whatever has completed without blocking; the
``TwoLevelPipeline`` calls it for earlier buckets whenever a bucket starts, so bucket k's inter-node
stage (and its decode) overlaps bucket k+1's intra-node stage and the rest of the backward pass;
``wait`` (Megatron's) blocks for the rest. Step 1 runs on the ``intra`` group, everything launched
from ``advance`` on groups only ``advance`` uses, one bucket at a time in start order: every
process group sees its collectives in the same order on every rank, and ``advance`` never blocks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import INTRA_NODE_DTYPES
from ..numerics.error_feedback import ErrorFeedback
from .layout import BucketLayout, ShardPlan, _pad4
from .quantized import (
    CommLedger,
    QuantizedReduce,
    PieceExchange,
    Whitenings,
    _all_gather,
    _bytes,
    _Codec,
    _encode,
    _gather_runs,
    _kernels_on,
    _plan,
    _starts,
    decode_gathered,
    encode_messages,
    flag_nonfinite,
    transform_rows,
    write_shard,
)
from .topology import TwoLevelGroups

INTRA_DTYPES = dict(zip(INTRA_NODE_DTYPES, (torch.float32, torch.bfloat16, None)))
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", None: "fp8+scales"}


def intra_wire(intra: str, bucket_dtype: torch.dtype) -> torch.dtype | None:
    """Wire dtype of coded values in the intra-node stage (None: FP8); a BF16 bucket is never widened."""
    if intra not in INTRA_DTYPES:
        raise ValueError(f"intra-node dtype must be one of {sorted(INTRA_DTYPES)}, got {intra!r}")
    wire = INTRA_DTYPES[intra]
    return bucket_dtype if wire is not None and bucket_dtype.itemsize < wire.itemsize else wire


def _float_bytes(plan: ShardPlan, wire: torch.dtype) -> int:
    """Size of a float message ``[off | bf16 | coded in wire]`` of shard ``plan``."""
    return sum(plan.plain_bytes) + _pad4((plan.coded_hi - plan.coded_lo) * wire.itemsize)


class TwoLevelReduce:
    """One bucket's two-level quantized reduction (module doc); ``wait()`` completes it in ``flat``.

    Same contract as ``QuantizedReduce``; ``intra`` is the intra-node dtype (``fp32``, ``bf16``,
    ``fp8``); ``pipeline``, when given, orders this reduction after the ones started before it."""

    def __init__(self, flat: torch.Tensor, layout: BucketLayout, groups: TwoLevelGroups, transforms: Whitenings,
                 intra: str = "bf16", average: bool = False, all_reduce: bool = False, ledger: CommLedger | None = None,
                 async_op: bool = False, nonfinite: torch.Tensor | None = None, pipeline: "TwoLevelPipeline | None" = None,
                 kernels: bool | None = None):  # fmt: skip
        topo = groups.topology
        if not topo.two_level or topo.world != layout.num_shards or groups.group.size() != topo.world:
            raise ValueError(f"a two-level reduction needs >1 node of >1 ranks and one shard per rank, got {topo}, "
                             f"{layout.num_shards} shards, {groups.group.size()} ranks")  # fmt: skip
        self.flat, self.layout, self.groups, self.topo, self.transforms = flat, layout, groups, topo, transforms
        self.average, self.all_reduce, self.async_op, self.nonfinite = average, all_reduce, async_op, nonfinite
        self.ledger = ledger if ledger is not None else CommLedger()
        self.rank = groups.group.rank()
        self.held = topo.inter_ranks(self.rank)
        self.wire = intra_wire(intra, flat.dtype)
        self.codec = _Codec(layout)
        self.plan = _plan(layout, _kernels_on(flat.device, kernels))
        last = [self._gather_intra, self._decode_all] if all_reduce else [self._write_shard]
        self._steps = [self._node_sums, self._encode_inter, self._decode, *last]
        self.work = self._intra_stage()
        self._pipeline = pipeline
        if pipeline is not None:
            pipeline.submit(self)
        elif not async_op:
            self.advance(block=True)

    def _intra_size(self, j: int) -> int:
        plan = self.layout.shards[j]
        return plan.message_bytes if self.wire is None else _float_bytes(plan, self.wire)

    def _intra_stage(self):
        """Step 1: shards H(l') to local rank l', one all-to-all in the node."""
        g, layout = self.topo.ranks_per_node, self.layout
        order = [j for lp in range(g) for j in self.topo.inter_ranks(lp)]
        if self.wire is None:  # G T encoded here, as the flat path does
            send, sizes = encode_messages(self.codec, self.plan.bucket, self.flat, self.transforms, order, keep=not self.all_reduce)
        else:
            sizes = [self._intra_size(j) for j in order]
            send = torch.zeros(sum(sizes), dtype=torch.uint8, device=self.flat.device)
            for j, at in zip(order, _starts(sizes)):
                plan, off = layout.shards[j], at
                for values, size in zip(self.codec.plain_sections(self.flat, plan), plan.plain_bytes):
                    send[off : off + size][: values.numel() * values.element_size()] = _bytes(values)
                    off += size
                coded = _bytes(_gather_runs(self.flat, plan.coded_runs).to(self.wire))
                send[off : off + coded.numel()] = coded
        n = self.topo.nodes
        per_peer = [sum(sizes[lp * n : (lp + 1) * n]) for lp in range(g)]
        own_bytes = per_peer[self.topo.local(self.rank)]
        self.recv = torch.empty(g * own_bytes, dtype=torch.uint8, device=self.flat.device)
        sent = sum(per_peer) - own_bytes
        self.ledger.add("all_to_all", _NAMES[self.wire], sent, {"intra": sent})
        return dist.all_to_all_single(self.recv, send, [own_bytes] * g, per_peer, group=self.groups.intra, async_op=self.async_op)

    def advance(self, block: bool) -> bool:
        """Run the steps whose communication has completed (all, waiting, if ``block``); True when done."""
        while self._steps:
            if self.work is not None:
                if not block and not self.work.is_completed():
                    return False
                self.work.wait()
            self.work = self._steps.pop(0)()
        return True

    @property
    def finished(self) -> bool:
        """Whether every step has run (the result is in ``flat``)."""
        return not self._steps

    def wait(self) -> None:
        if self._pipeline is not None:
            self._pipeline.wait(self)
        else:
            self.advance(block=True)

    def _node_sums(self):
        """Steps 2-3: this node's partial sums of shards H(l), whitened (pieces: launched here)."""
        g = self.topo.ranks_per_node
        chunks = self.recv.view(g, -1)
        self.partials, at = [], 0
        for j in self.held:
            plan, size = self.layout.shards[j], self._intra_size(j)
            msgs = chunks[:, at : at + size]
            at += size
            if self.wire is None:  # whitened already
                self.partials.append(self.codec.reduce(plan, self.plan.shards[j], msgs, False, None))
                continue
            sums = []
            for lp in range(g):  # one FP32 accumulator per section, local ranks in order
                plain_sections = self.codec.plain_values(plan, msgs[lp], start=0)
                coded_at = sum(plan.plain_bytes)
                parts = [msgs[lp, coded_at : coded_at + (plan.coded_hi - plan.coded_lo) * self.wire.itemsize].view(self.wire).float(), *plain_sections]
                sums = [t.clone() for t in parts] if not sums else [acc.add_(t) for acc, t in zip(sums, parts)]
            transform_rows(self.layout, self.transforms, sums[0], plan.coded_lo, self.plan.shards[j].rest_rows, inverse=False)
            self.partials.append((sums[0], sums[1:]))
        if self.wire is None:
            self.pieces = None
            return None
        self.pieces = PieceExchange(self.layout, self.transforms, self.held, [c for c, _ in self.partials],
                                    self.groups.intra_late, self.topo.inter_ranks, self.ledger,
                                    lambda chunk: {"intra": (g - 1) * chunk}, inverse=False, async_op=self.async_op)  # fmt: skip
        return self.pieces.work

    def _encode_inter(self):
        """Step 4: encode the node partials, all-to-all among the ranks with this local index."""
        if self.pieces is not None:
            self.pieces.finish()
        layout, n = self.layout, self.topo.nodes
        sizes = [layout.shards[j].message_bytes for j in self.held]
        send = torch.zeros(sum(sizes), dtype=torch.uint8, device=self.flat.device)
        whiten = self.transforms if self.wire is not None else None  # kernel blocks are whitened as they encode
        for j, (coded, plain_sections), at, size in zip(self.held, self.partials, _starts(sizes), sizes):
            plan = layout.shards[j]
            lengths = layout.group_lengths_on(coded.device)[plan.group_lo : plan.group_hi]
            enc = _encode(coded, lengths, self.plan.shards[j], layout.codec, whiten)
            self.codec.pack(plan, enc, [t.to(dt) for t, dt in zip(plain_sections, layout.plain_dtypes)], out=send[at : at + size])
        del self.partials
        own_bytes = layout.shards[self.rank].message_bytes
        self.recv = torch.empty(n * own_bytes, dtype=torch.uint8, device=self.flat.device)
        sent = sum(sizes) - sizes[self.topo.node(self.rank)]
        self.ledger.add("all_to_all", "fp8+scales", sent, {"inter": sent})
        return dist.all_to_all_single(self.recv, send, [own_bytes] * n, sizes, group=self.groups.inter, async_op=self.async_op)

    def _decode(self):
        """Step 5: this rank's shard, summed over nodes in order; ``T⁻¹`` of whole rows and the cut rows'
        exchange launched (all-reduce: ÷ p, re-encoded, the inter-node all-gather launched)."""
        plan, split, p = self.layout.shards[self.rank], self.plan.shards[self.rank], self.topo.world
        msgs = self.recv.view(self.topo.nodes, plan.message_bytes)
        coded, plain_sections = self.codec.reduce(plan, split, msgs, False, None if self.all_reduce else self.transforms)
        if self.all_reduce:
            if self.average:
                for t in (coded, *plain_sections):
                    t /= p
            flag_nonfinite(self.nonfinite, [coded, *plain_sections])
            self.width = max(q.message_bytes for q in self.layout.shards)
            msg = self.codec.message(plan, split, coded, plain_sections, self.width)
            self.recv = torch.empty(self.topo.nodes * self.width, dtype=torch.uint8, device=self.flat.device)
            sent = (self.topo.nodes - 1) * self.width
            self.ledger.add("all_gather", "fp8+scales", sent, {"inter": sent})
            return _all_gather(self.recv, msg, group=self.groups.inter, async_op=self.async_op)
        transform_rows(self.layout, self.transforms, coded, plan.coded_lo, split.rest_rows, inverse=True)
        self.shard = coded, plain_sections
        self.pieces = PieceExchange(self.layout, self.transforms, [self.rank], [coded], self.groups.whole, lambda m: [m],
                                    self.ledger, lambda chunk: self.topo.link_bytes(self.rank, [chunk] * p),
                                    inverse=True, async_op=self.async_op)  # fmt: skip
        return self.pieces.work

    def _write_shard(self):
        """Reduce-scatter: ``T⁻¹`` of the cut rows, ÷ p, shard i of the bucket."""
        self.pieces.finish()
        coded, plain_sections = self.shard
        if self.average:
            for t in (coded, *plain_sections):
                t /= self.topo.world
        flag_nonfinite(self.nonfinite, [coded, *plain_sections])
        write_shard(self.flat, self.layout.shards[self.rank], coded, plain_sections)
        return None

    def _gather_intra(self):
        """All-reduce: the n messages of shards H(l) to every rank of the node."""
        g = self.topo.ranks_per_node
        first = self.recv
        self.recv = torch.empty(g * first.numel(), dtype=torch.uint8, device=self.flat.device)
        sent = (g - 1) * first.numel()
        self.ledger.add("all_gather", "fp8+scales", sent, {"intra": sent})
        return _all_gather(self.recv, first, group=self.groups.intra_late, async_op=self.async_op)

    def _decode_all(self):
        """All-reduce: every shard's message (row m·g + l' of [g, n] → shard order), decoded, T⁻¹."""
        g, n = self.topo.ranks_per_node, self.topo.nodes
        gathered = self.recv.view(g, n, self.width).transpose(0, 1).reshape(g * n, self.width)
        decode_gathered(self.codec, self.plan, self.transforms, gathered, self.flat)
        return None


class TwoLevelPipeline:
    """Two-level reductions in flight, advanced one at a time in the order they started (the
    same on every rank): each new one first lets the earlier ones run what has arrived."""

    def __init__(self):
        self._queue: list[TwoLevelReduce] = []

    def submit(self, reduction: TwoLevelReduce) -> None:
        self._queue.append(reduction)
        while self._queue and self._queue[0].advance(block=False):
            self._queue.pop(0)

    def wait(self, reduction: TwoLevelReduce) -> None:
        while reduction in self._queue:
            self._queue[0].advance(block=True)
            self._queue.pop(0)


def start_reduction(flat: torch.Tensor, layout: BucketLayout, groups: TwoLevelGroups, transforms: Whitenings,
                    intra: str, error_feedback: ErrorFeedback | None, pipeline: TwoLevelPipeline | None, **common):  # fmt: skip
    """The two-level reduction where ``groups`` has its subgroups (several nodes of several ranks)
    and there is no error feedback (its residual belongs to one rank's whole bucket), else the flat
    one; ``common``: ``average``, ``all_reduce``, ``ledger``, ``async_op``, ``nonfinite``, ``kernels``."""
    if groups.intra is not None and error_feedback is None:
        return TwoLevelReduce(flat, layout, groups, transforms, intra=intra, pipeline=pipeline, **common)
    return QuantizedReduce(flat, layout, groups.group, transforms, error_feedback=error_feedback, topology=groups.topology, **common)
