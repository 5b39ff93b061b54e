"""``--gift-param-gather delta``: Megatron's bucket groups all-gather the coded change of each
parameter shard (``comm.param_delta``) instead of the shard itself.

``enable_delta_param_gather(ddp)`` turns every bucket group of the DDP (Megatron's own and the
plugin's ``GiftBucketGroup``) that has a 16-bit parameter buffer and a distributed-optimizer group
of several ranks into a subclass with :class:`DeltaParamSync` in front. ``start_param_sync``
keeps Megatron's control flow (the distributed-optimizer path: synchronous, or asynchronous under
``--overlap-param-gather`` with the handle Megatron's ``finish_param_sync`` waits on); Megatron's
forward pre-hooks and its ``next_param_gather_bucket_group`` chain stay as they are. The handle's
``wait()`` enqueues the decode on a side stream behind the collective (on CUDA) and returns, so
the next bucket group's gather, which Megatron dispatches right after it, overlaps this decode;
``finish_param_sync`` then makes the compute stream wait for the decode's event. ``finish_grad_sync``
notes which iteration's update the next gather carries and, every ``--log-interval`` iterations,
compares a checksum of the replicas over the group (the only host synchronisation, on those
steps only): a difference is warned about and the group's next update is gathered in full;
``reset`` (at ``zero_grad_buffer``) does the first full gather.

Full gathers (every shard as the optimizer wrote it, 2 bytes per element) wherever the replicas
cannot be known to agree:

* at the first ``zero_grad_buffer()`` of the process (a fresh run, a resume, a resume with
  another data-parallel size) and the first after a checkpoint load
  (``GiftDistributedDataParallel.restart_param_gather``), before the next optimizer update: every
  replica then holds its owners' shards as initialized or loaded, and ``prev`` is set from them.
  A checkpoint holds the reconstructed weights every replica had, so a resumed run continues bit
  for bit;
* the update of every iteration ``i`` with ``i % --gift-param-gather-full-every == 0``
  (optional). The iteration is the one whose gradients the update used, so the decision is the
  same with ``--overlap-param-gather`` (gathered in the next forward) and without (in the step).

Megatron changes the parameters outside the optimizer only at start-up (initialization,
``broadcast_params``, checkpoint loading), all before that first full gather. A skipped step
(``found_inf``) writes nothing: the next gather sends a zero change. A NaN or Inf in a change
reaches every replica as NaN over its block of 32; the next gather codes those elements against
0 (``comm.param_delta``: repair by construction).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..comm.param_delta import CODED_DTYPES, DeltaGather
from ..comm.schedule import StageStreams

logger = logging.getLogger(__name__)


def refuse_delta_param_gather(ddp_config) -> None:
    """``ValueError`` naming the flag when the DDP's configuration cannot take the delta gather."""
    flag = "--gift-param-gather delta"
    if not ddp_config.use_distributed_optimizer:
        raise ValueError(
            f"{flag} codes the distributed optimizer's parameter all-gather: add --use-distributed-optimizer "
            "(use_distributed_optimizer=True) or use --gift-param-gather bf16"
        )
    for field, what in (
        ("fp8_param_gather", "--fp8-param-gather"),
        ("fp4_param_gather", "--fp4-param-gather"),
        ("reuse_grad_buf_for_mxfp8_param_ag", "--reuse-grad-buf-for-mxfp8-param-ag"),
        ("use_megatron_fsdp", "--use-megatron-fsdp"),
    ):
        if getattr(ddp_config, field, False):
            raise ValueError(
                f"{flag} replaces the same parameter all-gather as {what} ({field}=True): drop one of them"
            )


class DeltaParamSync:
    """Put in front of a Megatron bucket-group class: ``start_param_sync`` sends coded changes (module doc)."""

    delta: DeltaGather
    delta_full_every: int
    delta_iteration: Callable[[], int]  # the DDP's current iteration index
    delta_update: int | None  # iteration whose optimizer update the next gather carries, once its gradients are reduced

    delta_check_every: int  # iterations between replica checks (0: none)
    delta_force_full: bool  # the replica check found a difference: gather the next update in full

    def reset(self):
        super().reset()
        if self.delta.prev is None and self.param_gather_handle is None:
            self.start_param_sync(force_sync=True)

    def finish_grad_sync(self, *args, **kwargs):
        super().finish_grad_sync(*args, **kwargs)
        self.delta_update = step = self.delta_iteration()
        every = self.delta_check_every
        if every and step % every == 0 and self.delta.prev is not None and self.delta.replicas_differ():
            logger.warning(
                "megatron-gift: the parameter replicas of a bucket group differ (checksums over its "
                "data-parallel group, iteration %d): its next update is gathered in full",
                step,
            )
            self.delta_force_full = True

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False):
        """Megatron's (its handle's ``wait()`` enqueues the decode, then it dispatches the next group's
        gather), then the current stream waits for the decode's event."""
        super().finish_param_sync(skip_next_bucket_dispatch)
        self.delta.ready()

    def start_param_sync(self, force_sync: bool = False):
        """Megatron's control flow (distributed-optimizer path) around ``DeltaGather.start``."""
        if force_sync and self.param_gather_handle is not None:  # wait on (and decode) the gather in flight
            self.delta.ready()
            self.param_gather_handle = None
            self._post_param_sync()
            return
        assert self.param_gather_handle is None
        update, self.delta_update = self.delta_update, None
        every = self.delta_full_every
        full = (
            self.delta.prev is None
            or self.delta_force_full
            or bool(every and update is not None and update % every == 0)
        )
        self.delta_force_full = False
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        handle = self.delta.start(async_op, full=full)
        if not async_op:
            self.delta.ready()
        self.param_gather_handle = handle if async_op else None
        if force_sync and self.ddp_config.overlap_param_gather:
            self._post_param_sync()
        self.param_gather_dispatched = True


_CLASSES: dict[type, type] = {}


def _delta_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Delta{cls.__name__.lstrip('_')}", (DeltaParamSync, cls), {"__module__": __name__})
    return _CLASSES[cls]


def enable_delta_param_gather(
    ddp, full_every: int, ledger=None, check_every: int = 0, kernels: bool | None = None
) -> int:
    """Convert ``ddp``'s bucket groups (see the module doc); returns how many were converted.

    Groups of one rank send nothing (Megatron's gather is a copy there) and keep it, as do groups
    without 16-bit parameters; an FP32 bucket in a converted group is the optimizer's own main
    parameters (a reconstruction would overwrite them): it is gathered as it is, in the same
    launch. ``check_every``: iterations between replica checks (0: none); ``kernels``: the fused
    codec's setting (``GiftConfig.exchange.kernels``). The decodes of all groups run on one stream. The
    caller refuses what cannot work first (``refuse_delta_param_gather``)."""
    converted, kept = 0, 0
    streams = None
    for bg in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        group = bg.intra_distributed_optimizer_instance_group
        if group.size() == 1 or not any(b.param_data.dtype in CODED_DTYPES for b in bg.buckets):
            kept += 1
            continue
        buffers = [b.param_data for b in bg.buckets]
        streams = streams or StageStreams(buffers[0].device)
        bg.delta = DeltaGather(buffers, group, ledger, streams, kernels)
        bg.delta_full_every, bg.delta_update, bg.delta_check_every, bg.delta_force_full = (
            full_every,
            None,
            check_every,
            False,
        )
        bg.delta_iteration = lambda: ddp.step
        bg.__class__ = _delta_class(type(bg))
        converted += 1
    if kept:
        logger.info(
            "megatron-gift: %d bucket group(s) keep Megatron's parameter all-gather (one rank, or no 16-bit "
            "parameters)",
            kept,
        )
    return converted
