"""Two-sided whitening ``U = T_outᵀ G T_in`` against a dense FP64 Kronecker reference."""

import math

import pytest
import torch

from megatron_gift.numerics import LowRankWhitening, approximate_factor
from megatron_gift.numerics.two_sided import TwoSidedWhitening

D_OUT, D_IN = 12, 20


def spd(d: int, decades: float, seed: int) -> torch.Tensor:
    """A random SPD matrix with eigenvalues spread over ``decades``, FP64."""
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return (basis * torch.logspace(0, -decades, d, dtype=torch.float64)) @ basis.T


def linear_map(fn, d_out: int, d_in: int) -> torch.Tensor:
    """The matrix ``M`` with ``vec(fn(G)) = M vec(G)`` (row-major ``vec``), from ``fn`` of every basis matrix at
    once."""
    n = d_out * d_in
    basis = torch.eye(n, dtype=torch.float64).view(n, d_out, d_in)
    return fn(basis).reshape(n, n).T


def sides(r_in: int, r_out: int, damping: float, dtype=torch.float64):
    a, b = spd(D_IN, 3.0, 0), spd(D_OUT, 3.0, 1)
    fa, fb = approximate_factor(a, r_in, damping), approximate_factor(b, r_out, damping)
    return fa, fb, TwoSidedWhitening(LowRankWhitening(fa, dtype), LowRankWhitening(fb, dtype))


@pytest.mark.parametrize("r_in, r_out, damping", [(D_IN, D_OUT, 1e-3), (4, 3, 0.3), (4, 0, 1.0), (0, 3, 1.0)])
def test_whitens_the_kronecker_factor(r_in, r_out, damping):
    """``M (B̂ ⊗ Â) Mᵀ = I`` for the map ``vec G -> vec U`` (row-major ``vec``: ``Cov(G[i,j], G[k,l]) =
    B[i,k] A[j,l]``), and the inverse's map is ``M⁻¹``. The reference is the K-FAC covariance itself,
    built densely, not the low-rank formulas. Bugs caught: a side applied to the wrong axis (``G T_out``
    or ``T_in G`` fail the shapes or the identity), ``T_out`` instead of ``T_outᵀ`` (``T`` is not
    symmetric: ``T_out B̂ T_outᵀ ≠ I``), an inverse in the wrong order or transposed.

    Tolerance: FP64 with sums of at most ``n = d_out·d_in`` terms per product, each normwise within
    ``γ = n·2^-53`` relative; ``‖M‖₂² = 1/λmin(K)`` (from ``M K Mᵀ = I``), so a perturbation ``δM``
    moves ``M K Mᵀ`` by at most ``2‖δM‖‖K‖‖M‖ ≤ 2γ κ(K)``, ``K = B̂ ⊗ Â``, ``κ(K) = κ(B̂)κ(Â)``;
    likewise ``N M − I`` by ``2γ κ(M) = 2γ sqrt(κ(K))``. A factor 4 covers the few products chained."""
    fa, fb, w = sides(r_in, r_out, damping)
    k = torch.kron(fb.dense(), fa.dense())
    m = linear_map(w.apply, D_OUT, D_IN)
    n_inv = linear_map(w.inverse, D_OUT, D_IN)
    eye = torch.eye(D_OUT * D_IN, dtype=torch.float64)
    gamma = D_OUT * D_IN * 2.0**-53
    kappa = torch.linalg.cond(k).item()
    assert (m @ k @ m.T - eye).abs().max() <= 4 * 2 * gamma * kappa
    assert (n_inv @ m - eye).abs().max() <= 4 * 2 * gamma * math.sqrt(kappa)


def test_identity_side_is_the_one_sided_map():
    """With ``T_out = I`` the map is the input-side ``G T_in`` alone, bit for bit, and with
    ``T_in = I`` it acts on rows only: ``U[:, j]`` depends on column ``j`` of ``G`` alone, while
    an input-side map keeps each row to itself. Bug caught: the identity side not being a no-op
    (rank-0 ``LowRankWhitening.identity``), which would change today's input-only payload."""
    fa, fb, _ = sides(4, 3, 1.0, torch.float32)
    w_in, w_out = LowRankWhitening(fa), LowRankWhitening(fb)
    g = torch.randn(3, D_OUT, D_IN, generator=torch.Generator().manual_seed(5))
    assert torch.equal(TwoSidedWhitening(w_in, LowRankWhitening.identity(D_OUT)).apply(g), w_in.apply(g))
    out_only = TwoSidedWhitening(LowRankWhitening.identity(D_IN), w_out)
    poked = g.clone()
    poked[:, :, 7] += 1.0
    changed = (out_only.apply(poked) != out_only.apply(g)).any(dim=(0, 1))
    assert changed.tolist() == [j == 7 for j in range(D_IN)]


def test_fp32_round_trip_and_batched_ranks():
    """FP32 as the reduction runs it: ``inverse(apply(G)) = G`` for a stack of rank gradients
    ``[R, d_out, d_in]``, each slice as if alone. Bound: every FP32 product chains sums of at most
    ``d_in + d_out`` terms (``γ = (d_in + d_out)·2^-24``), amplified by ``κ(T_in)κ(T_out) =
    sqrt(κ(Â)κ(B̂))`` normwise; factor 4 for the four maps chained."""
    fa, fb, _ = sides(4, 3, 0.3)
    w = TwoSidedWhitening(LowRankWhitening(fa), LowRankWhitening(fb))
    g = torch.randn(4, D_OUT, D_IN, generator=torch.Generator().manual_seed(6))
    kappa = math.sqrt(torch.linalg.cond(fa.dense()).item() * torch.linalg.cond(fb.dense()).item())
    bound = 4 * (D_IN + D_OUT) * 2.0**-24 * kappa
    back = w.inverse(w.apply(g))
    assert ((back - g).norm() / g.norm()).item() <= bound
    one = w.apply(g[2])
    assert ((w.apply(g)[2] - one).norm() / one.norm()).item() <= bound
