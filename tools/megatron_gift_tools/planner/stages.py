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
sum-first ``rows`` (reduce-scatter read 4N/g (the held sums)          4N_g/g (their ``G Q``)
then T on the node's sums)
sum-first ``node_sums``            write F/g
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

from dataclasses import replace

from megatron_gift.config import Mode
from megatron_gift_tools.planner import nccl
from megatron_gift_tools.planner.buckets import Bucket
from megatron_gift_tools.planner.refresh import factor_rank
from megatron_gift_tools.planner.schemes import Scheme
from megatron_gift_tools.planner.tasks import Context, Kind, Task

__all__ = ["Context", "Kind", "Task", "reduction_chain"]  # the tasks' types, where the chains' users take them


def reduction_chain(b: Bucket, scheme: Scheme, x: Context) -> list[Task]:
    """The gradient reduction of one bucket: reduce-scatter with the distributed optimizer, else all-reduce."""
    if x.p == 1:  # nothing to communicate, nothing to quantize (the plugin leaves the gradient to Megatron)
        return []
    dist_opt = x.opts.schedule.value == "overlap"
    if scheme.mode is Mode.OFF:
        kind = "reduce_scatter" if dist_opt else "all_reduce"
        return [x.ring(kind.replace("_", "-"), kind, b.wire_bytes, "dp", 1)]
    if scheme.two_level and x.g > 1 and x.n > 1 and scheme.sum_first:
        return _sum_first(b, x, scheme.inter_format)
    if scheme.two_level and x.g > 1 and x.n > 1:
        return _two_level(b, x, dist_opt, scheme.inter_format)
    return _flat(b, x, dist_opt)


def _finish(b: Bucket, x: Context, path: str, stage: int, across_nodes: bool) -> list[Task]:
    """The cut rows of GIFT parameters: their neighbour exchange and the stage's launches (the meter's ``finish``)."""
    if not b.gift_elements:
        return []
    count = x.count(b, path, "finish")
    sums = [x.gpu("cut-row sums", stage, 0.0, count=count)] if count.launches else []
    return [x.cut_rows(stage, across_nodes), *sums]


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


def _inter_all_to_all(nbytes: float, x: Context, stage: int) -> Task:
    """The two-level exchange's all-to-all of ``nbytes`` (a rank's held messages) among the ``n`` ranks with its
    local index, one per node: all of it but the own message through the NIC."""
    return Task(
        "inter all-to-all",
        Kind.COMM,
        nccl.all_to_all_time(nbytes, x.n, 1, x.c),
        "inter",
        ("nic",),
        stage,
        0.0,
        (x.n - 1) / x.n * nbytes,
    )


def _two_level(b: Bucket, x: Context, dist_opt: bool, fp4: str | None = None) -> list[Task]:
    """Intra-node all-to-all in the intra dtype, node sums and encode of the 1/g slice, FP8 all-to-all among
    the ``n`` ranks with the same local index, decode-sum (``comm.hierarchical``). An FP4 scheme's inter-node
    messages are ``b.inter_bytes`` (``fp4``: its format), its stages the meter's FP4 ones where it has them
    (``metered``), else its FP8 ones at those bytes."""
    F = b.wire_bytes if b.inter_bytes is None else b.inter_bytes  # the inter-node messages' bytes
    p, g, N, Ng = x.p, x.g, b.elements, b.gift_elements
    path = f"two-level/{x.opts.intra_dtype}-{'rs' if dist_opt else 'ar'}"
    if fp4 and dist_opt and x.costs.meter is not None and x.costs.meter.has(f"two-level/{x.opts.intra_dtype}-{fp4}-rs"):
        path = f"two-level/{x.opts.intra_dtype}-{fp4}-rs"
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
        _inter_all_to_all(F / g, x, 2),
    ]
    if dist_opt:
        tasks.append(x.metered(b, path, "reduce", "decode-sum", 3, F / g + 4 * N / p, 8 * Ng / p))
        return tasks + _finish(b, x, path, 3, True) + _output_side(b, x, path, 3, True)
    return tasks + _two_level_all_gather(b, x, path)


def _sum_first(b: Bucket, x: Context, fp4: str) -> list[Task]:
    """``--gift-intra-node reduce-scatter`` (``comm.sum_first``, the distributed optimizer's): NCCL's ring
    reduce-scatter of the bucket (FP32, or BF16: ``Options.grad_reduce_in_bf16``) over the node's NVLink, no
    plugin pass over it; ``T`` on the node's sums of the held ``1/g`` (``rows``: the held sums read, GIFT rows
    twice), the cut rows' exchange inside the node, ``H`` and the FP4 encode (``node_sums``: the messages
    written), the inter-node all-to-all and the owner's decode-sum. Stages: the meter's
    ``two-level/reduce-scatter-<fmt>-rs`` records (mxfp4: nvfp4's, at its bytes)."""
    F, p, g, N, Ng = b.inter_bytes, x.p, x.g, b.elements, b.gift_elements
    path = f"two-level/reduce-scatter-{fp4}-rs"
    meter = x.costs.meter
    if meter is not None and not meter.has(path):
        path = "two-level/reduce-scatter-nvfp4-rs"
    if meter is not None and not meter.has(path):  # an older meter JSON: one fused pass each (the lower bound)
        x = replace(x, costs=replace(x.costs, meter=None))
    held = b.intra_bytes["reduce-scatter"]  # the bucket the node's ranks sum, in its dtype (FP32 or BF16)
    tasks = [
        Task(
            "intra reduce-scatter",
            Kind.COMM,
            nccl.ring_time("reduce_scatter", held, g, g, x.c),
            "intra",
            ("nvlink",),
            1,
            (g - 1) / g * held,
        ),
        x.metered(b, path, "rows", "T on the node's sums", 2, held / g, 4 * Ng / g),
    ]
    if Ng:  # the cut rows' projections among the node's ranks
        tasks.append(Task("sender cut rows", Kind.COMM, nccl.neighbour_exchange_time(False, x.c), "intra", (), 2))
    tasks += [
        x.metered(b, path, "node_sums", "rotate + encode slice", 3, F / g),
        _inter_all_to_all(F / g, x, 3),
        x.metered(b, path, "reduce", "decode-sum", 4, F / g + 4 * N / p, 8 * Ng / p),
    ]
    return tasks + _finish(b, x, path, 4, True)


def _two_level_all_gather(b: Bucket, x: Context, path: str) -> list[Task]:
    """The two-level all-reduce's second half (no distributed optimizer): each shard's decode-sum and re-encode, its
    FP8 all-gather among the nodes then within the node, and the decode of the whole bucket."""
    p, g, n, N, F, Ng = x.p, x.g, x.n, b.elements, b.wire_bytes, b.gift_elements
    Fi = (
        F if b.inter_bytes is None else b.inter_bytes
    )  # the inter-node all-to-all's messages (FP4 rows: smaller than F; the gathers stay FP8)
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
    return [
        x.metered(b, path, "gather_inter", "decode-sum + re-encode shard", 3, Fi / g + F / p),
        *gather,
        x.metered(b, path, "decode_all", "decode bucket", 5, F + 4 * N, 8 * Ng),
        *_output_side(b, x, path, 5, False),
    ]
