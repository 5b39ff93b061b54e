"""What the planner prices besides the machine and the model: schedules, the parameter gather,
which gradients go as FP8, buckets, GIFT's refresh. Defaults are the runtime's (``GiftConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gift.config import INTRA_NODE_DTYPES, GiftConfig, Mode, ParamGather, Schedule, Side
from megatron_gift_tools.planner.choices import FP8Params, MegatronSchedule
from megatron_gift_tools.planner.delta import DeltaCodec, DeltaKernels
from megatron_gift_tools.planner.workloads import GIFT_KINDS

_GIFT = GiftConfig(mode=Mode.GIFT)
SIDES = tuple(s.value for s in Side)  # ``--gift-side``


@dataclass(frozen=True)
class Options:
    """``schedule``: Megatron's; ``gift_schedule``: the plugin's stream schedule; ``param_gather`` and
    ``delta``: the distributed optimizer's parameter all-gather and the delta codec's bytes;
    ``fp8_params``; ``bucket_size`` (None: Megatron's ``max(40M, 1M·DP)``); ``intra_dtype`` of the two-level
    exchange; ``gift_layers``: the linear-layer kinds GIFT whitens; the refresh's interval, sketch and rank, and
    ``side`` (``--gift-side``: ``input``, or ``both``/``auto``: every GIFT layer keeps output statistics too and
    is reduced two-sided, ``stages``; ``auto``, which chooses per layer at each refresh, is priced as ``both``,
    its upper bound);
    ``cpu_waits``: the plugin's waits block the host (CPU/gloo: ``Work.wait()`` is a host wait, so each
    bucket's whole reduction runs inside its hook; the CPU validation only); ``grad_reduce_in_bf16``: the plugin's
    rows keep BF16 gradient buffers (Megatron's ``--grad-reduce-in-bf16``, as the BF16 ring's; default FP32, as
    ``--bf16`` reduces): the sum-first reduce-scatter and an ``fp32`` intra-node stage then send BF16 (never widened);
    the plugin's GPU stages stay priced from the meter's FP32-bucket records (an upper bound)."""

    schedule: MegatronSchedule = MegatronSchedule.OVERLAP
    gift_schedule: Schedule = Schedule.EAGER
    param_gather: ParamGather = ParamGather.BF16
    delta: DeltaCodec = field(default_factory=DeltaCodec)
    delta_kernels: DeltaKernels = field(default_factory=DeltaKernels)
    fp8_params: FP8Params = FP8Params.ALL
    bucket_size: int | None = None
    intra_dtype: str = _GIFT.exchange.intra_node.value
    gift_layers: tuple[str, ...] = GIFT_KINDS
    refresh_interval: int = _GIFT.whitening.refresh_interval
    sketch: int = _GIFT.whitening.sketch
    rank: int = _GIFT.whitening.rank
    side: str = "input"
    cpu_waits: bool = False
    grad_reduce_in_bf16: bool = False

    def __post_init__(self):
        for name, kind in (
            ("schedule", MegatronSchedule),
            ("gift_schedule", Schedule),
            ("param_gather", ParamGather),
            ("fp8_params", FP8Params),
        ):
            object.__setattr__(self, name, kind(getattr(self, name)))
        if self.intra_dtype not in INTRA_NODE_DTYPES:
            raise ValueError(f"intra_dtype must be one of {INTRA_NODE_DTYPES}, got {self.intra_dtype!r}")
        if self.intra_dtype == "reduce-scatter":
            raise ValueError(
                "intra_dtype reduce-scatter is priced in rows of its own (the -2level-rs- modes, with an inter-node "
                "format): the intra-node dtype sets the other two-level rows'"
            )
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1 or None, got {self.bucket_size}")
        if self.side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {self.side!r}")
        if min(self.refresh_interval, self.sketch, self.rank) < 1:
            raise ValueError(f"refresh_interval, sketch and rank must be >= 1, got {self}")
        if self.schedule is MegatronSchedule.SYNC and self.param_gather is ParamGather.DELTA:
            raise ValueError("the delta parameter gather needs the distributed optimizer (schedule overlap)")
