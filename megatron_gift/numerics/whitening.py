"""Input-side whitening of a weight gradient from a low-rank-plus-diagonal K-FAC factor.

Shapes: gradient ``G [d_out, d_in]``, factor ``A [d_in, d_in]``, rank ``r``.

Approximation (``approximate_factor``, or ``factor_from_sketch`` from a Nyström sketch): top-r
eigenpairs ``A ≈ V Λ Vᵀ`` (``V [d_in, r]``) plus the residual diagonal, damped::

    Â = D + V Λ Vᵀ,   D = max(diag(A) - diag(V Λ Vᵀ), 0) + δ·mean(diag A)

Whitening (``LowRankWhitening``): with ``W = D^{-1/2} V Λ^{1/2}`` and its thin SVD
``W = Q Σ Pᵀ`` (``Q [d_in, r]`` orthonormal, ``s = σ²``)::

    D^{-1/2} Â D^{-1/2} = I + Q diag(s) Qᵀ
    T   = D^{-1/2} (I + Q diag(c)  Qᵀ),   c  = (1+s)^{-1/2} - 1
    T⁻¹ = (I + Q diag(c') Qᵀ) D^{1/2},    c' = (1+s)^{+1/2} - 1

so ``Tᵀ Â T = I`` and ``T T⁻¹ = I`` exactly (``(1+c)²(1+s) = 1``, ``(1+c)(1+c') = 1``).
``G T = G' + ((G' Q) ⊙ c) Qᵀ`` with ``G' = G D^{-1/2}``: O(d_out·d_in·r) time and
O(d_in·r) memory, no d_in x d_in matrix. ``DenseCholeskyWhitening`` is the paper's
variant (``T = L⁻ᵀ`` with ``Â = L Lᵀ``, O(d_out·d_in²)), kept as a benchmark reference.

Determinism: the factor is built in FP64 on the CPU from FP32 statistics and rounded to
FP32 once, so the same statistics give the same ``T`` bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

logger = logging.getLogger(__name__)


@dataclass
class LowRankFactor:
    """``Â = diag(d) + V diag(lam) Vᵀ`` in FP64, plus ``trace_a = tr(A)`` of the exact factor and
    the relative ``damping`` δ that ``d`` includes (``δ·mean(diag A)``)."""

    d: torch.Tensor
    v: torch.Tensor
    lam: torch.Tensor
    trace_a: float
    damping: float = 0.0

    def with_damping(self, damping: float) -> "LowRankFactor":
        """The same factor with relative damping ``damping`` instead of ``self.damping``."""
        mean_diag = self.trace_a / self.d.shape[0]
        return replace(self, d=self.d + (damping - self.damping) * mean_diag, damping=damping)

    @property
    def trace(self) -> float:
        """``tr(Â) = Σ d + Σ λ`` (V is orthonormal)."""
        return float(self.d.sum() + self.lam.sum())

    def dense(self) -> torch.Tensor:
        return torch.diag(self.d) + (self.v * self.lam) @ self.v.T


def approximate_factor(a: torch.Tensor, rank: int, damping: float = 1e-3) -> LowRankFactor:
    """Top-``rank`` eigenpairs of ``a`` plus its damped residual diagonal (see module doc)."""
    return factors_by_rank(a, [rank], damping)[rank]


def factors_by_rank(a: torch.Tensor, ranks, damping: float = 0.0) -> dict[int, LowRankFactor]:
    """``approximate_factor(a, r, damping)`` for every ``r`` in ``ranks``, from one eigendecomposition."""
    a64 = a.detach().to("cpu", torch.float64)
    a64 = 0.5 * (a64 + a64.T)
    d_in = a64.shape[0]
    evals, evecs = torch.linalg.eigh(a64)  # ascending
    out = {}
    for rank in ranks:
        r = max(0, min(rank, d_in))
        lam = evals[d_in - r :].flip(0).clamp_min(0.0)
        v = evecs[:, d_in - r :].flip(1)
        out[rank] = _with_residual_diagonal(torch.diagonal(a64), v, lam, damping)
    return out


def factor_from_sketch(y: torch.Tensor, omega: torch.Tensor, diag: torch.Tensor, rank: int, damping: float = 1e-3,
                       max_shifts: int = 12) -> LowRankFactor:  # fmt: skip
    """Like ``approximate_factor`` from ``Y = A Ω`` (``[d_in, k]``), ``Ω`` and ``diag(A)`` only.

    Stabilized single-pass Nyström approximation (Tropp et al., 2017): with a small shift
    ``ν``, ``Y_ν = Y + νΩ``, ``ΩᵀY_ν = C Cᵀ``, ``E = Y_ν C⁻ᵀ = U Σ Pᵀ``; then
    ``A ≈ U (Σ² - ν) Uᵀ`` and the top ``rank ≤ k`` pairs are kept. FP32 statistics can leave
    ``ΩᵀY`` slightly indefinite: ``ν`` grows 10x at a time, at most ``max_shifts`` times (from
    1e-6·‖Y‖ to 1e6·‖Y‖); if the core is still not positive definite (e.g. non-finite ``Y``)
    the factor falls back to the damped diagonal alone (rank 0), with a warning."""
    y64, om = y.detach().to("cpu", torch.float64), omega.detach().to("cpu", torch.float64)
    d64 = diag.detach().to("cpu", torch.float64)
    nu = 1e-6 * float(torch.linalg.norm(y64)) + 1e-300
    for _ in range(max_shifts + 1):
        y_nu = y64 + nu * om
        core = om.T @ y_nu
        c, info = torch.linalg.cholesky_ex(0.5 * (core + core.T))
        if int(info) == 0:
            break
        nu *= 10.0
    else:
        logger.warning("megatron-gift: the Nyström core stayed indefinite after %d shifts (non-finite or "
                       "corrupt statistics?): using the diagonal of A alone for this factor", max_shifts)  # fmt: skip
        empty = torch.zeros(d64.shape[0], 0, dtype=torch.float64)
        return _with_residual_diagonal(d64, empty, empty[0], damping)
    e = torch.linalg.solve_triangular(c, y_nu.T, upper=False).T
    u, sig, _ = torch.linalg.svd(e, full_matrices=False)
    r = max(0, min(rank, u.shape[1]))
    return _with_residual_diagonal(d64, u[:, :r], (sig[:r] ** 2 - nu).clamp_min(0.0), damping)


def _with_residual_diagonal(diag: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, damping: float) -> LowRankFactor:
    mean_diag = float(diag.mean())
    if mean_diag <= 0:
        raise ValueError("K-FAC factor has a non-positive trace: no activations were seen")
    resid = (diag - (v * v) @ lam).clamp_min(0.0)
    return LowRankFactor(d=resid + damping * mean_diag, v=v, lam=lam, trace_a=float(diag.sum()), damping=damping)


class LowRankWhitening:
    """``T`` and ``T⁻¹`` of the module docstring, stored as ``D^{∓1/2}`` (d_in), ``Q`` (d_in x r), ``c``, ``c'`` (r)."""

    def __init__(self, factor: LowRankFactor, dtype: torch.dtype = torch.float32, device=None):
        d = factor.d
        w = (factor.v * factor.lam.sqrt()) / d.sqrt().unsqueeze(1)
        q, sig, _ = torch.linalg.svd(w, full_matrices=False)
        s = sig * sig
        self.rank = q.shape[1]
        self.d_in = d.shape[0]
        self.d_inv_sqrt = d.rsqrt().to(device=device, dtype=dtype)
        self.d_sqrt = d.sqrt().to(device=device, dtype=dtype)
        self.q = q.to(device=device, dtype=dtype).contiguous()
        self.c = ((1.0 + s).rsqrt() - 1.0).to(device=device, dtype=dtype)
        self.c_inv = ((1.0 + s).sqrt() - 1.0).to(device=device, dtype=dtype)

    @classmethod
    def empty(cls, d_in: int, rank: int, dtype: torch.dtype = torch.float32, device=None) -> "LowRankWhitening":
        """Uninitialized tensors of the right shapes, to receive a broadcast transform."""
        w = cls.__new__(cls)
        w.rank, w.d_in = rank, d_in
        w.d_inv_sqrt, w.d_sqrt = (torch.empty(d_in, dtype=dtype, device=device) for _ in range(2))
        w.q = torch.empty(d_in, rank, dtype=dtype, device=device)
        w.c, w.c_inv = (torch.empty(rank, dtype=dtype, device=device) for _ in range(2))
        return w

    @classmethod
    def identity(cls, d_in: int, dtype: torch.dtype = torch.float32, device=None) -> "LowRankWhitening":
        """``T = I`` (rank 0, ``D = I``): the layer is sent as plain FP8, bit for bit."""
        w = cls.empty(d_in, 0, dtype=dtype, device=device)
        for t in (w.d_inv_sqrt, w.d_sqrt):
            t.fill_(1.0)
        return w

    @classmethod
    def from_statistics(cls, a: torch.Tensor, rank: int, damping: float = 1e-3, device=None) -> "LowRankWhitening":
        return cls(approximate_factor(a, rank, damping), device=device if device is not None else a.device)

    def _low_rank_update(self, x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """``x (I + Q diag(coef) Qᵀ)`` for ``x [..., d_in]``."""
        if self.rank == 0:
            return x
        return torch.addmm(x.reshape(-1, self.d_in), (x.reshape(-1, self.d_in) @ self.q) * coef, self.q.T).view_as(x)

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        """``G T`` for ``G [..., d_in]``."""
        return self._low_rank_update(g * self.d_inv_sqrt, self.c)

    def inverse(self, u: torch.Tensor) -> torch.Tensor:
        """``U T⁻¹`` for ``U [..., d_in]``."""
        return self._low_rank_update(u, self.c_inv) * self.d_sqrt

    def projection(self, u: torch.Tensor, cols: slice) -> torch.Tensor:
        """``U[:, cols] Q[cols]`` (``[k, r]``): a row's ``U Q`` is the sum of its column pieces'."""
        return u @ self.q[cols]

    def inverse_piece(self, u: torch.Tensor, proj: torch.Tensor, cols: slice) -> torch.Tensor:
        """Columns ``cols`` of ``U T⁻¹`` from those of ``U`` and the whole rows' ``U Q`` (``proj [k, r]``)."""
        return torch.addmm(u, proj * self.c_inv, self.q[cols].T) * self.d_sqrt[cols]

    def apply_projection(self, g: torch.Tensor, cols: slice) -> torch.Tensor:
        """``G'[:, cols] Q[cols]`` (``[k, r]``, ``G' = G D^{-1/2}``): a row's ``G' Q`` is the sum of its pieces'."""
        return (g * self.d_inv_sqrt[cols]) @ self.q[cols]

    def apply_piece(self, g: torch.Tensor, proj: torch.Tensor, cols: slice) -> torch.Tensor:
        """Columns ``cols`` of ``G T`` from those of ``G`` and the whole rows' ``G' Q`` (``proj [k, r]``)."""
        return torch.addmm(g * self.d_inv_sqrt[cols], proj * self.c, self.q[cols].T)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``(T, T⁻¹)``, for tests and diagnostics only."""
        eye = torch.eye(self.d_in, dtype=self.q.dtype, device=self.q.device)
        return self.apply(eye), self.inverse(eye)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"d_inv_sqrt": self.d_inv_sqrt, "d_sqrt": self.d_sqrt, "q": self.q, "c": self.c, "c_inv": self.c_inv}


class DenseCholeskyWhitening:
    """The paper's transform: ``Â = L Lᵀ``, ``T = L⁻ᵀ`` (``G T`` by a triangular solve), ``T⁻¹ = Lᵀ``."""

    def __init__(self, factor: LowRankFactor, dtype: torch.dtype = torch.float32, device=None):
        self.d_in = factor.d.shape[0]
        self.l = torch.linalg.cholesky(factor.dense()).to(device=device, dtype=dtype)

    @classmethod
    def from_statistics(cls, a: torch.Tensor, rank: int, damping: float = 1e-3, device=None) -> "DenseCholeskyWhitening":
        return cls(approximate_factor(a, rank, damping), device=device if device is not None else a.device)

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        # G L⁻ᵀ = X  <=>  X Lᵀ = G
        return torch.linalg.solve_triangular(self.l.T, g.reshape(-1, self.d_in), upper=True, left=False).view_as(g)

    def inverse(self, u: torch.Tensor) -> torch.Tensor:
        return (u.reshape(-1, self.d_in) @ self.l.T).view_as(u)
