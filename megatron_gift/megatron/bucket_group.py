"""The bucket-group collective: a Megatron bucket group whose gradient reduction sends FP8.

``GiftBucketGroup.start_grad_sync`` (which re-implements Megatron's) launches
``comm.QuantizedReduce`` (or ``comm.hierarchical.TwoLevelReduce`` where the data-parallel group spans
several nodes with several ranks each) instead of NCCL's reduce-scatter / all-reduce. That one
override serves the overlapped backward-hook path, the synchronous path and the first batch, and
``finish_grad_sync`` (Megatron's) waits on the returned ``_BucketGroupReduction``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from ..comm.hierarchical import start_reduction
from ..comm.layout import BucketLayout
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

    gift: "GiftDistributedDataParallel"  # the DDP that converted it: configuration, state, monitor
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
        # as Megatron: with several instances finish_grad_sync waits on a stream, not on a handle
        async_op = self.ddp_config.overlap_grad_reduce and self.ddp_config.num_distributed_optimizer_instances == 1
        handles = []
        for bucket, layout, params, ef in zip(self.buckets, self.gift_layouts, self.gift_params, self.gift_error_feedback):
            transforms = [p.whitening if p is not None and p.mode is Mode.GIFT else None for p in params]
            handles.append(
                start_reduction(
                    bucket.grad_data,
                    layout,
                    self.gift_groups,
                    transforms,
                    self.gift.gift_config.intra_node,
                    ef,
                    self.gift.pipeline,
                    average=self.ddp_config.average_in_collective,
                    all_reduce=not use_rs,
                    ledger=self.gift.ledger,
                    async_op=async_op,
                    nonfinite=self.gift.nonfinite,
                    kernels=self.gift.gift_config.kernels,
                )
            )
        after = None
        if refs is not None:
            after = lambda: self.gift.monitor.after_reduce(self, group, refs, self.ddp_config.average_in_collective)  # noqa: E731
        inter = None
        if use_rs and self.ddp_config.num_distributed_optimizer_instances > 1:
            inter = self._all_reduce_across_instances
        handle = _BucketGroupReduction(handles, after, inter)
        if async_op:
            self.grad_reduce_handle = handle
        else:
            handle.wait()

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
    """The bucket group's reductions; then ``inter()`` (the reduction across distributed-optimizer
    instances) and ``after()`` run, once."""

    def __init__(self, handles, after=None, inter=None):
        self.handles, self.after, self.inter = handles, after, inter

    def wait(self):
        with torch.no_grad():
            for h in self.handles:
                h.wait()
            if self.inter is not None:
                self.inter()
            if self.after is not None:
                self.after()
