"""Configuration: what each parameter's gradient is sent as, and how GIFT's factor is kept.

Frozen dataclasses validated on construction, enums for choices.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .numerics.fp8 import CodecConfig


class Mode(enum.Enum):
    """Per-parameter gradient communication: Megatron's own precision, BF16, plain FP8, or whitened FP8."""

    OFF = "off"
    BF16 = "bf16"
    EUCLIDEAN = "euclidean"
    GIFT = "gift"


@dataclass(frozen=True)
class GiftConfig:
    """Everything the plugin needs; see ``megatron_gift.arguments`` for the matching flags.

    ``refresh_interval``: steps between factor refreshes (before the first interval also at
    steps 1, 2, 4, ..., each replacing the factor; later refreshes fold into the ``ema``).
    ``sketch``: columns of the Nyström sketch of ``XᵀX`` that is kept and summed over ranks
    instead of the full matrix (0: exact ``XᵀX``). ``layers``: regular expressions on parameter names that select which weights use ``mode``
    (default: the weight matrices of linear layers). ``extra_layers`` puts other parameters
    (embeddings, output layer) in plain FP8 as well.
    """

    mode: Mode = Mode.GIFT
    codec: CodecConfig = field(default_factory=CodecConfig)
    rank: int = 32
    sketch: int = 64
    damping: float = 1e-3
    ema: float = 0.95
    refresh_interval: int = 50
    error_feedback: bool = False
    layers: tuple[str, ...] = (r"\.linear_(qkv|proj|fc1|fc2)\.weight$",)
    euclidean_layers: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.mode, Mode):
            object.__setattr__(self, "mode", Mode(self.mode))
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if self.sketch and self.sketch < self.rank:
            raise ValueError(f"sketch ({self.sketch}) must be 0 (exact statistics) or >= rank ({self.rank})")
        if self.damping <= 0:
            raise ValueError(f"damping must be > 0, got {self.damping}")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {self.ema}")
        if self.refresh_interval < 1:
            raise ValueError(f"refresh_interval must be >= 1, got {self.refresh_interval}")
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "euclidean_layers", tuple(self.euclidean_layers))
