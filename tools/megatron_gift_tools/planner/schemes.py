"""The gradient-reduction schemes the planner prices: Megatron's rings and the plugin's modes
(``config.Mode``) over the flat or the two-level exchange."""

from __future__ import annotations

import enum

from megatron_gift.config import Mode


class Scheme(enum.Enum):
    """How one step's gradients are reduced (the value is the key in tables and JSON)."""

    FP32 = "fp32"
    BF16 = "bf16"
    EUCLIDEAN = "euclidean"
    GIFT = "gift"
    EUCLIDEAN_2LEVEL = "euclidean-2level"
    GIFT_2LEVEL = "gift-2level"

    @property
    def mode(self) -> Mode:
        """The plugin's mode; ``Mode.OFF`` for Megatron's own ring (FP32 or BF16)."""
        return _MODES[self]

    @property
    def two_level(self) -> bool:
        return self.value.endswith("-2level")

    @property
    def ring_bytes(self) -> float:
        """Bytes per element of Megatron's ring (plugin schemes: not a ring)."""
        return {"fp32": 4.0, "bf16": 2.0}[self.value]

    @property
    def label(self) -> str:
        if self.mode is Mode.OFF:
            return f"{self.value.upper()} ring"
        name = {Mode.EUCLIDEAN: "Euclidean", Mode.GIFT: "GIFT"}[self.mode]
        return f"{name} FP8 {'two-level' if self.two_level else 'flat'}"


_MODES = {
    s: {"euclidean": Mode.EUCLIDEAN, "gift": Mode.GIFT}.get(s.value.removesuffix("-2level"), Mode.OFF) for s in Scheme
}
PLUGIN = (Scheme.EUCLIDEAN_2LEVEL, Scheme.GIFT_2LEVEL, Scheme.EUCLIDEAN, Scheme.GIFT)
"""the plugin's schemes, in the order of preference on ties (one rank per node: two-level is flat)."""
