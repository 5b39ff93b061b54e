"""Randomised block Hadamard rotation, applied before FP4 coding to spread outliers across a block.

``fwht(x, block)``: y = x H_block / sqrt(block) on each consecutive block of the last dim, with H the
Sylvester Hadamard matrix (H_1 = [1], H_2k = [[H_k, H_k], [H_k, -H_k]]); orthonormal and symmetric,
so it is its own inverse. ``BlockHadamard``: R = D_s H (D_s a seeded ±1 diagonal), apply(x) = fwht(x * s),
inverse(y) = fwht(y) * s. GIFT composes it on the input (column) side after whitening: the sender
codes U = (G T) R, the receiver forms (Σ_i dec(U_i)) Rᵀ T⁻¹ (sum first: R is linear).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


def fwht(x: torch.Tensor, block: int, scratch: bool = False) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform over consecutive ``block``-element blocks of the last dim
    (log2(block) butterfly stages, ``(a, b) -> (a + b, a - b)``, each into the other of two buffers, then
    the scale in place: two copies of ``x`` at most). ``scratch``: ``x`` (contiguous) is the caller's
    temporary and serves as one of the two."""
    if block <= 0 or block & (block - 1):
        raise ValueError(f"Hadamard block must be a power of two, got {block}")
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} is not a multiple of the Hadamard block {block}")
    lead = x.shape[:-1]
    y = x.reshape(-1, n // block, block)
    own = [y] if scratch and x.is_contiguous() else []  # the buffers a stage may write
    h = 1
    while h < block:
        src = y.reshape(-1, n // block, block // (2 * h), 2, h)  # a view but of a strided ``x``
        free = [b for b in own if b is not y]
        out = free[0] if free else torch.empty_like(y)
        dst = out.view(src.shape)
        torch.add(src[..., 0, :], src[..., 1, :], out=dst[..., 0, :])
        torch.sub(src[..., 0, :], src[..., 1, :], out=dst[..., 1, :])
        own += [] if free else [out]
        y, h = out, h * 2
    y, scale = y.view(*lead, n), 1.0 / math.sqrt(block)
    return y.mul_(scale) if own else y * scale


@functools.lru_cache(maxsize=64)
def _signs(seed: int, n: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 2, (n,), generator=g).to(torch.float32) * 2 - 1
    return s.to(device)


@dataclass(frozen=True)
class BlockHadamard:
    """Randomised block Hadamard R = D_s H_block: every rank derives the same signs from ``seed``."""

    block: int = 64
    seed: int = 0

    def signs(self, n: int, device=None) -> torch.Tensor:
        """±1 signs (float32 [n]), from a CPU generator seeded with ``seed``; cached per (n, device)."""
        return _signs(self.seed, n, str(torch.device(device if device is not None else "cpu")))

    def apply(self, x: torch.Tensor, scratch: bool = False) -> torch.Tensor:
        """fwht(x * signs) along the last dim; ``scratch``: ``x`` is the caller's temporary, overwritten."""
        s = self.signs(x.shape[-1], x.device)
        return fwht(x.mul_(s) if scratch else x * s, self.block, scratch=True)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """fwht(y) * signs: undoes ``apply``."""
        return fwht(y, self.block).mul_(self.signs(y.shape[-1], y.device))
