"""K-FAC input statistics of one linear layer: ``A = E[a aᵀ]`` over its input activations.

Every step ``accumulate`` adds linear statistics ``S_t`` of ``X [tokens, d_in]`` and the token
count ``N_t``; ``fold`` puts them into a per-step EMA of both, in FP32 (tokens FP64)::

    E_t = β E_{t-1} + (1-β) S_t,    M_t = β M_{t-1} + (1-β) N_t,    A_t = E_t / M_t

Both are linear in ``(S, N)``, so summing every rank's local ``(E, M)`` gives exactly the EMA of
the global statistics; the ratio needs no bias correction (the first fold gives ``S_1/N_1``) and a
step without tokens leaves ``A`` unchanged. Two kinds of ``S``:

* exact (``sketch=0``): ``XᵀX`` ``[d_in, d_in]``;
* sketched (``sketch=k``): ``Y = XᵀX Ω`` ``[d_in, k]`` for a fixed Gaussian ``Ω [d_in, k]`` plus
  ``diag(XᵀX)`` ``[d_in]``: O(d_in·k) memory and traffic. The top eigenpairs are then
  recovered with a Nyström approximation (``whitening.factor_from_sketch``).

FP32 throughout: the residual diagonal ``D = diag(A) - diag(V Λ Vᵀ)`` is a difference of
near-equal numbers when the top-r part holds most of the trace, so BF16 (~0.4%) on ``diag(A)``
would become tens of percent on ``D``. (``accumulate``'s matmuls follow the user's matmul
precision: TF32 rounds the products' inputs by up to 2^-11, independently per token, so the
error averages out over the tokens (about 2^-11/√tokens relative on the diagonal) instead of
biasing every entry as BF16-rounded sums do.)
Folding and accumulating never wait for the device. No torch.distributed here.
"""

from __future__ import annotations

import torch

from .whitening import LowRankFactor, approximate_factor, factor_from_sketch


def _fold(pairs, beta: float) -> None:
    """``E = β E + (1-β) S`` and ``M = β M + (1-β) N`` for each ``(target, source)`` pair, batched by dtype."""
    ema = [t for dst, _ in pairs for t in (*dst.ema_sums.values(), dst.ema_tokens)]
    new = [t for _, src in pairs for t in (*src.sums.values(), src.tokens)]
    for dtype in dict.fromkeys(t.dtype for t in ema):
        es = [e for e in ema if e.dtype is dtype]
        torch._foreach_mul_(es, beta)
        torch._foreach_add_(es, [n for e, n in zip(ema, new) if e.dtype is dtype], alpha=1.0 - beta)


def sketch_matrix(d_in: int, k: int, seed: int) -> torch.Tensor:
    """The fixed test matrix ``Ω [d_in, k]``, generated on the CPU so every rank gets the same one."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(d_in, k, generator=gen, dtype=torch.float32) / k**0.5


class KFACStatistics:
    """The step's accumulators (``sums``, ``tokens``) and their per-step EMA (``ema_sums``, ``ema_tokens``).

    ``dtype``: of the sums and EMAs (FP32; FP64 for exactness checks)."""

    def __init__(
        self,
        d_in: int,
        ema: float = 0.95,
        sketch: int = 0,
        seed: int = 0,
        device=None,
        dtype: torch.dtype = torch.float32,
    ):
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        if sketch < 0:
            raise ValueError(f"sketch size must be >= 0, got {sketch}")
        self.d_in = d_in
        self.ema = ema
        self.omega = sketch_matrix(d_in, sketch, seed).to(device, dtype) if 0 < sketch < d_in else None
        if self.omega is None:
            self.sums = {"xtx": torch.zeros(d_in, d_in, device=device, dtype=dtype)}
        else:
            self.sums = {
                k: torch.zeros(shape, device=device, dtype=dtype)
                for k, shape in (("y", (d_in, sketch)), ("diag", (d_in,)))
            }
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)
        self.ema_sums = {k: torch.zeros_like(v) for k, v in self.sums.items()}
        self.ema_tokens = torch.zeros((), dtype=torch.float64, device=device)
        self.folds = 0

    @staticmethod
    def summed_numel(d_in: int, sketch: int) -> int:
        """Elements of what a refresh sums of statistics of this size (``RefreshSync.sum_statistics``):
        the EMA sums (``xtx`` exact, else the sketch ``y`` and ``diag``) and the token count."""
        return d_in * d_in + 1 if not 0 < sketch < d_in else d_in * sketch + d_in + 1

    def accumulate(self, x: torch.Tensor) -> None:
        """Add the statistics of the activations ``x [..., d_in]`` to this step's."""
        x2 = x.detach().reshape(-1, self.d_in).to(self.sums[next(iter(self.sums))].dtype)
        if self.omega is None:
            self.sums["xtx"].addmm_(x2.T, x2)
        else:
            self.sums["y"].addmm_(x2.T, x2 @ self.omega)
            self.sums["diag"].add_((x2 * x2).sum(0))
        self.tokens += x2.shape[0]

    def fold(self, ema: float | None = None, step: KFACStatistics | None = None) -> None:
        """Fold this step's accumulators (or those of ``step``, left as they are) into the EMA
        (module doc), then reset ours. ``ema`` overrides the configured decay for this fold (0: replace)."""
        _fold([(self, step if step is not None else self)], self.ema if ema is None else ema)
        self.reset_accumulators()
        self.folds += 1

    @staticmethod
    def fold_all(stats: list[KFACStatistics]) -> None:
        """``fold()`` of every one of ``stats`` at once: a fixed number of ``torch._foreach_*``
        launches per decay and dtype however many layers there are, no host synchronisation."""
        by_beta: dict[float, list] = {}
        for s in stats:
            by_beta.setdefault(s.ema, []).append(s)
        for beta, members in by_beta.items():
            _fold([(s, s) for s in members], beta)
            torch._foreach_zero_([t for s in members for t in (*s.sums.values(), s.tokens)])
            for s in members:
                s.folds += 1

    def reset_ema(self) -> None:
        """Forget the EMA (e.g. after non-finite statistics): the next fold starts it afresh."""
        for v in self.ema_sums.values():
            v.zero_()
        self.ema_tokens.zero_()

    def reset_accumulators(self) -> None:
        for v in self.sums.values():
            v.zero_()
        self.tokens.zero_()

    def averages(self, ema: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """``A``'s statistics ``E / M`` of this rank's EMA, or of ``ema = (sums, tokens)`` (e.g. summed over ranks)."""
        sums, tokens = ema if ema is not None else (self.ema_sums, self.ema_tokens)
        if float(tokens) <= 0:
            raise RuntimeError("KFACStatistics: no statistics folded yet")
        out = {k: v / tokens.to(v.dtype) for k, v in sums.items()}
        if "xtx" in out:
            out["xtx"] = 0.5 * (out["xtx"] + out["xtx"].T)
        return out

    @property
    def factor(self) -> torch.Tensor:
        """The dense EMA factor ``A`` (exact statistics only)."""
        return self.averages()["xtx"]

    def factor_rank(self, rank: int) -> int:
        """The rank ``low_rank_factor(rank, ...)`` delivers: at most d_in, or the sketch size."""
        return min(rank, self.d_in if self.omega is None else self.omega.shape[1])

    def low_rank_factor(self, rank: int, damping: float, ema=None) -> LowRankFactor:
        """``Â = D + V Λ Vᵀ`` from the EMA statistics (or ``ema``, as in ``averages``): eigendecomposition or
        Nyström."""
        avg = self.averages(ema)
        if self.omega is None:
            return approximate_factor(avg["xtx"], rank, damping)
        return factor_from_sketch(avg["y"], self.omega, avg["diag"], rank, damping)

    def state_dict(self) -> dict:
        return {
            "sums": self.sums,
            "tokens": self.tokens,
            "ema_sums": self.ema_sums,
            "ema_tokens": self.ema_tokens,
            "folds": self.folds,
        }

    def load_state_dict(self, state: dict) -> None:
        for mine, saved in ((self.sums, state["sums"]), (self.ema_sums, state["ema_sums"])):
            for k, v in saved.items():
                mine[k].copy_(v)
        self.tokens.copy_(state["tokens"])
        self.ema_tokens.copy_(state["ema_tokens"])
        self.folds = int(state["folds"])
