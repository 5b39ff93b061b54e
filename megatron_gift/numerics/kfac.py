"""K-FAC input statistics of one linear layer: ``A = E[a aᵀ]`` over its input activations.

Between refreshes ``accumulate`` adds linear statistics of ``X [tokens, d_in]`` in FP32, and
the token count. They are sums, so a caller may add them over data-parallel ranks in place
(``sums``) before ``refresh`` divides by the tokens and folds them into an EMA
(``S <- β S + (1-β) S_new``; the first refresh takes ``S_new``). Two kinds:

* exact (``sketch=0``): ``XᵀX`` ``[d_in, d_in]``;
* sketched (``sketch=k``): ``Y = XᵀX Ω`` ``[d_in, k]`` for a fixed Gaussian ``Ω [d_in, k]`` plus
  ``diag(XᵀX)`` ``[d_in]``: O(d_in·k) memory and traffic. The top eigenpairs are then
  recovered with a Nyström approximation (``whitening.factor_from_sketch``).

No torch.distributed here.
"""

from __future__ import annotations

import torch

from .whitening import LowRankFactor, approximate_factor, factor_from_sketch


def sketch_matrix(d_in: int, k: int, seed: int) -> torch.Tensor:
    """The fixed test matrix ``Ω [d_in, k]``, generated on the CPU so every rank gets the same one."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(d_in, k, generator=gen, dtype=torch.float32) / k**0.5


class KFACStatistics:
    """Accumulators of the current refresh (``sums``, ``tokens``) and their EMA (``ema_sums``)."""

    def __init__(self, d_in: int, ema: float = 0.95, sketch: int = 0, seed: int = 0, device=None):
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        if sketch < 0:
            raise ValueError(f"sketch size must be >= 0, got {sketch}")
        self.d_in = d_in
        self.ema = ema
        self.omega = sketch_matrix(d_in, sketch, seed).to(device) if 0 < sketch < d_in else None
        if self.omega is None:
            self.sums = {"xtx": torch.zeros(d_in, d_in, device=device)}
        else:
            self.sums = {"y": torch.zeros(d_in, sketch, device=device), "diag": torch.zeros(d_in, device=device)}
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)
        self.ema_sums: dict[str, torch.Tensor] | None = None
        self.refreshes = 0

    def accumulate(self, x: torch.Tensor) -> None:
        """Add the statistics of the activations ``x [..., d_in]``."""
        x2 = x.detach().reshape(-1, self.d_in).float()
        if self.omega is None:
            self.sums["xtx"].addmm_(x2.T, x2)
        else:
            self.sums["y"].addmm_(x2.T, x2 @ self.omega)
            self.sums["diag"].add_((x2 * x2).sum(0))
        self.tokens += x2.shape[0]

    def refresh(self, ema: float | None = None) -> dict[str, torch.Tensor]:
        """Fold the accumulated statistics (divided by the tokens) into the EMA, reset them.
        ``ema`` overrides the configured decay for this refresh (0: replace)."""
        ema = self.ema if ema is None else ema
        if self.tokens.item() <= 0:
            raise RuntimeError("KFACStatistics.refresh() with no accumulated tokens")
        new = {k: v / self.tokens.float() for k, v in self.sums.items()}
        if "xtx" in new:
            new["xtx"] = 0.5 * (new["xtx"] + new["xtx"].T)
        if self.ema_sums is None:
            self.ema_sums = new
        else:
            for k, v in new.items():
                self.ema_sums[k].mul_(ema).add_(v, alpha=1.0 - ema)
        self.reset_accumulators()
        self.refreshes += 1
        return self.ema_sums

    def reset_accumulators(self) -> None:
        for v in self.sums.values():
            v.zero_()
        self.tokens.zero_()

    @property
    def factor(self) -> torch.Tensor | None:
        """The dense EMA factor ``A`` (exact statistics only)."""
        return None if self.ema_sums is None else self.ema_sums.get("xtx")

    def factor_rank(self, rank: int) -> int:
        """The rank ``low_rank_factor(rank, ...)`` delivers: at most d_in, or the sketch size."""
        return min(rank, self.d_in if self.omega is None else self.omega.shape[1])

    def low_rank_factor(self, rank: int, damping: float) -> LowRankFactor:
        """``Â = D + V Λ Vᵀ`` from the EMA statistics (eigendecomposition or Nyström)."""
        if self.ema_sums is None:
            raise RuntimeError("no statistics yet: refresh() first")
        if self.omega is None:
            return approximate_factor(self.ema_sums["xtx"], rank, damping)
        return factor_from_sketch(self.ema_sums["y"], self.omega, self.ema_sums["diag"], rank, damping)

    def state_dict(self) -> dict:
        return {"sums": self.sums, "tokens": self.tokens, "ema_sums": self.ema_sums, "refreshes": self.refreshes}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state["sums"].items():
            self.sums[k].copy_(v)
        self.tokens.copy_(state["tokens"])
        self.ema_sums = None if state["ema_sums"] is None else {k: v.clone() for k, v in state["ema_sums"].items()}
        self.refreshes = int(state["refreshes"])
