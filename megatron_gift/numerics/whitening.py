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
O(d_in·r) memory, no d_in x d_in matrix. The paper's dense variant (``T = L⁻ᵀ`` with ``Â = L Lᵀ``,
O(d_out·d_in²)) is the tests' and benchmarks' reference, ``testing.dense.DenseCholeskyWhitening``.

Where the work runs: everything of size d_in (the sketch ``Y``, ``V``, ``D``, ``W``, ``Q``) stays on
the statistics' device, in FP64; only the small symmetric cores go to the host, where LAPACK
solves them in FP64 (``torch.linalg.eigh`` on a GPU checks its error code on the host, so it would
synchronise anyway): the Nyström core (``k x k``, ``nystrom_core``) and the whitening's ``r x r``
Gram ``S = Wᵀ W = P diag(s) Pᵀ``, from which ``Q = W P diag(s)^{-1/2}`` (``whitening_tensors``: the
thin SVD of ``W`` without a d_in-sized SVD). Each needs one host transfer; ``numerics.refresh``
batches them over all layers of a refresh. FP64 matmuls never use TF32; the FP32 ones of
``LowRankWhitening`` run under ``ieee_fp32`` (full FP32 even where ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``
made TF32 the default).

Determinism: one rank builds each factor and the others receive its bits, so every rank
holds the same ``T`` bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace

import torch

logger = logging.getLogger(__name__)

MAX_SHIFTS = 12  # Nyström shifts tried: 1e-6·‖Y‖ growing 10x at a time, up to 1e6·‖Y‖


@contextlib.contextmanager
def ieee_fp32(device):
    """cuBLAS matmuls enqueued inside run in full FP32 (CUDA only; elsewhere a no-op).

    torch 2.13 reads ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` (set by NGC containers) once, as the
    initial matmul precision "high" (TF32); ``torch.set_float32_matmul_precision("highest")`` turns
    it off again and keeps the legacy and the new (``fp32_precision``) flags consistent, whereas
    setting ``torch.backends.cuda.matmul.fp32_precision = "ieee"`` alone leaves them inconsistent and
    makes every later matmul raise. The previous precision is restored on exit (the setting is
    read when a kernel is enqueued)."""
    if torch.device(device).type != "cuda" or torch.get_float32_matmul_precision() == "highest":
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


@dataclass
class LowRankFactor:
    """``Â = diag(d) + V diag(lam) Vᵀ`` in FP64, plus ``trace_a = tr(A)`` of the exact factor and
    the relative ``damping`` δ that ``d`` includes (``δ·mean(diag A)``). During a refresh build
    ``trace_a`` and ``damping`` may be 0-d device tensors; an installed factor holds floats."""

    d: torch.Tensor
    v: torch.Tensor
    lam: torch.Tensor
    trace_a: float | torch.Tensor
    damping: float | torch.Tensor = 0.0

    def with_damping(self, damping) -> LowRankFactor:
        """The same factor with relative damping ``damping`` instead of ``self.damping``."""
        mean_diag = self.trace_a / self.d.shape[0]
        return replace(self, d=self.d + (damping - self.damping) * mean_diag, damping=damping)

    @property
    def trace(self) -> torch.Tensor:
        """``tr(Â) = Σ d + Σ λ`` (V is orthonormal), a 0-d tensor on the factor's device."""
        return self.d.sum() + self.lam.sum()

    def dense(self) -> torch.Tensor:
        return torch.diag(self.d) + (self.v * self.lam) @ self.v.T


def approximate_factor(a: torch.Tensor, rank: int, damping: float = 1e-3) -> LowRankFactor:
    """Top-``rank`` eigenpairs of ``a`` plus its damped residual diagonal (see module doc)."""
    return factors_by_rank(a, [rank], damping)[rank]


def top_eigenpairs(a64: torch.Tensor, ranks) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``(V [d, r], λ [r])`` of the host FP64 symmetric ``a64`` for every ``r`` in ``ranks``, descending."""
    a64 = 0.5 * (a64 + a64.T)
    d_in = a64.shape[0]
    evals, evecs = torch.linalg.eigh(a64)  # ascending
    out = {}
    for rank in ranks:
        r = max(0, min(rank, d_in))
        out[rank] = evecs[:, d_in - r :].flip(1), evals[d_in - r :].flip(0).clamp_min(0.0)
    return out


def factors_by_rank(a: torch.Tensor, ranks, damping: float = 0.0) -> dict[int, LowRankFactor]:
    """``approximate_factor(a, r, damping)`` for every ``r`` in ``ranks``, from one eigendecomposition."""
    a64 = a.detach().to("cpu", torch.float64)
    diag = torch.diagonal(0.5 * (a64 + a64.T))
    _check_trace(diag)
    return {rank: residual_factor(diag, v, lam, damping) for rank, (v, lam) in top_eigenpairs(a64, ranks).items()}


def sketch_grams(y64: torch.Tensor, om64: torch.Tensor) -> torch.Tensor:
    """``[ΩᵀY, YᵀY, ΩᵀΩ]`` (``[3, k, k]``, FP64, on the sketch's device): all that the Nyström
    core needs of ``Y = A Ω`` and ``Ω`` (``[d_in, k]`` each)."""
    return torch.stack([om64.T @ y64, y64.T @ y64, om64.T @ om64])


@dataclass
class NystromCore:
    """The host part of ``factor_from_sketch``: the shift ``nu``, ``basis`` ``B [k, r]`` with
    ``V = (Y + ν Ω) B``, and ``lam [r]``; ``ok`` False where the core stayed indefinite (``B`` and
    ``lam`` then have no columns: the factor is the damped diagonal alone)."""

    nu: float
    basis: torch.Tensor
    lam: torch.Tensor
    ok: bool


def nystrom_core(grams: torch.Tensor, rank: int, max_shifts: int = MAX_SHIFTS) -> NystromCore:
    """Stabilized single-pass Nyström approximation (Tropp et al., 2017) from ``sketch_grams``
    (host, FP64), on ``k x k`` matrices only.

    With a small shift ``ν``, ``Y_ν = Y + νΩ``, ``ΩᵀY_ν = C Cᵀ``, ``E = Y_ν C⁻ᵀ = U Σ Pᵀ``; then
    ``A ≈ U (Σ² - ν) Uᵀ`` and the top ``rank ≤ k`` pairs are kept. ``ΩᵀY_ν = ΩᵀY + νΩᵀΩ``, and
    ``Eᵀ E = C⁻¹ Y_νᵀ Y_ν C⁻ᵀ = P Σ² Pᵀ`` with ``Y_νᵀY_ν = YᵀY + ν(YᵀΩ + ΩᵀY) + ν²ΩᵀΩ``, so
    ``U = Y_ν B`` with ``B = C⁻ᵀ P Σ⁻¹``. FP32 statistics can leave ``ΩᵀY`` slightly indefinite:
    ``ν`` starts at 1e-6·‖Y‖ and grows 10x at a time, at most ``max_shifts`` times."""
    oty, yty, oto = grams.unbind(0)
    k = oty.shape[0]
    # host tensors: read with tolist(), which never dispatches to a device
    nu = 1e-6 * torch.diagonal(yty).sum().clamp_min(0.0).sqrt().tolist() + 1e-300  # ‖Y‖ (Frobenius) = sqrt(tr YᵀY)
    empty = torch.zeros(k, 0, dtype=torch.float64)
    for _ in range(max_shifts + 1):
        core = oty + nu * oto
        c, info = torch.linalg.cholesky_ex(0.5 * (core + core.T))
        if info.tolist() == 0:
            break
        nu *= 10.0
    else:
        return NystromCore(nu, empty, empty[0], False)
    m = yty + nu * (oty + oty.T) + nu * nu * oto
    x = torch.linalg.solve_triangular(c, m, upper=False)
    g = torch.linalg.solve_triangular(c, x.T, upper=False)  # C⁻¹ M C⁻ᵀ
    sig2, p = torch.linalg.eigh(0.5 * (g + g.T))
    r = max(0, min(rank, k))
    sig2, p = sig2.flip(0)[:r], p.flip(1)[:, :r]
    inv_sig = torch.where(sig2 > 0, sig2.clamp_min(1e-300).rsqrt(), 0.0)
    basis = torch.linalg.solve_triangular(c.T, p, upper=True) * inv_sig
    return NystromCore(nu, basis, (sig2 - nu).clamp_min(0.0), True)


def nystrom_basis(y64: torch.Tensor, om64: torch.Tensor, nu, basis: torch.Tensor) -> torch.Tensor:
    """``V = (Y + ν Ω) B`` (``[d_in, r]``, on the sketch's device)."""
    return torch.add(y64, om64, alpha=nu) @ basis


def factor_from_sketch(
    y: torch.Tensor,
    omega: torch.Tensor,
    diag: torch.Tensor,
    rank: int,
    damping: float = 1e-3,
    max_shifts: int = MAX_SHIFTS,
) -> LowRankFactor:
    """Like ``approximate_factor`` from ``Y = A Ω`` (``[d_in, k]``), ``Ω`` and ``diag(A)`` only
    (``nystrom_core``), on ``y``'s device. If the core is still not positive definite after
    ``max_shifts`` shifts (e.g. non-finite ``Y``) the factor falls back to the damped diagonal
    alone (rank 0), with a warning."""
    y64, om64, d64 = (t.detach().double() for t in (y, omega.to(y.device), diag))
    core = nystrom_core(sketch_grams(y64, om64).cpu(), rank, max_shifts)
    if not core.ok:
        logger.warning(
            "megatron-gift: the Nyström core stayed indefinite after %d shifts (non-finite or "
            "corrupt statistics?): using the diagonal of A alone for this factor",
            max_shifts,
        )
    _check_trace(d64)
    v = nystrom_basis(y64, om64, core.nu, core.basis.to(y64.device))
    return residual_factor(d64, v, core.lam.to(y64.device), damping)


def _check_trace(diag: torch.Tensor) -> None:
    if not float(diag.sum()) > 0:
        raise ValueError("K-FAC factor has a non-positive trace: no activations were seen")


def residual_factor(diag: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, damping) -> LowRankFactor:
    """``D + V Λ Vᵀ`` with ``D`` the damped residual diagonal of the module doc (on ``diag``'s device,
    no host synchronisation: ``trace_a`` stays a 0-d tensor)."""
    trace = diag.sum()
    resid = (diag - (v * v) @ lam).clamp_min(0.0)
    return LowRankFactor(d=resid + damping * (trace / diag.shape[0]), v=v, lam=lam, trace_a=trace, damping=damping)


def whitening_gram(d: torch.Tensor, v: torch.Tensor, lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``W = D^{-1/2} V Λ^{1/2}`` (``[..., d_in, r]``) and its Gram ``Wᵀ W`` (``[..., r, r]``), batched over
    leading dims."""
    w = v * lam.sqrt().unsqueeze(-2) * d.rsqrt().unsqueeze(-1)
    return w, w.mT @ w


def gram_eigh(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, P)`` of the host FP64 Gram(s) ``S = P diag(s) Pᵀ``, descending, ``s ≥ 0``."""
    s, p = torch.linalg.eigh(0.5 * (gram + gram.mT))
    return s.flip(-1).clamp_min(0.0), p.flip(-1)


def whitening_tensors(d: torch.Tensor, w: torch.Tensor, s: torch.Tensor, p: torch.Tensor, dtype=torch.float32) -> dict:
    """``LowRankWhitening.tensors()`` from ``D``, ``W`` and the eigenpairs of ``Wᵀ W``: ``Q = W P
    diag(s)^{-1/2}`` (a column with ``s = 0`` is 0, and its ``c = c' = 0``), batched over leading dims."""
    q = (w @ p) * torch.where(s > 0, s.clamp_min(1e-300).rsqrt(), 0.0).unsqueeze(-2)
    out = {
        "d_inv_sqrt": d.rsqrt(),
        "d_sqrt": d.sqrt(),
        "q": q,
        "c": (1.0 + s).rsqrt() - 1.0,
        "c_inv": (1.0 + s).sqrt() - 1.0,
    }
    return {k: t.to(dtype).contiguous() for k, t in out.items()}


class LowRankWhitening:
    """``T`` and ``T⁻¹`` of the module docstring, stored as ``D^{∓1/2}`` (d_in), ``Q`` (d_in x r), ``c``, ``c'`` (r)."""

    def __init__(self, factor: LowRankFactor, dtype: torch.dtype = torch.float32, device=None):
        w, gram = whitening_gram(factor.d, factor.v, factor.lam)
        s, p = (t.to(w.device) for t in gram_eigh(gram.cpu()))
        tensors = whitening_tensors(factor.d, w, s, p, dtype)
        self._set(**{k: t.to(device if device is not None else t.device) for k, t in tensors.items()})

    def _set(self, d_inv_sqrt, d_sqrt, q, c, c_inv) -> None:
        self.d_inv_sqrt, self.d_sqrt, self.q, self.c, self.c_inv = d_inv_sqrt, d_sqrt, q, c, c_inv
        self.d_in, self.rank = q.shape
        self._q_t, self._q_t_version = q.T.contiguous(), q._version

    @property
    def q_t(self) -> torch.Tensor:
        """``Qᵀ`` ``[r, d_in]`` contiguous, which the kernels load rows of: made when the transform is set (once,
        outside any reduction stage; not per kernel call, which cost a launch each), again only where ``Q`` was
        written in place since (a transform received into ``empty()``'s tensors)."""
        if self._q_t_version != self.q._version:
            self._q_t, self._q_t_version = self.q.T.contiguous(), self.q._version
        return self._q_t

    @classmethod
    def from_tensors(cls, tensors: dict) -> LowRankWhitening:
        """A transform holding ``tensors`` (``tensors()``'s keys) themselves, e.g. views of a received buffer."""
        w = cls.__new__(cls)
        w._set(**tensors)
        return w

    @classmethod
    def empty(cls, d_in: int, rank: int, dtype: torch.dtype = torch.float32, device=None) -> LowRankWhitening:
        """Uninitialized tensors of the right shapes, to receive a saved transform."""
        vec = lambda n: torch.empty(n, dtype=dtype, device=device)  # noqa: E731
        return cls.from_tensors(
            {
                "d_inv_sqrt": vec(d_in),
                "d_sqrt": vec(d_in),
                "q": torch.empty(d_in, rank, dtype=dtype, device=device),
                "c": vec(rank),
                "c_inv": vec(rank),
            }
        )

    @classmethod
    def identity(cls, d_in: int, dtype: torch.dtype = torch.float32, device=None) -> LowRankWhitening:
        """``T = I`` (rank 0, ``D = I``): the layer is sent as plain FP8, bit for bit."""
        w = cls.empty(d_in, 0, dtype=dtype, device=device)
        for t in (w.d_inv_sqrt, w.d_sqrt):
            t.fill_(1.0)
        return w

    @classmethod
    def from_statistics(cls, a: torch.Tensor, rank: int, damping: float = 1e-3, device=None) -> LowRankWhitening:
        return cls(approximate_factor(a, rank, damping), device=device if device is not None else a.device)

    def _low_rank_update(self, x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """``x (I + Q diag(coef) Qᵀ)`` for ``x [..., d_in]``."""
        if self.rank == 0:
            return x
        with ieee_fp32(x.device):
            return torch.addmm(x.reshape(-1, self.d_in), (x.reshape(-1, self.d_in) @ self.q) * coef, self.q.T).view_as(
                x
            )

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        """``G T`` for ``G [..., d_in]``."""
        return self._low_rank_update(g * self.d_inv_sqrt, self.c)

    def inverse(self, u: torch.Tensor) -> torch.Tensor:
        """``U T⁻¹`` for ``U [..., d_in]``."""
        return self._low_rank_update(u, self.c_inv) * self.d_sqrt

    def projection(self, u: torch.Tensor, cols: slice) -> torch.Tensor:
        """``U[:, cols] Q[cols]`` (``[k, r]``): a row's ``U Q`` is the sum of its column pieces'."""
        with ieee_fp32(u.device):
            return u @ self.q[cols]

    def inverse_piece(self, u: torch.Tensor, proj: torch.Tensor, cols: slice) -> torch.Tensor:
        """Columns ``cols`` of ``U T⁻¹`` from those of ``U`` and the whole rows' ``U Q`` (``proj [k, r]``)."""
        with ieee_fp32(u.device):
            return torch.addmm(u, proj * self.c_inv, self.q[cols].T) * self.d_sqrt[cols]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``(T, T⁻¹)``, for tests and diagnostics only."""
        eye = torch.eye(self.d_in, dtype=self.q.dtype, device=self.q.device)
        return self.apply(eye), self.inverse(eye)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"d_inv_sqrt": self.d_inv_sqrt, "d_sqrt": self.d_sqrt, "q": self.q, "c": self.c, "c_inv": self.c_inv}
