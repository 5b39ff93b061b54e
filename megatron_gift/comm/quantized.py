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
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from ..numerics.error_feedback import ErrorFeedback
from ..numerics.fp8 import Encoded, decode_flat, encode_flat
from ..numerics.whitening import LowRankWhitening
from .layout import BucketLayout, ShardPlan


class CommLedger:
    """Bytes this rank sent, by ``(collective, dtype)``: all-to-all counts what leaves the rank,
    ring all-gather ``(R-1)·chunk``, ring reduce-scatter ``(R-1)/R·buffer``, ring all-reduce twice that."""

    def __init__(self):
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, collective: str, dtype: str, nbytes: int) -> None:
        self.bytes[(collective, dtype)] += int(nbytes)

    def total(self) -> int:
        return sum(self.bytes.values())

    def as_dict(self) -> dict[str, int]:
        return {f"{c}/{d}": n for (c, d), n in sorted(self.bytes.items())}

    def reset(self) -> None:
        self.bytes.clear()


# torch >= 2.10 renamed all_gather_into_tensor; NGC containers may carry either.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _gather_runs(flat: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    if len(runs) == 1:
        return flat[runs[0][0] : runs[0][1]]
    return torch.cat([flat[a:b] for a, b in runs]) if runs else flat.new_zeros(0)


def _rank_order_sum(t: torch.Tensor, world: int) -> torch.Tensor:
    """``Σ_i t[i]`` accumulated in FP32 in rank order (the same order on every rank)."""
    acc = t[0].clone()
    for i in range(1, world):
        acc += t[i]
    return acc


def _scatter_runs(flat: torch.Tensor, runs: list[tuple[int, int]], values: torch.Tensor) -> None:
    pos = 0
    for a, b in runs:
        flat[a:b].copy_(values[pos : pos + b - a])
        pos += b - a


class _Codec:
    """Packs and unpacks shard messages ``[scales | off | bf16 | payload]`` for one layout."""

    def __init__(self, layout: BucketLayout):
        self.layout = layout
        self.cfg = layout.codec

    def plains(self, flat: torch.Tensor, plan: ShardPlan) -> list[torch.Tensor]:
        """This shard's plain values from ``flat``, each class in its wire dtype."""
        return [_gather_runs(flat, runs).to(dt) for runs, dt in zip(plan.plain_runs, self.layout.plain_dtypes)]

    def pack(self, plan: ShardPlan, enc: Encoded, plains: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(plan.message_bytes, dtype=torch.uint8, device=enc.payload.device)
        off = 0
        for section, size in zip([enc.scales, *plains], [plan.scale_bytes, *plan.plain_bytes]):
            b = _bytes(section)
            out[off : off + b.numel()] = b
            off += size
        out[off : off + enc.payload.numel()] = enc.payload
        return out

    def unpack(self, plan: ShardPlan, msgs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``msgs [k, ≥ message_bytes]`` → decoded coded values ``[k, n_coded]`` and each plain
        class ``[k, n]``, all FP32."""
        n_groups, n_coded = plan.g_hi - plan.g_lo, plan.c_hi - plan.c_lo
        lengths = self.layout.group_lengths_on(msgs.device)[plan.g_lo : plan.g_hi]
        scale_dtype = self.cfg.scale_dtype()
        payload_at = plan.scale_bytes + sum(plan.plain_bytes)
        coded = torch.stack(
            [
                decode_flat(Encoded(m[payload_at : payload_at + n_coded], m[: n_groups * scale_dtype.itemsize].view(scale_dtype)), lengths, self.cfg)
                for m in msgs
            ]
        )
        plains, off = [], plan.scale_bytes
        for runs, dt, size in zip(plan.plain_runs, self.layout.plain_dtypes, plan.plain_bytes):
            n = sum(b - a for a, b in runs)
            plains.append(msgs[:, off : off + n * dt.itemsize].contiguous().view(dt).float())
            off += size
        return coded, plains

    def encode(self, plan: ShardPlan, coded: torch.Tensor) -> Encoded:
        """Encode this shard's coded values (``[n_coded]``, in the shard's group layout)."""
        lengths = self.layout.group_lengths_on(coded.device)[plan.g_lo : plan.g_hi]
        return encode_flat(coded, lengths, self.cfg)


class QuantizedReduce:
    """One bucket's quantized reduction in flight; ``wait()`` completes it in place in ``flat``.

    ``nonfinite`` (a bool tensor), when given, is set if the reduced shard holds NaN/Inf."""

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
    ):
        self.flat, self.layout, self.group = flat, layout, group
        self.transforms, self.average, self.all_reduce = transforms, average, all_reduce
        self.ledger = ledger if ledger is not None else CommLedger()
        self.nonfinite = nonfinite
        self.codec = _Codec(layout)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.world != layout.num_shards:
            raise ValueError(f"layout has {layout.num_shards} shards but the group has {self.world} ranks")
        coded = _gather_runs(flat, layout.coded_runs).float()  # aliases flat when FP32 and contiguous
        self._transform(coded, 0, whole_rows=[(i, 0, s.rows) for i, s in enumerate(layout.segments)], inverse=False)
        if error_feedback is not None:
            coded = error_feedback.compensate(coded)
        lengths = layout.group_lengths_on(flat.device)
        enc = encode_flat(coded, lengths, layout.codec)
        if error_feedback is not None:
            error_feedback.stage(coded, decode_flat(enc, lengths, layout.codec))
        send = []
        for plan in layout.shards:
            shard_enc = Encoded(enc.payload[plan.c_lo : plan.c_hi], enc.scales[plan.g_lo : plan.g_hi])
            send.append(self.codec.pack(plan, shard_enc, self.codec.plains(flat, plan)))
        mine = layout.shards[self.rank]
        self.recv = torch.empty(self.world * mine.message_bytes, dtype=torch.uint8, device=flat.device)
        in_splits = [m.numel() for m in send]
        self.ledger.add("all_to_all", "fp8+scales", sum(in_splits) - in_splits[self.rank])
        self.work = dist.all_to_all_single(
            self.recv,
            torch.cat(send),
            output_split_sizes=[mine.message_bytes] * self.world,
            input_split_sizes=in_splits,
            group=group,
            async_op=async_op,
        )

    def _transform(self, coded: torch.Tensor, base: int, whole_rows, inverse: bool) -> None:
        """Apply ``T`` (or ``T⁻¹``) in place to rows ``[r0, r1)`` of GIFT segments; ``coded`` starts
        at coded index ``base``."""
        for i, r0, r1 in whole_rows:
            t, s = self.transforms[i], self.layout.segments[i]
            if t is None:
                continue
            c = self.layout.coded_index(s.start + r0 * s.cols) - base
            view = coded[c : c + (r1 - r0) * s.cols].view(r1 - r0, s.cols)
            view.copy_(t.inverse(view) if inverse else t.apply(view))

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        plan = self.layout.shards[self.rank]
        coded, plains = self.codec.unpack(plan, self.recv.view(self.world, plan.message_bytes))
        sums = [_rank_order_sum(t, self.world) for t in (coded, *plains)]
        if self.average:
            for t in sums:
                t /= self.world
        if self.nonfinite is not None:  # device-side flag, no host sync
            for t in sums:
                self.nonfinite |= ~torch.isfinite(t).all()
        coded_sum, plain_sums = sums[0], sums[1:]
        if self.all_reduce:
            self._all_gather(plan, coded_sum, plain_sums)
            return
        self._transform(coded_sum, plan.c_lo, plan.gift_rows, inverse=True)
        self._unwhiten_pieces(plan, coded_sum)
        _scatter_runs(self.flat, plan.coded_runs, coded_sum)
        for runs, values in zip(plan.plain_runs, plain_sums):
            _scatter_runs(self.flat, runs, values)

    def _all_gather(self, plan: ShardPlan, coded_sum: torch.Tensor, plain_sums: list[torch.Tensor]) -> None:
        width = max(p.message_bytes for p in self.layout.shards)
        msg = torch.zeros(width, dtype=torch.uint8, device=self.flat.device)
        plains = [t.to(dt) for t, dt in zip(plain_sums, self.layout.plain_dtypes)]
        msg[: plan.message_bytes] = self.codec.pack(plan, self.codec.encode(plan, coded_sum), plains)
        gathered = torch.empty(self.world * width, dtype=torch.uint8, device=self.flat.device)
        self.ledger.add("all_gather", "fp8+scales", (self.world - 1) * width)
        _all_gather(gathered, msg, group=self.group)
        gathered = gathered.view(self.world, width)
        coded_all = torch.empty(self.layout.n_coded, device=self.flat.device)
        for j, p in enumerate(self.layout.shards):
            coded, plains = self.codec.unpack(p, gathered[j : j + 1])
            coded_all[p.c_lo : p.c_hi] = coded[0]
            for runs, values in zip(p.plain_runs, plains):
                _scatter_runs(self.flat, runs, values[0])
        self._transform(coded_all, 0, [(i, 0, s.rows) for i, s in enumerate(self.layout.segments)], inverse=True)
        _scatter_runs(self.flat, self.layout.coded_runs, coded_all)

    def _unwhiten_pieces(self, plan: ShardPlan, coded_sum: torch.Tensor) -> None:
        """Rows cut by shard boundaries: exchange each piece's partial ``U·Q`` (r floats) and
        finish ``T⁻¹`` with the whole row's sum (the same sum, in shard order, on every rank)."""
        segs, ts = self.layout.segments, self.transforms
        if not any(ts[q.seg] is not None for other in self.layout.shards for q in other.pieces):
            return
        r_max = max(t.rank for t in ts if t is not None)
        mine = torch.zeros(self.layout.max_pieces, r_max, device=self.flat.device)
        views = []
        for k, p in enumerate(plan.pieces):
            a, b = p.flat(segs[p.seg])
            c = self.layout.coded_index(a) - plan.c_lo
            views.append(coded_sum[c : c + b - a].view(1, -1))
            if ts[p.seg] is not None:
                mine[k, : ts[p.seg].rank] = ts[p.seg].projection(views[-1], slice(p.c0, p.c1))[0]
        every = torch.empty(self.world * mine.shape[0], r_max, device=self.flat.device)
        self.ledger.add("all_gather", "fp32", (self.world - 1) * mine.numel() * 4)
        _all_gather(every, mine, group=self.group)
        every = every.view(self.world, *mine.shape)
        for p, view in zip(plan.pieces, views):
            t = ts[p.seg]
            if t is None:
                continue
            proj = torch.zeros(1, t.rank, device=self.flat.device)
            for j, other in enumerate(self.layout.shards):
                for k, q in enumerate(other.pieces):
                    if (q.seg, q.row) == (p.seg, p.row):
                        proj += every[j, k, : t.rank]
            view.copy_(t.inverse_piece(view, proj, slice(p.c0, p.c1)))
