"""numerics/fp4.py and numerics/rotation.py against references written out here: E2M1 rounding by a
scalar nearest-value search, the scales from their definitions, a dense Hadamard matrix."""

import math

import pytest
import torch

from megatron_gift.numerics.fp4 import (
    FP4_FORMATS,
    FP4Encoded,
    decode_fp4,
    encode_fp4,
    pack_nibbles,
    roundtrip_fp4,
    unpack_nibbles,
)
from megatron_gift.numerics.rotation import BlockHadamard, fwht

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1(y: float) -> float:
    """Nearest E2M1 value of ``y``, a tie to the even code (index in GRID), clamped to ±6."""
    a = min(abs(y), 6.0)
    best = min(range(8), key=lambda k: (abs(GRID[k] - a), k % 2))
    return math.copysign(GRID[best], y)


def test_pack_order_and_roundtrip():
    """Bug caught: nibbles swapped (element 2i must be the low nibble) or lost in unpacking."""
    codes = torch.tensor([1, 2, 15, 0, 7, 8], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [0x21, 0x0F, 0x87]
    assert torch.equal(unpack_nibbles(packed, 6), codes)


def test_mxfp4_matches_the_scalar_reference():
    """Bug caught: ties rounded away from even, the E8M0 exponent rounded down (a block maximum
    clipping at 6), values beyond the grid not clamped, signs lost."""
    fmt = FP4_FORMATS["mxfp4"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4 * 32, generator=gen) * torch.logspace(-3, 3, 4).repeat_interleave(32)
    x[:8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25])  # ties (block 0's amax is larger)
    x[5] = 6.0  # block 0: amax 6 -> scale 1, the ties stay ties
    got = roundtrip_fp4(x, fmt)
    want = []
    for blk in x.view(-1, 32):
        e = math.ceil(math.log2(float(blk.abs().max()) / 6))
        want += [e2m1(float(v) / 2.0**e) * 2.0**e for v in blk]
    assert got.tolist() == want
    assert got[:8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 6.0, 4.0, -0.0]


def test_nvfp4_scales_and_values_match_their_definition():
    """Bug caught: the E4M3 block scale rounded to nearest (the block maximum clipping), the segment
    scale not per segment, the decode's order of multiplication changed."""
    fmt = FP4_FORMATS["nvfp4"]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, generator=gen) * torch.tensor([1.0, 1e-3, 1e2, 7.0]).repeat_interleave(16)
    lengths = torch.tensor([32, 32])
    enc = encode_fp4(x, fmt, lengths)
    got = decode_fp4(enc, fmt, lengths)
    for g, seg in enumerate(x.view(2, 32)):
        s = torch.tensor(float(seg.abs().max())) / (6 * 448)
        assert enc.segment_scales[g] == s
        for k, blk in enumerate(seg.view(2, 16)):
            b = enc.block_scales[2 * g + k].view(torch.float8_e4m3fn).float()
            target = blk.abs().max() / (6 * s)
            assert b >= target  # rounded up: nothing saturates
            below = (enc.block_scales[2 * g + k] - 1).view(torch.float8_e4m3fn).float()
            assert below < target  # and by one step at most
            for i, v in enumerate(blk):
                want = (e2m1(float(v / (b * s))) * b) * s
                assert got[32 * g + 16 * k + i] == want


@pytest.mark.parametrize("name, nan_code", [("nvfp4", 0x7F), ("mxfp4", 0xFF)])
def test_a_nonfinite_block_decodes_to_nan(name, nan_code):
    """Bug caught: an Inf or NaN gradient quantized to a finite value (the NaN check after the reduction
    would not fire), or the other blocks' scales taken over it."""
    fmt = FP4_FORMATS[name]
    x = torch.ones(2 * fmt.block)
    x[3] = float("inf")
    enc = encode_fp4(x, fmt)
    assert enc.block_scales[0] == nan_code
    got = decode_fp4(enc, fmt)
    assert torch.isnan(got[: fmt.block]).all() and torch.equal(got[fmt.block :], x[fmt.block :])


def test_zero_input_and_byte_counts():
    """Bug caught: an all-zero block or segment decoding to NaN (a zero scale divided by), or the
    formats' byte counts other than 0.5 + 1/block per element plus NVFP4's 4 bytes per segment."""
    for fmt in FP4_FORMATS.values():
        assert torch.equal(roundtrip_fp4(torch.zeros(64), fmt), torch.zeros(64))
        enc = encode_fp4(torch.randn(64), fmt, torch.tensor([32, 32]))
        assert isinstance(enc, FP4Encoded) and enc.codes.numel() == fmt.payload_bytes(64) == 32
        assert enc.block_scales.numel() + 4 * 2 * fmt.segment_scale == fmt.scale_bytes(64, 2)
        assert fmt.bytes_per_element == 0.5 + 1 / fmt.block


def test_block_hadamard_is_a_seeded_orthogonal_rotation():
    """Bug caught: a transform that is not the normalized Hadamard matrix per block (not orthogonal:
    the receiver's inverse would not undo it), signs that differ between instances of one seed."""
    n, block = 128, 64
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h /= math.sqrt(block)
    x = torch.randn(3, n, dtype=torch.float64)
    dense = torch.block_diag(h, h)
    assert torch.allclose(fwht(x, block), x @ dense.T, atol=1e-12)
    rot = BlockHadamard(block, seed=5)
    assert torch.equal(rot.signs(n, "cpu"), BlockHadamard(block, seed=5).signs(n, "cpu"))
    assert not torch.equal(rot.signs(n, "cpu"), BlockHadamard(block, seed=6).signs(n, "cpu"))
    y = rot.apply(x.float())
    assert torch.allclose(rot.inverse(y), x.float(), atol=1e-5)
    assert torch.allclose(y.double(), (x * rot.signs(n, "cpu").double()) @ dense.T, atol=1e-5)
