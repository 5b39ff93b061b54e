"""An error feedback whose next residual goes to a buffer of its own, NaN until written: what the
in-place ``ErrorFeedback`` must match bit for bit, and a way to see that every coded element is written."""

import torch

from megatron_gift.numerics.error_feedback import ErrorFeedback


class StagedResidual(ErrorFeedback):
    """``feedback`` hands ``(e, e')`` as two tensors: ``e`` the residual, ``e'`` a view of ``staged``."""

    def __init__(self, residual: torch.Tensor):
        super().__init__(residual.numel(), device=residual.device)
        self.residual.copy_(residual)
        self.staged = torch.full_like(self.residual, float("nan"))

    def feedback(self, lo: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.residual[lo : lo + n], self.staged[lo : lo + n]
