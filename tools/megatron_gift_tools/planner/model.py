"""Step time of one data-parallel rank (the plan over schemes: ``plan``).

``step = (m + pp - 1)·(fwd + bwd) + exposed gradient reduction + exposed parameter gather + GIFT``,
``m = global_batch / (micro_batch·dp)`` micro-batches. Compute: Megatron's FLOP count at
``peak_flops x mfu`` (or a measured micro-batch time), split 1:2 between forward and backward and
over buckets by their parameters' FLOPs. The reduction overlaps the last micro-batch's backward
(``simulate``), the parameter gather the first micro-batch's forward (``gather``: in the order the
code runs it); a GIFT refresh adds its collectives and builds to the next forward, enqueued after
the gathers, amortized over the refresh interval, and the statistics cost FLOPs every step.
"""

from __future__ import annotations

from megatron_gift.config import Mode, Schedule
from megatron_gift_tools.planner.buckets import buckets
from megatron_gift_tools.planner.choices import MegatronSchedule
from megatron_gift_tools.planner.cluster import Cluster
from megatron_gift_tools.planner.costs import KernelCosts
from megatron_gift_tools.planner.gather import forward_phase, gather_chain
from megatron_gift_tools.planner.options import Options
from megatron_gift_tools.planner.refresh import refresh_chain, statistics_sides
from megatron_gift_tools.planner.schemes import Scheme
from megatron_gift_tools.planner.simulate import simulate, simulate_lagged
from megatron_gift_tools.planner.stages import reduction_chain
from megatron_gift_tools.planner.tasks import Context, Kind, Task
from megatron_gift_tools.planner.workloads import Workload, is_kind


def placement(dp: int, tp: int, c: Cluster) -> tuple[int, int]:
    """``(g, n)``: data-parallel ranks per node and nodes of one data-parallel group (TP ranks are
    adjacent, so ``G/tp`` DP ranks share a node when ``tp`` divides ``G``; one per node when ``tp >= G``)."""
    if tp < c.gpus_per_node and c.gpus_per_node % tp:
        raise ValueError(f"tensor parallelism {tp} must divide the GPUs per node ({c.gpus_per_node}) or be a multiple")
    g = min(max(1, c.gpus_per_node // tp), dp)
    if dp % g:
        raise ValueError(f"{dp} data-parallel ranks do not fill nodes of {g}: unequal ranks per node")
    return g, dp // g


def data_parallel(w: Workload, gpus: int) -> tuple[int, int]:
    """``(dp, micro-batches per step)``, or a ValueError naming what does not divide."""
    if gpus % (w.tp * w.pp):
        raise ValueError(f"{gpus} GPUs are not a multiple of tp x pp = {w.tp * w.pp}")
    dp = gpus // (w.tp * w.pp)
    if w.global_batch % (w.micro_batch * dp):
        raise ValueError(
            f"global batch {w.global_batch} is not a multiple of micro-batch {w.micro_batch} x {dp} data-parallel ranks"
        )
    return dp, w.global_batch // (w.micro_batch * dp)


def _grad_phase(scheme: Scheme, bwd: list[float], chains: list, opts: Options, c: Cluster) -> float:
    """Seconds the reduction adds after the last backward (sync: everything in series after it)."""
    if opts.schedule is MegatronSchedule.SYNC:
        return sum(t.seconds for chain in chains for t in chain)
    plugin = scheme.mode is not Mode.OFF
    if plugin and (opts.cpu_waits or opts.gift_schedule is Schedule.LAGGED):
        _, end = simulate_lagged(bwd, chains, blocking=opts.cpu_waits)
    else:
        _, end = simulate(bwd, chains, list(range(len(chains))), [None] * len(bwd), c.codec_compute_overlap)
    return end - sum(bwd)


def step_time(
    w: Workload,
    c: Cluster,
    scheme: Scheme,
    gpus: int,
    costs: KernelCosts | None = None,
    opts: Options = Options(),
    compute_seconds: float | None = None,
) -> dict:
    """Predicted seconds of one training step on ``gpus`` GPUs, its parts, and the bytes one rank sends per
    step (``compute_seconds``: a measured micro-batch fwd+bwd instead of the FLOP model)."""
    scheme, costs = Scheme(scheme), costs or KernelCosts.from_hbm(c)
    dp, micro = data_parallel(w, gpus)
    g, n = placement(dp, w.tp, c)
    tokens = w.micro_batch * w.seq
    bks = buckets(w, scheme, dp, opts.fp8_params, opts.bucket_size, opts.gift_layers, bf16=opts.grad_reduce_in_bf16)
    flops = sum(b.flops_per_token for b in bks) * tokens
    per_flop = compute_seconds / flops if compute_seconds is not None else 1.0 / (c.peak_flops * c.mfu)
    fwd = [b.flops_per_token * tokens * per_flop / 3 for b in bks]
    bwd = [2 * f for f in fwd]
    x = Context(g, n, c, costs, opts)
    chains = [reduction_chain(b, scheme, x) for b in bks]
    overlap = opts.schedule is MegatronSchedule.OVERLAP
    gathers = [gather_chain(b.elements, x) for b in reversed(bks)] if overlap else []
    gather_exposed = forward_phase(fwd[::-1], gathers, [], c.codec_compute_overlap)
    refresh, refresh_s = _refresh(w, scheme, x, fwd, gathers, gather_exposed, (tokens, micro, per_flop))
    grad = [t for chain in chains for t in chain]
    pg = [t for chain in gathers for t in chain]
    grad_exposed = _grad_phase(scheme, bwd, chains, opts, c)
    compute = (micro + w.pp - 1) * (sum(fwd) + sum(bwd))
    return dict(
        mode=scheme.value,
        gpus=gpus,
        dp=dp,
        ranks_per_node=g,
        nodes=n,
        micro_batches=micro,
        schedule=opts.schedule.value,
        gift_schedule=opts.gift_schedule.value,
        param_gather=opts.param_gather.value,
        intra_dtype="reduce-scatter" if scheme.sum_first else opts.intra_dtype if scheme.two_level else None,
        gift_side=opts.side if scheme.mode is Mode.GIFT else None,
        grad_reduce_in_bf16=scheme is Scheme.BF16 or (scheme.mode is not Mode.OFF and opts.grad_reduce_in_bf16),
        step_s=compute + grad_exposed + gather_exposed + refresh_s,
        compute_s=compute,
        grad_comm_s=sum(t.seconds for t in grad if t.kind is Kind.COMM),
        grad_exposed_s=grad_exposed,
        param_gather_s=sum(t.seconds for t in pg if t.kind is Kind.COMM),
        param_gather_exposed_s=gather_exposed,
        plugin_s=sum(t.seconds for t in grad + pg if t.kind is Kind.GPU),
        refresh_s=refresh_s,
        nvlink_bytes_per_rank=sum(t.nvlink_bytes for t in grad),
        nic_bytes_per_rank=sum(t.nic_bytes for t in grad),
        grad_bytes_per_rank=sum(t.nvlink_bytes + t.nic_bytes for t in grad),
        param_gather_bytes_per_rank=sum(t.nvlink_bytes + t.nic_bytes for t in pg),
        refresh_bytes_per_rank=sum(t.nvlink_bytes + t.nic_bytes for t in refresh) / opts.refresh_interval,
        refresh_statistics_bytes=sum(t.nvlink_bytes + t.nic_bytes for t in refresh[:1]),
        buckets=len(bks),
        first_bucket_gpu_stages=_gpu_stages(chains[:1] + gathers[-1:]),
    )


def _refresh(
    w: Workload, scheme: Scheme, x: Context, fwd: list[float], gathers: list, gather_exposed: float, per: tuple
) -> tuple[list[Task], float]:
    """A GIFT refresh's chain and its seconds per step: the statistics' FLOPs (``per``: tokens per micro-batch,
    micro-batches, seconds per FLOP) and the refresh's exposure in the forward, once every ``refresh_interval``
    steps."""
    tokens, micro, per_flop = per
    opts, c = x.opts, x.c
    shapes = [s for name, s, _ in w.parameters() if is_kind(name, opts.gift_layers)] if scheme.mode is Mode.GIFT else []
    refresh = refresh_chain(shapes, x)
    per_refresh = (
        forward_phase(fwd[::-1], gathers, refresh, c.codec_compute_overlap) - gather_exposed if refresh else 0.0
    )
    sides = [d for s in shapes for d in statistics_sides(s, opts)]
    stats = sum(4.0 * tokens * d * min(opts.sketch, d) for d in sides) * micro * per_flop if x.p > 1 else 0.0
    return refresh, stats + per_refresh / opts.refresh_interval


def _gpu_stages(chains: list[list[Task]]) -> list[dict]:
    """The GPU stages of these chains as the JSON records them: launches, HBM bytes moved, milliseconds."""
    return [
        dict(stage=t.label, launches=t.launches, hbm_mb=round(t.hbm_bytes / 1e6, 3), ms=round(1e3 * t.seconds, 4))
        for chain in chains
        for t in chain
        if t.kind is Kind.GPU
    ]
