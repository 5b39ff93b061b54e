"""The bucket-group collective: a Megatron bucket group whose gradient reduction sends FP8.

A converted bucket group holds one ``GiftBucket`` per Megatron bucket (its layout, the plugin
parameter of each segment, its error-feedback residual) and the ``ReductionContext`` the DDP hands
it (configuration, state, monitor, queue, the refresh's hook): it never reads the DDP itself.

``GiftBucketGroup.start_grad_sync`` (which re-implements Megatron's) starts one quantized reduction
per bucket on the DDP's ``comm.schedule.ReductionQueue`` (``comm.QuantizedReduce``, or
``comm.hierarchical.TwoLevelReduce`` where the data-parallel group spans several nodes with several
ranks each) instead of NCCL's reduce-scatter / all-reduce, wrapped in ``comm.output_side.OutputSide``
where a GIFT parameter has an output side (``--gift-side both`` / ``auto``: ``T_outᵀ G T_in`` sent):
its stages run on the plugin's side streams, in bucket order. That one override serves the overlapped
backward-hook path, the synchronous path and the first batch; ``finish_grad_sync`` waits on the
returned ``_BucketGroupReduction`` (a device-side wait). With several distributed-optimizer instances
each bucket's reduction ends with the FP32 all-reduce of its shard across the instances
(``comm.instances``), and ``finish_grad_sync`` keeps Megatron's contract for that case in every
state of the group (``GiftBucketGroup.finish_grad_sync``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from ..comm.fp4_reduce import FP4Reduce, FP4TwoLevelReduce, exchange_rotation
from ..comm.hierarchical import TwoLevelReduce
from ..comm.instances import AcrossInstances
from ..comm.layout import BucketLayout, Segment
from ..comm.output_side import OutputSide
from ..comm.quantized import QuantizedReduce
from ..comm.rounds import Round, plan
from ..comm.schedule import ReductionQueue
from ..comm.sum_first import FP4SumFirstReduce
from ..comm.topology import TwoLevelGroups
from ..config import GiftConfig, IntraNode, Mode, Rotation
from ..numerics import two_sided
from ..numerics.error_feedback import ErrorFeedback
from ..numerics.fp4 import FP4_FORMATS
from ..numerics.whitening import LowRankWhitening
from ..state import GiftParam, GiftState

if TYPE_CHECKING:
    from .monitor import Monitor

logger = logging.getLogger(__name__)


def output_side(gp: GiftParam) -> LowRankWhitening | None:
    """``gp``'s ``T_out`` in use (``--gift-side both`` / ``auto``), None where it has none or only a
    diagonal one (rank 0: it scales whole rows, which the codec's row and block scales already do)."""
    w = gp.output.whitening if gp.output is not None else None
    return w if w is not None and w.rank > 0 else None


def sent_map(gp: GiftParam):
    """The map a GIFT parameter's gradient is sent through: ``T_in`` (None: no ``T`` yet), or with an
    output side ``TwoSidedWhitening`` (``U = T_outᵀ G T_in``)."""
    return two_sided.sent_map(gp.input.whitening, output_side(gp))


def reduction_group(bg: _ParamAndGradBucketGroup) -> dist.ProcessGroup:
    """The group a bucket group's gradients are reduced over: the distributed-optimizer instance's
    group with the distributed optimizer, the data-parallel group otherwise."""
    if bg.ddp_config.use_distributed_optimizer:
        return bg.intra_distributed_optimizer_instance_group
    return bg.data_parallel_group


@dataclass
class GiftBucket:
    """One Megatron bucket as the plugin reduces it: ``layout`` (its segments in buffer order),
    ``params`` (the ``GiftParam`` of each segment, None where the plugin leaves a parameter off) and
    ``error_feedback`` (its residual, None without ``--gift-error-feedback``). A mode switch
    (``GiftDistributedDataParallel.set_mode``) replaces the layout and the residual."""

    bucket: object  # Megatron's _ParamAndGradBucket
    layout: BucketLayout
    params: list[GiftParam | None]
    error_feedback: ErrorFeedback | None
    # all_reduce -> (the layout split, the whole reduction's type, the sub-buckets or None): ``_reductions``
    rounds: dict = field(default_factory=dict)

    @property
    def grad(self) -> torch.Tensor:
        """The bucket's gradient buffer (flat)."""
        return self.bucket.grad_data

    def segments(self) -> Iterator[tuple[Segment, GiftParam]]:
        """``(Segment, GiftParam)`` of the bucket's plugin parameters, in buffer order."""
        return ((seg, p) for seg, p in zip(self.layout.segments, self.params) if p is not None)

    def local_grad(self, seg: Segment) -> torch.Tensor:
        """``seg``'s gradient in the buffer as ``[rows, cols]`` (a view)."""
        return self.grad[seg.start : seg.end].view(seg.rows, seg.cols)


@dataclass(frozen=True)
class ReductionContext:
    """What a converted bucket group reads from the plugin, handed to it once at conversion: the
    configuration, the per-rank state (step, byte ledger, non-finite flag), the monitor, the queue
    its reductions run on, and ``at_sync(bucket group)``: the refresh's hook before each reduction."""

    config: GiftConfig
    state: GiftState
    monitor: Monitor
    queue: ReductionQueue
    at_sync: Callable[[GiftBucketGroup], None]


class GiftBucketGroup(_ParamAndGradBucketGroup):
    """A Megatron bucket group whose gradient reduction is quantized (see module doc)."""

    gift_context: ReductionContext
    gift_buckets: list[GiftBucket]  # one per bucket, in ``buckets`` order
    gift_groups: TwoLevelGroups

    def start_grad_sync(self, force_all_reduce: bool | None = False):
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return
        assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
        self._prepare_grads()
        ctx = self.gift_context
        ctx.at_sync(self)
        use_rs = self.ddp_config.use_distributed_optimizer and not force_all_reduce
        group = reduction_group(self)
        refs = ctx.monitor.before_reduce(self.gift_buckets, group, ctx.state.step)
        flights = [
            ctx.queue.start(reduction)
            for b in self.gift_buckets
            for reduction in self._reductions(b, all_reduce=not use_rs)
        ]
        after = None
        if refs is not None:
            after = lambda: ctx.monitor.after_reduce(
                self.gift_buckets, group, refs, self.ddp_config.average_in_collective
            )  # noqa: E731
        handle = _BucketGroupReduction(ctx.queue, flights, after)
        # a group started after this iteration's finish_grad_sync (several instances: Megatron's
        # returns before the group starts) has nothing left to wait for it: it completes now
        if self.ddp_config.overlap_grad_reduce and not self.grad_reduce_finished:
            self.grad_reduce_handle = handle
        else:
            handle.wait()

    def footprints(self) -> list[int]:
        """The arena bytes each reduction takes (``comm.schedule.Reduction.footprint``; a bucket's rounds
        one by one), as a step without ``force_all_reduce`` builds them: what the DDP sizes its arena by."""
        all_reduce = not self.ddp_config.use_distributed_optimizer
        return [r.footprint() or 0 for b in self.gift_buckets for r in self._reductions(b, all_reduce)]

    def _reductions(self, b: GiftBucket, all_reduce: bool) -> list:
        """The bucket's reduction; where its message buffers exceed a stated ``--gift-inflight-mb``, its
        sub-buckets' (``comm.rounds``), each within half the bound (one exchange in flight while the next is
        encoded), planned once per layout and kind of reduction, error feedback reading the bucket's residual
        where each round's values lie; with several distributed-optimizer instances the last one followed by
        the shard's all-reduce across them. Not split (the arena warns that it runs outside it): with an
        output side, the sum-first exchange (Megatron's equal shards), or a shard inside one row."""
        whole = self._reduction(b, all_reduce)
        arena = self.gift_context.queue.arena
        out = [whole]
        if arena is not None and arena.fixed and (whole.footprint() or 0) > arena.nbytes:
            planned = b.rounds.get(all_reduce)
            if planned is None or planned[0] is not b.layout or planned[1] is not type(whole):  # an output side since?
                b.rounds[all_reduce] = planned = (
                    b.layout,
                    type(whole),
                    self._split(b, all_reduce, whole, arena.nbytes),
                )
            if planned[2] is not None:
                out = [self._reduction(b, all_reduce, r) for r in planned[2]]
        # several instances: the own shard's all-reduce across them after the last round (each round's last
        # stage on the same stream, in start order: the shard is whole there)
        out[-1] = self._across_instances(out[-1], b)
        return out

    def _split(self, b: GiftBucket, all_reduce: bool, whole, nbytes: int) -> list[Round] | None:
        """``b``'s rounds (``comm.rounds.plan``), or None, warned with the reason, where the bucket cannot be
        split (``_reductions``)."""
        why = (
            "an output side (--gift-side both / auto)"
            if isinstance(whole, OutputSide)
            else "the sum-first exchange (--gift-intra-node reduce-scatter: Megatron's equal shards)"
            if isinstance(whole, FP4SumFirstReduce)
            else None
        )
        if why is None:
            rounds, worst = plan(
                b.layout, lambda r: self._reduction(b, all_reduce, r).footprint() or 0, whole.footprint(), nbytes
            )
            if rounds is None:
                why = (
                    "a shard lying inside one row"
                    if worst is None
                    else f"rounds of rows needing {worst / 2**20:.1f} MiB"
                )
        if why is not None:
            logger.warning("megatron-gift: a bucket over --gift-inflight-mb is not split into sub-buckets: %s", why)
            return None
        logger.info(
            "megatron-gift: a bucket's message buffers (%.1f MiB) exceed --gift-inflight-mb %d: reduced in %d "
            "sub-buckets of at most %.1f MiB",
            whole.footprint() / 2**20,
            nbytes >> 20,
            len(rounds),
            worst / 2**20,
        )
        return rounds

    def _reduction(self, b: GiftBucket, all_reduce: bool, part: Round | None = None):
        """The two-level reduction where the group has its subgroups (several nodes of several
        ranks) and there is no error feedback (its residual belongs to one rank's whole bucket),
        else the flat one (their FP4 variants with four bits between nodes: ``comm.fp4_reduce``); wrapped in
        ``comm.output_side.OutputSide`` where a parameter has an
        output side (``--gift-side both`` / ``auto``). ``part``: one round of the bucket (``comm.rounds``)."""
        layout = b.layout if part is None else part.layout
        params = b.params if part is None else part.per_segment(b.params)
        feedback = (
            b.error_feedback if part is None or b.error_feedback is None else part.feedback(b.error_feedback, b.layout)
        )
        transforms = [p.input.whitening if p is not None and p.mode is Mode.GIFT else None for p in params]
        ctx, groups = self.gift_context, self.gift_groups
        common = dict(
            average=self.ddp_config.average_in_collective,
            all_reduce=all_reduce,
            ledger=ctx.state.ledger,
            nonfinite=ctx.state.nonfinite,
            kernels=ctx.config.exchange.kernels,
        )
        fp4 = ctx.config.wire.inter_node_format
        if fp4.block is not None:  # four bits between nodes (input side only)
            fmt, cfg = FP4_FORMATS[fp4.value], ctx.config
            common["rotation"] = exchange_rotation(cfg.wire.rotation, cfg.wire.rotation_seed)
            if cfg.wire.rotation is Rotation.AUTO:  # the GIFT layers whose last refresh chose the rotation
                common["rotated"] = tuple(p is not None and p.mode is Mode.GIFT and p.input.rotate for p in params)
            two_level = groups.intra is not None and b.error_feedback is None
            if two_level and cfg.exchange.intra_node is IntraNode.REDUCE_SCATTER:
                return FP4SumFirstReduce(b.grad, layout, groups, transforms, fmt, **common)
            if two_level:
                return FP4TwoLevelReduce(b.grad, layout, groups, transforms, fmt, cfg.exchange.intra_node, **common)
            return FP4Reduce(
                b.grad,
                layout,
                groups.group,
                transforms,
                fmt,
                topology=groups.topology,
                error_feedback=feedback,
                **common,
            )
        if groups.intra is not None and b.error_feedback is None:
            inner = TwoLevelReduce(b.grad, layout, groups, transforms, intra=ctx.config.exchange.intra_node, **common)
        else:
            inner = QuantizedReduce(
                b.grad,
                layout,
                groups.group,
                transforms,
                error_feedback=feedback,
                topology=groups.topology,
                **common,
            )
        outputs = [output_side(p) if p is not None and p.mode is Mode.GIFT else None for p in params]
        if any(w is not None for w in outputs):
            return OutputSide(inner, outputs, ctx.state.ledger)
        return inner

    def finish_grad_sync(self, force_all_reduce: bool | None = False):
        """Megatron's. With several distributed-optimizer instances and ``overlap_grad_reduce``
        Megatron's only makes the current stream wait for its communication stream, in whatever
        state the group is: not started (no assertion, unlike one instance), started, finished
        (a no-op). Here the current stream waits for the group's reductions where they were
        started; a group started after this returned completes in ``start_grad_sync``."""
        if not (self.ddp_config.overlap_grad_reduce and self.ddp_config.num_distributed_optimizer_instances > 1):
            return super().finish_grad_sync(force_all_reduce=force_all_reduce)
        self.param_gather_dispatched = False
        if self.grad_reduce_finished:
            return
        if self.is_first_batch:
            self.start_grad_sync(force_all_reduce=force_all_reduce)
        if self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
        self._copy_back_extra_main_grads()
        self.grad_reduce_finished = True

    def _across_instances(self, reduction, b: GiftBucket):
        """Several distributed-optimizer instances: ``reduction`` followed by the FP32 all-reduce of this
        rank's shard of the bucket over the instances (averaged with ``average_in_collective``), as
        Megatron's after its intra-instance collective (the reduce-scatter, or a forced all-reduce)."""
        if not (self.ddp_config.use_distributed_optimizer and self.ddp_config.num_distributed_optimizer_instances > 1):
            return reduction
        size = b.grad.numel() // self.intra_distributed_optimizer_instance_size
        r = self.intra_distributed_optimizer_instance_rank
        return AcrossInstances(
            reduction,
            b.grad[r * size : (r + 1) * size],
            self.inter_distributed_optimizer_instance_group,
            self.ddp_config.average_in_collective,
            self.gift_context.state.ledger,
        )

    def _prepare_grads(self) -> None:
        """Megatron's pre-collective steps: extra main-grad copies, NaN check, gradient scaling."""
        for bucket in self.buckets:
            for param in bucket.params_with_extra_main_grads:
                if getattr(param, "main_grad_copy_in_grad_buffer", None) is not None:
                    param.main_grad_copy_in_grad_buffer.copy_(param.main_grad)
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self.check_grads(
                check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
                check_for_large=self.ddp_config.check_for_large_grads,
            )
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor


class _BucketGroupReduction:
    """The bucket group's reductions in the queue; ``wait`` enqueues what is left of them and
    makes the current stream wait (no host synchronisation), then ``after()`` (telemetry) runs, once."""

    def __init__(self, queue, flights, after=None):
        self.queue, self.flights, self.after = queue, flights, after

    def wait(self):
        with torch.no_grad():
            for flight in self.flights:
                self.queue.wait(flight)
            if self.after is not None:
                self.after()
