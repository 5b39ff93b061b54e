"""Block Hadamard rotation (numerics/rotation.py) against a dense FP64 Sylvester matrix with the signs."""

import pytest
import torch

from megatron_gift.numerics.rotation import BlockHadamard, fwht


def sylvester(k: int) -> torch.Tensor:
    """Dense Sylvester Hadamard H_k (FP64), built by the recursion, unnormalised."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < k:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def dense_rotation(n: int, block: int, signs: torch.Tensor) -> torch.Tensor:
    """R = D_s blockdiag(H_block / sqrt(block)) as a dense FP64 matrix."""
    hb = sylvester(block) / block**0.5
    return torch.diag(signs.double()) @ torch.block_diag(*[hb] * (n // block))


@pytest.mark.parametrize("block", [1, 2, 16, 64])
def test_fwht_matches_dense_sylvester(block):
    """Catches a wrong butterfly order (Sylvester ordering), a missing 1/sqrt(block) or a block mix-up."""
    x = torch.randn(3, 4 * block, dtype=torch.float64)
    want = x @ torch.block_diag(*[sylvester(block) / block**0.5] * 4)
    assert torch.allclose(fwht(x, block), want, atol=1e-12)
    assert torch.allclose(fwht(fwht(x, block), block), x, atol=1e-12)


@pytest.mark.parametrize("block", [1, 2, 64])
def test_fwht_on_views_and_scratch(block):
    """A strided input (a transposed view) against the dense FP64 matrix; ``scratch`` (the input serving as
    a stage buffer) changes no bit of the result, and without it the input is left as it was; at most two
    copies of the input live at once. Catches a stage writing into the caller's tensor, a view taken of a
    strided input as if contiguous, and each stage's halves stacked into new tensors (three copies)."""
    from megatron_gift.testing.dispatch import LiveBytes

    x = torch.randn(4 * block, 96, dtype=torch.float64).t()  # [96, 4 * block], not contiguous
    before = x.clone()
    want = x @ torch.block_diag(*[sylvester(block) / block**0.5] * 4)
    got = fwht(x, block)
    assert torch.allclose(got, want, atol=1e-12) and torch.equal(x, before)
    y = torch.randn(96, 4 * block, dtype=torch.float32)
    with LiveBytes() as p:
        plain = fwht(y, block)
    assert p.peak <= 2 * y.numel() * 4
    assert torch.equal(fwht(y.clone(), block, scratch=True), plain)


def test_fwht_rejects_bad_blocks():
    """Catches a silent wrong transform for a non-power-of-two block or a ragged last dim."""
    with pytest.raises(ValueError):
        fwht(torch.zeros(12), 12)
    with pytest.raises(ValueError):
        fwht(torch.zeros(24), 16)


def test_signs_are_seeded_and_shared():
    """Catches signs that differ between calls (ranks must agree with no communication) or are not ±1."""
    r = BlockHadamard(16, seed=7)
    s = r.signs(128)
    g = torch.Generator().manual_seed(7)
    want = torch.randint(0, 2, (128,), generator=g).float() * 2 - 1
    assert torch.equal(s, want) and torch.equal(BlockHadamard(16, seed=7).signs(128), s)
    assert not torch.equal(BlockHadamard(16, seed=8).signs(128), s)


def test_apply_and_inverse_match_dense():
    """Catches signs applied on the wrong side of H: apply is x R, inverse is y Rᵀ, with R = D_s H."""
    r = BlockHadamard(16, seed=3)
    n = 64
    x = torch.randn(5, n)
    rd = dense_rotation(n, 16, r.signs(n))
    assert torch.allclose(r.apply(x).double(), x.double() @ rd, atol=1e-5)
    assert torch.allclose(r.inverse(x).double(), x.double() @ rd.T, atol=1e-5)


def test_composed_gift_rotation_inverts_after_the_sum():
    """Catches a receiver that rotates back before summing or in the wrong order: (Σ G_i T R) Rᵀ T⁻¹ = Σ G_i."""
    r = BlockHadamard(32, seed=1)
    m, n = 6, 64
    t = torch.eye(n, dtype=torch.float64) + 0.1 * torch.randn(n, n, dtype=torch.float64)
    gs = [torch.randn(m, n, dtype=torch.float64) for _ in range(3)]
    us = [r.apply((g @ t).float()) for g in gs]
    rd = dense_rotation(n, 32, r.signs(n))
    for g, u in zip(gs, us):
        assert torch.allclose(u.double(), g @ t @ rd, atol=1e-4)
    got = r.inverse(sum(us)).double() @ torch.linalg.inv(t)
    assert torch.allclose(got, sum(gs), atol=1e-3)
