"""Megatron command-line flags (``--gift-*``) that build a :class:`GiftConfig`.

``add_gift_args`` is an ``extra_args_provider`` for ``megatron.training.arguments.parse_args``;
``chain_args_providers`` combines it with a script's own provider. Every default is read from
``GiftConfig()``, the single source of truth; ``--gift-mode`` defaults to ``off`` as
``GiftConfig().mode`` does, so adding the flags changes nothing until asked.

Start-up errors a user reads: a bad flag or combination stops every rank with exit status 2 and
one message naming the flag, printed by rank 0 only, without a traceback (argparse's own errors
through :func:`add_gift_args`, the checks of :func:`validate_gift_args` through
:func:`checked_gift_config` / :func:`startup_errors`); a flag that does nothing in the chosen mode
is warned about, once.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import sys

from . import preflight
from .config import (
    DeltaGatherConfig,
    Exchange,
    ExchangeConfig,
    GiftConfig,
    InterNodeFormat,
    IntraNode,
    Mode,
    ParamGather,
    PolicyConfig,
    Rotation,
    Schedule,
    Side,
    WhiteningConfig,
    WireConfig,
    param_modes,
)
from .numerics.fp8 import CodecConfig, FP8Format, Scaling
from .startup import exit_after_rank0
from .upstream import TESTED_VERSIONS, UntestedMegatronError, check_upstream

_DEFAULT = GiftConfig()
_WIRE, _WHITENING, _EXCHANGE, _GATHER, _POLICY = (
    WireConfig(),
    WhiteningConfig(),
    ExchangeConfig(),
    DeltaGatherConfig(),
    PolicyConfig(),
)
AUTO = "auto"

# GiftConfig's concerns, each one argument group (title, description); a flag of a concern has no effect
# exactly where the configuration lacks that concern (:func:`_ineffective_flags`; ``general``: never).
CONCERNS = {
    "general": ("megatron-gift", "data-parallel gradients in FP8 or four bits, with GIFT whitening"),
    "wire": (
        "megatron-gift wire",
        "GiftConfig.wire: read where --gift-mode or --gift-euclidean-layers code a gradient",
    ),
    "whitening": ("megatron-gift whitening", "GiftConfig.whitening: --gift-mode gift"),
    "policy": ("megatron-gift layer policy", f"GiftConfig.policy: --gift-layers {AUTO}"),
    "exchange": ("megatron-gift exchange", "GiftConfig.exchange: how a bucket's reduction runs"),
    "param_gather": ("megatron-gift parameter gather", "GiftConfig.param_gather: independent of --gift-mode"),
}

# GiftConfig/CodecConfig field names as they appear in their ValueError messages -> flag names.
_FIELD_FLAGS = {
    "rank": "--gift-rank",
    "sketch": "--gift-sketch",
    "damping": "--gift-damping",
    "ema": "--gift-ema",
    "refresh_interval": "--gift-refresh-interval",
    "block size": "--gift-block-size",
    "inter_node_format": "--gift-inter-node-format",
    "intra_node": "--gift-intra-node",
    "error_feedback": "--gift-error-feedback",
    "rotation": "--gift-rotation",
    "margin": "--gift-policy-margin",
    "hysteresis": "--gift-policy-hysteresis",
    "bf16_bound": "--gift-bf16-bound",
    "profile_steps": "--gift-profile-steps",
    "profile_interval": "--gift-profile-interval",
    "log_interval": "--gift-log-interval",
    "ranks_per_node": "--gift-ranks-per-node",
    "inflight_mb": "--gift-inflight-mb",
    "param_gather_full_every": "--gift-param-gather-full-every",
}
_FIELD_RE = re.compile(r"\b(" + "|".join(re.escape(f) for f in _FIELD_FLAGS) + r")\b")
_SHOWN_NAMES = 8  # parameter names quoted in an error message
STARTUP_EXIT = 2  # exit status of a start-up error, argparse's


# --------------------------------------------------------------------------- messages a user reads


def global_rank() -> int:
    """This process's global rank: torch.distributed's once initialized, else the launcher's ``RANK``
    (torchrun sets it before Megatron parses its flags), else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def print_once(msg: str) -> None:
    """``msg`` on stderr from global rank 0 only (every rank checks the same flags)."""
    if global_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def startup_errors():
    """Within the block, a ``ValueError`` (a refused flag, combination or setting) or an untested
    megatron-core ends the process with exit status 2 and the error's message printed once, by
    rank 0, instead of a traceback on every rank."""
    try:
        yield
    except (ValueError, UntestedMegatronError) as e:
        text = str(e)
        print_once(text if text.startswith("megatron-gift") else f"megatron-gift: {text}")
        exit_after_rank0(STARTUP_EXIT, global_rank())  # no rank leaves before rank 0 has printed


def _errors_once(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse's errors (a bad choice or type, an unknown flag) as one line printed by rank 0,
    status 2 on every rank; argparse itself prints the whole usage (Megatron's: hundreds of flags)
    on every rank."""

    def error(message: str):
        print_once(f"{parser.prog}: error: {message} (--help lists the flags)")
        exit_after_rank0(STARTUP_EXIT, global_rank())

    parser.error = error
    return parser


_PERCENT = re.compile(r"%(\(|%)|%")


def escape_stray_percent(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Double each ``%`` in ``parser``'s help strings that is not ``%(...)`` or ``%%``.

    argparse formats help strings with ``%``; Megatron-Core 0.19 has one with a bare ``%``
    (``--moe-paged-stash-buffer-size-factor-cuda``: "1.10 = 10%)"), so its ``--help`` raised
    ValueError instead of printing. :func:`add_gift_args` applies it to the whole parser it is
    given (Megatron's), so the launcher's and the patched ``pretrain_gpt.py``'s ``--help`` print."""
    for action in parser._actions:
        if action.help:
            action.help = _PERCENT.sub(lambda m: m.group(0) if m.group(1) else "%%", action.help)
    return parser


def add_gift_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``megatron-gift`` argument groups, one per concern of ``GiftConfig`` (:data:`CONCERNS`),
    to ``parser`` and return it (Megatron's provider contract), with its help strings' stray ``%``
    escaped (:func:`escape_stray_percent`) and its errors printed once."""
    groups = {concern: parser.add_argument_group(*heading) for concern, heading in CONCERNS.items()}
    groups["general"].add_argument(
        "--gift-mode",
        choices=[m.value for m in Mode],
        default=_DEFAULT.mode.value,
        help="What the --gift-layers gradients are sent as: off (Megatron's own reduction, the default), "
        "bf16, euclidean (plain FP8) or gift (whitened FP8).",
    )
    groups["general"].add_argument(
        "--gift-layers",
        nargs="+",
        metavar="REGEX",
        default=list(_DEFAULT.layers),
        help="Regular expressions (re.search) on parameter names that use --gift-mode (default: %(default)s). "
        f"'{AUTO}' (with --gift-mode gift, optionally followed by patterns of the candidates, else the default "
        "ones) chooses GIFT, Euclidean or BF16 per layer from profiles of its gradients (see --gift-profile-*).",
    )
    groups["general"].add_argument(
        "--gift-euclidean-layers",
        nargs="+",
        metavar="REGEX",
        default=list(_DEFAULT.euclidean_layers),
        help="Further parameters (e.g. embeddings) sent as plain FP8.",
    )
    groups["general"].add_argument(
        "--gift-log-interval",
        type=int,
        default=_DEFAULT.log_interval,
        help="Iterations between megatron-gift log lines and telemetry records (per-layer RelL2, cosine, "
        "saturation, mode, bytes; to --gift-telemetry-dir and Megatron's TensorBoard / W&B writers); "
        "0 turns them off (default: %(default)s).",
    )
    groups["general"].add_argument(
        "--gift-telemetry-dir",
        default=None,
        metavar="DIR",
        help="Where gift_telemetry.jsonl goes (default: --save, else --tensorboard-dir).",
    )
    groups["general"].add_argument(
        "--gift-allow-untested-megatron",
        action="store_true",
        help="Run although Megatron-Core functions the plugin re-implements, wraps or replaces differ from "
        f"their source in every megatron-core it was checked against ({', '.join(TESTED_VERSIONS)}).",
    )
    groups["wire"].add_argument(
        "--gift-fp8-format",
        choices=[f.value for f in FP8Format],
        default=_WIRE.codec.fmt.name,
        help="FP8 format on the wire (default: %(default)s).",
    )
    groups["wire"].add_argument(
        "--gift-scaling",
        choices=[s.value for s in Scaling],
        default=_WIRE.codec.scaling.value,
        help="FP8 scale granularity: one per tensor, row, 1x--gift-block-size block, or 1x32 MX block "
        "(default: %(default)s).",
    )
    groups["wire"].add_argument(
        "--gift-block-size",
        type=int,
        default=_WIRE.codec.block,
        help="Elements per scale with --gift-scaling block (mx always uses 32; default: %(default)s).",
    )
    groups["wire"].add_argument(
        "--gift-inter-node-format",
        choices=tuple(f.value for f in InterNodeFormat),
        default=_WIRE.inter_node_format.value,
        help="Format of the coded values between nodes (the two-level exchange's inter-node stage, and the "
        "flat exchange): fp8 (--gift-fp8-format), or E2M1 four-bit codes with nvfp4's 16-element blocks "
        "(E4M3 block scales, an FP32 scale per segment: 0.5 + 1/16 byte per element) or mxfp4's 32-element "
        "blocks (E8M0 scales: 0.5 + 1/32); every shard and chunk boundary of the coded sequence falls on a whole "
        "block (refused at start-up otherwise); the FP4 codec and the rotation run as Triton kernels where "
        "--gift-kernels does, the whitening around them in PyTorch (default: %(default)s).",
    )
    groups["wire"].add_argument(
        "--gift-rotation",
        choices=tuple(r.value for r in Rotation),
        default=_WIRE.rotation.value,
        help="With --gift-inter-node-format nvfp4 or mxfp4: hadamard sends each coded layer's G T H (G H where "
        "Euclidean), H a randomized Hadamard transform of 64-column blocks with signs from --seed (no "
        "communication), undone on the sum at the receiver; auto rotates a GIFT layer where each refresh "
        "measures a smaller four-bit error with H than without on the owner's gradient, other layers "
        "unrotated (default: %(default)s).",
    )
    groups["wire"].add_argument(
        "--gift-error-feedback",
        action=argparse.BooleanOptionalAction,
        default=_WIRE.error_feedback,
        help="Carry each rank's rounding error of what it sends (FP8, or the four-bit format) into the next step "
        "(4 B per coded element; a skipped step resets it); keeps one flat exchange (default: %(default)s).",
    )
    groups["whitening"].add_argument(
        "--gift-rank",
        type=int,
        default=_WHITENING.rank,
        help="Rank of the whitening factor: the top eigenvectors of the input statistics XᵀX it whitens along; 0 "
        "scales each input column by its damped diagonal entry alone (no low-rank part; default: %(default)s).",
    )
    groups["whitening"].add_argument(
        "--gift-sketch",
        type=int,
        default=_WHITENING.sketch,
        help="Nyström sketch columns of the input statistics XᵀX; 0 keeps the exact XᵀX (default: %(default)s).",
    )
    groups["whitening"].add_argument(
        "--gift-refresh-interval",
        type=int,
        default=_WHITENING.refresh_interval,
        help="Iterations between whitening-factor refreshes (default: %(default)s).",
    )
    groups["whitening"].add_argument(
        "--gift-ema",
        type=float,
        default=_WHITENING.ema,
        help="Per-step EMA decay of the input statistics (default: %(default)s).",
    )
    groups["whitening"].add_argument(
        "--gift-damping",
        type=_damping,
        default=_WHITENING.damping if _WHITENING.damping is not None else AUTO,
        help="Damping added to the factor's diagonal, relative to mean(diag A), or 'auto': chosen per layer at "
        f"every refresh among {_WHITENING.damping_candidates} and Euclidean by the local error each gives "
        "(default: %(default)s).",
    )
    groups["whitening"].add_argument(
        "--gift-side",
        choices=[s.value for s in Side],
        default=_WHITENING.side.value,
        help="Which sides of each GIFT layer's gradient are whitened. input: from the statistics of the layer's "
        "inputs alone. both: also from those of its output gradients, collected in the backward (U = T_outᵀ G T_in); "
        "measured on pretrained models 3-8%% lower error per layer type than input alone (SmolLM2-135M: 0.79 of "
        "the best plain FP8's error against 0.84), for refresh bytes of 3.5%% of the FP8 gradient bytes at "
        "Llama-600M shapes instead of 1.2%%, a second low-rank map at sender and receiver, and with the distributed "
        "optimizer one FP32 all-reduce of rank x input size per layer and step, one per bucket (4.7%% of the FP8 "
        "gradient payload at 600M). auto: the statistics and costs of both; "
        "each refresh chooses per layer, with the damping, between the input side alone and both "
        "(docs/fidelity.md; default: %(default)s).",
    )
    groups["policy"].add_argument(
        "--gift-profile-steps",
        type=int,
        default=_POLICY.profile_steps,
        help=f"--gift-layers {AUTO}: profile every one of the first N iterations (default: %(default)s).",
    )
    groups["policy"].add_argument(
        "--gift-profile-interval",
        type=int,
        default=_POLICY.profile_interval,
        help=f"--gift-layers {AUTO}: then profile every N iterations (default: %(default)s).",
    )
    groups["policy"].add_argument(
        "--gift-policy-margin",
        type=float,
        default=_POLICY.margin,
        help=f"--gift-layers {AUTO}: relative RelL2 gain GIFT needs over Euclidean (default: %(default)s).",
    )
    groups["policy"].add_argument(
        "--gift-policy-hysteresis",
        type=int,
        default=_POLICY.hysteresis,
        help=f"--gift-layers {AUTO}: consecutive profiles before a layer switches (default: %(default)s).",
    )
    groups["policy"].add_argument(
        "--gift-bf16-bound",
        type=float,
        default=_POLICY.bf16_bound,
        help=f"--gift-layers {AUTO}: FP8 RelL2 above which a layer falls back to BF16 (default: %(default)s).",
    )
    groups["exchange"].add_argument(
        "--gift-exchange",
        choices=tuple(e.value for e in Exchange),
        default=_EXCHANGE.topology.value,
        help="auto: two-level exchange (intra-node stage, then FP8 among the ranks with the same local index) "
        "where the data-parallel group spans several nodes with several ranks each, else one all-to-all; "
        "flat: always one all-to-all over the group (default: %(default)s).",
    )
    groups["exchange"].add_argument(
        "--gift-intra-node",
        choices=(AUTO, *(d.value for d in IntraNode)),
        default=AUTO,
        help="Wire dtype of the two-level exchange's intra-node stage, summed in FP32 (bf16: half of FP32's "
        "intra-node bytes at an error far below FP8's; fp8 quantizes twice); reduce-scatter: NCCL's "
        "reduce-scatter of the gradient in the bucket's dtype, whitening, rotation and FP4 encode on the node's "
        "sums only (1/ranks-per-node of the work; needs --gift-inter-node-format nvfp4 or mxfp4 and "
        f"--use-distributed-optimizer). {AUTO}: reduce-scatter where it runs (four bits between nodes, the "
        "distributed optimizer, the two-level exchange), else bf16 (default: %(default)s).",
    )
    groups["exchange"].add_argument(
        "--gift-ranks-per-node",
        type=int,
        default=None,
        metavar="N",
        help="Processes per node, grouped by global rank (default: LOCAL_WORLD_SIZE from the launcher, "
        "else the ranks' hosts); e.g. to simulate nodes on one machine.",
    )
    groups["exchange"].add_argument(
        "--gift-schedule",
        choices=("auto",) + tuple(s.value for s in Schedule),
        default="auto",
        help="When a bucket's later reduction stages are enqueued on the plugin's streams: eager (all at the "
        "bucket's gradient hook) or lagged (one further stage per later bucket, the rest at the end of the "
        "backward); auto: lagged where CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue) and on CPUs, else "
        "eager (default: %(default)s).",
    )
    groups["exchange"].add_argument(
        "--gift-inflight-mb",
        type=int,
        default=None,
        metavar="MIB",
        help="Bound on the reductions' message buffers in flight, in MiB: a bucket's exchange reuses an earlier "
        "one's memory once that one is done, ordered on the GPU without a host sync (default: two of the "
        "largest bucket's, at most all of a step's, so one exchange runs while the next bucket is encoded). A "
        "bucket larger than the bound is reduced in sub-buckets of at most half of it each; with an output side "
        "or the sum-first exchange it runs outside the bound (warned at start-up).",
    )
    groups["exchange"].add_argument(
        "--gift-loopback",
        action="store_true",
        default=_EXCHANGE.loopback,
        help="Benchmarking tool: quantize gradients even where the data-parallel group has one rank (encode, "
        "decode, sum, unwhiten, nothing sent), to measure the plugin's on-GPU cost on one GPU. Without it a "
        "group of one keeps Megatron's reduction and gradient bit for bit.",
    )
    groups["param_gather"].add_argument(
        "--gift-param-gather",
        choices=[m.value for m in ParamGather],
        default=ParamGather.BF16.value,
        help="The distributed optimizer's parameter all-gather, independent of --gift-mode: bf16 (Megatron's own, "
        "the default) or delta (each shard's change since the last gather as int8 in units of the weight's own "
        "step, or of a power-of-two scale per 32 where coarser: 0.52x BF16's bytes; every replica bit-identical, "
        "weights within one step's quantization error of bf16(main)).",
    )
    groups["param_gather"].add_argument(
        "--gift-param-gather-full-every",
        type=int,
        default=_GATHER.full_every,
        metavar="N",
        help="With --gift-param-gather delta, gather the update of every N-th iteration in full BF16 "
        "(0: only at start-up, after a checkpoint load, and after the replica check of a --log-interval step "
        "found replicas that differ; default: %(default)s).",
    )
    return _errors_once(escape_stray_percent(parser))


def _damping(text: str) -> str | float:
    """``--gift-damping``: ``auto`` or a number (argparse names the flag in its error)."""
    if text == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0 or '{AUTO}', got {text!r}") from None


def print_help_if_asked(extra_args_provider) -> None:
    """With ``-h`` / ``--help`` on the command line: print Megatron's help with ``extra_args_provider``'s
    flags (:func:`add_gift_args` escapes its stray ``%``) and exit. Megatron-LM's ``pretrain_gpt.py``
    (patched) calls it first: its in-process-restart wrapper parses the command line with Megatron's
    parser alone, whose ``--help`` raises ``ValueError`` on a bare ``%``. A ``--gift-cpu`` there (the
    launcher's flag) is refused in one line naming the script's CPU route, ``megatron.cpu_run``."""
    if "--gift-cpu" in sys.argv[1:]:  # the launcher's flag: the script's CPU route is a module around it
        with startup_errors():
            raise ValueError(
                "--gift-cpu is megatron_gift.pretrain_gpt's flag; run this script on CPU with torchrun "
                f"--nproc-per-node N -m megatron_gift.megatron.cpu_run {sys.argv[0]} <flags> (docs/integration.md)"
            )
    if {"-h", "--help"} & set(sys.argv[1:]):
        from megatron.training.arguments import parse_args

        parse_args(extra_args_provider=extra_args_provider)  # argparse prints the help and exits 0


def chain_args_providers(*providers):
    """One ``extra_args_provider`` that applies ``providers`` in order (Megatron accepts only one)."""

    def provider(parser):
        for p in providers:
            parser = p(parser)
        return parser

    return provider


def gift_config_from_args(args) -> GiftConfig | None:
    """The configuration the flags ask for, or None with ``--gift-mode off --gift-param-gather bf16``;
    each concern's flags build its sub-config, present only where it applies (``CONCERNS``).

    Out-of-range values raise the configs' ``ValueError`` reworded with the flag names."""
    mode = Mode(args.gift_mode)
    delta = ParamGather(args.gift_param_gather) is ParamGather.DELTA
    if mode is Mode.OFF and not delta:
        return None
    try:
        wire = WireConfig(
            codec=CodecConfig(FP8Format(args.gift_fp8_format), Scaling(args.gift_scaling), args.gift_block_size),
            inter_node_format=InterNodeFormat(args.gift_inter_node_format),
            rotation=Rotation(args.gift_rotation),
            rotation_seed=getattr(args, "seed", 0) if args.gift_rotation != Rotation.NONE.value else 0,
            error_feedback=args.gift_error_feedback,
        )
        whitening = None
        if mode is Mode.GIFT:
            whitening = WhiteningConfig(
                rank=args.gift_rank,
                sketch=args.gift_sketch,
                damping=None if args.gift_damping == AUTO else args.gift_damping,
                side=Side(args.gift_side),
                ema=args.gift_ema,
                refresh_interval=args.gift_refresh_interval,
            )
        exchange = ExchangeConfig(
            topology=Exchange(args.gift_exchange),
            intra_node=intra_node(args),
            ranks_per_node=args.gift_ranks_per_node,
            schedule=None if args.gift_schedule == AUTO else Schedule(args.gift_schedule),
            loopback=args.gift_loopback,
            inflight_mb=args.gift_inflight_mb,
        )
        gather = None
        if delta:  # the checks' interval: Megatron's logging steps (without Megatron's flags: the default)
            check_every = getattr(args, "log_interval", _GATHER.check_every)
            gather = DeltaGatherConfig(full_every=args.gift_param_gather_full_every, check_every=check_every)
        return GiftConfig(
            mode=mode,
            layers=tuple(p for p in args.gift_layers if p != AUTO) or _DEFAULT.layers,
            euclidean_layers=tuple(args.gift_euclidean_layers),
            wire=wire,
            whitening=whitening,
            policy=_policy_from_args(args),
            exchange=exchange,
            param_gather=gather,
            log_interval=args.gift_log_interval,
            allow_untested_megatron=args.gift_allow_untested_megatron,
        )
    except ValueError as e:
        raise ValueError(f"megatron-gift: {_FIELD_RE.sub(lambda m: _FIELD_FLAGS[m.group(1)], str(e))}") from e


def telemetry_dir(args) -> str | None:
    """The directory of ``gift_telemetry.jsonl``: ``--gift-telemetry-dir``, else ``--save``, else
    ``--tensorboard-dir``."""
    return args.gift_telemetry_dir or args.save or args.tensorboard_dir


def _check_writable_dir(path: str) -> None:
    """Refuse a telemetry directory that cannot be written (or created) now, at start-up: it failed on
    rank 0 after the model was built, and the other ranks then saw only gloo's "connection closed"."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):  # the nearest existing ancestor: the directory is made under it
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(
            f"the telemetry directory {path} cannot be written ({probe} is not a writable directory): "
            "give a writable --gift-telemetry-dir (else --save or --tensorboard-dir is used)"
        )


def _policy_from_args(args) -> PolicyConfig | None:
    if AUTO not in args.gift_layers:
        return None
    if args.gift_mode != Mode.GIFT.value:
        raise ValueError(f"--gift-layers {AUTO} chooses among GIFT, Euclidean and BF16: it needs --gift-mode gift")
    return PolicyConfig(
        margin=args.gift_policy_margin,
        hysteresis=args.gift_policy_hysteresis,
        bf16_bound=args.gift_bf16_bound,
        profile_steps=args.gift_profile_steps,
        profile_interval=args.gift_profile_interval,
    )


def validate_gift_args(args, named_parameters=None, warn: bool = True) -> None:
    """Raise ``ValueError`` saying which flag to change when the ``--gift-*`` flags cannot work.

    Checks value ranges, regular expressions, conflicts with other Megatron flags, ``LOCAL_WORLD_SIZE``
    and ``--gift-ranks-per-node`` against the run's processes, and (flag-level, ``warn``) warns on
    rank 0 about flags the chosen mode ignores; given the model's ``named_parameters`` (``(name,
    param)`` pairs, as the DDP wrapper will see them), also checks that every pattern selects a
    parameter and that ``--gift-rank`` fits each GIFT layer."""
    if args.gift_log_interval < 0:
        raise ValueError(f"--gift-log-interval must be >= 0 (0 = off), got {args.gift_log_interval}")
    if args.gift_param_gather_full_every and args.gift_param_gather != ParamGather.DELTA.value:
        raise ValueError(
            "--gift-param-gather-full-every has no effect without --gift-param-gather delta: add it or "
            "drop --gift-param-gather-full-every"
        )
    cfg = gift_config_from_args(args)
    if named_parameters is None and warn:  # the flag-level call, once before the model exists: warn there
        _warn_ineffective_flags(args, cfg)
        if cfg is not None and cfg.whitening is not None and cfg.whitening.rank == 0:
            print_once(
                "megatron-gift: note: --gift-rank 0 scales each GIFT layer's input columns by the damped "
                "diagonal of its statistics alone (no low-rank whitening)"
            )
            if (side := cfg.whitening.side) is not Side.INPUT:
                print_once(
                    f"megatron-gift: note: --gift-side {side.value} with --gift-rank 0 whitens the input side "
                    "alone: a diagonal T_out only rescales whole rows, which the FP8 scales already do, so no "
                    "output statistics are kept"
                )
    if args.gift_mode == Mode.OFF.value:
        for flag, value in (
            ("--gift-euclidean-layers", args.gift_euclidean_layers),
            ("--gift-loopback", args.gift_loopback),
        ):
            if value:
                raise ValueError(
                    f"{flag} has no effect with --gift-mode off: choose --gift-mode bf16, euclidean or gift, "
                    f"or drop {flag}"
                )
    if cfg is None:
        return
    _check_param_gather(args)
    if cfg.mode is Mode.OFF:  # the parameter all-gather alone
        check_upstream(allow_untested=args.gift_allow_untested_megatron)
        return
    patterns = {"--gift-layers": cfg.layers, "--gift-euclidean-layers": cfg.euclidean_layers}
    if args.gift_log_interval and not telemetry_dir(args):
        raise ValueError(
            "--gift-log-interval writes gift_telemetry.jsonl: give --gift-telemetry-dir (or --save, or "
            "--tensorboard-dir)"
        )
    if args.gift_log_interval:
        _check_writable_dir(telemetry_dir(args))
    for flag, pats in patterns.items():
        for pat in pats:
            try:
                re.compile(pat)
            except re.error as e:
                raise ValueError(f"{flag}: {pat!r} is not a valid regular expression ({e})") from e
    check_upstream(allow_untested=args.gift_allow_untested_megatron)
    _check_megatron_flags(args)
    if cfg.exchange.ranks_per_node is None:
        _check_local_world_size()
    else:
        _check_ranks_per_node(cfg.exchange.ranks_per_node)
    if named_parameters is not None:
        _check_parameters(cfg, list(named_parameters), patterns)


@contextlib.contextmanager
def gift_flags_checked_first():
    """Within the block, Megatron's ``validate_args`` checks the ``--gift-*`` flags first
    (:func:`validate_gift_args`, with its warnings): a refused value stops the run before Megatron's
    own checks and its argument dump (hundreds of lines), as argparse's errors do. Wrap the
    ``parse_and_validate_args`` call in it; :func:`checked_gift_config` after it checks again with
    the values Megatron derived (e.g. the layer-wise optimizer), without repeating the warnings."""
    from megatron.training import arguments as megatron_arguments

    original = megatron_arguments.validate_args

    @functools.wraps(original)
    def validate_args(args, *a, **kw):
        with startup_errors():
            validate_gift_args(args)
        return original(args, *a, **kw)

    megatron_arguments.validate_args = validate_args
    try:
        yield
    finally:
        megatron_arguments.validate_args = original


def checked_gift_config(args) -> GiftConfig | None:
    """:func:`validate_gift_args` (flag-level, after Megatron's ``validate_args``: its warnings came
    from :func:`gift_flags_checked_first`) then :func:`gift_config_from_args`, for a training script:
    a refused flag ends every rank with one message from rank 0 (:func:`startup_errors`)."""
    with startup_errors():
        validate_gift_args(args, warn=False)
        cfg = gift_config_from_args(args)
        preflight.check(args, cfg)  # what Megatron would find only after the model build
        return cfg


def _check_local_world_size() -> None:
    """``LOCAL_WORLD_SIZE`` (processes per node, from the launcher) must be an integer >= 1 when
    ``--gift-ranks-per-node`` does not override it: the two-level exchange groups nodes by it."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if not value:
        return
    try:
        ok = int(value) >= 1
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={value!r} (processes per node, set by the launcher) is not an integer >= 1: "
            "fix the launcher's environment or give --gift-ranks-per-node N"
        )


def _check_ranks_per_node(per_node: int) -> None:
    """``--gift-ranks-per-node`` must divide the run's processes (``WORLD_SIZE``, set by the launcher):
    nodes hold equal numbers of consecutive ranks, and a count above the run's is no layout at all."""
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) % per_node:
        raise ValueError(
            f"--gift-ranks-per-node {per_node} does not divide the {world} processes of this run (WORLD_SIZE): "
            "give the processes per node the launcher starts"
        )


def _flag_defaults() -> dict:
    return vars(add_gift_args(argparse.ArgumentParser()).parse_args([]))


# errors, or read whatever the mode (the parameter all-gather is independent of it)
_ANY_MODE = (
    "gift_mode",
    "gift_allow_untested_megatron",
    "gift_euclidean_layers",
    "gift_loopback",
    "gift_param_gather",
    "gift_param_gather_full_every",
)


def concern_groups(parser: argparse.ArgumentParser | None = None) -> list[tuple[str, argparse._ArgumentGroup]]:
    """``(concern, argument group)`` of each group :func:`add_gift_args` made (on a parser of its own
    when none is given), in ``CONCERNS``' order."""
    parser = parser or add_gift_args(argparse.ArgumentParser())
    by_title = {title: concern for concern, (title, _) in CONCERNS.items()}
    return [(by_title[g.title], g) for g in parser._action_groups if g.title in by_title]


def flag_concerns(parser: argparse.ArgumentParser | None = None) -> dict[str, str]:
    """Each ``--gift-*`` flag's destination -> its concern (``CONCERNS``)."""
    return {action.dest: concern for concern, group in concern_groups(parser) for action in group._group_actions}


def intra_node(args) -> IntraNode:
    """``--gift-intra-node``, with ``auto`` resolved: a reduce-scatter first where it runs (four bits between nodes,
    the distributed optimizer's equal shards, the two-level exchange: the faster two-level path in the planner,
    training as the per-rank path within the seeds' noise, docs/two-level-exchange.md), else bf16."""
    if args.gift_intra_node != AUTO:
        return IntraNode(args.gift_intra_node)
    runs = (
        args.gift_inter_node_format != InterNodeFormat.FP8.value
        and getattr(args, "use_distributed_optimizer", False)
        and args.gift_exchange != Exchange.FLAT.value
        and not args.gift_error_feedback
    )
    return IntraNode.REDUCE_SCATTER if runs else IntraNode.BF16


def _ineffective_flags(args, cfg: GiftConfig | None) -> list[tuple[str, str]]:
    """``(attribute, why)`` of each ``--gift-*`` flag set to a non-default value that the configuration
    never reads: its concern's sub-config is absent (``--gift-euclidean-layers`` / ``--gift-loopback``
    with mode off are errors); within the wire and the exchange, ``--gift-block-size`` needs block
    scaling, ``--gift-intra-node`` the two-level exchange, ``--gift-telemetry-dir`` telemetry."""
    changed = [k for k, v in _flag_defaults().items() if hasattr(args, k) and getattr(args, k) != v]
    if cfg is None or cfg.mode is Mode.OFF:
        return [(k, "with --gift-mode off") for k in changed if k not in _ANY_MODE]
    absent = {
        "whitening": None if cfg.whitening else f"with --gift-mode {cfg.mode.value} (GIFT only)",
        "wire": None
        if cfg.codes
        else f"with --gift-mode {cfg.mode.value} and no --gift-euclidean-layers (nothing is sent in FP8)",
        "policy": None if cfg.policy else f"without --gift-layers {AUTO}",
        "param_gather": None if cfg.param_gather else "without --gift-param-gather delta",
    }
    concerns = flag_concerns()
    out = []
    for k in changed:
        why = absent.get(concerns[k])
        if why and k not in _ANY_MODE:
            out.append((k, why))
        elif k == "gift_block_size" and cfg.wire.codec.scaling is not Scaling.BLOCK:
            out.append((k, f"with --gift-scaling {cfg.wire.codec.scaling.value} (block only)"))
        elif k == "gift_intra_node" and (cfg.exchange.topology is Exchange.FLAT or cfg.wire.error_feedback):
            out.append(
                (k, "with --gift-exchange flat or --gift-error-feedback (one flat exchange, no intra-node stage)")
            )
        elif k == "gift_telemetry_dir" and not cfg.log_interval:
            out.append((k, "without --gift-log-interval"))
        elif k == "gift_rotation" and cfg.wire.rotation is Rotation.AUTO and cfg.whitening is None:
            out.append((k, f"with --gift-mode {cfg.mode.value} (auto chooses per GIFT layer; hadamard rotates all)"))
    return out


def _warn_ineffective_flags(args, cfg: GiftConfig | None) -> None:
    for attr, why in _ineffective_flags(args, cfg):
        value = getattr(args, attr)
        shown = " ".join(map(str, value)) if isinstance(value, list) else "" if value is True else str(value)
        flag = "--" + attr.replace("_", "-")
        print_once(f"megatron-gift: warning: {flag}{' ' + shown if shown else ''} has no effect {why}; ignored")


def _check_megatron_flags(args) -> None:
    """Megatron features that replace or change the reduction megatron-gift takes over."""
    off = "or set --gift-mode off"
    for attr, flag in (
        ("use_megatron_fsdp", "--use-megatron-fsdp"),
        ("use_custom_fsdp", "--use-megatron-fsdp"),  # deprecated alias Megatron's validate_args still sets
        ("use_torch_fsdp2", "--use-torch-fsdp2"),
    ):
        if getattr(args, attr, False):
            raise ValueError(
                f"megatron-gift extends Megatron's DistributedDataParallel and does not support {flag}: "
                f"drop {flag} (use --use-distributed-optimizer for sharded optimizer states) {off}"
            )
    graphs = [
        flag
        for attr, flag in (
            ("enable_cuda_graph", "--enable-cuda-graph"),
            ("external_cuda_graph", "--external-cuda-graph"),
        )
        if getattr(args, attr, False)
    ]
    if getattr(args, "cuda_graph_impl", "none") not in (None, "none"):
        graphs.append(f"--cuda-graph-impl {args.cuda_graph_impl}")
    if graphs:
        raise ValueError(
            f"megatron-gift does not support CUDA graphs ({', '.join(graphs)}): its reduction does not wait on "
            f"graph-replayed weight gradients and graphs do not replay its statistics hooks; drop them {off}"
        )
    instances = getattr(args, "num_distributed_optimizer_instances", 1)
    if instances > 1 and (args.gift_log_interval or AUTO in args.gift_layers):
        raise ValueError(
            f"--num-distributed-optimizer-instances {instances}: megatron-gift's telemetry and --gift-layers {AUTO} "
            "compare with a reduction inside one instance: set --gift-log-interval 0 and choose layers by pattern "
            f"{off}"
        )
    if args.gift_intra_node == IntraNode.REDUCE_SCATTER.value and not getattr(args, "use_distributed_optimizer", False):
        raise ValueError(
            "--gift-intra-node reduce-scatter reduce-scatters the distributed optimizer's equal shards: add "
            "--use-distributed-optimizer or choose --gift-intra-node bf16"
        )
    if getattr(args, "ddp_reduce_scatter_with_fp32_accumulation", False):
        raise ValueError(
            "--ddp-reduce-scatter-with-fp32-accumulation replaces the same collective as megatron-gift "
            f"(which already sums in FP32): drop it {off}"
        )


def _check_param_gather(args) -> None:
    """Megatron features whose parameter all-gather ``--gift-param-gather delta`` cannot code."""
    if args.gift_param_gather != ParamGather.DELTA.value:
        return
    flag, alt = "--gift-param-gather delta", "or use --gift-param-gather bf16"
    if getattr(args, "use_layer_wise_distributed_optimizer", False):
        raise ValueError(
            f"{flag} codes the distributed optimizer's all-gather of equal shards; --optimizer {args.optimizer} uses "
            f"the layer-wise distributed optimizer (whole parameters per rank, uneven gathers): "
            f"use --gift-param-gather bf16"
        )
    for attr, other in (
        ("use_megatron_fsdp", "--use-megatron-fsdp"),
        ("use_custom_fsdp", "--use-megatron-fsdp"),
        ("use_torch_fsdp2", "--use-torch-fsdp2"),
    ):
        if getattr(args, attr, False):
            raise ValueError(
                f"{flag} codes the distributed optimizer's all-gather; {other} gathers parameters its own "
                f"way: drop {other} {alt}"
            )
    if not getattr(args, "use_distributed_optimizer", False):
        raise ValueError(
            f"{flag} codes the distributed optimizer's parameter all-gather: add --use-distributed-optimizer {alt}"
        )
    for attr, other in (("fp8_param_gather", "--fp8-param-gather"), ("fp4_param_gather", "--fp4-param-gather")):
        if getattr(args, attr, False):
            raise ValueError(f"{flag} and {other} both replace the parameter all-gather: drop {other} {alt}")
    if getattr(args, "use_precision_aware_optimizer", False):
        raise ValueError(
            f"{flag} writes the reconstructed weights into each rank's own BF16 shard, which --use-precision-aware-"
            f"optimizer may keep as part of its master weights: drop --use-precision-aware-optimizer {alt}"
        )


def _check_parameters(cfg: GiftConfig, named: list, patterns: dict) -> None:
    """Every pattern selects some parameter, and ``rank`` fits each GIFT layer's input size."""
    names = [n for n, _ in named]
    unmatched = [
        f"{flag} {pat!r}"
        for flag, pats in patterns.items()
        for pat in pats
        if not any(re.search(pat, n) for n in names)
    ]
    if unmatched:
        more = f", ... ({len(names)} in all)" if len(names) > _SHOWN_NAMES else ""
        raise ValueError(
            f"megatron-gift: no parameter name matches {', '.join(unmatched)}: fix or drop the pattern(s). "
            f"Parameter names: {', '.join(names[:_SHOWN_NAMES])}{more}"
        )
    if cfg.whitening is None:  # no GIFT layer
        return
    rank, side = cfg.whitening.rank, cfg.whitening.side
    modes = param_modes(named, cfg)
    narrow = [(n, p.shape[1]) for n, p in named if modes[n] is Mode.GIFT and p.shape[1] < rank]
    if narrow:
        listed = ", ".join(f"{n} (input size {d})" for n, d in narrow[:_SHOWN_NAMES])
        raise ValueError(
            f"--gift-rank {rank} exceeds the input size of GIFT layer(s) {listed}: lower --gift-rank to at most "
            f"{min(d for _, d in narrow)} or leave those layers out of --gift-layers"
        )
    if side is Side.INPUT:
        return
    narrow = [(n, p.shape[0]) for n, p in named if modes[n] is Mode.GIFT and p.shape[0] < rank]
    if narrow:  # the shapes of this rank's shards: a column-parallel weight has d_out/tp rows
        listed = ", ".join(f"{n} (output size {d} on this rank)" for n, d in narrow[:_SHOWN_NAMES])
        raise ValueError(
            f"--gift-side {side.value}: --gift-rank {rank} exceeds the output size of GIFT layer(s) {listed}: "
            f"lower --gift-rank to at most {min(d for _, d in narrow)}, use --gift-side input, or leave those layers "
            "out of --gift-layers"
        )
