"""FP4 inter-node wire formats the planner prices (issue 36 item 6): bytes per parameter of the two-level
exchange's inter-node stage. The runtime's ``numerics.fp4.FP4Format`` is not imported (the planner imports
no runtime module): the bytes are defined here and tested against a hand count.

nvfp4: 4-bit E2M1 codes (0.5 B per element), an E4M3 scale per block of 16 elements (1/16 B per element) and
an FP32 scale per segment (one per parameter, 4 B). mxfp4: the codes and an E8M0 scale per block of 32
(1/32 B per element), no segment scale. The GPU stages of nvfp4's reduce-scatter rows are the launch meter's
records of the runtime's FP4 exchange (its codec and rotation have kernels, ``kernels/fp4.py``; ``G T`` and
``T⁻¹`` are PyTorch's); the other FP4 rows' are the meter's FP8 stages at the FP4 bytes (``stages``,
``metered``)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class FP4:
    """One FP4 format: ``block`` elements per 1-byte block scale, ``segment_scale_bytes`` per parameter."""

    block: int
    segment_scale_bytes: int

    def param_bytes(self, rows: int, cols: int) -> float:
        """Bytes of one ``[rows, cols]`` parameter's gradient: codes, block scales (a partial last block has
        one too) and the segment's scale."""
        n = rows * cols
        return n / 2 + math.ceil(n / self.block) + self.segment_scale_bytes


FORMATS = {"nvfp4": FP4(block=16, segment_scale_bytes=4), "mxfp4": FP4(block=32, segment_scale_bytes=0)}
NOTE = (
    "FP4 inter-node rows ({fmt}: 0.5 B codes + 1/{block} B block scale per element{segment}) are never "
    "recommended: the runtime's FP4 exchange has not run on a GPU yet; their GPU stages are {stages}\n"
)
METERED = "the meter's records of it (reduce-scatter; all-reduce: the meter's FP8 ones at the FP4 bytes)"
UNMETERED = "the meter's FP8 ones at the FP4 bytes (the meter records the nvfp4 exchange only)"


def note(fmt: str) -> str:
    """The output's line on the FP4 rows' pricing."""
    f = FORMATS[fmt]
    segment = f" + {f.segment_scale_bytes} B FP32 scale per parameter" if f.segment_scale_bytes else ""
    return NOTE.format(fmt=fmt, block=f.block, segment=segment, stages=METERED if fmt == "nvfp4" else UNMETERED)
