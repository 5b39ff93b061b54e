"""Geometry statistics that predict whether whitening lowers the FP8 round-trip error.

Error model: FP8 rounding is relative per element and spreads isotropically over the d_in
directions of whichever space is quantized. Euclidean: relative error² ≈ ε². Whitened
(``U = G T``, mapped back by ``T⁻¹``, ``T Tᵀ = Â⁻¹``): error energy ≈ ε² ‖U‖² tr(Â)/d_in, so

    ratio = RelL2_gift / RelL2_euclid ≈ ‖G T‖ · sqrt(tr(Â) / d_in) / ‖G‖          (model)

Two-level version from shares alone: with ``p`` = share of tr(A) in its top-r eigenvalues,
``q`` = share of ‖G‖² in that top-r subspace, ``ρ = r/d_in``, and Â taken as flat inside
and outside the subspace::

    ratio² ≈ ρ·q/p + (1-ρ)·(1-q)/(1-p)                                             (shares)

Rows drawn like A (q = p) give ratio 1; gradient energy more concentrated than A's trace
(q > p) gives ratio < 1. Shapes: ``G [d_out, d_in]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .whitening import LowRankFactor, LowRankWhitening


@dataclass(frozen=True)
class GeometryStats:
    trace_share_top_r: float
    grad_energy_share_top_r: float
    predicted_ratio_shares: float
    predicted_ratio_model: float


def shares_ratio(p: float, q: float, rho: float) -> float:
    """Two-level predicted GIFT/Euclidean RelL2 ratio from the shares ``p``, ``q`` and ``ρ = r/d``."""
    if p >= 1.0 or rho >= 1.0:
        return math.sqrt(rho * q / p) if p > 0 else float("nan")
    if p <= 0.0:
        return math.sqrt((1 - rho) * (1 - q))
    return math.sqrt(rho * q / p + (1 - rho) * (1 - q) / (1 - p))


# Profiles and geometry sums take a gradient's rows in this many blocks (fewer where the rows are): their
# FP64 copies and round trips hold a quarter of the gradient at a time, in at most as many ops.
ROW_BLOCKS = 4


def even_spans(lo: int, hi: int, blocks: int) -> list[tuple[int, int]]:
    """``blocks`` consecutive ranges covering ``[lo, hi)``, as even as whole elements (rows) allow, some empty
    where they are fewer: the pieces the PyTorch path takes a long range in, so many ops whatever its length."""
    step = max(1, -(-(hi - lo) // blocks))
    return [(min(lo + i * step, hi), min(lo + (i + 1) * step, hi)) for i in range(blocks)]


def row_spans(rows: int, blocks: int = ROW_BLOCKS) -> list[tuple[int, int]]:
    """The non-empty ones of ``even_spans(0, rows, blocks)``."""
    return [(a, b) for a, b in even_spans(0, rows, blocks) if b > a]


def geometry_sums(grad: torch.Tensor, factor: LowRankFactor, whitening: LowRankWhitening) -> torch.Tensor:
    """``[‖G‖², ‖G V‖², ‖G T‖²·tr(Â)/d_in, p]`` (FP64, on ``grad``'s device, no host synchronisation)
    for the gradient ``grad`` (``G [d_out, d_in]``): the first three are additive over ranks (and over
    the row blocks they are summed from)."""
    g = grad.detach().reshape(-1, factor.d.shape[0])
    d_in, dev = g.shape[1], g.device
    v, sums = factor.v.to(dev), torch.zeros(3, dtype=torch.float64, device=dev)
    for a, b in row_spans(g.shape[0]):
        g64 = g[a:b].double().reshape(-1)
        u = whitening.apply(g[a:b].float()).double().reshape(-1)
        sums += torch.stack([torch.dot(g64, g64), ((g64.view(b - a, d_in) @ v) ** 2).sum(), torch.dot(u, u)])
        del g64, u
    trace = factor.trace.to(dev, torch.float64)
    p = factor.lam.sum().to(dev, torch.float64) / factor.trace_a
    return torch.cat([sums[:2], sums[2:] * trace / d_in, p.view(1)])


def geometry_stats(grad: torch.Tensor, factor: LowRankFactor, whitening: LowRankWhitening) -> GeometryStats:
    """Shares and both predicted ratios for the gradient ``grad`` (``G [d_out, d_in]``; ``geometry_sums``,
    read on the host)."""
    g_energy, top, model_sq, p = geometry_sums(grad, factor, whitening).tolist()
    q = top / g_energy if g_energy > 0 else 0.0
    model = math.sqrt(model_sq / g_energy) if g_energy > 0 else float("nan")
    return GeometryStats(p, q, shares_ratio(p, q, factor.v.shape[1] / factor.d.shape[0]), model)
