"""K-FAC statistics, low-rank whitening, its inverse, determinism, and the predicted error ratio."""

import math
import subprocess
import sys

import pytest
import torch

from megatron_gift import kernels
from megatron_gift.numerics import (
    CodecConfig,
    ErrorFeedback,
    KFACStatistics,
    LowRankWhitening,
    approximate_factor,
    geometry_stats,
    roundtrip,
)
from megatron_gift.numerics.fp8 import decode
from megatron_gift.numerics.whitening import factor_from_sketch
from megatron_gift.testing.dense import DenseCholeskyWhitening
from tests.bounds import lowrank_gamma, lowrank_magnitudes


def spectrum_factor(d, decay=4.0, seed=0):
    """A random SPD factor with eigenvalues spread over ``decay`` decades, and its square root's pieces."""
    gen = torch.Generator().manual_seed(seed)
    evals = torch.logspace(0, -decay, d, dtype=torch.float64)
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return basis, evals


def sample_rows(basis, evals, power, n, seed=1):
    """Rows drawn from N(0, A^power): ``Z · V Λ^{power/2} Vᵀ``."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, basis.shape[0], generator=gen, dtype=torch.float64)
    return (z @ (basis * evals ** (power / 2)) @ basis.T).float()


@pytest.fixture(scope="module")
def factor_a():
    basis, evals = spectrum_factor(384)
    return basis, evals, ((basis * evals) @ basis.T).float()


EPS32 = torch.finfo(torch.float32).eps  # 2^-23


def fp32_bound(t: torch.Tensor, c: float = 1.0, factor=None) -> float:
    """``c · d · eps · κ(T)``: a normwise worst case for FP32 work with ``T [d, d]``.

    ``T``, ``T⁻¹`` and ``G T`` are each built by FP32 sums of at most ``d`` terms, so each carries a
    normwise relative error ``δ ≤ γ_d ≈ d · eps``; an identity that multiplies one by the other
    turns that into an error ``‖T⁻¹‖ ‖δT‖ ≤ κ(T) · δ`` per factor (first order), whatever CPU did
    the rounding. ``κ`` from the FP64 ``factor`` (``LowRankFactor``: ``Tᵀ Â T = I`` makes
    ``κ(T)² = κ(Â)``) when given, else from ``T`` itself. For a whitening's own identities the
    componentwise ``tests/bounds.py::lowrank_magnitudes`` is far tighter (test_whitening_identities)."""
    kappa = (
        math.sqrt(torch.linalg.cond(factor.dense()).item())
        if factor is not None
        else torch.linalg.cond(t.double()).item()
    )
    return c * t.shape[0] * EPS32 * kappa


@pytest.mark.parametrize("rank", [0, 8, 32, 384])
def test_whitening_identities(factor_a, rank):
    """``Tᵀ Â T = I``, ``T T⁻¹ = I``, ``(G T) T⁻¹ = G`` and the low-rank path equal to the dense
    matrices, each elementwise within the first-order propagation of the componentwise FP32 errors of
    ``tests/bounds.py::lowrank_magnitudes`` (``T = T_e + Δ``, ``|Δ| ≤ γ M``; ``Â T_e = T_e⁻ᵀ``):

        |Tᵀ Â T − I| ≤ γ (Mᵀ |T⁻ᵀ| + |T⁻¹| M) + γ² Mᵀ |Â| M
        |T T⁻¹ − I| ≤ γ (M |T⁻¹| + |T| M') + γ² M M'

    checked in FP64 (its own rounding, ``d 2^-52`` of the magnitudes, added). Bugs caught: a wrong
    ``c``/``c'``, ``D`` or ``Q`` (any departs at O(1)); on a CPU whose FP32 sums round otherwise the
    bound still holds (it is a worst case)."""
    _, _, a = factor_a
    f = approximate_factor(a, rank)
    w = LowRankWhitening(f)
    t, t_inv = (x.double() for x in w.dense())
    ahat, d = f.dense(), a.shape[0]
    m, m_inv = lowrank_magnitudes(w)
    gamma, fp64 = lowrank_gamma(w), d * 2.0**-52
    eye = torch.eye(d, dtype=torch.float64)
    bound = gamma * (m.T @ t_inv.T.abs() + t_inv.abs() @ m) + gamma**2 * m.T @ ahat.abs() @ m
    err = (t.T @ ahat @ t - eye).abs()
    assert (err <= bound + fp64 * t.abs().T @ ahat.abs() @ t.abs()).all()
    print(f"rank {rank}: max |TᵀÂT − I| / bound {float((err / bound.clamp_min(1e-300)).max()):.4f}")  # pytest -s
    bound = gamma * (m @ t_inv.abs() + t.abs() @ m_inv) + gamma**2 * m @ m_inv
    assert ((t @ t_inv - eye).abs() <= bound + fp64 * t.abs() @ t_inv.abs()).all()
    g = torch.randn(100, d, generator=torch.Generator().manual_seed(rank))
    g64 = g.double()
    # (G T) T⁻¹: the first transform's error through T⁻¹, the second's on |G T|
    u = w.apply(g)
    assert (
        (w.inverse(u).double() - g64).abs() <= gamma * (g64.abs() @ m @ t_inv.abs() + u.double().abs() @ m_inv)
    ).all()
    # the low-rank path against G times the dense T: both within γ|G|M of G T_e, plus the FP32
    # matrix product's own d-term sums
    assert ((u.double() - g64 @ t).abs() <= 2 * gamma * g64.abs() @ m + d * EPS32 * g64.abs() @ t.abs()).all()


def test_low_rank_matches_dense_factor(factor_a):
    """Rank-r plus residual diagonal keeps the exact top-r spectrum and the exact diagonal (+ damping)."""
    basis, evals, a = factor_a
    f = approximate_factor(a, 16, damping=0.0)
    # a is A rounded to FP32: ‖δA‖₂ ≤ d · 2^-24 · max|A| moves each eigenvalue at most that (Weyl)
    assert torch.allclose(f.lam, evals[:16], rtol=0, atol=a.shape[0] * 2.0**-24 * float(a.abs().max()))
    # the diagonal is kept exactly, up to FP64 rounding of d + Σ λ v²
    assert torch.allclose(torch.diagonal(f.dense()), torch.diagonal(a).double(), rtol=1e-12)


def test_dense_cholesky_reference(factor_a):
    _, _, a = factor_a
    f = approximate_factor(a, 32)
    dense = DenseCholeskyWhitening(f)
    eye = torch.eye(a.shape[0])
    t = dense.apply(eye)
    t64 = t.double()
    assert (t64.T @ f.dense() @ t64 - eye.double()).abs().max() <= fp32_bound(t, 2)  # as in the identities above
    g = torch.randn(50, a.shape[0], generator=torch.Generator().manual_seed(0))
    assert (dense.inverse(dense.apply(g)) - g).norm() / g.norm() <= fp32_bound(t, 2)


def _whitening_bytes(seed: int) -> bytes:
    basis, evals = spectrum_factor(256, seed=seed)
    a = ((basis * evals) @ basis.T).float()
    w = LowRankWhitening.from_statistics(a, rank=32)
    return b"".join(t.numpy().tobytes() for t in w.tensors().values())


def test_factor_is_bitwise_deterministic_across_processes():
    """Same statistics give the same T bit for bit, here and in a fresh process with other thread counts."""
    here = _whitening_bytes(3)
    assert here == _whitening_bytes(3)
    code = (
        "import sys, torch; torch.set_num_threads(int(sys.argv[1]));"
        "from tests.unit.test_whitening import _whitening_bytes;"
        "sys.stdout.buffer.write(_whitening_bytes(3))"
    )
    for threads in (1, 2):
        out = subprocess.run([sys.executable, "-c", code, str(threads)], capture_output=True, check=True).stdout
        assert out == here


def test_kfac_statistics_ema():
    """Per-step EMA of (sums, tokens): the first fold gives the step's mean, later ones the
    token-weighted EMA of sums over that of tokens (both start at 0); a step without tokens changes nothing."""
    stats = KFACStatistics(8, ema=0.5)
    gen = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(100, 8, generator=gen), torch.randn(3, 50, 8, generator=gen) * 2
    stats.accumulate(x1[:40])
    stats.accumulate(x1[40:])
    stats.fold()
    a1 = stats.factor.clone()
    assert torch.allclose(a1, x1.T @ x1 / 100, atol=1e-5)
    stats.accumulate(x2)
    stats.fold()
    x2f = x2.reshape(-1, 8)
    # E = β(1-β) S1 + (1-β) S2, M = β(1-β) N1 + (1-β) N2
    assert torch.allclose(stats.factor, (0.25 * x1.T @ x1 + 0.5 * x2f.T @ x2f) / (0.25 * 100 + 0.5 * 150), atol=1e-4)
    # β = 0.5 is also 1 - β: at β = 0.75 the old sums' weight β and the new ones' 1 - β differ
    skewed = KFACStatistics(8, ema=0.75)
    for x in (x1, x2):
        skewed.accumulate(x)
        skewed.fold()
    assert torch.allclose(
        skewed.factor, (0.1875 * x1.T @ x1 + 0.25 * x2f.T @ x2f) / (0.1875 * 100 + 0.25 * 150), atol=1e-4
    )
    before = stats.factor.clone()
    stats.fold()  # no tokens this step: E and M both halve (β = 0.5, a power of two: exact)
    assert torch.equal(stats.factor, before)
    restored = KFACStatistics(8, ema=0.5)
    restored.load_state_dict(stats.state_dict())
    assert torch.equal(restored.factor, stats.factor) and restored.folds == 3
    with pytest.raises(RuntimeError):
        KFACStatistics(8).averages()


@pytest.mark.parametrize("sketch", [0, 4])
def test_sum_of_local_emas_is_the_ema_of_global_statistics(sketch):
    """Linearity, exactly in FP64: dyadic activations and β = 0.75 keep every product and sum
    exact, so Σ_ranks (local EMA) equals the EMA of the globally summed per-step statistics bit
    for bit, unequal token counts and a rank without tokens included."""
    ranks, steps, d = 3, 6, 8
    gen = torch.Generator().manual_seed(0)
    local = [KFACStatistics(d, ema=0.75, sketch=sketch, seed=1, dtype=torch.float64) for _ in range(ranks)]
    glob = KFACStatistics(d, ema=0.75, sketch=sketch, seed=1, dtype=torch.float64)
    glob.omega = local[0].omega = local[1].omega = local[2].omega = (
        None if sketch == 0 else torch.randint(-2, 3, (d, sketch), generator=gen).double()
    )
    for step in range(steps):
        for r, stats in enumerate(local):
            n = 0 if (step, r) == (2, 1) else 4 + 3 * r + step
            x = torch.randint(-4, 5, (n, d), generator=gen).double() / 4
            stats.accumulate(x)
            glob.accumulate(x)
            stats.fold()
        glob.fold()
    for k in glob.ema_sums:
        assert torch.equal(sum(s.ema_sums[k] for s in local), glob.ema_sums[k]), k
    assert torch.equal(sum(s.ema_tokens for s in local), glob.ema_tokens)
    summed = ({k: sum(s.ema_sums[k] for s in local) for k in glob.ema_sums}, sum(s.ema_tokens for s in local))
    for k, v in glob.averages(summed).items():
        assert torch.equal(v, glob.averages()[k])


def test_statistics_are_fp32_and_bf16_would_cost_the_residual_diagonal():
    """Sums, EMAs and their averages stay FP32. Why it matters: with 99% of the trace in the top
    r eigenvalues, D = diag(A) - diag(VΛVᵀ) is a 1% difference, so BF16's 2^-9 relative rounding of
    diag(A) becomes ~2^-9/0.01 ≈ 20% on D; FP32's 2^-24 stays ~1e-5."""
    d, r = 64, 8
    basis = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))[0]
    evals = torch.cat([torch.full((r,), 99.0 / r), torch.full((d - r,), 1.0 / (d - r))])
    a = (basis * evals) @ basis.T
    stats = KFACStatistics(d, sketch=0)
    stats.accumulate(torch.randn(10, d))
    stats.fold()
    assert all(
        t.dtype == torch.float32 for t in (*stats.sums.values(), *stats.ema_sums.values(), *stats.averages().values())
    )
    exact = approximate_factor(a, r, damping=0.0).d
    errs = {}
    for dtype in (torch.float32, torch.bfloat16):
        errs[dtype] = float(((approximate_factor(a.to(dtype), r, damping=0.0).d - exact).abs() / exact).max())
    assert errs[torch.float32] < 64 * 2**-24 / 0.01  # d · u32 / residual share: the eigensolver's error on D
    assert errs[torch.bfloat16] > 0.02  # BF16: several percent (measured ~20%)


@pytest.mark.parametrize("damping", [1e-3, 0.1, 1.0, 10.0])
def test_damping_bounds_the_transform(factor_a, damping):
    """Tᵀ Â T = I gives ‖T⁻¹‖₂² = λmax(Â) ≤ max diag(A) + λ1(A) + δ·m and ‖T‖₂² = 1/λmin(Â) ≤ 1/(δ·m)
    (m = mean diag A, D ≥ δ·m): so the quantization error T⁻¹ can amplify relative to the
    whitened signal is at most κ(T) ≤ sqrt((max diag A + λ1 + δm)/(δm)); larger δ, smaller bound."""
    _, evals, a = factor_a
    m = float(torch.diagonal(a).mean())
    f = approximate_factor(a, 16, damping)
    t, t_inv = (x.double() for x in LowRankWhitening(f).dense())
    spec = torch.linalg.eigvalsh(f.dense())
    tol = 1 + 1e-4  # FP32 transform of an FP64 factor: relative error ~ d·u32
    n_t, n_inv = float(torch.linalg.matrix_norm(t, 2)), float(torch.linalg.matrix_norm(t_inv, 2))
    assert n_inv**2 == pytest.approx(float(spec[-1]), rel=1e-4) and n_t**2 == pytest.approx(
        1 / float(spec[0]), rel=1e-3
    )
    assert n_inv**2 <= (float(torch.diagonal(a).max()) + float(evals.max()) + damping * m) * tol
    assert n_t**2 <= tol / (damping * m)
    if damping >= 0.1:
        assert (
            n_t * n_inv
            <= ((float(torch.diagonal(a).max()) + float(evals.max()) + damping * m) / (damping * m)) ** 0.5 * tol
        )


def test_with_damping_replaces_the_damping(factor_a):
    _, _, a = factor_a
    f = approximate_factor(a, 8, 1e-3)
    assert torch.allclose(f.with_damping(3.0).d, approximate_factor(a, 8, 3.0).d, rtol=1e-12)
    assert f.with_damping(3.0).damping == 3.0


def test_nystrom_shift_is_bounded_and_falls_back_to_the_diagonal(caplog):
    """A sketch whose core never becomes positive definite (NaN) ends after max_shifts tries with a
    rank-0 (damped diagonal) factor and a warning, instead of looping forever."""
    d, k = 16, 8
    diag = torch.linspace(1, 2, d)
    with caplog.at_level("WARNING"):
        f = factor_from_sketch(torch.full((d, k), float("nan")), torch.randn(d, k), diag, rank=4, damping=0.5)
    assert "stayed indefinite" in caplog.text
    assert f.v.shape == (d, 0) and torch.allclose(f.d, diag.double() + 0.5 * 1.5)
    w = LowRankWhitening(f)
    assert torch.allclose(w.apply(torch.ones(2, d)), (1 / f.d.sqrt()).float().expand(2, d))
    # an indefinite but finite core: found after a few shifts, not a fallback
    caplog.clear()
    om = torch.randn(d, k, generator=torch.Generator().manual_seed(0))
    factor_from_sketch(-om, om, diag, rank=4)
    assert "stayed indefinite" not in caplog.text


def test_identity_whitening_is_exact():
    g = torch.randn(5, 12)
    w = LowRankWhitening.identity(12)
    assert torch.equal(w.apply(g), g) and torch.equal(w.inverse(g), g) and w.rank == 0


def test_sketched_statistics_whiten_like_exact(factor_a):
    """A Nyström sketch of k = 2r columns recovers the top-r spectrum; its whitening helps alike."""
    basis, evals, a = factor_a
    d = a.shape[0]
    x = sample_rows(basis, evals, 1, n=4000, seed=5)  # activations with covariance A
    exact, sketched = KFACStatistics(d), KFACStatistics(d, sketch=64, seed=7)
    for stats in (exact, sketched):
        stats.accumulate(x)
        stats.fold()
    assert sketched.sums["y"].shape == (d, 64) and "xtx" not in sketched.sums
    f_exact, f_sketch = exact.low_rank_factor(32, 1e-3), sketched.low_rank_factor(32, 1e-3)
    assert torch.allclose(f_sketch.lam[:8], f_exact.lam[:8], rtol=0.2)  # a flat top: Nyström undershoots a little
    g = sample_rows(basis, evals, 2, n=256)
    cfg = CodecConfig("e4m3", "block")
    euclid = (roundtrip(g, cfg) - g).norm()
    ratios = []
    for f in (f_exact, f_sketch):
        w = LowRankWhitening(f)
        ratios.append(((w.inverse(roundtrip(w.apply(g), cfg)) - g).norm() / euclid).item())
    assert ratios[1] < 0.9 and ratios[1] < ratios[0] * 1.1, ratios


@pytest.mark.parametrize("power,helps", [(2, True), (1, False)])
@pytest.mark.parametrize("codec", ["e4m3-block", "e5m2-tensor"])
def test_predicted_ratio_matches_measured(factor_a, power, helps, codec):
    """Rows from N(0, A²): whitening helps; rows from N(0, A): it does not. Prediction matches."""
    basis, evals, a = factor_a
    g = sample_rows(basis, evals, power, n=256)
    cfg = CodecConfig(*codec.split("-"))
    f = approximate_factor(a, 32)
    w = LowRankWhitening(f)
    euclid = ((roundtrip(g, cfg) - g).norm() / g.norm()).item()
    gift = ((w.inverse(roundtrip(w.apply(g), cfg)) - g).norm() / g.norm()).item()
    measured = gift / euclid
    geo = geometry_stats(g, f, w)
    if helps:
        assert measured < 0.9 and geo.grad_energy_share_top_r > geo.trace_share_top_r + 0.1
    else:
        assert 0.95 < measured < 1.1 and abs(geo.grad_energy_share_top_r - geo.trace_share_top_r) < 0.05
    assert abs(geo.predicted_ratio_model - measured) < 0.08 * measured
    assert abs(geo.predicted_ratio_shares - measured) < 0.15 * measured


def test_error_feedback_telescopes():
    """Error feedback's invariant: after T steps of ``x̃ = x + e``, send ``q = Q(x̃)``, keep
    ``e = x̃ − q``, the decoded values plus the residual sum to the inputs, ``Σ_t q_t + e_T = Σ_t x_t``,
    up to FP32 rounding: each step rounds ``x + e`` once (``2^-24 |x̃|``; ``x̃ − q`` is exact, q being
    x̃ rounded to fewer bits), accumulated here per element. Bugs caught: a residual not committed,
    committed twice, or taken against the uncompensated input. A skipped step (NaN) leaves it zero, not
    NaN (bug: the in-place residual kept after a step that was not applied)."""
    cfg = CodecConfig("e4m3", "tensor")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 64, generator=gen) * 1e-3
    x[0, 0] = 1.0  # one outlier sets the scale, the rest sits near the subnormal range
    ef = ErrorFeedback(x.numel())
    total, bound = torch.zeros_like(x, dtype=torch.float64), torch.zeros_like(x, dtype=torch.float64)
    for _ in range(50):
        xc = ef.compensate(x)
        y = roundtrip(xc, cfg)
        ef.stage(xc, y)
        ef.commit()
        total += y.double()
        bound += 2.0**-24 * xc.double().abs()
    defect = (total + ef.residual.view_as(x).double() - 50 * x.double()).abs()
    assert (defect <= bound).all(), float((defect - bound).max())
    plain = (roundtrip(x, cfg).double() * 50 - 50 * x.double()).abs()
    assert float(plain.max()) > 1e3 * float(bound.max())  # without the residual: far outside (the test can fail)
    assert float(ef.residual.abs().max()) > 0
    ef.stage(x + float("nan"), x)
    ef.commit(applied=False)
    assert torch.equal(ef.residual, torch.zeros_like(ef.residual))


def test_the_sender_feeds_the_residual_back():
    """The same invariant through the sender's path: ``kernels.whiten_encode`` given ``ErrorFeedback.feedback``'s
    ``(e, e')``, as ``comm.codec.encode_bucket`` calls it, decoded by the codec. Bug caught: the residual
    staged but never added to the next input (every step sends ``Q(x)`` again: the sum drifts by
    ``Q(x) - x`` per step), which the test above, driving ``ErrorFeedback`` by hand, cannot see."""
    cfg = CodecConfig("e4m3", "tensor")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 64, generator=gen) * 1e-3
    x[0, 0] = 1.0
    ef = ErrorFeedback(x.numel())
    total, bound = torch.zeros_like(x, dtype=torch.float64), torch.zeros_like(x, dtype=torch.float64)
    for _ in range(50):
        e, staged = ef.feedback(0, x.numel())
        bound += 2.0**-24 * (x + e.view_as(x)).double().abs()  # the FP32 rounding of x + e, as above
        enc = kernels.whiten_encode(x, None, cfg, fused=False, feedback=(e, staged))
        ef.commit()
        total += decode(enc, cfg).double()
    defect = (total + ef.residual.view_as(x).double() - 50 * x.double()).abs()
    assert (defect <= bound).all(), float((defect - bound).max())


def test_kernels_transposed_q_follows_q():
    """``q_t`` (the contiguous ``Qᵀ`` the kernels load, made once per transform) is ``Qᵀ`` also after ``Q`` is
    written in place: a transform received into ``empty()``'s tensors, or into views of a buffer (bug caught:
    a ``Qᵀ`` cached at construction and never renewed, so the kernels whiten with the uninitialised one)."""
    w = LowRankWhitening.empty(8, 3)
    w.q.copy_(torch.arange(24.0).view(8, 3))
    assert torch.equal(w.q_t, torch.arange(24.0).view(8, 3).T) and w.q_t.is_contiguous()
    buf = torch.zeros(24)
    v = LowRankWhitening.from_tensors({**w.tensors(), "q": buf.view(8, 3)})
    buf.copy_(torch.arange(24.0) + 1)
    assert torch.equal(v.q_t, (torch.arange(24.0) + 1).view(8, 3).T)
