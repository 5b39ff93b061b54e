"""The delta parameter gather's inputs: its wire format (``DeltaCodec``) and what its encode and
decode kernels cost and where they run (``DeltaKernels``). Defaults are today's implementation,
``comm/param_delta.py``: the decode on the compute stream inside Megatron's forward pre-hook, the
next bucket's encode and all-gather dispatched after it, ~49 bytes of HBM traffic per element.
A fused decode on a side stream is the same model with other inputs
(``--delta-decode-stream side --delta-decode-bytes 5.03``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .cluster import sourced


@dataclass(frozen=True)
class DeltaCodec:
    """Wire format of the delta parameter all-gather: a code per element plus one scale per block. The one
    place the planner reads its bytes per element from."""

    payload_bytes: float = sourced(1.0, "an int8 code per element (comm/param_delta.py)")
    scale_bytes: float = sourced(1.0, "one power-of-two scale code (1 B) per block, as OCP's MXINT8 (comm/param_delta.py)")
    block: int = sourced(32, "elements per scale: comm/param_delta.py's BLOCK (OCP MX's 32)")

    @property
    def bytes_per_element(self) -> float:
        return self.payload_bytes + self.scale_bytes / self.block


class DecodeStream(enum.Enum):
    """Where bucket k's decode runs. ``compute``: on the compute stream in the forward pre-hook, after its
    all-gather; bucket k+1's encode follows it there and its all-gather waits for that encode. ``side``: on
    a stream of its own; the forward waits on an event, the next bucket's encode and gather do not wait."""

    COMPUTE = "compute"
    SIDE = "side"


@dataclass(frozen=True)
class DeltaKernels:
    """Launches and HBM bytes of the delta gather's kernels per bucket of ``N`` elements (shard ``S = N/p``)
    and the decode's stream: counted from the torch operations of ``comm/param_delta.py`` (each
    operation's reads and writes; the launches beyond the bytes priced at ``Cluster.launch_s``)."""

    stream: DecodeStream = sourced(DecodeStream.COMPUTE, """the decode runs in ``_Gathered.wait()``, which
        Megatron's ``finish_param_sync`` calls in the forward pre-hook, on the compute stream, before it
        dispatches the next bucket's gather (comm/param_delta.py, megatron/param_gather.py).""")
    decode_bytes: float = sourced(49.16, """per element of the bucket: ``decode_into`` widens the base to
        FP32 (2 + 4), builds the units from its exponent bits (4 + 4, 4 + 4), clamps them by the block scales
        (4 + 4 + 5/32), adds codes times units (4 + 4 + 1 + 4), writes the parameters back (4 + 2).""")
    prev_bytes: float = sourced(4.0, "per shard element: the decode copies the own shard into ``prev`` (2 + 2)")
    decode_launches: int = sourced(10, "``decode_into``'s nine elementwise operations and the copy into ``prev``")
    encode_bytes: float = sourced(129.0, """per shard element: ``encode``'s FP32 widening of the new shard and
        ``prev``, the difference, the half spacings, the far-block maxima, the division by the units, rounding,
        the casts to codes, and the own shard put back to ``prev``.""")
    encode_launches: int = sourced(33, "``encode``'s operations (about a dozen on the per-block scales) and the copy back")

    def __post_init__(self):
        object.__setattr__(self, "stream", DecodeStream(self.stream))
        if min(self.decode_bytes, self.prev_bytes, self.encode_bytes, self.decode_launches, self.encode_launches) < 0:
            raise ValueError(f"DeltaKernels: bytes and launches must be >= 0, got {self}")
