"""The paper's dense whitening, the reference for ``numerics.whitening.LowRankWhitening`` in the runtime's
tests and the tools (``bench overhead`` times both, ``bench fidelity`` compares their errors); no training
path uses it."""

from __future__ import annotations

import torch

from megatron_gift.numerics.whitening import LowRankFactor


class DenseCholeskyWhitening:
    """The paper's transform: ``Â = L Lᵀ``, ``T = L⁻ᵀ`` (``G T`` by a triangular solve), ``T⁻¹ = Lᵀ``."""

    def __init__(self, factor: LowRankFactor, dtype: torch.dtype = torch.float32, device=None):
        self.d_in = factor.d.shape[0]
        self.l = torch.linalg.cholesky(factor.dense()).to(device=device, dtype=dtype)

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        # G L⁻ᵀ = X  <=>  X Lᵀ = G
        return torch.linalg.solve_triangular(self.l.T, g.reshape(-1, self.d_in), upper=True, left=False).view_as(g)

    def inverse(self, u: torch.Tensor) -> torch.Tensor:
        return (u.reshape(-1, self.d_in) @ self.l.T).view_as(u)
