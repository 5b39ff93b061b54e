"""The pure-PyTorch hot paths that the Triton kernels fuse: the reference they are tested
against and the path taken wherever Triton cannot run. Built from ``numerics`` without
restating its math; ``rank_order_sum`` is the receivers' summation order, which
``comm.quantized`` uses as well."""

from __future__ import annotations

import torch

from ..numerics.fp8 import CodecConfig, Encoded, decode_flat, encode, group_lengths
from ..numerics.whitening import LowRankWhitening


def rank_order_sum(t: torch.Tensor, world: int) -> torch.Tensor:
    """``Σ_i t[i]`` accumulated in FP32 in rank order (the same order on every rank)."""
    acc = t[0].clone()
    for i in range(1, world):
        acc += t[i]
    return acc


def reference_whiten_encode(
    g: torch.Tensor, whitening: LowRankWhitening | None, cfg: CodecConfig, out: torch.Tensor | None = None
) -> Encoded:
    """``fp8.encode(G T)`` (``G`` when ``whitening`` is None) of ``g [rows, cols]``; ``out``,
    when given, receives ``G T`` in FP32."""
    u = whitening.apply(g.float()) if whitening is not None else g.float()
    if out is not None:
        out.copy_(u)
    return encode(u, cfg)


def reference_decode_sum_unwhiten(
    payloads: torch.Tensor,
    scales: torch.Tensor,
    rows: int,
    cols: int,
    whitening: LowRankWhitening | None,
    cfg: CodecConfig,
    average: bool,
) -> torch.Tensor:
    """``(Σ_i dec(payloads[i], scales[i]) [÷ R]) T⁻¹`` as FP32 ``[rows, cols]``: the rank sum in
    rank order, as the quantized reduction's receiver does it."""
    world = payloads.shape[0]
    lengths = group_lengths(rows, cols, cfg, device=payloads.device)
    messages = zip(payloads.reshape(world, -1), scales.reshape(world, -1))
    decoded = torch.stack([decode_flat(Encoded(p, s), lengths, cfg) for p, s in messages])
    acc = rank_order_sum(decoded, world)
    if average:
        acc /= world
    acc = acc.view(rows, cols)
    return whitening.inverse(acc) if whitening is not None else acc
