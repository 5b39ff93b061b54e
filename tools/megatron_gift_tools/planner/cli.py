"""``megatron-gift model``: the argument table, the handler and the run (tables, checks, JSON).

Module level imports only torch-free modules, so that building the command line stays fast; the
model itself (torch: the wire format) is imported by the handler. ``megatron_gift_tools.cli`` imports this
module when it builds its parser."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from megatron_gift_tools.commands import CORPUS, positive_int, require_bench_extra
from megatron_gift_tools.planner.choices import FP8Params, MegatronSchedule
from megatron_gift_tools.planner.cluster import CLUSTERS, PRESET_SOURCES, Cluster, sources
from megatron_gift_tools.planner.delta import DecodeStream, DeltaKernels
from megatron_gift_tools.planner.metered import Meter
from megatron_gift_tools.planner.workloads import DIMS, PRESETS

DIM_HELP = {"kv_heads": "key-value heads (grouped-query attention; default: the preset's, else --heads)"}


def _shown(path) -> str:
    """``path`` as the JSON records it: relative to the checkout where it lies inside it."""
    from megatron_gift_tools.planner.checks import COMM_JSON

    root = COMM_JSON.parents[2]
    path = Path(path).resolve()
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _runtime_choice(name: str):
    """An argparse ``type`` for the runtime's choice ``config.<name>``: the flag's value as the runtime
    takes it. ``config`` imports torch: it is read when the command's arguments are parsed, not when the
    parser is built. An enum, or a tuple of strings (``INTRA_NODE_DTYPES``, until the runtime has an
    enum for it)."""

    def convert(text: str):
        from megatron_gift import config

        kind = getattr(config, name)
        values = [k.value for k in kind] if isinstance(kind, type) else list(kind)
        if text not in values:
            raise argparse.ArgumentTypeError(f"one of {', '.join(values)}, got {text!r}")
        return kind(text) if isinstance(kind, type) else text

    return convert


def _values(kind) -> list[str]:
    return [k.value for k in kind]


def add_parser(subparsers) -> None:
    """The ``model`` command's arguments (the argument table)."""
    mod = subparsers.add_parser(
        "model",
        help="planner: will FP8 gradient communication speed up my training? (analytic step-time model)",
        description="Predict the step time of data-parallel Llama training with Megatron's FP32 and BF16 ring "
        "reduction and the plugin's FP8 exchanges (Euclidean and GIFT, flat all-to-all and two-level) as the plugin's "
        "stream schedules run them, with Megatron's BF16 or the delta parameter all-gather, on a given cluster, model "
        "and batch; print the model's parameter count, the BF16 baseline at Megatron's default and at its best bucket "
        "size, a table per GPU count, a verdict line per mode with its break-even all-to-all efficiency and the "
        "recommendation; with --checks, the byte model against a bench comm JSON, with --validate-cpu, step times "
        "against CPU gloo runs of the demo model.",
    )
    mod.add_argument(
        "--model",
        default="600m",
        metavar="NAME",
        help=f"preset: {', '.join(PRESETS)} (llama- prefix allowed), or custom with every dimension below "
        "(default: %(default)s)",
    )
    for dim in DIMS:
        mod.add_argument(
            f"--{dim.replace('_', '-')}",
            dest=dim,
            type=positive_int,
            default=None,
            help=DIM_HELP.get(dim, f"override the preset's {dim}"),
        )
    mod.add_argument(
        "--gpus",
        type=positive_int,
        nargs="+",
        default=[64, 256, 512],
        metavar="N",
        help="GPU counts, one table each (default: 64 256 512)",
    )
    mod.add_argument(
        "--cluster",
        default="gh200",
        choices=list(CLUSTERS),
        help="machine preset (default: %(default)s; sources in the JSON and docs/planner.md)",
    )
    mod.add_argument("--gpus-per-node", type=positive_int, default=None, help="GPUs per node (each with its own NIC)")
    mod.add_argument(
        "--nic-gbps",
        type=positive_float,
        default=None,
        help="NIC bandwidth per GPU and direction in Gb/s (GH200 Slingshot: 200)",
    )
    mod.add_argument(
        "--nvlink-gbps",
        type=positive_float,
        default=None,
        help="NVLink bandwidth per GPU and direction in Gb/s (H100: 3600, i.e. 450 GB/s)",
    )
    mod.add_argument(
        "--a2a-efficiency",
        type=positive_float,
        default=None,
        metavar="RATIO",
        help="your measured all-to-all NIC bandwidth relative to a ring's, e.g. nccl-tests alltoall over "
        "all_gather busbw (default: 0.48, the middle of the published measurements; every verdict prints "
        "the break-even)",
    )
    mod.add_argument("--global-batch", type=positive_int, default=512, help="sequences per step (default: %(default)s)")
    mod.add_argument(
        "--micro-batch", type=positive_int, default=1, help="sequences per micro-batch (default: %(default)s)"
    )
    mod.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (default: %(default)s)")
    mod.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size (default: %(default)s)")
    mod.add_argument(
        "--bucket-size",
        type=positive_int,
        default=None,
        metavar="ELEMENTS",
        help="Megatron's --ddp-bucket-size (default: Megatron's max(40M, 1M x data-parallel size))",
    )
    mod.add_argument(
        "--intra-node",
        type=_runtime_choice("INTRA_NODE_DTYPES"),
        default="bf16",
        metavar="DTYPE",
        help="dtype of the two-level exchange's intra-node stage, as --gift-intra-node (default: %(default)s)",
    )
    mod.add_argument(
        "--fp8-params",
        default="all",
        choices=_values(FP8Params),
        help="FP8 for every gradient (the paper) or linear weights only, the rest BF16 (default: %(default)s)",
    )
    mod.add_argument(
        "--schedule",
        default="overlap",
        choices=_values(MegatronSchedule),
        help="overlap: distributed optimizer, overlapped grad reduce and param gather (the recipes); sync: "
        "one all-reduce after the backward (the paper's artifact) (default: %(default)s)",
    )
    mod.add_argument(
        "--gift-schedule",
        default="eager",
        type=_runtime_choice("Schedule"),
        metavar="SCHEDULE",
        help="the plugin's stream schedule, as --gift-schedule: eager (all of a bucket's stages at its hook; "
        "the default) or lagged (the default where CUDA_DEVICE_MAX_CONNECTIONS=1); the table shows the other "
        "beside it (default: %(default)s)",
    )
    mod.add_argument(
        "--gift-side",
        default="input",
        type=_runtime_choice("Side"),
        metavar="SIDE",
        help="GIFT's whitened sides, as --gift-side: input, both (T_out^T G T_in: the output side's encode and "
        "output stages, and with the distributed optimizer an FP32 all-reduce of r x d_in per GIFT weight) or "
        "auto (priced as both, its upper bound) (default: %(default)s)",
    )
    mod.add_argument(
        "--param-gather",
        default="bf16",
        type=_runtime_choice("ParamGather"),
        metavar="GATHER",
        help="the parameter all-gather of every row but the stock BF16 reference: Megatron's bf16, or delta "
        "(about 1 byte per element, as --gift-param-gather delta) (default: %(default)s)",
    )
    mod.add_argument(
        "--delta-decode-stream",
        default=DeltaKernels().stream.value,
        choices=_values(DecodeStream),
        help="where the delta gather's decode runs: side (a stream of its own, as the code runs it) or "
        "compute (in the forward pre-hook, before the next bucket's gather) (default: %(default)s)",
    )
    mod.add_argument(
        "--delta-decode-bytes",
        type=positive_float,
        default=DeltaKernels().decode_bytes,
        metavar="BYTES",
        help="HBM bytes per element of the delta decode, before the meter's moved/essential ratio "
        "(default: %(default)s, the fused kernel's essential bytes; the unfused decode it replaced: 49.16)",
    )
    mod.add_argument(
        "--sensitivity", action="store_true", help="also move one machine parameter at a time (largest --gpus)"
    )
    mod.add_argument(
        "--launches-json",
        metavar="PATH",
        default=None,
        help="the launch-and-traffic meter's JSON each GPU stage's launches and bytes come from (default: "
        "the checkout's bench/results/launches-cpu.json; megatron-gift bench launches writes it)",
    )
    mod.add_argument(
        "--overhead-json",
        metavar="PATH",
        help="plugin kernel costs from a bench overhead JSON of the target GPU (default: HBM-bandwidth estimates)",
    )
    mod.add_argument(
        "--checks",
        action="store_true",
        help="also print the byte model against a bench comm ledger (--comm-json; recorded in --json either way)",
    )
    mod.add_argument(
        "--comm-json",
        metavar="PATH",
        default=None,
        help="bench comm JSON the byte model is checked against (default: the checkout's "
        "bench/results/comm-cpu.json; absent: no check)",
    )
    mod.add_argument(
        "--validate-cpu",
        metavar="OVERHEAD_JSON",
        help="also train the demo model on 2 gloo ranks per mode "
        "and compare step times, with the plugin's costs from this CPU overhead JSON (~4 min)",
    )
    mod.add_argument(
        "--measured",
        metavar="MODEL_JSON",
        help="with --validate-cpu: reuse the measured step times and gloo "
        "fits of this earlier model JSON instead of training",
    )
    mod.add_argument(
        "--iters", type=positive_int, default=30, help="iterations per mode of --validate-cpu (default 30)"
    )
    mod.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a machine parameter, e.g. --set a2a_nic_ratio=0.5 --set mfu=0.5",
    )
    mod.add_argument("--json", metavar="PATH", help="write the plans and checks as JSON")
    mod.set_defaults(func=main)


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


def main(args: argparse.Namespace) -> int:
    """The handler: everything is checked before anything is printed."""
    from megatron_gift_tools.planner import model
    from megatron_gift_tools.planner.checks import COMM_JSON
    from megatron_gift_tools.planner.options import Options
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
        kernels = DeltaKernels(stream=args.delta_decode_stream, decode_bytes=args.delta_decode_bytes)
        opts = Options(
            schedule=args.schedule,
            gift_schedule=args.gift_schedule,
            param_gather=args.param_gather,
            fp8_params=args.fp8_params,
            bucket_size=args.bucket_size,
            intra_dtype=args.intra_node,
            delta_kernels=kernels,
            side=args.gift_side.value,
        )
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
) -> dict:
    """The parameter count, per GPU count a table with verdicts, a summary row each (several counts), optionally
    the sensitivity at the largest count; the byte check against ``comm_json`` where it exists (printed with
    ``show_checks``) and optionally the CPU validation. Prints, writes JSON, returns the document."""
    from megatron_gift_tools.planner import checks, nccl, output, plan, validation
    from megatron_gift_tools.planner.costs import KernelCosts

    costs = (
        KernelCosts.from_json(overhead_json, c, f"llama-{w.name}", meter)
        if overhead_json
        else KernelCosts.from_hbm(c, meter)
    )
    doc = dict(
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
        plans=[plan.plan(w, c, n, costs, opts) for n in gpus],
    )
    head = output.format_model(w) + output.format_costs(costs, opts)
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
