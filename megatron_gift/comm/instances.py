"""A bucket's reduction followed by the FP32 all-reduce of this rank's shard across several
distributed-optimizer instances (Megatron's inter-instance all-reduce after the intra-instance
reduce-scatter), as further stages of the same reduction on the plugin's side streams.

Stages: the inner reduction's, its last one extended with the launch of the all-reduce (the
shard is final there), then one that waits for it and writes the sum back::

    total = fp32(shard)          on the last inner stage's stream, after the shard is written
    all_reduce(total, inter)     asynchronous; the next stage's stream waits for it
    shard ← total [÷ n]          n: the number of instances, when averaging

Every rank enqueues them in the order of its buckets (``comm.schedule``): the same order on the
intra- and inter-instance communicators everywhere; no host synchronisation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .ledger import CommLedger, ring_all_reduce_bytes
from .schedule import Reduction, StageResult, Wrapping, then


class AcrossInstances(Wrapping):
    """``inner`` (a reduction writing ``shard``), then ``shard`` summed over ``group`` (the ranks
    holding the same shard in the other instances) in FP32, averaged when ``average``."""

    def __init__(self, inner: Reduction, shard: torch.Tensor, group, average: bool, ledger: CommLedger):
        self.inner, self.shard, self.group, self.average, self.ledger = inner, shard, group, average, ledger

    def stages(self) -> list:
        stages = self.inner.stages()
        return [*stages[:-1], then(stages[-1], self._launch), self._write]

    def _launch(self, last: StageResult) -> StageResult:
        """After the inner's last stage (which leaves no collective in flight: the shard is final)."""
        total = self.shard.float()  # the shard itself when the buffer is FP32
        self.ledger.add("all_reduce", "fp32", ring_all_reduce_bytes(self.group.size(), total.numel() * 4))
        return StageResult(works=[dist.all_reduce(total, group=self.group, async_op=True)], total=total)

    def _write(self, prev: StageResult) -> StageResult:
        if self.average:
            prev.total.div_(self.group.size())
        if prev.total is not self.shard:
            self.shard.copy_(prev.total)
        return StageResult()
