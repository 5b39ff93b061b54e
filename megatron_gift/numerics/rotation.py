"""Randomized block Hadamard rotation ``H`` (``fwht`` of consecutive blocks after random signs),
composed after GIFT's whitening in the four-bit exchange: the sender sends ``(G T) H``, the receiver
applies ``Hᵀ`` to the sum before ``T⁻¹``. Written on branch fp4wire to the API agreed with branch fp4
(not landed by 00:40 UTC); branch fp4's module replaces it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform of consecutive ``block``-element blocks (a power of
    two) of the last dim: log2(block) butterfly stages, scaled by 1/sqrt(block); its own inverse."""
    shape = x.shape
    y = x.reshape(-1, block).clone()
    h = 1
    while h < block:
        y = y.view(-1, block // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(shape) / math.sqrt(block)).to(x.dtype)


@dataclass(frozen=True)
class BlockHadamard:
    """``apply(x) = fwht(x · signs, block)``, ``inverse(y) = fwht(y, block) · signs`` along the last
    dim; the ±1 signs from ``seed`` on the CPU, cached per (n, device): every rank the same."""

    block: int = 64
    seed: int = 0
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def signs(self, n: int, device) -> torch.Tensor:
        """``n`` signs (FP32 ±1) on ``device``."""
        key = (n, str(device))
        if key not in self._cache:
            gen = torch.Generator().manual_seed(self.seed)
            s = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
            self._cache[key] = s.to(device)
        return self._cache[key]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return fwht(x * self.signs(x.shape[-1], x.device), self.block)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return fwht(y, self.block) * self.signs(y.shape[-1], y.device)
