"""Megatron's gradient buckets and the bytes each scheme puts on the wire for them."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from megatron_gift.comm.layout import wire_bytes
from megatron_gift.config import INTRA_NODE_DTYPES, Mode
from megatron_gift.numerics.fp8 import CodecConfig
from megatron_gift_tools.planner import fp4
from megatron_gift_tools.planner.choices import FP8Params
from megatron_gift_tools.planner.schemes import Scheme
from megatron_gift_tools.planner.workloads import LINEAR_KINDS, Workload, is_kind


@dataclass
class Bucket:
    """One gradient bucket: elements, compute FLOPs per token of its parameters, wire bytes of the scheme
    (full buffer, before ``(p-1)/p``), bytes in each intra-node dtype (two-level stage 1), GIFT elements,
    parameters (the layout's segments: launches grow with them), GIFT parameters and their shapes ``(rows, cols)``
    (a two-sided one's ``P``: ``stages``)."""

    elements: int = 0
    flops_per_token: float = 0.0
    wire_bytes: float = 0.0
    intra_bytes: dict = field(default_factory=lambda: dict.fromkeys(INTRA_NODE_DTYPES, 0.0))
    gift_elements: int = 0
    parameters: int = 0
    gift_parameters: int = 0
    gift_shapes: list = field(default_factory=list)
    inter_bytes: float | None = None  # the two-level exchange's inter-node messages (None: wire_bytes; FP4: ``fp4``)


def param_bytes(scheme: Scheme, name: str, shape: tuple[int, int], fp8_params: FP8Params, codec: CodecConfig) -> float:
    """Bytes ``scheme`` sends for one parameter's gradient (``comm.layout.wire_bytes``: Megatron's ring in
    its dtype, the plugin's in ``codec``); with ``fp8_params=linear`` the others go as BF16."""
    if scheme.mode is Mode.OFF:
        return wire_bytes(Mode.OFF, *shape, codec, scheme.ring_bytes)
    fp8 = fp8_params is FP8Params.ALL or is_kind(name, LINEAR_KINDS)
    return wire_bytes(scheme.mode if fp8 else Mode.BF16, *shape, codec)


def intra_param_bytes(
    dtype: str, scheme: Scheme, name: str, shape, fp8_params: FP8Params, codec: CodecConfig, bf16: bool = False
) -> float:
    """Bytes of one parameter in the two-level exchange's intra-node stage in ``dtype`` (fp8: the scheme's;
    reduce-scatter: the bucket's gradient as the collective sums it, FP32, or BF16 with ``bf16``, BF16 gradient
    buffers, which an ``fp32`` stage never widens either)."""
    if dtype in ("reduce-scatter", "fp32"):
        dtype = "bf16" if bf16 else "fp32"
    if dtype == "fp8":
        return param_bytes(scheme, name, shape, fp8_params, codec)
    return param_bytes(Scheme(dtype), name, shape, fp8_params, codec)


def inter_param_bytes(scheme: Scheme, name: str, shape, fp8_params: FP8Params, codec: CodecConfig) -> float:
    """Bytes of one parameter in the two-level exchange's inter-node stage: ``scheme``'s FP4 format for the
    parameters it sends as FP8 elsewhere, else ``param_bytes``."""
    fp8 = fp8_params is FP8Params.ALL or is_kind(name, LINEAR_KINDS)
    if scheme.inter_format and fp8:
        return fp4.FORMATS[scheme.inter_format].param_bytes(*shape)
    return param_bytes(scheme, name, shape, fp8_params, codec)


@functools.lru_cache(maxsize=256)
def buckets(
    w: Workload,
    scheme: Scheme,
    dp: int,
    fp8_params: FP8Params = FP8Params.ALL,
    bucket_size: int | None = None,
    gift_layers: tuple[str, ...] = ("fc2",),
    codec: CodecConfig = CodecConfig(),
    bf16: bool = False,
) -> tuple[Bucket, ...]:
    """Megatron's gradient buckets (backward order: parameters reversed, a bucket closes once it holds
    ``bucket_size`` elements, default ``max(40M, 1M·dp)`` as ``DistributedDataParallel``'s) with the bytes
    (coded in ``codec``; ``bf16``: BF16 gradient buffers, ``intra_param_bytes``). Cached (the planner
    prices one layout many times): do not modify the buckets returned."""
    size = bucket_size or max(40_000_000, 1_000_000 * dp)
    out = [Bucket()]
    for name, shape, flops in reversed(w.parameters()):
        b = out[-1]
        b.elements += shape[0] * shape[1]
        b.parameters += 1
        b.flops_per_token += flops
        b.wire_bytes += param_bytes(scheme, name, shape, fp8_params, codec)
        b.inter_bytes = (b.inter_bytes or 0.0) + inter_param_bytes(scheme, name, shape, fp8_params, codec)
        for dtype in INTRA_NODE_DTYPES:
            b.intra_bytes[dtype] += intra_param_bytes(dtype, scheme, name, shape, fp8_params, codec, bf16)
        if scheme.mode is Mode.GIFT and is_kind(name, gift_layers):
            b.gift_elements += shape[0] * shape[1]
            b.gift_parameters += 1
            b.gift_shapes.append(shape)
        if b.elements >= size:
            out.append(Bucket())
    return tuple(b for b in out if b.elements or b.flops_per_token)
