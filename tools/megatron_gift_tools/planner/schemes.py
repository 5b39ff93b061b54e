"""The gradient-reduction schemes the planner prices: Megatron's rings and the plugin's modes
(``config.Mode``) over the flat or the two-level exchange; and, priced only on request
(``--inter-node-format``, issue 36), two-level exchanges whose inter-node stage is FP4 (``fp4``), whitening
at the sender or, with the distributed optimizer, after a plain reduce-scatter inside the node (``-rs-``)."""

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
    EUCLIDEAN_2LEVEL_NVFP4 = "euclidean-2level-nvfp4"
    GIFT_2LEVEL_NVFP4 = "gift-2level-nvfp4"
    EUCLIDEAN_2LEVEL_MXFP4 = "euclidean-2level-mxfp4"
    GIFT_2LEVEL_MXFP4 = "gift-2level-mxfp4"
    EUCLIDEAN_2LEVEL_RS_NVFP4 = "euclidean-2level-rs-nvfp4"
    GIFT_2LEVEL_RS_NVFP4 = "gift-2level-rs-nvfp4"
    EUCLIDEAN_2LEVEL_RS_MXFP4 = "euclidean-2level-rs-mxfp4"
    GIFT_2LEVEL_RS_MXFP4 = "gift-2level-rs-mxfp4"

    @property
    def mode(self) -> Mode:
        """The plugin's mode; ``Mode.OFF`` for Megatron's own ring (FP32 or BF16)."""
        return _MODES[self]

    @property
    def two_level(self) -> bool:
        return "-2level" in self.value

    @property
    def sum_first(self) -> bool:
        """Whether the node's ranks reduce-scatter ``G`` before ``T`` (``--gift-intra-node reduce-scatter``,
        ``comm.sum_first``: the distributed optimizer's, four bits between nodes)."""
        return "-2level-rs-" in self.value

    @property
    def inter_format(self) -> str | None:
        """The inter-node stage's FP4 format (``fp4.FORMATS``); None: FP8, as the runtime sends it."""
        return self.value.partition("-2level-")[2].removeprefix("rs-") or None

    @property
    def ring_bytes(self) -> float:
        """Bytes per element of Megatron's ring (plugin schemes: not a ring)."""
        return {"fp32": 4.0, "bf16": 2.0}[self.value]

    @property
    def label(self) -> str:
        if self.mode is Mode.OFF:
            return f"{self.value.upper()} ring"
        name = {Mode.EUCLIDEAN: "Euclidean", Mode.GIFT: "GIFT"}[self.mode]
        if self.inter_format:
            return f"{name} two-level {self.inter_format.upper()} inter-node"
        return f"{name} FP8 {'two-level' if self.two_level else 'flat'}"


_MODES = {
    s: {"euclidean": Mode.EUCLIDEAN, "gift": Mode.GIFT}.get(s.value.partition("-2level")[0], Mode.OFF) for s in Scheme
}
BASE = tuple(s for s in Scheme if s.inter_format is None)
"""the schemes every plan prices (the runtime's); the FP4 ones only with an inter-node format (``schemes``)."""


def schemes(inter_format: str | None = None, sum_first: bool = True) -> tuple[Scheme, ...]:
    """The schemes a plan prices: ``BASE``, then the two-level ones in ``inter_format`` (FP4) if given, those
    that sum first only with ``sum_first`` (the distributed optimizer's reduce-scatter)."""
    return BASE + tuple(
        s for s in Scheme if inter_format and s.inter_format == inter_format and (sum_first or not s.sum_first)
    )


PLUGIN = (Scheme.EUCLIDEAN_2LEVEL, Scheme.GIFT_2LEVEL, Scheme.EUCLIDEAN, Scheme.GIFT)
"""the plugin's schemes, in the order of preference on ties (one rank per node: two-level is flat)."""
