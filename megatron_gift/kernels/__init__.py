"""Fused Triton kernels for the two hot paths of a GIFT gradient exchange, with the pure-PyTorch
code as reference and fallback:

- sender, ``whiten_encode``: ``U = G T`` and its FP8 codes and scales in one pass over ``G``
  after the small ``G Q`` (1x128 block scales; TENSOR/ROW/MX scaling take two passes);
- receiver, ``decode_sum_unwhiten``: decode R ranks' messages, sum them in FP32 in rank order,
  ``÷ R`` if averaging, and apply ``T⁻¹``: one launch for the sum whatever R, written straight
  into the caller's ``out`` (a bucket slice) in its dtype; ``decode_placed``, the same for one
  all-gathered message per shard read at a table's positions (``kernels/receive.py``);
  ``sum_rows`` / ``take``, the FP32 rank sum of float values (plain values, a BF16/FP32 wire)
  and a placed read, one launch each.

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

import torch

from ..numerics.fp8 import CodecConfig, Encoded, Scaling
from ..numerics.whitening import LowRankWhitening
from .reference import (
    ordered_sum,
    reference_decode_placed,
    reference_decode_sum_unwhiten,
    reference_sum_rows,
    reference_take,
    reference_whiten_encode,
)

__all__ = [
    "available",
    "ordered_sum",
    "whiten_encode",
    "decode_sum_unwhiten",
    "decode_placed",
    "sum_rows",
    "take",
    "reference_whiten_encode",
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
def _receive():
    """The placed receive kernels (``kernels/receive.py``), or None where triton does not import."""
    try:
        from . import receive
    except ImportError:
        return None
    return receive


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


def whiten_encode(
    g: torch.Tensor, whitening: LowRankWhitening | None, cfg: CodecConfig, out: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None, fused: bool = True,
) -> Encoded:  # fmt: skip
    """``fp8.encode(G T)`` of ``g [rows, cols]`` (``T = I`` when ``whitening`` is None): payload
    ``[rows, cols]`` codes, scales ``cfg.groups(rows, cols)`` (flat, one per group, with
    ``lengths``: groups in memory order other than the matrix codec's, each inside one row unless
    the scaling is per tensor); ``out``, when given, receives ``G T`` in FP32 (e.g. for error
    feedback); ``fused=False`` takes the PyTorch reference wherever the kernels could run."""
    lengths = _lengths(cfg, lengths)
    if _use_kernels("whiten_encode", fused, g.device, g.numel(), cfg, lengths):
        return _fused().whiten_encode(g, whitening, cfg, out=out, lengths=lengths)
    return reference_whiten_encode(g, whitening, cfg, out=out, lengths=lengths)


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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(Σ_i dec(payloads[i], scales[i]) [÷ R]) T⁻¹`` as ``[rows, cols]`` from ``R`` ranks'
    messages: ``payloads [R, rows·cols]`` codes, ``scales [R, groups]`` as ``fp8.encode`` made them
    (grouped by ``lengths`` when given), each also as a sequence of parts whose rows in turn are the
    ranks in order (``reference``'s module doc); ``fused`` as in ``whiten_encode``. Written into
    ``out`` (contiguous, ``rows·cols`` elements, FP32/BF16/FP16: the FP32 result rounded once) and
    returned as ``[rows, cols]``; a new FP32 tensor without it."""
    parts = [p for p in ([payloads] if isinstance(payloads, torch.Tensor) else payloads) if p.shape[0] > 0]
    lengths = _lengths(cfg, lengths)
    if (parts and _use_kernels("decode_sum_unwhiten", fused, parts[0].device, rows * cols, cfg, lengths)
            and len(parts) <= _fused().MAX_PARTS):  # fmt: skip
        return _fused().decode_sum_unwhiten(payloads, scales, rows, cols, whitening, cfg, average, lengths=lengths, out=out)
    return reference_decode_sum_unwhiten(payloads, scales, rows, cols, whitening, cfg, average, lengths=lengths, out=out)


def decode_placed(codes: torch.Tensor, scales: torch.Tensor, code_table, scale_table, seq_at: int, group_at: int,
                  rows: int, cols: int, whitening: LowRankWhitening | None, cfg: CodecConfig,
                  lengths: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  fused: bool = True) -> torch.Tensor:  # fmt: skip
    """``dec(c, s) T⁻¹`` as ``[rows, cols]`` (written into ``out`` as ``decode_sum_unwhiten`` does) of
    one message per shard in a buffer: element ``i`` of the matrix is element ``seq_at + i`` of the
    coded sequence, its code at ``codes[code_table(seq_at + i)]``, and its group ``u`` (the matrix
    codec's, or ``lengths``') is group ``group_at + u``, its scale at ``scales[scale_table(group_at + u)]``.
    ``codes``/``scales``: the buffer viewed in the code/scale dtype; a table is a
    ``comm.packing.Placement`` (``ends``, ``delta`` on the device; ``index(lo, hi)`` for the reference).
    Each group lies in one shard of the tables' source."""
    lengths = _lengths(cfg, lengths)
    if _use_kernels("decode_sum_unwhiten", fused, codes.device, rows * cols, cfg, lengths):
        return _receive().decode_placed(codes, scales, code_table, scale_table, seq_at, group_at, rows, cols,
                                        whitening, cfg, lengths, out)  # fmt: skip
    return reference_decode_placed(codes, scales, code_table, scale_table, seq_at, group_at, rows, cols, whitening,
                                   cfg, lengths, out)  # fmt: skip


def _use_sum(fused: bool, parts: Sequence[torch.Tensor], out: torch.Tensor | None) -> bool:
    """Whether ``receive._sum_kernel`` runs: float dtypes, at most three non-empty parts, values to sum."""
    parts = [p for p in parts if p.shape[0] > 0]
    floats = (torch.float32, torch.bfloat16, torch.float16)
    return (fused and parts and parts[0].shape[-1] > 0 and available(parts[0].device) and len(parts) <= 3
            and all(p.dtype in floats for p in parts) and (out is None or out.dtype in floats))  # fmt: skip


def sum_rows(parts: torch.Tensor | Sequence[torch.Tensor], average: bool, out: torch.Tensor | None = None, place: tuple | None = None,
             fused: bool = True) -> torch.Tensor:  # fmt: skip
    """``Σ_i x_i`` over the rows of ``parts`` (``[k, n]`` each, FP32/BF16/FP16, inner stride 1; the
    rows, part after part, the senders in order), FP32 in row order (``ordered_sum``'s bits), ``÷ R``
    when averaging; into ``out`` (``[n]``, the FP32 result rounded once to its dtype; a new FP32
    tensor when None) or, with ``place = (table, at)``, element ``i`` into ``out[table(at + i)]``
    (``out`` a buffer view, the table a ``comm.packing.Placement``)."""
    parts = [parts] if isinstance(parts, torch.Tensor) else list(parts)
    if _use_sum(fused, parts, out):
        return _receive().sum_rows(parts, average, out, place)
    return reference_sum_rows(parts, average, out, place)


def take(src: torch.Tensor, table, at: int, out: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """``out[i] = src[table(at + i)]`` (``src`` a buffer view, ``out`` contiguous; cast to its dtype)."""
    if _use_sum(fused, [src.view(1, -1)[:, : out.numel()]], out):
        return _receive().take(src, table, at, out)
    return reference_take(src, table, at, out)
