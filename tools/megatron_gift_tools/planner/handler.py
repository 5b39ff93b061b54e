"""``megatron-gift model``'s handler and run: the command line's cluster and options, the tables, the checks
and the JSON. Module level imports only torch-free modules (``cli`` imports this one when it builds its parser);
the model itself (torch: the wire format) is imported by the handler."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from megatron_gift_tools.commands import CORPUS, require_bench_extra
from megatron_gift_tools.planner.cluster import CLUSTERS, PRESET_SOURCES, Cluster, sources
from megatron_gift_tools.planner.delta import DeltaKernels
from megatron_gift_tools.planner.metered import Meter
from megatron_gift_tools.planner.workloads import DIMS


def _shown(path) -> str:
    """``path`` as the JSON records it: relative to the checkout where it lies inside it."""
    from megatron_gift_tools.planner.checks import COMM_JSON

    root = COMM_JSON.parents[2]
    path = Path(path).resolve()
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    """The preset with the command line's overrides (ValueError on a bad one)."""
    c = CLUSTERS[args.cluster]
    for name, value in (
        ("gpus_per_node", args.gpus_per_node),
        ("inter_bw", args.nic_gbps and args.nic_gbps * 1e9 / 8),
        ("intra_bw", args.nvlink_gbps and args.nvlink_gbps * 1e9 / 8),
        ("a2a_nic_ratio", args.a2a_efficiency),
    ):
        if value is not None:
            c = dataclasses.replace(c, **{name: value})
    fields = {f.name: f for f in dataclasses.fields(Cluster)}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields or key == "name" or not value:
            raise ValueError(f"--set wants FIELD=VALUE, FIELD one of {', '.join(list(fields)[1:])}; got {item!r}")
        kind = float if key == "latency_s" else type(getattr(c, key))
        try:
            c = dataclasses.replace(c, **{key: kind(value)})
        except ValueError as e:
            raise ValueError(f"--set {item}: {e}") from None
    return c


def options_from_args(args: argparse.Namespace):
    """The planner's ``Options`` from the command line (``options`` imports torch: read here, not at import)."""
    from megatron_gift_tools.planner.options import Options

    kernels = DeltaKernels(stream=args.delta_decode_stream, decode_bytes=args.delta_decode_bytes)
    return Options(
        schedule=args.schedule,
        gift_schedule=args.gift_schedule,
        param_gather=args.param_gather,
        fp8_params=args.fp8_params,
        bucket_size=args.bucket_size,
        intra_dtype=args.intra_node,
        delta_kernels=kernels,
        side=args.gift_side.value,
        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
    )


def main(args: argparse.Namespace) -> int:
    """The handler: everything is checked before anything is printed."""
    from megatron_gift_tools.planner import model
    from megatron_gift_tools.planner.checks import COMM_JSON
    from megatron_gift_tools.planner.workloads import workload

    if args.validate_cpu:  # trains on the text corpus
        require_bench_extra(args.command_line, CORPUS)
    if args.measured and not args.validate_cpu:
        raise SystemExit("megatron-gift model: --measured needs --validate-cpu OVERHEAD_JSON")
    try:
        c = cluster_from_args(args)
        w = workload(
            args.model,
            micro_batch=args.micro_batch,
            global_batch=args.global_batch,
            tp=args.tp,
            pp=args.pp,
            **{k: getattr(args, k) for k in DIMS},
        )
        opts = options_from_args(args)
        for gpus in args.gpus:
            model.placement(model.data_parallel(w, gpus)[0], w.tp, c)
        meter = Meter.load(args.launches_json)
    except ValueError as e:
        raise SystemExit(f"megatron-gift model: {e}") from None
    comm_json = args.comm_json or str(COMM_JSON)
    if args.checks and not Path(comm_json).exists():
        raise SystemExit(
            f"megatron-gift model: --checks needs a bench comm JSON; {comm_json} does not exist (--comm-json)"
        )
    a2a = "yours, --a2a-efficiency" if args.a2a_efficiency else "assumed from published measurements"
    run(
        w,
        c,
        tuple(args.gpus),
        opts,
        overhead_json=args.overhead_json,
        json_path=args.json,
        comm_json=comm_json,
        show_checks=args.checks,
        validate_overhead_json=args.validate_cpu,
        validate_iters=args.iters,
        measured_json=args.measured,
        show_sensitivity=args.sensitivity,
        command=args.command_line,
        a2a_source=a2a,
        meter=meter,
        inter_format=args.inter_node_format,
    )
    return 0


def run(
    w,
    c: Cluster,
    gpus: tuple[int, ...],
    opts,
    overhead_json: str | None = None,
    json_path: str | None = None,
    comm_json: str | None = None,
    show_checks: bool = False,
    validate_overhead_json: str | None = None,
    validate_iters: int = 30,
    measured_json: str | None = None,
    show_sensitivity: bool = False,
    command: str | None = None,
    a2a_source: str = "assumed",
    meter=None,
    inter_format: str | None = None,
) -> dict:
    """The parameter count, per GPU count a table with verdicts, a summary row each (several counts), optionally
    the sensitivity at the largest count; the byte check against ``comm_json`` where it exists (printed with
    ``show_checks``) and optionally the CPU validation; ``inter_format``: also FP4 inter-node rows (``fp4``).
    Prints, writes JSON, returns the document."""
    from megatron_gift_tools.planner import checks, fp4, output, plan, validation

    costs = _costs(w, c, overhead_json, meter)
    doc = _document(w, c, gpus, opts, costs, command, a2a_source, inter_format)
    head = output.format_model(w) + output.format_costs(costs, opts) + (fp4.note(inter_format) if inter_format else "")
    out = [head, *(output.format_plan(p, w, a2a_source) for p in doc["plans"])]
    if len(gpus) > 1:
        out.append(output.format_summary(doc["plans"]))
    if show_sensitivity:
        doc["sensitivity"] = plan.sensitivity(w, c, max(gpus), costs if overhead_json else None, opts, meter)
        out.append(output.format_sensitivity(doc["sensitivity"], max(gpus)))
    if comm_json and Path(comm_json).exists():
        doc["bytes_check"] = dict(
            source=_shown(comm_json), rows=checks.comm_bytes_check(comm_json), links=checks.comm_links_check(comm_json)
        )
        if show_checks:
            out.append(output.format_bytes_check(doc["bytes_check"]["rows"], doc["bytes_check"]["links"]))
    if validate_overhead_json:
        doc["cpu_validation"] = validation.validate_cpu(
            validate_overhead_json, iters=validate_iters, measured_json=measured_json
        )
        out.append(output.format_validation(doc["cpu_validation"]))
    print("\n".join(out), end="")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1, default=lambda o: o.value)  # enums
    return doc


def _costs(w, c: Cluster, overhead_json: str | None, meter):
    """The plugin's kernel costs: from a bench overhead JSON of the target GPU, else HBM-bandwidth estimates."""
    from megatron_gift_tools.planner.costs import KernelCosts

    return (
        KernelCosts.from_json(overhead_json, c, f"llama-{w.name}", meter)
        if overhead_json
        else KernelCosts.from_hbm(c, meter)
    )


def _document(w, c: Cluster, gpus: tuple[int, ...], opts, costs, command, a2a_source: str, inter_format) -> dict:
    """The JSON document's inputs and plans (the run adds its checks); ``inter_node_format`` only where given."""
    from megatron_gift_tools.planner import nccl, plan

    fmt = {} if inter_format is None else dict(inter_node_format=inter_format)
    return dict(
        model="planner",
        command=command or "megatron-gift model",
        workload=dataclasses.asdict(w),
        parameters=w.total_parameters(),
        options=dataclasses.asdict(opts),
        cluster=dataclasses.asdict(c),
        cluster_sources=sources(),
        preset_source=PRESET_SOURCES.get(c.name, "custom"),
        a2a_source=a2a_source,
        costs=costs.summary(),
        nccl=nccl.SOURCE,
        min_gain_pct=plan.MIN_GAIN_PCT,
        **fmt,
        plans=[plan.plan(w, c, n, costs, opts, inter_format=inter_format) for n in gpus],
    )
