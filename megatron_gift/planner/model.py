"""Step time of one data-parallel rank, the plan over schemes, break-even and sensitivity.

``step = (m + pp - 1)·(fwd + bwd) + exposed gradient reduction + exposed parameter gather + GIFT``,
``m = global_batch / (micro_batch·dp)`` micro-batches. Compute: Megatron's FLOP count at
``peak_flops x mfu`` (or a measured micro-batch time), split 1:2 between forward and backward and
over buckets by their parameters' FLOPs. The reduction overlaps the last micro-batch's backward
(``simulate``), the parameter gather the first micro-batch's forward (each bucket's forward waits
for its gather; the gathers run back to back on their NCCL stream); a GIFT refresh adds its
collectives and builds to the next forward, amortized over the refresh interval, and the
statistics cost FLOPs every step.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..config import Mode, ParamGather, Schedule
from .buckets import buckets
from .choices import MegatronSchedule
from .cluster import Cluster
from .costs import KernelCosts
from .options import Options
from .schemes import PLUGIN, Scheme
from .simulate import simulate, simulate_lagged
from .stages import Context, Kind, gather_chain, reduction_chain, refresh_chain
from .workloads import Workload, is_kind

MIN_GAIN_PCT = 1.0
"""a scheme is recommended over BF16 only when the model gives it at least this gain (the model's resolution,
assumed)."""
BREAK_EVEN_RANGE = (1e-3, 100.0)
"""all-to-all NIC ratios searched for the break-even (beyond: "any" or "none")."""


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
        raise ValueError(f"global batch {w.global_batch} is not a multiple of micro-batch {w.micro_batch} x {dp} "
                         "data-parallel ranks")  # fmt: skip
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


def _forward_phase(fwd: list[float], gathers: list, refresh: list, c: Cluster) -> float:
    """Seconds the parameter gathers (and a refresh's work, when given) add to the first forward."""
    chains = [refresh] + gathers
    waits = [i + 1 for i in range(len(fwd))] if gathers else [None] * len(fwd)
    _, end = simulate(fwd, chains, [None] * len(chains), waits, c.codec_compute_overlap)
    return end - sum(fwd)


def step_time(w: Workload, c: Cluster, scheme: Scheme, gpus: int, costs: KernelCosts | None = None,
              opts: Options = Options(), compute_seconds: float | None = None) -> dict:  # fmt: skip
    """Predicted seconds of one training step on ``gpus`` GPUs, its parts, and the bytes one rank sends per
    step (``compute_seconds``: a measured micro-batch fwd+bwd instead of the FLOP model)."""
    scheme, costs = Scheme(scheme), costs or KernelCosts.from_hbm(c)
    dp, micro = data_parallel(w, gpus)
    g, n = placement(dp, w.tp, c)
    tokens = w.micro_batch * w.seq
    bks = buckets(w, scheme, dp, opts.fp8_params, opts.bucket_size, opts.gift_layers)
    flops = sum(b.flops_per_token for b in bks) * tokens
    per_flop = compute_seconds / flops if compute_seconds is not None else 1.0 / (c.peak_flops * c.mfu)
    fwd = [b.flops_per_token * tokens * per_flop / 3 for b in bks]
    bwd = [2 * f for f in fwd]
    x = Context(g, n, c, costs, opts)
    chains = [reduction_chain(b, scheme, x) for b in bks]
    overlap = opts.schedule is MegatronSchedule.OVERLAP
    gathers = [gather_chain(b.elements, x) for b in reversed(bks)] if overlap else []
    d_ins = [s[1] for name, s, _ in w.parameters() if is_kind(name, opts.gift_layers)] if scheme.mode is Mode.GIFT else []
    refresh = refresh_chain(d_ins, x)
    gather_exposed = _forward_phase(fwd[::-1], gathers, [], c)
    per_refresh = _forward_phase(fwd[::-1], gathers, refresh, c) - gather_exposed if refresh else 0.0
    stats = sum(4.0 * tokens * d * min(opts.sketch, d) for d in d_ins) * micro * per_flop if dp > 1 else 0.0
    grad = [t for chain in chains for t in chain]
    pg = [t for chain in gathers for t in chain]
    grad_exposed = _grad_phase(scheme, bwd, chains, opts, c)
    compute = (micro + w.pp - 1) * (sum(fwd) + sum(bwd))
    refresh_s = stats + per_refresh / opts.refresh_interval
    return dict(mode=scheme.value, gpus=gpus, dp=dp, ranks_per_node=g, nodes=n, micro_batches=micro,
                schedule=opts.schedule.value, gift_schedule=opts.gift_schedule.value, param_gather=opts.param_gather.value,
                intra_dtype=opts.intra_dtype if scheme.two_level else None,
                step_s=compute + grad_exposed + gather_exposed + refresh_s, compute_s=compute,
                grad_comm_s=sum(t.seconds for t in grad if t.kind is Kind.COMM), grad_exposed_s=grad_exposed,
                param_gather_s=sum(t.seconds for t in pg if t.kind is Kind.COMM), param_gather_exposed_s=gather_exposed,
                plugin_s=sum(t.seconds for t in grad + pg if t.kind is Kind.GPU), refresh_s=refresh_s,
                nvlink_bytes_per_rank=sum(t.nvlink_bytes for t in grad), nic_bytes_per_rank=sum(t.nic_bytes for t in grad),
                grad_bytes_per_rank=sum(t.nvlink_bytes + t.nic_bytes for t in grad),
                param_gather_bytes_per_rank=sum(t.nvlink_bytes + t.nic_bytes for t in pg),
                refresh_bytes_per_rank=sum(t.nvlink_bytes + t.nic_bytes for t in refresh) / opts.refresh_interval,
                buckets=len(bks))  # fmt: skip


def uses_nic_all_to_all(row: dict) -> bool:
    """Whether a row's reduction sends an all-to-all through the NIC (where the break-even means something)."""
    return Scheme(row["mode"]).mode is not Mode.OFF and row["nodes"] > 1


def break_even(w: Workload, c: Cluster, scheme: Scheme, gpus: int, costs: KernelCosts, opts: Options,
               target_s: float) -> float | None:  # fmt: skip
    """The all-to-all NIC ratio (``Cluster.a2a_nic_ratio``) at which ``scheme``'s step equals ``target_s``:
    bisection on a log scale; ``BREAK_EVEN_RANGE[0]`` if it is faster at any ratio, None if at none."""
    lo, hi = BREAK_EVEN_RANGE

    def gap(ratio: float) -> float:
        return step_time(w, replace(c, a2a_nic_ratio=ratio), scheme, gpus, costs, opts)["step_s"] - target_s

    if gap(hi) > 0:
        return None
    if gap(lo) <= 0:
        return lo
    for _ in range(14):  # to a relative 0.3% of the ratio
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
    return hi


def plan(w: Workload, c: Cluster, gpus: int, costs: KernelCosts, opts: Options = Options(),
         with_break_even: bool = True) -> dict:  # fmt: skip
    """Every scheme's step at one configuration (under ``opts``, and under the other plugin schedule), its change
    against stock Megatron (BF16 ring and BF16 gather) and FP32, the break-even all-to-all ratio, and the
    recommendation (``recommended``, ``recommended_param_gather``): the fastest row if it beats stock BF16 by
    ``MIN_GAIN_PCT``, else stock BF16."""
    stock = replace(opts, param_gather=ParamGather.BF16)
    ref = {s: step_time(w, c, s, gpus, costs, stock)["step_s"] for s in (Scheme.BF16, Scheme.FP32)}
    other = replace(opts, gift_schedule=Schedule.LAGGED if opts.gift_schedule is Schedule.EAGER else Schedule.EAGER)
    rows = []
    for s in Scheme:
        r = step_time(w, c, s, gpus, costs, opts)
        r["vs_bf16_pct"] = 100 * (r["step_s"] / ref[Scheme.BF16] - 1)
        r["vs_fp32_pct"] = 100 * (r["step_s"] / ref[Scheme.FP32] - 1)
        if s.mode is not Mode.OFF:
            r["other_schedule_vs_bf16_pct"] = 100 * (step_time(w, c, s, gpus, costs, other)["step_s"] / ref[Scheme.BF16] - 1)
        if with_break_even and uses_nic_all_to_all(r):
            r["break_even_a2a_nic_ratio"] = break_even(w, c, s, gpus, costs, opts, ref[Scheme.BF16])
        rows.append(r)
    by = {r["mode"]: r for r in rows}
    best = min([by[s.value] for s in PLUGIN] + [by["bf16"]], key=lambda r: r["step_s"])  # the first of equals
    stock_wins = best["vs_bf16_pct"] > -MIN_GAIN_PCT
    return dict(model=w.name, cluster=c.name, gpus=gpus, tp=w.tp, pp=w.pp, a2a_nic_ratio=c.a2a_nic_ratio,
                stock_bf16_step_s=ref[Scheme.BF16], other_schedule=other.gift_schedule.value, rows=rows,
                recommended="bf16" if stock_wins else best["mode"],
                recommended_param_gather="bf16" if stock_wins else best["param_gather"])  # fmt: skip


SENSITIVITY = (("a2a_nic_ratio", (0.5, 1.0)), ("a2a_nvlink_ratio", (0.5,)), ("efficiency", (0.6, 0.95)),
               ("mfu", (0.25, 0.55)), ("inter_bw", (0.5, 2.0)), ("latency_factor", (0.5, 2.0)),
               ("codec_hbm_efficiency", (0.3, 0.9)), ("codec_compute_overlap", (0.5, 1.0)))  # fmt: skip
"""fields moved one at a time: absolute values, except ``inter_bw`` (a factor)."""


def sensitivity(w: Workload, c: Cluster, gpus: int, costs: KernelCosts | None, opts: Options = Options()) -> list[dict]:
    """Each scheme's change against stock BF16 at ``gpus`` GPUs when one cluster field moves (``costs``: None
    re-estimates the kernel costs from each moved cluster's HBM)."""
    rows = []
    for name, values in (("defaults", (None,)), *SENSITIVITY):
        for v in values:
            value = v if v is None or name != "inter_bw" else v * c.inter_bw
            moved = c if v is None else replace(c, **{name: value})
            p = plan(w, moved, gpus, costs or KernelCosts.from_hbm(moved), opts, with_break_even=False)
            rows.append(dict(field=name, value=value, bf16_step_s=p["stock_bf16_step_s"], recommended=p["recommended"],
                             recommended_param_gather=p["recommended_param_gather"],
                             **{f"{r['mode']}_vs_bf16_pct": r["vs_bf16_pct"] for r in p["rows"]}))  # fmt: skip
    return rows
