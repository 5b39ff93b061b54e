"""The delta parameter gather's inputs: its wire format (``DeltaCodec``) and what its encode and
decode kernels must move and where they run (``DeltaKernels``; their launches and moved over
essential bytes: the meter's, ``metered``). Defaults are the implementation on a GPU,
``comm/param_delta.py`` with ``kernels/delta.py``: one fused encode and one fused decode per bucket,
the decode on a side stream overlapping the next bucket's gather. The decode of the unfused code it
replaced (on the compute stream in the forward pre-hook, ~49 bytes per element) is the same model
with other inputs (``--delta-decode-stream compute --delta-decode-bytes 49.16``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from megatron_gift_tools.planner.cluster import sourced


@dataclass(frozen=True)
class DeltaCodec:
    """Wire format of the delta parameter all-gather: a code per element plus one scale per block. The one
    place the planner reads its bytes per element from."""

    payload_bytes: float = sourced(1.0, "an int8 code per element (comm/param_delta.py)")
    scale_bytes: float = sourced(
        1.0, "one power-of-two scale code (1 B) per block, as OCP's MXINT8 (comm/param_delta.py)"
    )
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
    """The essential HBM bytes of the delta gather's kernels per bucket of ``N`` elements (shard ``S = N/p``),
    one fused pass each (``kernels.delta``), and the decode's stream; the meter's JSON gives their launches and
    moved over essential bytes (``metered.Meter.delta``)."""

    stream: DecodeStream = sourced(
        DecodeStream.SIDE,
        """bucket k's decode is enqueued on a stream of its own
        (``comm.param_delta.DeltaGather``); Megatron's forward pre-hook waits on its event, and the next bucket's
        gather is dispatched right after it (megatron/param_gather.py).""",
    )
    decode_bytes: float = sourced(
        5.03,
        """per element of the bucket: the fused decode (``kernels.delta``'s
        ``TRAFFIC``) reads every rank's codes and scales (1 + 1/32) and each row's BF16 base (2), and writes the
        BF16 parameters (2).""",
    )
    prev_bytes: float = sourced(2.0, "per shard element: the decode also writes the own shard's new base ``prev`` (2)")
    encode_bytes: float = sourced(
        5.03,
        """per shard element: the fused encode reads the new BF16 shard and its
        base ``prev`` (2 + 2) and writes the codes and scales (1 + 1/32) (``kernels.delta``'s ``TRAFFIC``).""",
    )

    def __post_init__(self):
        object.__setattr__(self, "stream", DecodeStream(self.stream))
        if min(self.decode_bytes, self.prev_bytes, self.encode_bytes) < 0:
            raise ValueError(f"DeltaKernels: bytes must be >= 0, got {self}")
