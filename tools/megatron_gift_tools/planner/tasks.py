"""The planner's tasks (``Task``: a GPU stage or a collective, on its stream) and where a bucket is reduced
(``Context``: the ranks, the cluster, the kernel costs and the options, with the helpers that price one
stage). ``stages``, ``gather`` and ``refresh`` build their chains from these; ``simulate`` runs them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from megatron_gift_tools.planner import nccl
from megatron_gift_tools.planner.buckets import Bucket
from megatron_gift_tools.planner.cluster import Cluster
from megatron_gift_tools.planner.costs import KernelCosts
from megatron_gift_tools.planner.metered import ONE_PASS, StageCount
from megatron_gift_tools.planner.options import Options


class Kind(enum.Enum):
    GPU = "gpu"  # kernels that occupy the GPU (shared with the model's compute)
    COMM = "comm"  # a collective: occupies its links, not the GPU queue


@dataclass(frozen=True)
class Task:
    """One step of a bucket's chain: runs after the previous task of its chain and of its ``stream``."""

    label: str
    kind: Kind
    seconds: float
    stream: str
    resources: tuple[str, ...]
    stage: int
    nvlink_bytes: float = 0.0
    nic_bytes: float = 0.0
    launches: float = 0.0  # a GPU stage's kernel launches and HBM bytes moved (the meter's)
    hbm_bytes: float = 0.0


@dataclass(frozen=True)
class Context:
    """Where a bucket is reduced: ``g`` ranks per node on ``n`` nodes."""

    g: int
    n: int
    c: Cluster
    costs: KernelCosts
    opts: Options

    @property
    def p(self) -> int:
        return self.g * self.n

    @property
    def two_sided(self) -> bool:
        """Whether GIFT parameters have an output side (``Options.side`` both, or auto priced as both)."""
        return self.opts.side != "input"

    def count(self, b: Bucket, path: str, stage: str) -> StageCount:
        """The meter's launches and ratios of ``stage`` for bucket ``b`` (without a meter: one fused pass)."""
        m = self.costs.meter
        return (
            ONE_PASS
            if m is None
            else m.reduction(
                path,
                stage,
                self.p,
                b.elements,
                b.parameters,
                b.gift_parameters,
                self.two_sided,
                len({cols for _, cols in b.gift_shapes}) or 1,
            )
        )

    def gpu(
        self,
        label: str,
        stage: int,
        codec_bytes: float,
        transform_bytes: float = 0.0,
        stream: str = "",
        count: StageCount = ONE_PASS,
        gift_share: float = 0.0,
    ) -> Task:
        """A GPU stage of ``count.launches`` moving these essential HBM bytes times the meter's ratios (the GIFT
        ratio for the ``gift_share`` of the elementwise bytes and for the whitening's), on stage ``stage``'s
        stream unless ``stream`` is given."""
        codec = codec_bytes * (count.ratio * (1 - gift_share) + count.gift_ratio * gift_share)
        seconds = self.costs.seconds(count.launches, codec, count.gift_ratio * transform_bytes)
        return Task(
            label,
            Kind.GPU,
            seconds,
            stream or f"stage{stage}",
            ("gpu",),
            stage,
            launches=count.launches,
            hbm_bytes=codec + count.gift_ratio * transform_bytes,
        )

    def metered(
        self, b: Bucket, path: str, name: str, label: str, stage: int, codec_bytes: float, transform_bytes: float = 0.0
    ) -> Task:
        """The code's GPU stage ``name`` (the meter's, on its ``path``) of bucket ``b``: ``gpu`` at the meter's
        count."""
        return self.gpu(
            label,
            stage,
            codec_bytes,
            transform_bytes,
            count=self.count(b, path, name),
            gift_share=b.gift_elements / b.elements,
        )

    def links(self, p: int, g: int) -> tuple[str, ...]:
        return ("nvlink", "nic") if p > g else ("nvlink",)

    def ring(self, label: str, kind: str, nbytes: float, stream: str, stage: int) -> Task:
        """A ring collective over the whole group (NCCL's tuner: ring or, for all-reduce, tree)."""
        p, g = self.p, self.g
        t = (
            nccl.all_reduce_time(nbytes, p, g, self.c)
            if kind == "all_reduce"
            else nccl.ring_time(kind, nbytes, p, g, self.c)
        )
        total = (2 if kind == "all_reduce" else 1) * (p - 1) / p * nbytes
        nic = total / g if p > g else 0.0
        return Task(label, Kind.COMM, t, stream, self.links(p, g), stage, total - nic, nic)

    def cut_rows(self, stage: int, across_nodes: bool) -> Task:
        """The cut rows' neighbour exchange, on the data-parallel group's communicator (``dp``)."""
        return Task("cut rows", Kind.COMM, nccl.neighbour_exchange_time(across_nodes, self.c), "dp", (), stage)
