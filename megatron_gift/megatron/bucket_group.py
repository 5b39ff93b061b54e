"""The bucket-group collective: a Megatron bucket group whose gradient reduction sends FP8.

``GiftBucketGroup.start_grad_sync`` (which re-implements Megatron's) starts one quantized reduction
per bucket on the DDP's ``comm.schedule.ReductionQueue`` (``comm.QuantizedReduce``, or
``comm.hierarchical.TwoLevelReduce`` where the data-parallel group spans several nodes with several
ranks each) instead of NCCL's reduce-scatter / all-reduce: its stages run on the plugin's side
streams, in bucket order. That one override serves the overlapped backward-hook path, the
synchronous path and the first batch; ``finish_grad_sync`` waits on the returned
``_BucketGroupReduction`` (a device-side wait), also with several distributed-optimizer instances.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from ..comm.hierarchical import TwoLevelReduce
from ..comm.layout import BucketLayout
from ..comm.quantized import QuantizedReduce
from ..comm.topology import TwoLevelGroups
from ..config import Mode
from ..numerics.error_feedback import ErrorFeedback
from ..state import GiftParam

if TYPE_CHECKING:
    from .ddp import GiftDistributedDataParallel


def reduction_group(bg: _ParamAndGradBucketGroup) -> dist.ProcessGroup:
    """The group a bucket group's gradients are reduced over: the distributed-optimizer instance's
    group with the distributed optimizer, the data-parallel group otherwise."""
    if bg.ddp_config.use_distributed_optimizer:
        return bg.intra_distributed_optimizer_instance_group
    return bg.data_parallel_group


class GiftBucketGroup(_ParamAndGradBucketGroup):
    """A Megatron bucket group whose gradient reduction is quantized (see module doc)."""

    gift: "GiftDistributedDataParallel"  # the DDP that converted it: configuration, state, monitor, queue
    gift_layouts: list[BucketLayout]
    gift_params: list[list[GiftParam | None]]
    gift_error_feedback: list[ErrorFeedback | None]
    gift_groups: TwoLevelGroups

    def start_grad_sync(self, force_all_reduce: bool | None = False):
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return
        assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
        self._prepare_grads()
        self.gift.refresh_factors(self)
        use_rs = self.ddp_config.use_distributed_optimizer and not force_all_reduce
        group = reduction_group(self)
        refs = self.gift.monitor.before_reduce(self, group, self.gift.step)
        queue = self.gift.queue
        flights = [
            queue.start(self._reduction(bucket, layout, params, ef, all_reduce=not use_rs))
            for bucket, layout, params, ef in zip(self.buckets, self.gift_layouts, self.gift_params, self.gift_error_feedback)
        ]
        after = None
        if refs is not None:
            after = lambda: self.gift.monitor.after_reduce(self, group, refs, self.ddp_config.average_in_collective)  # noqa: E731
        inter = None
        if use_rs and self.ddp_config.num_distributed_optimizer_instances > 1:
            inter = self._all_reduce_across_instances
        handle = _BucketGroupReduction(queue, flights, after, inter)
        if self.ddp_config.overlap_grad_reduce:
            self.grad_reduce_handle = handle
        else:
            handle.wait()

    def _reduction(self, bucket, layout: BucketLayout, params, ef: ErrorFeedback | None, all_reduce: bool):
        """The two-level reduction where the group has its subgroups (several nodes of several
        ranks) and there is no error feedback (its residual belongs to one rank's whole bucket),
        else the flat one."""
        transforms = [p.whitening if p is not None and p.mode is Mode.GIFT else None for p in params]
        gift, groups = self.gift, self.gift_groups
        common = dict(average=self.ddp_config.average_in_collective, all_reduce=all_reduce, ledger=gift.ledger,
                      nonfinite=gift.nonfinite, kernels=gift.gift_config.kernels)  # fmt: skip
        if groups.intra is not None and ef is None:
            return TwoLevelReduce(bucket.grad_data, layout, groups, transforms, intra=gift.gift_config.intra_node, **common)
        return QuantizedReduce(bucket.grad_data, layout, groups.group, transforms, error_feedback=ef,
                               topology=groups.topology, **common)  # fmt: skip

    def finish_grad_sync(self, force_all_reduce: bool | None = False):
        """Megatron's, except that with several distributed-optimizer instances it waits on the
        plugin's handle (Megatron's waits on its communication stream, which the plugin does not use)."""
        if not (self.ddp_config.overlap_grad_reduce and self.ddp_config.num_distributed_optimizer_instances > 1):
            return super().finish_grad_sync(force_all_reduce=force_all_reduce)
        self.param_gather_dispatched = False
        if self.grad_reduce_finished:
            return
        if self.is_first_batch:
            self.start_grad_sync(force_all_reduce=force_all_reduce)
        self.grad_reduce_handle.wait()
        self.grad_reduce_handle = None
        self._copy_back_extra_main_grads()
        self.grad_reduce_finished = True

    def _all_reduce_across_instances(self) -> None:
        """Several distributed-optimizer instances: sum this rank's reduced shard of every bucket
        over the instances in FP32 (averaged with ``average_in_collective``), as Megatron's
        inter-instance all-reduce does after the intra-instance reduce-scatter."""
        group = self.inter_distributed_optimizer_instance_group
        n, r = group.size(), self.intra_distributed_optimizer_instance_rank
        for bucket in self.buckets:
            size = bucket.grad_data.numel() // self.intra_distributed_optimizer_instance_size
            shard = bucket.grad_data[r * size : (r + 1) * size]
            total = shard.float()  # the shard itself when the buffer is FP32
            dist.all_reduce(total, group=group)
            if self.ddp_config.average_in_collective:
                total /= n
            if total is not shard:
                shard.copy_(total)
            self.gift.ledger.add("all_reduce", "fp32", 2 * (n - 1) * total.numel() * 4 // n)

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
    makes the current stream wait (no host synchronisation), then ``inter()`` (the reduction
    across distributed-optimizer instances) and ``after()`` (telemetry) run, once."""

    def __init__(self, queue, flights, after=None, inter=None):
        self.queue, self.flights, self.after, self.inter = queue, flights, after, inter

    def wait(self):
        with torch.no_grad():
            for flight in self.flights:
                self.queue.wait(flight)
            if self.inter is not None:
                self.inter()
            if self.after is not None:
                self.after()
