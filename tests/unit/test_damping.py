"""The damping ``T`` is built with, against an independent FP64 construction of the intended
factor: ``Tᵀ (A + δ m I) T = I`` with ``m = mean(diag A)`` (``numerics.whitening``'s module doc),
for every place a damping is chosen or applied: ``approximate_factor`` (``residual_factor``),
``LowRankFactor.with_damping``, and the refresh's staged build (``numerics.refresh.FactorBuild``)
with a configured damping and with ``auto`` (the candidate it says it chose).

**The factor.** ``A`` is built so that its rank-``r`` approximation is exact: an ``r x r`` block
``O diag(λ) Oᵀ`` (``O`` Haar, ``λ`` in ``[0.1, 1]``) on ``r`` scattered coordinates and a diagonal
``e`` in ``[1e-5, 1e-2]`` on the others. Its top ``r`` eigenpairs are the block's, the residual
diagonal is ``e`` there and 0 on the block, so the damped factor the module doc defines is exactly
``A + δ m I``: the test needs no eigensolver and restates no formula of the code.

**Why a wrong damping fails.** Along the coordinate with the smallest ``e`` the identity reads
``(e_min + δ m) / (e_min + δ' m)`` for a ``T`` built with ``δ'``: with ``e_min = 1e-5`` and ``δ m ≥
6e-5`` a factor 2 in the damping moves it by ≥ 0.4, 10% by ≥ 0.04.

**Tolerance** (any CPU): ``T`` is FP32, within ``γ M`` of the exact transform of the FP64 factor
elementwise (``tests/bounds.py::lowrank_magnitudes``), which gives ``|Tᵀ Â T − I| ≤ γ (Mᵀ |T⁻ᵀ| +
|T⁻¹| M) + γ² Mᵀ |Â| M`` (``test_whitening_identities``); the FP64 factor differs from ``A + δ m I``
by the eigensolver's backward error, at most ``100 d ε₆₄ ‖A‖₂`` in norm, which moves the identity by
``‖T‖₂²`` times that; plus the FP64 evaluation, ``d ε₆₄ |T|ᵀ |Â| |T|``. At ``κ(Â) ≈ 1e4`` this is
~1e-3, far below a factor-2 (or 10%) damping error.
"""

import pytest
import torch

from megatron_gift.numerics import CodecConfig, LowRankWhitening, approximate_factor
from megatron_gift.numerics.refresh import HEADER, FactorBuild, FactorSide, OwnedLayer
from tests.bounds import lowrank_gamma, lowrank_magnitudes

D, R = 64, 8
EPS64 = 2.0**-52


def structured_factor():
    """FP64 ``A`` (module doc) whose rank-``R`` approximation is exact."""
    gen = torch.Generator().manual_seed(5)
    block = torch.randperm(D, generator=gen)[:R]
    rest = torch.tensor([i for i in range(D) if i not in set(block.tolist())])
    o, _ = torch.linalg.qr(torch.randn(R, R, generator=gen, dtype=torch.float64))
    a = torch.zeros(D, D, dtype=torch.float64)
    a[block.unsqueeze(1), block] = (o * torch.logspace(0, -1, R, dtype=torch.float64)) @ o.T
    a[rest, rest] = torch.logspace(-2, -5, D - R, dtype=torch.float64)
    return a


def intended(a: torch.Tensor, damping: float) -> torch.Tensor:
    """``A + δ · mean(diag A) · I``, the factor a damping ``δ`` must whiten."""
    return a + damping * torch.diagonal(a).mean() * torch.eye(D, dtype=torch.float64)


def assert_whitens(w: LowRankWhitening, ahat: torch.Tensor, a: torch.Tensor) -> float:
    """``Tᵀ Â T = I`` elementwise within the module doc's tolerance; returns the worst error / tolerance."""
    t, t_inv = (x.double() for x in w.dense())
    m, _ = lowrank_magnitudes(w)
    gamma = lowrank_gamma(w)
    eye = torch.eye(D, dtype=torch.float64)
    tol = gamma * (m.T @ t_inv.T.abs() + t_inv.abs() @ m) + gamma**2 * m.T @ ahat.abs() @ m
    tol += float(torch.linalg.matrix_norm(t, 2)) ** 2 * 100 * D * EPS64 * float(torch.linalg.matrix_norm(a, 2))
    tol += D * EPS64 * t.abs().T @ ahat.abs() @ t.abs()
    err = (t.T @ ahat @ t - eye).abs()
    assert (err <= tol).all(), (
        f"max |TᵀÂT − I| {float(err.max()):.3g}, tolerance there {float(tol.flatten()[err.argmax()]):.3g}"
    )
    return float((err / tol).max())


@pytest.mark.parametrize("damping", [1e-3, 0.3, 3.0])
def test_approximate_factor_whitens_a_plus_damping(damping):
    """Bugs caught: the damping not relative to mean(diag A) (e.g. to its trace, or absolute), added
    twice, or missing from ``D``; a ``T`` built for another damping (any factor ≠ 1)."""
    a = structured_factor()
    assert_whitens(LowRankWhitening(approximate_factor(a, R, damping)), intended(a, damping), a)


def test_wrong_damping_is_caught():
    """The check itself: a ``T`` built with 2x or 1.1x the damping fails it."""
    a = structured_factor()
    for factor in (2.0, 1.1):
        with pytest.raises(AssertionError):
            assert_whitens(LowRankWhitening(approximate_factor(a, R, 1e-3 * factor)), intended(a, 1e-3), a)


@pytest.mark.parametrize("damping", [0.3, 10.0])
def test_with_damping_whitens_a_plus_the_new_damping(damping):
    """Bugs caught: ``with_damping`` adding the new damping on top of the old one, or scaling it otherwise."""
    a = structured_factor()
    f = approximate_factor(a, R, 1e-3).with_damping(damping)
    assert f.damping == damping
    assert_whitens(LowRankWhitening(f), intended(a, damping), a)


@pytest.mark.parametrize("auto", [False, True])
def test_refresh_build_whitens_a_plus_its_damping(auto):
    """The staged build of a refresh (exact statistics), with one configured damping or choosing
    among candidates: the ``T`` in its record whitens ``A + δ m I`` for the ``δ`` its header names.
    Bugs caught: a candidate's damping applied with the wrong scale, the record holding another
    candidate's ``T`` than the damping it names."""
    a = structured_factor()
    tokens = 7.0
    candidates = (0.3, 1.0, 3.0) if auto else (1e-3,)
    grad = torch.randn(40, D, generator=torch.Generator().manual_seed(3)) @ a.float()
    layer = OwnedLayer(
        "w", FactorSide(R, {"xtx": a * tokens}, torch.tensor(tokens, dtype=torch.float64), None), grad=grad
    )
    build = FactorBuild([layer], candidates, auto, CodecConfig(), 12)
    parts = build.whitening_cores(build.whitening_grams(build.cores(build.grams())))
    buf = torch.zeros(layer.layout.nbytes, dtype=torch.uint8)
    rec = layer.layout.views(buf)
    build.finish(parts, [rec])
    head = dict(zip(HEADER, rec["input"]["header"].tolist()))
    assert head["damping"] in candidates
    w = LowRankWhitening.from_tensors(
        {
            k: rec["input"][k][..., : int(head["rank"])] if k in ("q", "c", "c_inv") else rec["input"][k]
            for k in ("d_inv_sqrt", "d_sqrt", "q", "c", "c_inv")
        }
    )
    assert_whitens(w, intended(a, head["damping"]), a)


def test_a_sketched_build_holds_no_copy_of_omega_between_stages():
    """Between the refresh's first device stage and its host cores (while the step's reductions run),
    a sketched side holds its FP64 statistics (``Y``, ``diag``) and no FP64 copy of ``Ω``, which the
    stages make where they use it (the two-level refresh step's peak: docs/memory.md). Bug caught:
    ``Ω`` in FP64 kept in the build's work from the first stage to the second. Its build still
    completes."""
    a, tokens, k = structured_factor(), 5.0, 24
    omega = torch.randn(D, k, generator=torch.Generator().manual_seed(8))
    sums = {"y": (a @ omega.double()).float() * tokens, "diag": torch.diagonal(a).float() * tokens}
    grad = torch.randn(40, D, generator=torch.Generator().manual_seed(9)) @ a.float()
    side = FactorSide(R, sums, torch.tensor(tokens, dtype=torch.float64), omega)
    layer = OwnedLayer("w", side, grad=grad)
    build = FactorBuild([layer], (0.3, 1.0), True, CodecConfig(), 12)
    grams = build.grams()
    held = sum(t.numel() * t.element_size() for t in side.work.values() if isinstance(t, torch.Tensor))
    assert held == 8 * (D * k + D), f"{held} bytes held: Y and diag in FP64 are {8 * (D * k + D)}"
    parts = build.whitening_cores(build.whitening_grams(build.cores(grams)))
    rec = layer.layout.views(torch.zeros(layer.layout.nbytes, dtype=torch.uint8))
    build.finish(parts, [rec])
    assert side.status.name in ("OK", "INDEFINITE") and side.factor is not None


def test_four_bit_wire_chooses_on_its_own_errors():
    """With NVFP4 and a Hadamard rotation between nodes, the refresh's damping is the candidate of least
    four-bit error, ``‖(q(G T) − G T) T⁻¹‖`` with ``q(U) = dec(enc(U H)) Hᵀ`` computed here from the
    codec and the rotation (each pinned by its own tests), not FP8's: on this gradient they differ
    (0.3 against FP8's 3.0, margins over 10%). Bug caught: the damping of a four-bit exchange chosen
    on FP8's errors (SmolLM2's qkv at 0.81x plain NVFP4's error instead of 0.63x, docs/fidelity.md)."""
    from megatron_gift.config import GiftConfig, InterNodeFormat, Rotation
    from megatron_gift.numerics.fp4 import FP4_FORMATS, roundtrip_fp4
    from megatron_gift.numerics.rotation import BlockHadamard
    from megatron_gift.refresh_sync import damping_wire

    a, candidates, tokens = structured_factor(), (0.3, 1.0, 3.0, 10.0), 7.0
    grad = torch.randn(40, D, generator=torch.Generator().manual_seed(1)) @ a.float()
    rot = BlockHadamard(64, 3)

    def q(u):
        return rot.inverse(roundtrip_fp4(rot.apply(u).reshape(-1), FP4_FORMATS["nvfp4"]).view_as(u))

    errs = {}
    for c in candidates:
        t, t_inv = LowRankWhitening(approximate_factor(a, R, c)).dense()
        u = grad @ t
        errs[c] = float(((q(u) - u) @ t_inv).norm())
    ranked = sorted(candidates, key=errs.get)
    assert errs[ranked[1]] > 1.1 * errs[ranked[0]]  # the premise: a clear winner
    cfg = GiftConfig.build(inter_node_format=InterNodeFormat.NVFP4, rotation=Rotation.HADAMARD, rotation_seed=3)
    chosen = {}
    for name, (wire, rotated) in (("nvfp4", damping_wire(cfg)), ("fp8", damping_wire(GiftConfig()))):
        assert rotated is None  # a second wire only with --gift-rotation auto
        layer = OwnedLayer(
            "w", FactorSide(R, {"xtx": a * tokens}, torch.tensor(tokens, dtype=torch.float64), None), grad=grad
        )
        build = FactorBuild([layer], candidates, True, wire, 12)
        parts = build.whitening_cores(build.whitening_grams(build.cores(build.grams())))
        rec = layer.layout.views(torch.zeros(layer.layout.nbytes, dtype=torch.uint8))
        build.finish(parts, [rec])
        chosen[name] = dict(zip(HEADER, rec["input"]["header"].tolist()))["damping"]  # the best candidate (kept T)
    assert chosen["nvfp4"] == ranked[0] and chosen["fp8"] != ranked[0], (chosen, errs)
    assert damping_wire(GiftConfig()) == (GiftConfig().wire.codec, None)


def _mx_grid_gradient(rows, cols, gen):
    """A gradient MXFP4 sends exactly unrotated: E2M1 values, every 32-block's largest 6 (scale 1)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = grid[torch.randint(0, 8, (rows, cols), generator=gen)] * (
        torch.randint(0, 2, (rows, cols), generator=gen) * 2 - 1
    )
    x.view(-1, 32)[:, 7] = 6.0
    return x


@pytest.mark.parametrize("kind", ["outliers", "grid"])
def test_auto_rotation_is_the_smaller_four_bit_error(kind):
    """``--gift-rotation auto``: the record's ``rotate`` is 1 exactly where the rotated wire's error on
    the chosen candidate (here the Euclidean one: no held-out ``T`` yet) is the smaller, each error
    computed here from the codec and the rotation (pinned by their own tests): a Gaussian gradient with
    sparse outliers, which the rotation spreads (MXFP4: 0.65x), and one MXFP4 sends exactly without it.
    Bug caught: the rotation chosen without measuring it (always on or always off), on the wrong
    candidate's errors, or the flag lost on its way into the header."""
    from megatron_gift.config import GiftConfig, InterNodeFormat, Rotation
    from megatron_gift.numerics.fp4 import FP4_FORMATS, roundtrip_fp4
    from megatron_gift.numerics.rotation import BlockHadamard
    from megatron_gift.refresh_sync import damping_wire

    gen = torch.Generator().manual_seed(5)
    a, tokens, fmt, rot = structured_factor(), 7.0, FP4_FORMATS["mxfp4"], BlockHadamard(64, 3)
    if kind == "outliers":
        grad = torch.randn(40, D, generator=gen)
        grad += (torch.rand(40, D, generator=gen) < 0.03) * 8 * torch.randn(40, D, generator=gen)
    else:
        grad = _mx_grid_gradient(40, D, gen)
    plain = float((roundtrip_fp4(grad.reshape(-1), fmt).view_as(grad) - grad).norm())
    rotated = float((rot.inverse(roundtrip_fp4(rot.apply(grad).reshape(-1), fmt).view_as(grad)) - grad).norm())
    want = rotated < plain
    assert (rotated < 0.8 * plain) if want else (plain < 0.8 * rotated)  # the premise: a clear winner
    cfg = GiftConfig.build(inter_node_format=InterNodeFormat.MXFP4, rotation=Rotation.AUTO, rotation_seed=3)
    wire, rotated_wire = damping_wire(cfg)
    layer = OwnedLayer(
        "w", FactorSide(R, {"xtx": a * tokens}, torch.tensor(tokens, dtype=torch.float64), None), grad=grad
    )
    build = FactorBuild([layer], (0.3, 1.0, 3.0, 10.0), True, wire, 12, rotated_wire=rotated_wire)
    parts = build.whitening_cores(build.whitening_grams(build.cores(build.grams())))
    rec = layer.layout.views(torch.zeros(layer.layout.nbytes, dtype=torch.uint8))
    build.finish(parts, [rec])
    head = dict(zip(HEADER, rec["input"]["header"].tolist()))
    assert head["choice"] == -1 and head["rotate"] == float(want), (head, plain, rotated)
