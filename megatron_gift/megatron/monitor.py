"""Per-layer measurement inside the DDP's bucket reductions: profiles for ``--gift-layers auto``
and the telemetry records of ``--gift-log-interval``.

On a *profile step* (the policy's schedule, or a logging step) each bucket group, just before
its quantized reduction, profiles every plugin parameter's local gradient
(:func:`~megatron_gift.numerics.profile.profile_gradient`: round trips, saturation, geometry);
one MAX all-reduce (shared per-tensor scales) and one SUM all-reduce (the additive profiles)
over the reduction group give every rank the same summaries, so the policy's decisions are
identical everywhere. On a *logging step* it also keeps an FP32 copy of the buckets' local
gradients; once the reduction is done, an FP32 all-reduce of that copy is the reference for the
reduced gradient's RelL2 and cosine (on each rank's own shard, summed over ranks). Steps that
neither profile nor log cost nothing here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .._compat import reduce_scatter as _reduce_scatter
from ..comm.layout import wire_bytes
from ..config import GiftConfig, Mode
from ..numerics.geometry import even_spans
from ..numerics.profile import profile_gradient, summarize
from ..policy import LayerPolicy
from .bucket_group import output_side, sent_map


class Monitor:
    """Profiles, policy decisions and telemetry of one :class:`GiftDistributedDataParallel`.

    ``sink(step, record)`` receives each logging step's record (the schema of
    :mod:`megatron_gift.telemetry`); ``loss`` (a float or a 0-d tensor, read on logging steps only)
    may be set by the training loop before the step closes."""

    def __init__(self, cfg: GiftConfig, set_mode, verbose: bool):
        self.cfg = cfg
        self.set_mode = set_mode  # set_mode(GiftParam, Mode): switch a parameter and re-plan its bucket
        self.verbose = verbose  # print decisions (rank 0)
        self.policy = LayerPolicy(cfg.policy) if cfg.policy is not None else None
        self.sink = None
        self.loss: float | torch.Tensor | None = None
        self.summaries: dict[str, object] = {}
        self.reduced: dict[str, tuple[float | None, float | None]] = {}
        self.decisions: list[dict] = []

    def is_log_step(self, step: int) -> bool:
        return self.cfg.log_interval > 0 and step % self.cfg.log_interval == 0

    def is_profile_step(self, step: int) -> bool:
        return self.is_log_step(step) or (self.policy is not None and self.cfg.policy.is_profile_step(step))

    # -- before and after one bucket group's reduction ----------------------------------------
    def before_reduce(self, buckets, group, step: int):
        """Profile the parameters of one bucket group's ``buckets`` (``GiftBucket``), apply the policy's
        decisions; on logging steps return this rank's shard of every bucket's FP32 sum of local
        gradients, which :meth:`after_reduce` compares with."""
        if not self.is_profile_step(step):
            return None
        entries = [(b, seg, gp) for b in buckets for seg, gp in b.segments()]
        if not entries:
            return None
        grads = [b.local_grad(seg) for b, seg, _ in entries]
        amax = torch.stack([x.detach().abs().max().float() for x in grads])
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        vec = torch.stack(
            [
                # the map the gradient is sent through; two-sided: no geometry (its model is input-side)
                profile_gradient(
                    x, self.cfg.wire.codec, sent_map(gp), gp.input.factor if output_side(gp) is None else None, amax[k]
                )
                for k, (x, (_, _, gp)) in enumerate(zip(grads, entries))
            ]
        )
        dist.all_reduce(vec, group=group)
        decide = self.policy is not None and self.cfg.policy.is_profile_step(step)
        for (_, _, gp), v in zip(entries, vec.cpu()):  # the profile step's one host read of this bucket group
            summary = summarize(v)
            self.summaries[gp.name] = summary
            if decide and gp.candidate:
                d = self.policy.decide(gp.name, summary)
                if d.changed:
                    change = f"iteration {step + 1}: {gp.name}: {d.previous.value} -> {d.mode.value} ({d.reason})"
                    self.decisions.append(
                        {
                            "step": step + 1,
                            "param": gp.name,
                            "from": d.previous.value,
                            "to": d.mode.value,
                            "reason": d.reason,
                        }
                    )
                    if self.verbose:
                        print(f"megatron-gift: {change}", flush=True)
                    self.set_mode(gp, d.mode)
        if not self.is_log_step(step):
            return None
        return [self._reference_shard(b.grad, b.layout, group) for b in buckets]

    @staticmethod
    def _reference_shard(grad: torch.Tensor, layout, group) -> torch.Tensor:
        """This rank's shard ``[shard_size]`` of the FP32 sum of every rank's local ``grad`` (one
        reduce-scatter; a padded FP32 copy only where ``grad`` is not FP32 or not a whole number of shards)."""
        n, size = group.size(), layout.shard_size
        full = grad.detach()
        if full.dtype != torch.float32 or full.numel() != n * size:
            full = torch.zeros(n * size, dtype=torch.float32, device=grad.device)
            full[: grad.numel()].copy_(grad.detach())
        out = torch.empty(size, dtype=torch.float32, device=grad.device)
        _reduce_scatter(out, full, group=group)
        return out

    def after_reduce(self, buckets, group, refs, average: bool) -> None:
        """RelL2 and cosine of each reduced gradient against the FP32 sum, ``refs`` (this rank's shards of it)."""
        world, rank = group.size(), group.rank()
        rows, names = [], []
        for ref, bucket in zip(refs, buckets):
            if average:
                ref /= world
            shard = bucket.layout.shards[rank]
            for seg, gp in bucket.segments():
                a = max(seg.start, shard.lo)
                b = max(a, min(seg.end, shard.hi))
                row = torch.zeros(4, dtype=torch.float64, device=ref.device)
                for lo, hi in even_spans(a, b, COMPARE_BLOCKS):  # FP64 copies of a block at a time (some empty)
                    x = bucket.grad[lo:hi].to(torch.float64, copy=True)
                    y = ref[lo - shard.lo : hi - shard.lo].double()
                    ref_sq, dot, dec_sq = y.dot(y), x.dot(y), x.dot(x)  # FP64 sums, no product vectors
                    row += torch.stack([x.sub_(y).dot(x), ref_sq, dot, dec_sq])  # x's copy becomes x - y
                    del x, y  # before the next block's copies are made
                rows.append(row)
                names.append(gp.name)
        if not rows:
            return
        sums = torch.stack(rows)
        dist.all_reduce(sums, group=group)
        for name, (err, ref_sq, dot, dec_sq) in zip(
            names, sums.tolist()
        ):  # the logging step's host read of this bucket group
            rel = math.sqrt(err / ref_sq) if ref_sq > 0 else None
            cos = dot / math.sqrt(dec_sq * ref_sq) if dec_sq * ref_sq > 0 else None
            self.reduced[name] = (rel, cos)

    # -- the step's record -----------------------------------------------------------------
    def close(self, step: int, params, sent: dict[str, int]) -> dict | None:
        """The telemetry record of ``step`` if it logs (handed to ``sink``), else None. Records and
        decisions count iterations from 1, as Megatron's log does (``step`` counts from 0).

        ``params``: ``(GiftParam, Segment, bytes per element in the bucket)`` of every plugin
        parameter; ``sent``: the step's ``CommLedger.as_dict()``."""
        record = None
        if self.is_log_step(step):
            layers = {}
            for gp, seg, itemsize in params:
                s = self.summaries.get(gp.name)
                gift = gp.mode is Mode.GIFT and s is not None and s.gift_saturation is not None
                rel, cos = self.reduced.get(gp.name, (None, None))
                layers[gp.name] = {
                    "mode": gp.mode.value,
                    "rel_l2": rel,
                    "cos": cos,
                    "saturation": None if s is None else (s.gift_saturation if gift else s.saturation),
                    "underflow": None if s is None else (s.gift_underflow if gift else s.underflow),
                    "top_r_share": None if s is None else s.top_r_share,
                    "bytes": wire_bytes(gp.mode, seg.rows, seg.cols, self.cfg.wire.codec, itemsize),
                    "profile": s,
                }
            loss = None if self.loss is None else float(self.loss)
            record = {
                "step": step + 1,
                "loss": loss,
                "bytes": dict(sent),
                "layers": layers,
                "decisions": self.decisions,
            }
            if self.sink is not None:
                self.sink(step + 1, record)
        if record is not None or self.cfg.log_interval == 0:
            self.decisions = []
        self.summaries, self.reduced, self.loss = {}, {}, None
        return record


# A logging step compares a segment's part of the shard with the reference in this many blocks: FP64
# copies of both (16 B per element) of a quarter of it at a time, 4 B per element of the segment.
COMPARE_BLOCKS = 4
