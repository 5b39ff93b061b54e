"""Error feedback: carry each step's quantization residual into the next step's input.

``x̃_t = x_t + e_{t-1}``, send ``Q(x̃_t)``, keep ``e_t = x̃_t - dec(Q(x̃_t))``. The residual lives
in whichever space is quantized (whitened coordinates for GIFT), so Euclidean and GIFT
comparisons can use it alike. The encode overwrites ``e_{t-1}`` with ``e_t`` in place, each element
read before it is written: no second residual beside the first, 4 B per coded element at the step's
peak. A step that is not applied (a NaN/Inf anywhere, which also makes the optimizer skip it) resets
the residual to zero at ``commit``, so a poisoned ``e_t`` is never fed back; that step loses its
carried rounding error along with its gradient.
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """Residual buffer for one quantized tensor (or one flat bucket)."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, device=None):
        self.residual = torch.zeros(numel, dtype=dtype, device=device)

    def compensate(self, x: torch.Tensor, lo: int = 0) -> torch.Tensor:
        """``x + e`` as a new FP32 tensor of the shape of ``x``, for the residual's elements from ``lo`` on."""
        return x.float() + self.residual[lo : lo + x.numel()].view_as(x)

    def stage(self, compensated: torch.Tensor, decoded: torch.Tensor, lo: int = 0) -> None:
        """Write ``compensated - decoded`` as the residual of the elements from ``lo`` on (settled by ``commit``)."""
        self.residual[lo : lo + compensated.numel()] = compensated.float().reshape(-1) - decoded.float().reshape(-1)

    def feedback(self, lo: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(e, e')`` of the elements ``[lo, lo + n)`` for ``kernels.whiten_encode``'s ``feedback``: the
        residual to add and where the next one is written, one view of the residual (in place)."""
        e = self.residual[lo : lo + n]
        return e, e

    def commit(self, applied: bool | torch.Tensor = True) -> None:
        """Settle the step: keep the residual written if the step was applied, else reset it to zero.
        ``applied`` may be a 0-d bool tensor: the choice is then made on its device (no host
        synchronisation)."""
        if isinstance(applied, torch.Tensor):
            self.residual.masked_fill_(applied.logical_not(), 0.0)
        elif not applied:
            self.residual.zero_()
