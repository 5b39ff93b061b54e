"""Command-line interface: ``megatron-gift <group> <command>``.

Groups are argparse subcommands; each leaf sets ``func(args) -> exit code``. Heavy modules
are imported inside the handlers so that ``--help`` stays fast, and so that the training path
never needs what only these commands use: the optional ``bench`` extra (matplotlib for plots,
tokenizers for the text corpus). A command that needs part of it names the modules it needs
(``needs``) and says how to install them when they are missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys

PLOTS, CORPUS = ("matplotlib",), ("tokenizers",)  # pyproject.toml's [project.optional-dependencies] bench


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses it, or a broken installation
        return False


def require_bench_extra(command: str, modules: tuple[str, ...]) -> None:
    """Stop with the install line when one of ``modules`` (of the ``bench`` extra) is missing."""
    missing = [m for m in modules if not _importable(m)]
    if missing:
        raise SystemExit(
            f"{command} needs {', '.join(missing)} (the bench extra): pip install 'megatron-gift[bench]'"
        )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _bench_fidelity(args: argparse.Namespace) -> int:
    from megatron_gift.bench import fidelity

    report = fidelity.run(
        quick=args.quick, json_path=args.json, ranks=args.ranks, command=args.command_line, threads=args.threads or None
    )
    print(fidelity.format_tables(report), end="")
    return 0


def _bench_comm(args: argparse.Namespace) -> int:
    from megatron_gift.bench import comm

    nodes = args.nodes if args.nodes is not None else (["2x2"] if args.quick else ["2x2", "2x4"])
    comm.run(quick=args.quick, json_path=args.json, ranks=tuple(args.ranks), nodes=tuple(_node_layout(v) for v in nodes))
    return 0


def _node_layout(text: str) -> tuple[int, int]:
    """``"2x4"`` -> (2, 4): nodes x ranks per node."""
    try:
        n, g = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--nodes: expected NxG such as 2x4, got {text!r}") from None
    if n < 1 or g < 1:
        raise SystemExit(f"--nodes: nodes and ranks per node must be >= 1, got {text!r}")
    return n, g


def _bench_overhead(args: argparse.Namespace) -> int:
    from megatron_gift.bench import overhead

    overhead.run(quick=args.quick, json_path=args.json, device=args.device, command=args.command_line)
    return 0


def _bench_telemetry(args: argparse.Namespace) -> int:
    from megatron_gift.bench import telemetry_cost

    telemetry_cost.run(quick=args.quick, json_path=args.json, command=args.command_line)
    return 0


def _bench_memory(args: argparse.Namespace) -> int:
    from megatron_gift.bench import memory

    memory.run(quick=args.quick, json_path=args.json, ranks=args.ranks, command=args.command_line)
    return 0


def _bench_param_gather(args: argparse.Namespace) -> int:
    from megatron_gift.bench import param_gather

    param_gather.run(quick=args.quick, json_path=args.json, ranks=args.ranks, steps=args.steps, command=args.command_line)
    return 0


def _add_bench(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    fid = commands.add_parser(
        "fidelity",
        help="FP8 gradient-sum error of Euclidean and GIFT schemes on a small Llama",
        description="Train a small Llama on the Python docs and measure the RelL2 of FP8 data-parallel "
        "gradient sums (Euclidean and GIFT, every format and scaling granularity).",
    )
    fid.add_argument("--quick", action="store_true", help="small preset (under 3 minutes on 2 CPU cores)")
    fid.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    fid.add_argument("--ranks", type=_positive_int, default=8, metavar="N", help="simulated data-parallel ranks (default 8)")
    fid.add_argument(
        "--threads", type=int, default=1, metavar="N", help="torch intra-op threads (default 1; 0 keeps torch's default)"
    )
    fid.set_defaults(func=_bench_fidelity, needs=CORPUS)
    com = commands.add_parser(
        "comm",
        help="bytes on the wire and reduced-gradient error of real multi-rank Megatron runs",
        description="Train a small Megatron GPTModel on 2 and 4 CPU ranks (gloo) through GiftDistributedDataParallel "
        "in FP32, BF16, Euclidean-E4M3 and GIFT-E4M3 gradient communication, distributed optimizer on and off; "
        "report bytes sent per step and RelL2 of the reduced gradients against an FP32 average.",
    )
    com.add_argument("--quick", action="store_true", help="smaller model and fewer steps")
    com.add_argument("--json", metavar="PATH", help="write the results as JSON")
    com.add_argument("--ranks", type=_positive_int, nargs="+", default=[2, 4], metavar="N", help="rank counts (default 2 4)")
    com.add_argument("--nodes", nargs="*", default=None, metavar="NxG",
                     help="simulated nodes x ranks per node of the link ledger, flat vs two-level exchange "
                     "(default: 2x2 with --quick, else 2x2 2x4; none: skip)")  # fmt: skip
    com.set_defaults(func=_bench_comm, needs=CORPUS)
    ovh = commands.add_parser(
        "overhead",
        help="per-layer time of the GIFT transform, the FP8 codec and the dense-Cholesky transform vs the layer's fwd+bwd",
        description="Time the plugin's per-layer work (low-rank T and T^-1, FP8 encode+decode, whiten+encode, "
        "decode+sum+unwhiten, the paper's dense-Cholesky T) on the Llama-300M/600M and demo linear-layer shapes, "
        "next to each layer's forward+backward matmuls for one micro-batch.",
    )
    ovh.add_argument("--quick", action="store_true", help="Llama-600M and demo shapes, 1024 tokens (under 2 minutes on a CPU)")
    ovh.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ovh.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    ovh.set_defaults(func=_bench_overhead)
    tel = commands.add_parser(
        "telemetry",
        help="per-step cost of telemetry and --gift-layers auto, logging off vs on (2 CPU ranks)",
        description="Train a small Megatron GPTModel on 2 CPU ranks (gloo) through GiftDistributedDataParallel in "
        "several configurations at once (round-robin) and time the steps: logging off, a logging interval the run never "
        "reaches, a policy that never profiles, logging / profiling every step; median, IQR and ratios.",
    )
    tel.add_argument("--quick", action="store_true", help="tiny model, 4 timed steps (a smoke test, not a measurement)")
    tel.add_argument("--json", metavar="PATH", help="write the results as JSON")
    tel.set_defaults(func=_bench_telemetry)
    mem = commands.add_parser(
        "memory",
        help="peak extra bytes per parameter over stock Megatron, per mode and option (2/4/8 CPU ranks)",
        description="Wrap a small Megatron GPTModel in Megatron's DDP and in GiftDistributedDataParallel (each mode, "
        "error feedback, statistics, telemetry) on gloo ranks and count the live tensor bytes of a few training steps: "
        "peak, held and transient bytes per parameter over stock Megatron.",
    )
    mem.add_argument("--quick", action="store_true", help="tiny model, 2 ranks, 4 configurations, 1 step")
    mem.add_argument("--json", metavar="PATH", help="write the results as JSON")
    mem.add_argument("--ranks", type=_positive_int, nargs="+", default=None, metavar="N",
                     help="data-parallel sizes (default 2 4 8; --quick: 2)")  # fmt: skip
    mem.set_defaults(func=_bench_memory)
    pg = commands.add_parser(
        "param-gather",
        help="the distributed optimizer's parameter all-gather as coded changes: codecs, bit-identical weights, bytes",
        description="Train a small Megatron GPTModel (BF16 parameters, distributed optimizer) on the text corpus on CPU "
        "ranks (gloo) with Megatron's BF16 gather and with --gift-param-gather delta; on the real changes of the stock "
        "run compare the delta codecs (int8 in steps of the weight, plain MXINT8-like int8, E4M3 with FP32 1x128 "
        "scales): weights bit-identical to bf16(main), largest difference against the bound, bytes; and the delta "
        "run's replicas, bytes and loss against stock from the same and another seed.",
    )
    pg.add_argument("--quick", action="store_true", help="20 steps at one learning rate (a smoke test)")
    pg.add_argument("--json", metavar="PATH", help="write the results as JSON")
    pg.add_argument("--ranks", type=_positive_int, default=2, metavar="N", help="data-parallel size (default 2)")
    pg.add_argument("--steps", type=_positive_int, default=None, metavar="N", help="steps per run (default 200; --quick 20)")
    pg.set_defaults(func=_bench_param_gather, needs=CORPUS)


def _demo(args: argparse.Namespace) -> int:
    from megatron_gift import demo

    preset = {"iters": args.train_iters} if args.train_iters else None
    doc = demo.run(quick=args.quick, out=args.out, preset=preset, command=args.command_line)
    print(demo.format_table(doc), end="")
    return 0


def _add_demo(subparsers) -> None:
    dem = subparsers.add_parser(
        "demo",
        help="train a small Llama with FP32, BF16, Euclidean-E4M3 and GIFT-E4M3 gradients; report loss and bytes",
        description="Train a small Llama-style Megatron GPTModel on the real corpus on 2 CPU ranks (gloo) through "
        "python -m megatron_gift.pretrain_gpt, once per gradient-communication mode (FP32, BF16, Euclidean-E4M3, "
        "GIFT-E4M3), and write metrics.json, report.md and plots to --out.",
    )
    dem.add_argument("--quick", action="store_true", help="small preset (2 layers, hidden 64, 20 iterations)")
    dem.add_argument("--out", default="runs/demo", metavar="DIR", help="output directory (default: %(default)s)")
    dem.add_argument("--train-iters", type=_positive_int, default=None, help=argparse.SUPPRESS)  # tests
    dem.set_defaults(func=_demo, needs=PLOTS + CORPUS)


def _report(args: argparse.Namespace) -> int:
    from megatron_gift import report

    for kind, path in report.render(args.run_dir, out=args.out).items():
        print(f"{kind}: {path}")
    return 0


def _add_report(subparsers) -> None:
    rep = subparsers.add_parser(
        "report",
        help="plots and report.md from a run's gradient telemetry (gift_telemetry.jsonl)",
        description="Read RUN_DIR/gift_telemetry.jsonl (or the file given) and write per-layer RelL2 heat map, "
        "mode timeline with the policy's switches, loss curve and report.md.",
    )
    rep.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding gift_telemetry.jsonl, or the file itself")
    rep.add_argument("--out", default=None, metavar="DIR", help="output directory (default: the file's directory)")
    rep.set_defaults(func=_report, needs=PLOTS)


def _model(args: argparse.Namespace) -> int:
    import dataclasses

    if args.validate_cpu:  # trains on the text corpus
        require_bench_extra(args.command_line, CORPUS)
    from megatron_gift import perfmodel

    cluster = perfmodel.CLUSTERS[args.cluster]
    names = [f.name for f in dataclasses.fields(cluster)]
    if args.measured and not args.validate_cpu:
        raise SystemExit("megatron-gift model: --measured needs --validate-cpu OVERHEAD_JSON")
    dims = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn", "seq", "vocab")}
    try:
        for field, value in (("gpus_per_node", args.gpus_per_node), ("inter_bw", args.nic_gbps), ("intra_bw", args.nvlink_gbps)):
            if value is not None:
                cluster = dataclasses.replace(cluster, **{field: value if field == "gpus_per_node" else value * 1e9 / 8})
        for item in args.set:
            key, _, value = item.partition("=")
            if key not in names or not value:
                raise ValueError(f"--set wants FIELD=VALUE, FIELD one of {', '.join(names)}; got {item!r}")
            cluster = dataclasses.replace(cluster, **{key: type(getattr(cluster, key))(value)})
        w = perfmodel.workload(args.model, micro_batch=args.micro_batch, global_batch=args.global_batch, tp=args.tp,
                               pp=args.pp, **dims)
        for gpus in args.gpus:  # every configuration is checked before anything is printed
            perfmodel.step_time(w, cluster, "bf16", gpus, schedule=args.schedule)
    except ValueError as e:
        raise SystemExit(f"megatron-gift model: {e}") from None
    perfmodel.run(w, cluster, gpus=tuple(args.gpus), overhead_json=args.overhead_json, json_path=args.json,
                  comm_json=args.comm_json or str(perfmodel.COMM_JSON), validate_overhead_json=args.validate_cpu,
                  validate_iters=args.iters, measured_json=args.measured, show_sensitivity=args.sensitivity,
                  command=args.command_line, schedule=args.schedule, fp8_params=args.fp8_params,
                  bucket_size=args.bucket_size, intra_dtype=args.intra_node)  # fmt: skip
    return 0


def _add_model(subparsers) -> None:
    mod = subparsers.add_parser(
        "model",
        help="planner: will FP8 gradient communication speed up my training? (analytic step-time model)",
        description="Predict the step time of data-parallel Llama training with Megatron's FP32 and BF16 ring reduction "
        "and the plugin's FP8 exchanges (Euclidean and GIFT, flat all-to-all and two-level) on a given cluster, model and "
        "batch; print a table per GPU count, a verdict line per mode and the recommendation; check the byte model "
        "against a bench comm JSON and, with --validate-cpu, step times against CPU gloo runs of the demo model.",
    )
    mod.add_argument("--model", default="600m", metavar="NAME",
                     help="preset: 300m, 600m, 1.3b, 7b (llama- prefix allowed), or custom with every dimension below "
                     "(default: %(default)s)")  # fmt: skip
    for dim in ("layers", "hidden", "heads", "ffn", "seq", "vocab"):
        mod.add_argument(f"--{dim}", type=_positive_int, default=None, help=f"override the preset's {dim}")
    mod.add_argument("--gpus", type=_positive_int, nargs="+", default=[64, 256, 512], metavar="N",
                     help="GPU counts, one table each (default: 64 256 512)")  # fmt: skip
    mod.add_argument("--cluster", default="gh200", choices=["gh200", "h100", "h100-100g"],
                     help="machine preset (default: %(default)s; sources in the JSON and docs/planner.md)")  # fmt: skip
    mod.add_argument("--gpus-per-node", type=_positive_int, default=None, help="GPUs per node (each with its own NIC)")
    mod.add_argument("--nic-gbps", type=float, default=None, help="NIC bandwidth per GPU and direction in Gb/s (GH200 "
                     "Slingshot: 200)")  # fmt: skip
    mod.add_argument("--nvlink-gbps", type=float, default=None, help="NVLink bandwidth per GPU and direction in Gb/s "
                     "(H100: 3600, i.e. 450 GB/s)")  # fmt: skip
    mod.add_argument("--global-batch", type=_positive_int, default=512, help="sequences per step (default: %(default)s)")
    mod.add_argument("--micro-batch", type=_positive_int, default=1, help="sequences per micro-batch (default: %(default)s)")
    mod.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size (default: %(default)s)")
    mod.add_argument("--pp", type=_positive_int, default=1, help="pipeline-parallel size (default: %(default)s)")
    mod.add_argument("--bucket-size", type=_positive_int, default=None, metavar="ELEMENTS",
                     help="Megatron's --ddp-bucket-size (default: Megatron's max(40M, 1M x data-parallel size))")  # fmt: skip
    mod.add_argument("--intra-node", default="bf16", choices=["fp32", "bf16", "fp8"],
                     help="dtype of the two-level exchange's intra-node stage (--gift-intra-node; default: %(default)s)")  # fmt: skip
    mod.add_argument("--fp8-params", default="all", choices=["all", "linear"],
                     help="FP8 for every gradient (the paper) or linear weights only, the rest BF16 (default: %(default)s)")  # fmt: skip
    mod.add_argument("--schedule", default="overlap", choices=["overlap", "sync"],
                     help="overlap: distributed optimizer, overlapped grad reduce and param gather (the recipes); sync: "
                     "one all-reduce after the backward (the paper's artifact) (default: %(default)s)")  # fmt: skip
    mod.add_argument("--sensitivity", action="store_true", help="also move one machine parameter at a time (largest --gpus)")
    mod.add_argument("--overhead-json", metavar="PATH", help="plugin costs from a bench overhead JSON of the target GPU "
                     "(default: HBM-bandwidth estimates)")  # fmt: skip
    mod.add_argument("--comm-json", metavar="PATH", default=None,
                     help="bench comm JSON to check the byte model against (default: the checkout's bench/results/comm-cpu.json)")  # fmt: skip
    mod.add_argument("--validate-cpu", metavar="OVERHEAD_JSON", help="also train the demo model on 2 gloo ranks per mode "
                     "and compare step times, with the plugin's costs from this CPU overhead JSON (~4 min)")  # fmt: skip
    mod.add_argument("--measured", metavar="MODEL_JSON", help="with --validate-cpu: reuse the measured step times and gloo "
                     "fits of this earlier model JSON instead of training")  # fmt: skip
    mod.add_argument("--iters", type=_positive_int, default=30, help="iterations per mode of --validate-cpu (default 30)")
    mod.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                     help="override a machine parameter, e.g. --set a2a_efficiency=0.8 --set mfu=0.5")  # fmt: skip
    mod.add_argument("--json", metavar="PATH", help="write the plans and checks as JSON")
    mod.set_defaults(func=_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-gift", description="FP8 gradient communication with GIFT whitening")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_bench(subparsers)
    _add_demo(subparsers)
    _add_model(subparsers)
    _add_report(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["megatron-gift", *argv])
    require_bench_extra(args.command_line, getattr(args, "needs", ()))
    return args.func(args)
