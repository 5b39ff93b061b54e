"""Configuration: what each parameter's gradient is sent as, and how GIFT's factor is kept.

Frozen dataclasses validated on construction, enums for choices.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field, fields

from .numerics.fp8 import CodecConfig, Scaling


class Exchange(enum.Enum):
    """How a bucket's quantized reduction is exchanged (``comm.topology``): two-level where the
    group spans several nodes with several ranks each (``auto``), or one all-to-all over the group."""

    AUTO = "auto"
    FLAT = "flat"


class IntraNode(enum.Enum):
    """The two-level exchange's intra-node stage: the wire dtype of ``G T`` (``comm.hierarchical``),
    summed in FP32; or ``reduce-scatter``, a plain reduce-scatter of ``G`` in the bucket's dtype with
    ``T``, the rotation and the codec on the node's sums (``comm.sum_first``; four bits between nodes)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP8 = "fp8"
    REDUCE_SCATTER = "reduce-scatter"


INTRA_NODE_DTYPES = tuple(d.value for d in IntraNode)
"""The spellings of ``IntraNode`` (flags, the planner's tables)."""


class InterNodeFormat(enum.Enum):
    """Wire format of the coded values between nodes (the two-level exchange's inter-node stage, and
    the flat exchange): FP8 (``--gift-fp8-format``), or four-bit E2M1 with NVFP4's 16-element blocks
    (E4M3 block scales, an FP32 scale per segment) or MXFP4's 32-element blocks (E8M0 scales)."""

    FP8 = "fp8"
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"

    @property
    def block(self) -> int | None:
        """Elements per FP4 block (every boundary of the coded sequence falls on one); None for FP8."""
        return {"nvfp4": 16, "mxfp4": 32}.get(self.value)


class Rotation(enum.Enum):
    """A rotation of coded parameters' rows in the four-bit exchange, composed after GIFT's whitening
    (``numerics.rotation``): none; a randomized block Hadamard transform of 64 columns for every coded
    parameter (``U = G T H``, ``G H`` where Euclidean); or ``auto``: per GIFT layer, on where each
    refresh measures a smaller error with it on the owner's gradient (other parameters unrotated)."""

    NONE = "none"
    HADAMARD = "hadamard"
    AUTO = "auto"


class Schedule(enum.Enum):
    """When a bucket's later reduction stages are enqueued (``comm.schedule``): all at the bucket's
    hook, or one further stage per later bucket (for one hardware queue and for CPUs)."""

    EAGER = "eager"
    LAGGED = "lagged"


class Mode(enum.Enum):
    """Per-parameter gradient communication: Megatron's own precision, BF16, plain FP8, or whitened FP8."""

    OFF = "off"
    BF16 = "bf16"
    EUCLIDEAN = "euclidean"
    GIFT = "gift"


class Side(enum.Enum):
    """Which sides of a GIFT layer's gradient are whitened (``numerics.two_sided``): the input side
    alone (``T_in``, from ``A``), or both (``T_outᵀ G T_in``, ``T_out`` from ``B = E[g gᵀ]`` over the
    layer's output gradients, collected in the backward); ``auto`` chooses per layer at each refresh
    between the input side alone and both, with the damping."""

    INPUT = "input"
    BOTH = "both"
    AUTO = "auto"


class ParamGather(enum.Enum):
    """The distributed optimizer's parameter all-gather: Megatron's own (BF16 with ``--bf16``), or
    each shard's coded change since the last gather (``comm.param_delta``, ~1 byte per element)."""

    BF16 = "bf16"
    DELTA = "delta"


@dataclass(frozen=True)
class PolicyConfig:
    """How ``--gift-layers auto`` picks each layer's mode from its profiles (``policy.LayerPolicy``).

    ``margin``: relative gain GIFT needs over Euclidean (and the BF16 return band);
    ``hysteresis``: consecutive profiles before a switch; ``bf16_bound``: FP8 RelL2 above which
    the layer goes BF16 (``math.inf``: never); profiles are taken on the first ``profile_steps``
    steps, then every ``profile_interval`` steps."""

    margin: float = 0.05
    hysteresis: int = 2
    bf16_bound: float = 0.1
    profile_steps: int = 8
    profile_interval: int = 10

    def __post_init__(self):
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        for name in ("hysteresis", "profile_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.profile_steps < 0:
            raise ValueError(f"profile_steps must be >= 0, got {self.profile_steps}")
        if not self.bf16_bound > 0 or math.isnan(self.bf16_bound):
            raise ValueError(f"bf16_bound must be > 0, got {self.bf16_bound}")

    def is_profile_step(self, step: int) -> bool:
        return step < self.profile_steps or step % self.profile_interval == 0


def _enum(obj, name: str, kind) -> None:
    """Accept an enum's spelling for a frozen dataclass field (its member, or its ValueError)."""
    if not isinstance(getattr(obj, name), kind):
        object.__setattr__(obj, name, kind(getattr(obj, name)))


def _count(name: str, value, least: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}{why}, got {value!r}")


@dataclass(frozen=True)
class WireConfig:
    """What the coded values are on the wire: the FP8 ``codec``; between nodes (the two-level
    exchange's inter-node stage, and the flat exchange) ``inter_node_format``: ``fp8`` (``codec``),
    ``nvfp4`` or ``mxfp4``; with those, ``rotation`` ``hadamard`` sends every coded parameter's ``G T H``
    (``G H`` where Euclidean; ``numerics.rotation.BlockHadamard(64, rotation_seed)``, the same signs on
    every rank from the seed, ``--seed``); ``error_feedback`` carries each rank's rounding error of
    what it sends into the next step (kept in the whitened coordinates, before any rotation)."""

    codec: CodecConfig = field(default_factory=CodecConfig)
    inter_node_format: InterNodeFormat = InterNodeFormat.FP8
    rotation: Rotation = Rotation.NONE
    rotation_seed: int = 0
    error_feedback: bool = False

    def __post_init__(self):
        _enum(self, "inter_node_format", InterNodeFormat)
        _enum(self, "rotation", Rotation)
        if self.inter_node_format is not InterNodeFormat.FP8 and self.codec.scaling is Scaling.TENSOR:
            raise ValueError(
                f"inter_node_format {self.inter_node_format.value} cuts the coded values at whole FP8 scaling "
                "groups, which tensor scaling does not have: use --gift-scaling block, row or mx"
            )
        if self.rotation is not Rotation.NONE and self.inter_node_format is InterNodeFormat.FP8:
            raise ValueError(
                f"rotation {self.rotation.value} is applied by the four-bit exchange only: it needs "
                "inter_node_format nvfp4 or mxfp4"
            )


@dataclass(frozen=True)
class WhiteningConfig:
    """How GIFT's whitening factor is kept (present in GIFT mode only).

    ``ema``: per-step decay of the input statistics' EMA (every step folds its statistics in).
    ``refresh_interval``: steps between factor rebuilds from that EMA (before the first interval
    also at steps 1, 2, 4, ...). ``damping``: added to the factor's diagonal, relative to
    mean(diag A); ``None`` (``--gift-damping auto``) chooses it per layer at every rebuild among
    ``damping_candidates`` and Euclidean (no whitening), from the error each gives on the factor
    owner's own gradient (``numerics.profile.choose_damping``). Defaults: docs/fidelity.md.
    ``sketch``: columns of the Nyström sketch of ``XᵀX`` that is kept and summed over ranks
    instead of the full matrix (0: exact ``XᵀX``). ``side``: ``input`` whitens each GIFT layer's
    gradient from its input statistics alone; ``both`` / ``auto`` also keep statistics of its output
    gradients (the same ``ema``, ``sketch`` and ``rank``) and whiten the output side too (``auto``:
    per layer where that measures better); costs in docs/fidelity.md."""

    rank: int = 32
    sketch: int = 64
    damping: float | None = None
    damping_candidates: tuple[float, ...] = (0.3, 1.0, 3.0, 10.0)
    side: Side = Side.INPUT
    ema: float = 0.95
    refresh_interval: int = 10

    def __post_init__(self):
        _enum(self, "side", Side)
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if self.sketch and self.sketch < self.rank:
            raise ValueError(f"sketch ({self.sketch}) must be 0 (exact statistics) or >= rank ({self.rank})")
        if self.damping is not None and not self.damping > 0:
            raise ValueError(f"damping must be > 0 or auto, got {self.damping}")
        object.__setattr__(self, "damping_candidates", tuple(self.damping_candidates))
        if not self.damping_candidates or not all(c > 0 for c in self.damping_candidates):
            raise ValueError(f"damping_candidates must be positive, got {self.damping_candidates}")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {self.ema}")
        if self.refresh_interval < 1:
            raise ValueError(f"refresh_interval must be >= 1, got {self.refresh_interval}")

    @property
    def two_sided(self) -> bool:
        """Whether GIFT layers keep output statistics: ``side`` both / auto with a low-rank part (a
        rank-0 ``T_out`` is diagonal: it scales whole rows, which the codec's scales already do)."""
        return self.side is not Side.INPUT and self.rank > 0


@dataclass(frozen=True)
class ExchangeConfig:
    """How a bucket's reduction runs. ``topology``: ``auto`` (two-level where the data-parallel group
    spans several nodes with several ranks each) or ``flat`` (one all-to-all over the group);
    ``intra_node``: the two-level exchange's intra-node dtype; ``ranks_per_node``: processes per node
    (None: ``LOCAL_WORLD_SIZE``). ``kernels``: whether the fused Triton kernels run (None: on CUDA
    where they are available; True: wherever available, the CPU too under Triton's interpreter;
    False: never). ``schedule``: when a bucket's later stages are enqueued (None:
    ``comm.schedule.default_schedule``, eager on CUDA unless ``CUDA_DEVICE_MAX_CONNECTIONS=1``,
    lagged there and on CPUs). ``loopback``: a benchmarking switch: quantize even where the reduction
    group has one rank (encode, decode, sum, unwhiten, nothing sent), so one GPU measures the plugin's
    whole on-GPU cost; without it such a group keeps Megatron's reduction and its gradient bit for bit.
    ``inflight_mb``: the bytes of message buffers in flight, in MiB (``comm.schedule.Arena``; None:
    two of the largest bucket's, at most a step's, so one bucket's exchange runs while the next is encoded)."""

    topology: Exchange = Exchange.AUTO
    intra_node: IntraNode = IntraNode.BF16
    ranks_per_node: int | None = None
    schedule: Schedule | None = None
    kernels: bool | None = None
    loopback: bool = False
    inflight_mb: int | None = None

    def __post_init__(self):
        _enum(self, "topology", Exchange)
        if self.inflight_mb is not None:
            _count("inflight_mb", self.inflight_mb, 1, " (None: sized from the buckets)")
        _enum(self, "intra_node", IntraNode)
        if self.ranks_per_node is not None:
            _count("ranks_per_node", self.ranks_per_node, 1, " (None: from LOCAL_WORLD_SIZE)")
        if self.schedule is not None:
            _enum(self, "schedule", Schedule)
        if self.kernels not in (None, True, False):
            raise ValueError(f"kernels must be None (auto), True or False, got {self.kernels!r}")


@dataclass(frozen=True)
class DeltaGatherConfig:
    """The distributed optimizer's parameter all-gather as each shard's coded change since the last
    gather (``comm.param_delta``, ~1 byte per element; absent: Megatron's own). ``full_every``: send
    the update of every N-th iteration in full (0: only where replicas cannot be known to agree,
    docs/param-gather.md); ``check_every``: iterations between checks that the replicas hold the same
    weights (a checksum compared over the group; a difference is warned about and the next update
    gathered in full; 0: never; from the command line, Megatron's ``--log-interval``)."""

    full_every: int = 0
    check_every: int = 100

    def __post_init__(self):
        _count("param_gather_full_every", self.full_every, 0, " (0: never)")
        _count("param_gather_check_every", self.check_every, 0, " (0: never)")


# The flat keyword names (today's flags' and the earlier flat GiftConfig's) -> (sub-config, its field).
FLAT_FIELDS: dict[str, tuple[str, str]] = {
    **{name: ("wire", name) for name in ("codec", "inter_node_format", "rotation", "rotation_seed", "error_feedback")},
    **{
        name: ("whitening", name)
        for name in ("rank", "sketch", "damping", "damping_candidates", "side", "ema", "refresh_interval")
    },
    "exchange": ("exchange", "topology"),
    **{
        name: ("exchange", name)
        for name in ("intra_node", "ranks_per_node", "schedule", "kernels", "loopback", "inflight_mb")
    },
    "param_gather_full_every": ("param_gather", "full_every"),
    "param_gather_check_every": ("param_gather", "check_every"),
}
_SUB_CONFIGS = {
    "wire": WireConfig,
    "whitening": WhiteningConfig,
    "exchange": ExchangeConfig,
    "param_gather": DeltaGatherConfig,
}


@dataclass(frozen=True)
class GiftConfig:
    """Everything the plugin needs, by concern; ``megatron_gift.arguments`` has the matching flags,
    :meth:`build` takes them flat (``GiftConfig.build(mode="gift", rank=16, exchange="flat")``).

    ``mode`` defaults to ``off``, as ``--gift-mode`` does: a default ``GiftConfig()`` changes
    nothing (every gradient goes through Megatron's own reduction) until a mode is chosen.
    ``layers``: regular expressions on parameter names that select which weights use ``mode``
    (default: the weight matrices of linear layers). ``euclidean_layers`` puts other parameters
    (embeddings, output layer) in plain FP8 as well. ``wire``: what the coded values are;
    ``whitening``: GIFT's factor (present exactly in GIFT mode); ``policy``: when set (GIFT mode
    only), ``layers`` are candidates whose mode (Euclidean, GIFT or BF16) is chosen from
    measurement (``--gift-layers auto``); ``exchange``: how a bucket's reduction runs;
    ``param_gather``: the distributed optimizer's parameter all-gather, independent of ``mode``
    (None: Megatron's own); ``log_interval``: steps between telemetry records (0: none).
    ``allow_untested_megatron``: go on where Megatron-Core functions the plugin depends on differ
    from every release it was checked against (``upstream.check_upstream``).
    """

    mode: Mode = Mode.OFF
    layers: tuple[str, ...] = (r"\.linear_(qkv|proj|fc1|fc2)\.weight$",)
    euclidean_layers: tuple[str, ...] = ()
    wire: WireConfig = field(default_factory=WireConfig)
    whitening: WhiteningConfig | None = None
    policy: PolicyConfig | None = None
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)
    param_gather: DeltaGatherConfig | None = None
    log_interval: int = 0
    allow_untested_megatron: bool = False

    def __post_init__(self):
        _enum(self, "mode", Mode)
        if self.mode is Mode.GIFT and self.whitening is None:
            object.__setattr__(self, "whitening", WhiteningConfig())
        if self.whitening is not None and self.mode is not Mode.GIFT:
            raise ValueError(f"whitening settings (rank, sketch, damping, ...) need mode gift, got {self.mode.value}")
        if self.policy is not None and self.mode is not Mode.GIFT:
            raise ValueError(f"an automatic layer policy needs mode gift (it chooses per layer), got {self.mode.value}")
        if (
            self.whitening is not None
            and self.whitening.side is not Side.INPUT
            and self.wire.inter_node_format is not InterNodeFormat.FP8
        ):
            raise ValueError(
                f"the four-bit exchange whitens the input side alone: inter_node_format "
                f"{self.wire.inter_node_format.value} needs side=input (--gift-side input), got "
                f"{self.whitening.side.value}"
            )
        if self.exchange.intra_node is IntraNode.REDUCE_SCATTER and self.wire.inter_node_format is InterNodeFormat.FP8:
            raise ValueError(
                "intra_node reduce-scatter whitens the node's sums, which the four-bit exchange does: it needs "
                "inter_node_format nvfp4 or mxfp4"
            )
        if self.log_interval < 0:
            raise ValueError(f"log_interval must be >= 0 (0: off), got {self.log_interval}")
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "euclidean_layers", tuple(self.euclidean_layers))

    @property
    def codes(self) -> bool:
        """Whether anything is sent coded (FP8 or four bits): ``wire`` is read only then."""
        return self.mode in (Mode.EUCLIDEAN, Mode.GIFT) or (self.mode is not Mode.OFF and bool(self.euclidean_layers))

    @classmethod
    def build(cls, **flat) -> GiftConfig:
        """A configuration from flat settings: the sub-configs' fields by their flat names
        (``FLAT_FIELDS``: ``rank``, ``codec``, ``exchange`` (the topology), ...), ``param_gather``
        ``"delta"`` / ``"bf16"``, and ``GiftConfig``'s other fields. As the flags do, whitening settings
        apply in mode gift only (elsewhere they have no effect: no ``whitening``), the delta gather's
        with ``param_gather`` delta only."""
        gather = ParamGather(flat.pop("param_gather", ParamGather.BF16))
        top, parts = {}, {}
        for name, value in flat.items():
            if name in FLAT_FIELDS:
                part, key = FLAT_FIELDS[name]
                parts.setdefault(part, {})[key] = value
            elif name in _TOP and name not in _SUB_CONFIGS:
                top[name] = value
            else:
                raise TypeError(f"GiftConfig.build() got an unexpected setting {name!r}")
        delta = parts.pop("param_gather", {})
        if gather is ParamGather.DELTA:
            top["param_gather"] = DeltaGatherConfig(**delta)
        if Mode(top.get("mode", Mode.OFF)) is not Mode.GIFT:
            parts.pop("whitening", None)
        return cls(**top, **{part: _SUB_CONFIGS[part](**values) for part, values in parts.items()})

    def flat(self) -> dict:
        """The settings as :meth:`build` takes them (``build(**cfg.flat()) == cfg``)."""
        out = {k: getattr(self, k) for k in _TOP if k not in _SUB_CONFIGS and k != "policy"}
        out["policy"] = self.policy
        for name, (part, key) in FLAT_FIELDS.items():
            sub = getattr(self, part)
            if sub is not None:
                out[name] = getattr(sub, key)
        out["param_gather"] = ParamGather.BF16 if self.param_gather is None else ParamGather.DELTA
        return out

    def replace(self, **flat) -> GiftConfig:
        """This configuration with the flat settings changed (:meth:`build`'s)."""
        return GiftConfig.build(**{**self.flat(), **flat})


_TOP = tuple(f.name for f in fields(GiftConfig))


def param_modes(named_params, cfg: GiftConfig) -> dict[str, Mode]:
    """Mode of each parameter by name: ``cfg.layers`` → ``cfg.mode``, ``cfg.euclidean_layers`` →
    Euclidean, the rest off. GIFT needs a 2-D weight; other shapes fall back to Euclidean. (With a
    policy, the GIFT ones are its candidates, starting Euclidean.)"""
    modes = {}
    for name, p in named_params:
        if any(re.search(pat, name) for pat in cfg.layers):
            mode = cfg.mode
            if mode is Mode.GIFT and p.dim() != 2:
                mode = Mode.EUCLIDEAN
        elif any(re.search(pat, name) for pat in cfg.euclidean_layers):
            mode = Mode.EUCLIDEAN
        else:
            mode = Mode.OFF
        modes[name] = mode
    return modes
