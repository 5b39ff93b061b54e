"""``megatron-gift model``: the argument table (the handler and the run: ``handler``).

Module level imports only torch-free modules, so that building the command line stays fast; the
model itself (torch: the wire format) is imported by the handler. ``megatron_gift_tools.cli`` imports this
module when it builds its parser."""

from __future__ import annotations

import argparse

from megatron_gift_tools.commands import positive_int
from megatron_gift_tools.planner import handler
from megatron_gift_tools.planner.choices import FP8Params, MegatronSchedule
from megatron_gift_tools.planner.cluster import CLUSTERS
from megatron_gift_tools.planner.delta import DecodeStream, DeltaKernels
from megatron_gift_tools.planner.fp4 import FORMATS as FP4_FORMATS
from megatron_gift_tools.planner.workloads import DIMS, PRESETS

DIM_HELP = {"kv_heads": "key-value heads (grouped-query attention; default: the preset's, else --heads)"}


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
        "--grad-reduce-in-bf16",
        action="store_true",
        help="the plugin's rows keep BF16 gradient buffers, as Megatron's flag (the BF16 ring's); default FP32, "
        "as --bf16 reduces: the sum-first reduce-scatter then sends BF16 (GPU stages priced from FP32 buckets)",
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
        "--inter-node-format",
        default=None,
        choices=list(FP4_FORMATS),
        help="also price the two-level rows with this FP4 format on the inter-node stage (rows gift-2level-nvfp4 "
        "...; never recommended: the runtime's FP4 exchange has not run on a GPU yet; nvfp4's reduce-scatter "
        "stages from the meter's FP4 records, the others the meter's FP8 ones at the FP4 bytes)",
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
    mod.set_defaults(func=handler.main)
