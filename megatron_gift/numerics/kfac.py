"""K-FAC input statistics of one linear layer: ``A = E[a aᵀ]`` over its input activations.

``accumulate`` adds ``XᵀX`` (``X [tokens, d_in]``) and the token count in FP32 between
refreshes. The caller may sum ``xtx`` and ``tokens`` over data-parallel ranks in place, then
``refresh`` forms ``A_new = xtx / tokens`` and the EMA ``A <- β A + (1-β) A_new`` (the first
refresh takes ``A_new``). No torch.distributed here.
"""

from __future__ import annotations

import torch


class KFACStatistics:
    """Running input factor ``A [d_in, d_in]`` (FP32) and the current refresh's accumulators."""

    def __init__(self, d_in: int, ema: float = 0.95, device: torch.device | str | None = None):
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        self.d_in = d_in
        self.ema = ema
        self.xtx = torch.zeros(d_in, d_in, dtype=torch.float32, device=device)
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)
        self.factor: torch.Tensor | None = None
        self.refreshes = 0

    def accumulate(self, x: torch.Tensor) -> None:
        """Add ``XᵀX`` of the activations ``x [..., d_in]``."""
        x2 = x.detach().reshape(-1, self.d_in).float()
        self.xtx.addmm_(x2.T, x2)
        self.tokens += x2.shape[0]

    def refresh(self) -> torch.Tensor:
        """Fold the accumulated statistics into the EMA factor, reset them, return ``A``."""
        if self.tokens.item() <= 0:
            raise RuntimeError("KFACStatistics.refresh() with no accumulated tokens")
        a_new = self.xtx / self.tokens.float()
        a_new = 0.5 * (a_new + a_new.T)
        if self.factor is None:
            self.factor = a_new
        else:
            self.factor.mul_(self.ema).add_(a_new, alpha=1.0 - self.ema)
        self.xtx.zero_()
        self.tokens.zero_()
        self.refreshes += 1
        return self.factor

    def state_dict(self) -> dict:
        return {"xtx": self.xtx, "tokens": self.tokens, "factor": self.factor, "refreshes": self.refreshes, "ema": self.ema}

    def load_state_dict(self, state: dict) -> None:
        self.xtx.copy_(state["xtx"])
        self.tokens.copy_(state["tokens"])
        self.factor = None if state["factor"] is None else state["factor"].to(self.xtx).clone()
        self.refreshes = int(state["refreshes"])
