"""Each bucket's work as the plugin's execution model runs it (docs/planner.md "The model"): an
ordered chain of GPU stages and collectives, each on its stream.

Per bucket of ``N`` elements (``F`` wire bytes, ``N_g`` of them GIFT's, ``I`` in the intra-node
dtype), ``p = g·n`` ranks, shard ``S = N/p``. Each GPU stage is one of the meter's
(``metered``: its launches and moved over essential bytes come from the meter's JSON); its
essential HBM bytes, one fused pass (the meter's definitions, ``bench.launches``):

=================================  ============================  ==============================
stage (meter's name)               elementwise (codec bw)        GIFT (transform bandwidth)
=================================  ============================  ==============================
flat encode (send)                 read 4N, write F              read 4N_g (``G Q``)
flat decode-sum (reduce)           read F (p messages of S),     8 N_g/p (``T⁻¹``)
                                   write 4S
2-level cast/encode (intra)        read 4N, write I              4N_g (``G T`` at the sender)
2-level node sums + encode         read I (g messages of N/g),
(node_sums)                        write F/g (its FP8 messages)
2-level decode-sum (reduce)        read F/g (n messages of S),   8 N_g/p
                                   write 4S
cut rows (finish)                  launches only
all-reduce decode-sum + re-encode  read F (F/g two-level),
(gather, gather_inter)             write F/p
all-reduce decode (decode_all)     read F, write 4N              8 N_g
=================================  ============================  ==============================

All-to-alls skip the rank itself. GIFT rows cut by a shard boundary cost one neighbour exchange
(one LL latency) per bucket, on the data-parallel group's own communicator (``comm/pieces.py``):
with the flat exchange that is the all-to-all's, so it queues in line with the buckets' all-to-alls.

Two-sided GIFT (``Options.side`` both, and auto priced as both: every GIFT layer two-sided, the
upper bound; ``comm/output_side.py``): the stages above at the meter's ``gift+out`` counts
(``T_outᵀ`` in the sender's encode, ``W`` into FP32 targets, ``P``'s partials after the last
stage), then with the distributed optimizer an FP32 ring all-reduce of ``P = Q_outᵀ W``,
``4·r_out·d_in`` bytes per two-sided parameter (``factor_rank``), on the data-parallel group's
communicator (the ledger's ``all_reduce/fp32-out``; all-reduce: no collective, every rank has all
of ``W``), and the ``output`` stage ``G = D^{1/2} (W + Q (c' ⊙ P))`` on the rank's two-sided
elements ``E`` (``N_g/p``; all-reduce ``N_g``): essential read ``4E`` (``W``), write ``4E``, at the
GIFT ratio. With the distributed optimizer ``P``'s partials run in the cut rows' stage (``finish``):
their launches are priced, their bytes (a read of the shard's ``W``, ``4E``) are not, as that
stage has no essential bytes; without it they run in the decode of the bucket, whose ratio has them.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass

from megatron_gift.config import Mode
from megatron_gift.numerics.kfac import KFACStatistics
from megatron_gift.numerics.refresh import RecordLayout
from megatron_gift_tools.planner import nccl
from megatron_gift_tools.planner.buckets import Bucket
from megatron_gift_tools.planner.cluster import Cluster
from megatron_gift_tools.planner.costs import KernelCosts
from megatron_gift_tools.planner.metered import ONE_PASS, StageCount
from megatron_gift_tools.planner.options import Options
from megatron_gift_tools.planner.schemes import Scheme


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
            else m.reduction(path, stage, self.p, b.elements, b.parameters, b.gift_parameters, self.two_sided)
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


def reduction_chain(b: Bucket, scheme: Scheme, x: Context) -> list[Task]:
    """The gradient reduction of one bucket: reduce-scatter with the distributed optimizer, else all-reduce."""
    if x.p == 1:  # nothing to communicate, nothing to quantize (the plugin leaves the gradient to Megatron)
        return []
    dist_opt = x.opts.schedule.value == "overlap"
    if scheme.mode is Mode.OFF:
        kind = "reduce_scatter" if dist_opt else "all_reduce"
        return [x.ring(kind.replace("_", "-"), kind, b.wire_bytes, "dp", 1)]
    if scheme.two_level and x.g > 1 and x.n > 1:
        return _two_level(b, x, dist_opt)
    return _flat(b, x, dist_opt)


def _finish(b: Bucket, x: Context, path: str, stage: int, across_nodes: bool) -> list[Task]:
    """The cut rows of GIFT parameters: their neighbour exchange and the stage's launches (the meter's ``finish``)."""
    if not b.gift_elements:
        return []
    count = x.count(b, path, "finish")
    sums = [x.gpu("cut-row sums", stage, 0.0, count=count)] if count.launches else []
    return [x.cut_rows(stage, across_nodes), *sums]


def factor_rank(d: int, opts: Options) -> int:
    """The rank of one side's factor of size ``d`` (``KFACStatistics.factor_rank``): the configured rank, at most
    ``d`` or the sketch."""
    return min(opts.rank, d if not 0 < opts.sketch < d else opts.sketch)


def _output_side(b: Bucket, x: Context, path: str, stage: int, dist_opt: bool) -> list[Task]:
    """Two-sided GIFT after the inner reduction's last stage ``stage`` (module doc): ``P``'s all-reduce with the
    distributed optimizer, then the ``output`` stage. Nothing for a bucket without GIFT parameters or one-sided GIFT."""
    if not (x.two_sided and b.gift_elements):
        return []
    owned = b.gift_elements / x.p if dist_opt else b.gift_elements
    out = x.gpu("output side", stage + 1, 0.0, 8 * owned, count=x.count(b, path, "output"))
    if not dist_opt:
        return [out]
    nbytes = sum(4 * factor_rank(rows, x.opts) * cols for rows, cols in b.gift_shapes)
    return [x.ring("P all-reduce (FP32)", "all_reduce", nbytes, "dp", stage), out]


def _flat(b: Bucket, x: Context, dist_opt: bool) -> list[Task]:
    """One all-to-all over the group (one node, one rank per node, or ``--gift-exchange flat``)."""
    p, g, n, N, F, Ng = x.p, x.g, x.n, b.elements, b.wire_bytes, b.gift_elements
    path = "flat-rs" if dist_opt else "flat-ar"
    a2a = Task(
        "all-to-all",
        Kind.COMM,
        nccl.all_to_all_time(F, p, g, x.c),
        "dp",
        x.links(p, g),
        1,
        (g - 1) / p * F,
        (p - g) / p * F,
    )
    tasks = [x.metered(b, path, "send", "encode", 1, 4 * N + F, 4 * Ng), a2a]
    if dist_opt:
        tasks.append(x.metered(b, path, "reduce", "decode-sum", 2, F + 4 * N / p, 8 * Ng / p))
        return tasks + _finish(b, x, path, 2, n > 1) + _output_side(b, x, path, 2, True)
    return tasks + [
        x.metered(b, path, "gather", "decode-sum + re-encode shard", 2, F + F / p),
        x.ring("FP8 all-gather", "all_gather", F, "gather", 3),
        x.metered(b, path, "decode_all", "decode bucket", 4, F + 4 * N, 8 * Ng),
        *_output_side(b, x, path, 4, False),
    ]


def _two_level(b: Bucket, x: Context, dist_opt: bool) -> list[Task]:
    """Intra-node all-to-all in the intra dtype, node sums and encode of the 1/g slice, FP8 all-to-all among
    the ``n`` ranks with the same local index, decode-sum (``comm.hierarchical``)."""
    p, g, n, N, F, Ng = x.p, x.g, x.n, b.elements, b.wire_bytes, b.gift_elements
    path = f"two-level/{x.opts.intra_dtype}-{'rs' if dist_opt else 'ar'}"
    fp8 = x.opts.intra_dtype == "fp8"  # stage 1 then sends the flat path's message of G T
    intra = b.intra_bytes[x.opts.intra_dtype]
    # GIFT whitens at the sender, in every intra dtype: stage 1 casts or encodes G T, whole rows
    tasks = [
        x.metered(b, path, "intra", "encode" if fp8 else "cast", 1, 4 * N + intra, 4 * Ng),
        Task(
            "intra all-to-all",
            Kind.COMM,
            nccl.all_to_all_time(intra, g, g, x.c),
            "intra",
            ("nvlink",),
            1,
            (g - 1) / g * intra,
        ),
        x.metered(b, path, "node_sums", "node sums + encode slice", 2, intra + F / g),
        Task(
            "inter all-to-all",
            Kind.COMM,
            nccl.all_to_all_time(F / g, n, 1, x.c),
            "inter",
            ("nic",),
            2,
            0.0,
            (n - 1) / n * F / g,
        ),
    ]
    if dist_opt:
        tasks.append(x.metered(b, path, "reduce", "decode-sum", 3, F / g + 4 * N / p, 8 * Ng / p))
        return tasks + _finish(b, x, path, 3, True) + _output_side(b, x, path, 3, True)
    gather = [
        Task(
            "FP8 all-gather (inter)",
            Kind.COMM,
            nccl.ring_time("all_gather", F / g, n, 1, x.c),
            "inter",
            ("nic",),
            4,
            0.0,
            (n - 1) / n * F / g,
        ),
        Task(
            "FP8 all-gather (intra)",
            Kind.COMM,
            nccl.ring_time("all_gather", F, g, g, x.c),
            "intra",
            ("nvlink",),
            4,
            (g - 1) / g * F,
        ),
    ]
    return tasks + [
        x.metered(b, path, "gather_inter", "decode-sum + re-encode shard", 3, F / g + F / p),
        *gather,
        x.metered(b, path, "decode_all", "decode bucket", 5, F + 4 * N, 8 * Ng),
        *_output_side(b, x, path, 5, False),
    ]


def statistics_sides(shape: tuple[int, int], opts: Options) -> list[int]:
    """The statistics sizes of one GIFT layer ``(rows, cols)``: its input side's ``cols``, and with output
    statistics (``Options.side`` both or auto) its output side's ``rows``."""
    rows, cols = shape
    return [cols] + ([rows] if opts.side != "input" else [])


def record_bytes(shape: tuple[int, int], x: Context) -> int:
    """One layer's refresh record: ``numerics.refresh.RecordLayout`` at each side's ``factor_rank``."""
    sides = statistics_sides(shape, x.opts)
    d_out = sides[1] if len(sides) > 1 else 0
    r_out = factor_rank(d_out, x.opts) if d_out else 0
    return RecordLayout(sides[0], factor_rank(sides[0], x.opts), d_out, r_out).nbytes


def statistics_bytes(shape: tuple[int, int], x: Context) -> int:
    """One layer's FP32 statistics a refresh sums (EMA sums and token count, each side)."""
    return sum(4 * KFACStatistics.summed_numel(d, x.opts.sketch) for d in statistics_sides(shape, x.opts))


def owners(sizes: list[int], p: int) -> list[list[int]]:
    """The refresh's owners (``RefreshSync.assign_owners``): largest record first, to the rank that owns the fewest
    bytes so far, lowest rank on ties; the layers each of the ``p`` ranks builds."""
    heap, owned = [(0, r) for r in range(p)], [[] for _ in range(p)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: layer order on ties
        load, r = heapq.heappop(heap)
        owned[r].append(i)
        heapq.heappush(heap, (load + sizes[i], r))
    return owned


def refresh_chain(shapes: list[tuple[int, int]], x: Context) -> list[Task]:
    """A GIFT refresh of the layers ``(rows, cols)`` (``RefreshSync``): the statistics (each side's EMA sums
    and token count, FP32) reduce-scattered onto each layer's owner (``owners``) in one call, the layers
    packed by owner into equal slots (the most statistics bytes any rank owns; all-reduced instead where
    the slots would hold more than twice the statistics), the factors built on their
    owners, then one all-gather of a fixed-size record slot per rank (the most record bytes any rank
    owns). The busiest rank's builds (one per side) set the time. Only the data-parallel group is priced:
    a sequence-parallel layer's TP sum (an all-reduce over TP before the reduce-scatter) is not."""
    if x.p == 1 or not shapes:
        return []
    sizes = [record_bytes(s, x) for s in shapes]
    stats = [statistics_bytes(s, x) for s in shapes]
    owned = owners(sizes, x.p)
    slot = max(sum(sizes[i] for i in mine) for mine in owned)
    stats_slot = max(sum(stats[i] for i in mine) for mine in owned)
    builds = max(sum(len(statistics_sides(shapes[i], x.opts)) for i in mine) for mine in owned) * x.costs.factor_build_s
    # the runtime's choice (``RefreshSync.sum_statistics``): equal slots, or a ring all-reduce where they would
    # send more
    scatter = x.p * stats_slot <= 2 * sum(stats)
    summed = (
        x.ring("statistics reduce-scatter", "reduce_scatter", x.p * stats_slot, "refresh", 1)
        if scatter
        else x.ring("statistics all-reduce", "all_reduce", sum(stats), "refresh", 1)
    )
    return [
        summed,
        Task("factor builds", Kind.GPU, builds, "refresh-build", ("gpu",), 1),
        x.ring("record all-gather", "all_gather", x.p * slot, "refresh", 1),
    ]
