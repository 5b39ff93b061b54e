"""Error feedback: carry each step's quantization residual into the next step's input.

``x̃_t = x_t + e_{t-1}``, send ``Q(x̃_t)``, keep ``e_t = x̃_t - dec(Q(x̃_t))``. The residual lives
in whichever space is quantized (whitened coordinates for GIFT), so Euclidean and GIFT
comparisons can use it alike. A residual is only committed once the caller knows the step
was applied, so a skipped (NaN/Inf) step never poisons it.
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """Residual buffer for one quantized tensor (or one flat bucket)."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, device=None):
        self.residual = torch.zeros(numel, dtype=dtype, device=device)
        self._pending: torch.Tensor | None = None

    def compensate(self, x: torch.Tensor, lo: int = 0) -> torch.Tensor:
        """``x + e`` as a new FP32 tensor of the shape of ``x``, for the residual's elements from ``lo`` on."""
        return x.float() + self.residual[lo : lo + x.numel()].view_as(x)

    def stage(self, compensated: torch.Tensor, decoded: torch.Tensor, lo: int = 0) -> None:
        """Remember ``compensated - decoded`` as the next residual of the elements from ``lo`` on, pending
        ``commit``."""
        if self._pending is None:
            self._pending = torch.empty_like(self.residual)
        self._pending[lo : lo + compensated.numel()] = compensated.float().reshape(-1) - decoded.float().reshape(-1)

    def feedback(self, lo: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(e, e')`` of the elements ``[lo, lo + n)``: the residual to add, and where the next one is
        staged, pending ``commit`` (``kernels.whiten_encode``'s ``feedback``, which writes it)."""
        if self._pending is None:
            self._pending = torch.empty_like(self.residual)
        return self.residual[lo : lo + n], self._pending[lo : lo + n]

    def commit(self, applied: bool | torch.Tensor = True) -> None:
        """Adopt the staged residual if the step was applied; drop it otherwise. ``applied`` may be a
        0-d bool tensor: the choice is then made on its device (no host synchronisation)."""
        if self._pending is not None:
            if isinstance(applied, torch.Tensor):  # in place into the staged buffer: no temporary
                self.residual.copy_(torch.where(applied, self._pending, self.residual, out=self._pending))
            elif applied:
                self.residual.copy_(self._pending)
        self._pending = None
