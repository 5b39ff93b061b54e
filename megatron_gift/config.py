"""Configuration: what each parameter's gradient is sent as, and how GIFT's factor is kept.

Frozen dataclasses validated on construction, enums for choices.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field

from .numerics.fp8 import CodecConfig, Scaling


class Exchange(enum.Enum):
    """How a bucket's quantized reduction is exchanged (``comm.topology``): two-level where the
    group spans several nodes with several ranks each (``auto``), or one all-to-all over the group."""

    AUTO = "auto"
    FLAT = "flat"


class IntraNode(enum.Enum):
    """Wire dtype of the two-level exchange's intra-node stage (``comm.hierarchical``), summed in FP32."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP8 = "fp8"


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
    """A rotation composed after GIFT's whitening in the four-bit exchange (``numerics.rotation``):
    none, or a randomized block Hadamard transform of 64 columns (``U = G T H``)."""

    NONE = "none"
    HADAMARD = "hadamard"


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


@dataclass(frozen=True)
class GiftConfig:
    """Everything the plugin needs; see ``megatron_gift.arguments`` for the matching flags.

    ``mode`` defaults to ``off``, as ``--gift-mode`` does: a default ``GiftConfig()`` changes
    nothing (every gradient goes through Megatron's own reduction) until a mode is chosen.

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
    per layer where that measures better); costs in docs/fidelity.md.
    ``layers``: regular expressions on parameter names that select which weights use ``mode``
    (default: the weight matrices of linear layers). ``euclidean_layers`` puts other parameters
    (embeddings, output layer) in plain FP8 as well. ``policy``: when set, ``layers`` are
    candidates whose mode (Euclidean, GIFT or BF16) is chosen from measurement
    (``--gift-layers auto``). ``log_interval``: steps between telemetry records (0: none).
    ``loopback``: a benchmarking switch: quantize even where the reduction group has one rank
    (encode, decode, sum, unwhiten, nothing sent), so one GPU measures the plugin's whole on-GPU
    cost; without it such a group keeps Megatron's reduction and its gradient bit for bit.
    ``exchange``: ``auto`` (two-level where the data-parallel group spans several nodes with
    several ranks each) or ``flat`` (one all-to-all over the group); ``intra_node``: the two-level
    exchange's intra-node dtype; ``inter_node_format``: the coded values' format between nodes (the
    inter-node stage, and the flat exchange): ``fp8`` (``codec``), ``nvfp4`` or ``mxfp4``; ``rotation``:
    with those, ``hadamard`` sends GIFT layers' ``G T H`` (``numerics.rotation.BlockHadamard(64,
    rotation_seed)``, the same signs on every rank from the seed, ``--seed``);
    ``ranks_per_node``: processes per node (None: ``LOCAL_WORLD_SIZE``).
    ``kernels``: whether the reduction uses the fused Triton kernels (None: on CUDA where they are
    available; True: wherever available, the CPU too under Triton's interpreter; False: never).
    ``schedule``: when a bucket's later stages are enqueued (None: ``comm.schedule.default_schedule``,
    eager on CUDA unless ``CUDA_DEVICE_MAX_CONNECTIONS=1``, lagged there and on CPUs).
    ``param_gather``: the distributed optimizer's parameter all-gather (independent of ``mode``);
    ``param_gather_full_every``: with ``delta``, send the update of every N-th iteration in full
    (0: only where replicas cannot be known to agree, docs/param-gather.md);
    ``param_gather_check_every``: with ``delta``, iterations between checks that the replicas hold
    the same weights (a checksum compared over the group; a difference is warned about and the next
    update gathered in full; 0: never; from the command line, Megatron's ``--log-interval``).
    ``allow_untested_megatron``: go on where Megatron-Core functions the plugin depends on differ
    from every release it was checked against (``upstream.check_upstream``).
    """

    mode: Mode = Mode.OFF
    codec: CodecConfig = field(default_factory=CodecConfig)
    rank: int = 32
    sketch: int = 64
    damping: float | None = None
    damping_candidates: tuple[float, ...] = (0.3, 1.0, 3.0, 10.0)
    side: Side = Side.INPUT
    ema: float = 0.95
    refresh_interval: int = 10
    error_feedback: bool = False
    layers: tuple[str, ...] = (r"\.linear_(qkv|proj|fc1|fc2)\.weight$",)
    euclidean_layers: tuple[str, ...] = ()
    policy: PolicyConfig | None = None
    log_interval: int = 0
    loopback: bool = False
    exchange: Exchange = Exchange.AUTO
    intra_node: IntraNode = IntraNode.BF16
    inter_node_format: InterNodeFormat = InterNodeFormat.FP8
    rotation: Rotation = Rotation.NONE
    rotation_seed: int = 0
    ranks_per_node: int | None = None
    kernels: bool | None = None
    schedule: Schedule | None = None
    param_gather: ParamGather = ParamGather.BF16
    param_gather_full_every: int = 0
    param_gather_check_every: int = 100
    allow_untested_megatron: bool = False

    def __post_init__(self):
        enums = (
            ("mode", Mode),
            ("side", Side),
            ("param_gather", ParamGather),
            ("exchange", Exchange),
            ("intra_node", IntraNode),
            ("inter_node_format", InterNodeFormat),
            ("rotation", Rotation),
        )
        for name, kind in enums:
            if not isinstance(getattr(self, name), kind):  # a spelling: the enum's member, or its ValueError
                object.__setattr__(self, name, kind(getattr(self, name)))
        for name in ("param_gather_full_every", "param_gather_check_every"):
            every = getattr(self, name)
            if isinstance(every, bool) or not isinstance(every, int) or every < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: never), got {every!r}")
        if self.error_feedback and self.inter_node_format is not InterNodeFormat.FP8:
            raise ValueError(
                f"error_feedback works with FP8 only (its residual is staged by the FP8 encode), got "
                f"inter_node_format {self.inter_node_format.value}"
            )
        if self.side is not Side.INPUT and self.inter_node_format is not InterNodeFormat.FP8:
            raise ValueError(
                f"the four-bit exchange whitens the input side alone: inter_node_format "
                f"{self.inter_node_format.value} needs side=input (--gift-side input), got {self.side.value}"
            )
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
        if self.log_interval < 0:
            raise ValueError(f"log_interval must be >= 0 (0: off), got {self.log_interval}")
        if self.ranks_per_node is not None and (
            isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1
        ):
            raise ValueError(
                f"ranks_per_node must be an integer >= 1 (None: from LOCAL_WORLD_SIZE), got {self.ranks_per_node!r}"
            )
        if self.schedule is not None and not isinstance(self.schedule, Schedule):
            object.__setattr__(self, "schedule", Schedule(self.schedule))
        if self.kernels not in (None, True, False):
            raise ValueError(f"kernels must be None (auto), True or False, got {self.kernels!r}")
        if self.policy is not None and self.mode is not Mode.GIFT:
            raise ValueError(f"an automatic layer policy needs mode gift (it chooses per layer), got {self.mode.value}")
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "euclidean_layers", tuple(self.euclidean_layers))


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
