"""Fused Triton kernels for the two hot paths of a GIFT gradient exchange, with the pure-PyTorch
code as reference and fallback:

- sender, ``whiten_encode``: ``U = G T`` (``+ e`` with error feedback, the new residual written)
  and its FP8 codes and scales in one pass over ``G`` after the small ``G Q`` (1x128 block scales;
  MX scaling, and TENSOR/ROW without ``lengths``, take two passes), written straight into a buffer
  of messages at the positions of a per-layout table (``into``) or returned; ``whiten_place``:
  ``G T`` (or the values as they are) cast to a float wire dtype at the table's positions
  (``kernels/place.py``);
- receiver, ``decode_sum_unwhiten``: decode R ranks' messages, sum them in FP32 in rank order,
  ``÷ R`` if averaging, and apply ``T⁻¹``: one launch for the sum whatever R.

Each agrees with ``reference_whiten_encode`` / ``reference_decode_sum_unwhiten``: ``U`` and
``T⁻¹`` to FP32 rounding (true FP32: no TF32 whatever cuBLAS is told); the codes and scales bit
for bit those of ``fp8.encode(U)`` / ``fp8.encode_flat(U, lengths)`` (so those of the reference
where there is no whitening), and the rank sum bit for bit. The kernels' math is in
``kernels/fused.py``. They run where ``available(device)``: on CUDA, or on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, set before the first call here: triton reads it when the
kernels are defined), for every format whose table entry names them (``WireFormat.kernels``: E4M3
and E5M2), scaling and block size, with or without ``lengths`` and messages in up to
``fused.MAX_PARTS`` non-empty parts. The reference runs instead for other formats, for TENSOR
scaling with ``lengths``, for more parts, for empty inputs, elsewhere, and without triton.
The kernel path never synchronises the host with the device.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..numerics.fp8 import CodecConfig, Encoded, Scaling
from ..numerics.whitening import LowRankWhitening
from .reference import ordered_sum, reference_decode_sum_unwhiten, reference_whiten_encode, reference_whiten_place

__all__ = [
    "available",
    "ordered_sum",
    "Place",
    "Placed",
    "whiten_encode",
    "whiten_place",
    "decode_sum_unwhiten",
    "reference_whiten_encode",
    "reference_whiten_place",
    "reference_decode_sum_unwhiten",
]


@functools.cache
def _fused():
    """The kernel module, or None where triton does not import."""
    try:
        from . import fused
    except ImportError:
        return None
    return fused


@functools.cache
def _place():
    """The placed-cast kernel module (imports triton; only where ``_fused()`` is not None)."""
    from . import place

    return place


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: triton imports, and ``device`` is CUDA or
    the interpreter is on."""
    device = torch.device(device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _fused() is not None


def _lengths(cfg: CodecConfig, lengths: torch.Tensor | None) -> torch.Tensor | None:
    """``lengths`` as the kernels take them: one per-tensor group is the matrix codec's own."""
    return None if lengths is not None and cfg.scaling is Scaling.TENSOR and lengths.numel() == 1 else lengths


def _use_kernels(kernel: str, fused: bool, device: torch.device, numel: int, cfg: CodecConfig,
                 lengths: torch.Tensor | None) -> bool:  # fmt: skip
    """Whether ``kernel`` runs rather than the reference (module doc)."""
    return (fused and numel > 0 and kernel in cfg.fmt.kernels and available(device)
            and (lengths is None or cfg.scaling is not Scaling.TENSOR))  # fmt: skip


@dataclass(frozen=True)
class Place:
    """Where a sequence's elements go in a buffer: element ``i`` to ``out[k + delta[j]]``, ``k = at + i``
    and ``j`` the shard of ``table`` with ``ends[j-1] <= k < ends[j]``. ``out``: the buffer viewed in
    the sequence's dtype; ``table``: a ``comm.packing.Placement`` (``ends``, ``delta``: int64 on the
    device, one per shard; ``index(lo, hi)``, the positions of ``[lo, hi)``, for the reference)."""

    out: torch.Tensor
    table: Any
    at: int


@dataclass(frozen=True)
class Placed:
    """Where an encoding goes: its codes (memory order) and its scales (one per group, in order)."""

    codes: Place
    scales: Place


def whiten_encode(
    g: torch.Tensor, whitening: LowRankWhitening | None, cfg: CodecConfig, out: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None, fused: bool = True, into: Placed | None = None,
    feedback: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Encoded | None:  # fmt: skip
    """``fp8.encode(G T)`` of ``g [rows, cols]`` (``T = I`` when ``whitening`` is None): payload
    ``[rows, cols]`` codes, scales ``cfg.groups(rows, cols)`` (flat, one per group, with
    ``lengths``: groups in memory order other than the matrix codec's, each inside one row unless
    the scaling is per tensor); ``out``, when given, receives the encoded values in FP32 (``G T``,
    ``+ e`` with ``feedback``); ``fused=False`` takes the PyTorch reference wherever the kernels could run.

    ``into``: the codes and scales are written straight into a buffer at the positions of its
    tables (``Placed``), nothing returned; every group must lie inside one shard of the tables (the
    layout's groups, cut at shard boundaries, do). ``feedback = (e, e')``: FP32 tensors of ``g``'s
    numel (contiguous); ``Ũ = G T + e`` is encoded and ``e' ← Ũ - dec(q(Ũ))`` written (error feedback)."""
    lengths = _lengths(cfg, lengths)
    if _use_kernels("whiten_encode", fused, g.device, g.numel(), cfg, lengths):
        return _fused().whiten_encode(g, whitening, cfg, out=out, lengths=lengths, into=into, feedback=feedback)
    return reference_whiten_encode(g, whitening, cfg, out=out, lengths=lengths, into=into, feedback=feedback)


def whiten_place(x: torch.Tensor, whitening: LowRankWhitening | None, into: Place, fused: bool = True) -> None:
    """``x [rows, cols]`` (``G T`` in FP32 where ``whitening`` is given) cast to ``into.out``'s dtype,
    element ``i`` (memory order) written at its position of ``into`` (``Place``): the float
    intra-node wire and the plain values. ``fused``: the Triton kernel wherever it can run
    (``available``), else the PyTorch reference."""
    if fused and x.numel() > 0 and available(x.device):
        return _place().whiten_place(x, whitening, into)
    return reference_whiten_place(x, whitening, into)


def decode_sum_unwhiten(
    payloads: torch.Tensor | Sequence[torch.Tensor],
    scales: torch.Tensor | Sequence[torch.Tensor],
    rows: int,
    cols: int,
    whitening: LowRankWhitening | None,
    cfg: CodecConfig,
    average: bool,
    lengths: torch.Tensor | None = None,
    fused: bool = True,
) -> torch.Tensor:
    """``(Σ_i dec(payloads[i], scales[i]) [÷ R]) T⁻¹`` as FP32 ``[rows, cols]`` from ``R`` ranks'
    messages: ``payloads [R, rows·cols]`` codes, ``scales [R, groups]`` as ``fp8.encode`` made them
    (grouped by ``lengths`` when given), each also as a sequence of parts whose rows in turn are the
    ranks in order (``reference``'s module doc); ``fused`` as in ``whiten_encode``."""
    parts = [p for p in ([payloads] if isinstance(payloads, torch.Tensor) else payloads) if p.shape[0] > 0]
    lengths = _lengths(cfg, lengths)
    if (parts and _use_kernels("decode_sum_unwhiten", fused, parts[0].device, rows * cols, cfg, lengths)
            and len(parts) <= _fused().MAX_PARTS):  # fmt: skip
        return _fused().decode_sum_unwhiten(payloads, scales, rows, cols, whitening, cfg, average, lengths=lengths)
    return reference_decode_sum_unwhiten(payloads, scales, rows, cols, whitening, cfg, average, lengths=lengths)
