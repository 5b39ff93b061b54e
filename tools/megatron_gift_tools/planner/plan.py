"""The plan at one configuration: every scheme's step at its best bucket size, the BF16 baselines
(Megatron's default bucket size and its best one), the break-even all-to-all efficiency, the
recommendation; and the sensitivity to one machine parameter at a time."""

from __future__ import annotations

import math
from dataclasses import replace

from megatron_gift.config import Mode, ParamGather, Schedule
from megatron_gift_tools.planner import memory
from megatron_gift_tools.planner.cluster import Cluster
from megatron_gift_tools.planner.costs import KernelCosts
from megatron_gift_tools.planner.metered import Meter
from megatron_gift_tools.planner.model import step_time
from megatron_gift_tools.planner.options import Options
from megatron_gift_tools.planner.schemes import PLUGIN, Scheme, schemes
from megatron_gift_tools.planner.workloads import Workload

MIN_GAIN_PCT = 1.0
"""a scheme is recommended over the best BF16 alternative only when the model gives it at least this gain (the
model's resolution, assumed)."""
BREAK_EVEN_RANGE = (1e-3, 100.0)
"""all-to-all NIC ratios searched for the break-even (beyond: "any" or "none")."""
BUCKET_GRID = tuple(10_000_000 * 2**k for k in range(8))
"""``--ddp-bucket-size`` values (10M to 1.28G elements) searched for the tuned BF16 baseline."""


def uses_nic_all_to_all(row: dict) -> bool:
    """Whether a row's reduction sends an all-to-all through the NIC (where the break-even means something)."""
    return Scheme(row["mode"]).mode is not Mode.OFF and row["nodes"] > 1


def break_even(
    w: Workload, c: Cluster, scheme: Scheme, gpus: int, costs: KernelCosts, opts: Options, target_s: float
) -> float | None:
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


def bf16_baselines(w: Workload, c: Cluster, gpus: int, costs: KernelCosts, opts: Options) -> dict:
    """Stock Megatron (BF16 ring, BF16 gather) at ``opts.bucket_size`` (None: Megatron's default) and at the
    fastest of ``BUCKET_GRID``; ``baseline_s``: the better of the two, what every verdict compares with."""
    stock = replace(opts, param_gather=ParamGather.BF16)
    default = step_time(w, c, Scheme.BF16, gpus, costs, stock)["step_s"]
    tuned = {b: step_time(w, c, Scheme.BF16, gpus, costs, replace(stock, bucket_size=b))["step_s"] for b in BUCKET_GRID}
    best = min(tuned, key=tuned.get)
    return dict(
        bf16_default_step_s=default,
        bf16_bucket_size=opts.bucket_size,
        bf16_tuned_step_s=tuned[best],
        bf16_tuned_bucket_size=best,
        baseline_s=min(default, tuned[best]),
        baseline_bucket_size=opts.bucket_size if default <= tuned[best] else best,
    )


def _recommend(rows: list[dict], base: dict) -> dict:
    """The fastest FP8 row if it beats the best BF16 alternative (the baseline, or BF16 gradients with this
    run's gather) by ``MIN_GAIN_PCT``; else BF16 with the delta gather if it beats the baseline so; else the
    baseline (stock Megatron, at its better bucket size)."""
    by = {r["mode"]: r for r in rows}
    bf16_best = min(base["baseline_s"], by["bf16"]["step_s"])
    fp8 = min((by[s.value] for s in PLUGIN), key=lambda r: r["step_s"])  # the first of equals
    keep = 1 - MIN_GAIN_PCT / 100
    if fp8["step_s"] <= keep * bf16_best:
        return dict(
            recommended=fp8["mode"],
            recommended_param_gather=fp8["param_gather"],
            recommended_bucket_size=fp8["bucket_size"],
        )
    if by["bf16"]["param_gather"] == "delta" and by["bf16"]["step_s"] <= keep * base["baseline_s"]:
        return dict(
            recommended="bf16", recommended_param_gather="delta", recommended_bucket_size=by["bf16"]["bucket_size"]
        )
    return dict(
        recommended="bf16", recommended_param_gather="bf16", recommended_bucket_size=base["baseline_bucket_size"]
    )


def _tuned_row(
    w: Workload, c: Cluster, s: Scheme, gpus: int, costs: KernelCosts, opts: Options
) -> tuple[dict, Options]:
    """``s``'s step at its best bucket size (``opts.bucket_size``, None: Megatron's default, or one of
    ``BUCKET_GRID``; the first of equals), with the options that gave it."""
    best = None
    for size in (opts.bucket_size, *BUCKET_GRID):
        o = replace(opts, bucket_size=size)
        r = step_time(w, c, s, gpus, costs, o)
        if best is None or r["step_s"] < best[0]["step_s"]:
            best = (dict(r, bucket_size=size), o)
    return best


def plan(
    w: Workload,
    c: Cluster,
    gpus: int,
    costs: KernelCosts,
    opts: Options = Options(),
    with_break_even: bool = True,
    inter_format: str | None = None,
) -> dict:
    """Every scheme's step at its best bucket size (under ``opts``, and under the other plugin schedule), its change
    against the BF16 baseline (``bf16_baselines``) and FP32; for the plugin's rows the change against the best
    BF16 alternative and the all-to-all ratio at which they meet it; the recommendation (``_recommend``, among
    the runtime's schemes). ``inter_format``: also the two-level schemes with FP4 inter-node messages (``fp4``)."""
    priced = schemes(inter_format, sum_first=opts.schedule.value == "overlap")
    base = bf16_baselines(w, c, gpus, costs, opts)
    fp32 = step_time(w, c, Scheme.FP32, gpus, costs, replace(opts, param_gather=ParamGather.BF16))["step_s"]
    other = Schedule.LAGGED if opts.gift_schedule is Schedule.EAGER else Schedule.EAGER
    tuned = [_tuned_row(w, c, s, gpus, costs, opts) for s in priced]
    rows = [r for r, _ in tuned]
    bf16_best = min(base["baseline_s"], rows[priced.index(Scheme.BF16)]["step_s"])
    for s, (r, o) in zip(priced, tuned):
        r["vs_bf16_pct"] = 100 * (r["step_s"] / base["baseline_s"] - 1)
        r["vs_fp32_pct"] = 100 * (r["step_s"] / fp32 - 1)
        if s.mode is Mode.OFF:
            continue
        r["vs_best_bf16_pct"] = 100 * (r["step_s"] / bf16_best - 1)
        lag = step_time(w, c, s, gpus, costs, replace(o, gift_schedule=other))["step_s"]
        r["other_schedule_vs_bf16_pct"] = 100 * (lag / base["baseline_s"] - 1)
        if with_break_even and uses_nic_all_to_all(r):
            r["break_even_a2a_nic_ratio"] = break_even(w, c, s, gpus, costs, o, bf16_best)
    return dict(
        model=w.name,
        cluster=c.name,
        gpus=gpus,
        tp=w.tp,
        pp=w.pp,
        a2a_nic_ratio=c.a2a_nic_ratio,
        **base,
        best_bf16_step_s=bf16_best,
        other_schedule=other.value,
        rows=rows,
        **_recommend(rows, base),
        memory=memory.fit(w.numel(), rows[0]["dp"], c.gpu_memory),
    )


SENSITIVITY = (
    ("a2a_nic_ratio", (0.35, 0.75, 1.0)),
    ("a2a_nvlink_ratio", (0.5,)),
    ("efficiency", (0.6, 0.95)),
    ("mfu", (0.25, 0.55)),
    ("inter_bw", (0.5, 2.0)),
    ("latency_factor", (0.5, 2.0)),
    ("codec_hbm_efficiency", (0.3, 0.9)),
    ("codec_compute_overlap", (0.5, 1.0)),
)
"""fields moved one at a time: absolute values, except ``inter_bw`` (a factor)."""


def sensitivity(
    w: Workload, c: Cluster, gpus: int, costs: KernelCosts | None, opts: Options = Options(), meter: Meter | None = None
) -> list[dict]:
    """Each scheme's change against the BF16 baseline at ``gpus`` GPUs when one cluster field moves (``costs``:
    None re-estimates the kernel costs from each moved cluster's HBM, with ``meter``'s stage counts)."""
    rows = []
    for name, values in (("defaults", (None,)), *SENSITIVITY):
        for v in values:
            value = v if v is None or name != "inter_bw" else v * c.inter_bw
            moved = c if v is None else replace(c, **{name: value})
            p = plan(w, moved, gpus, costs or KernelCosts.from_hbm(moved, meter), opts, with_break_even=False)
            rows.append(
                dict(
                    field=name,
                    value=value,
                    bf16_step_s=p["baseline_s"],
                    recommended=p["recommended"],
                    recommended_param_gather=p["recommended_param_gather"],
                    **{f"{r['mode']}_vs_bf16_pct": r["vs_bf16_pct"] for r in p["rows"]},
                )
            )
    return rows
