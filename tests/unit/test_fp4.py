"""FP4 codecs (numerics/fp4.py) against independent references: a table-lookup E2M1 rounder, the E4M3
grid enumerated from torch.float8_e4m3fn's codes, and the E8M0 rule computed with Python floats."""

import math

import numpy as np
import pytest
import torch

from megatron_gift.numerics.fp4 import (
    E2M1_MAX,
    FP4_FORMATS,
    MXFP4,
    NVFP4,
    decode_fp4,
    e2m1_decode,
    e2m1_decode_packed,
    e2m1_encode,
    encode_fp4,
    pack_nibbles,
    roundtrip_fp4,
)

MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E4M3_GRID = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # codes 0..126, finite


def ref_e2m1(v: float) -> int:
    """Nearest magnitude by distance over the table; a tie goes to the even code; sign in bit 3."""
    a = min(abs(v), 6.0)
    d = [abs(a - m) for m in MAGS]
    best = min(d)
    code = [k for k in range(8) if d[k] == best]
    c = code[0] if len(code) == 1 else next(k for k in code if k % 2 == 0)
    return c | (8 if math.copysign(1.0, v) < 0 else 0)


def probe_values() -> np.ndarray:
    pts = MAGS + [(a + b) / 2 for a, b in zip(MAGS, MAGS[1:])] + [6.5, 7.0, 100.0, 1e30]
    pts = np.array(pts, dtype=np.float32)
    near = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(-np.inf))])
    near = near[near >= 0]
    return np.concatenate([near, -near])


def test_e2m1_matches_table_on_values_midpoints_and_neighbours():
    """Catches a wrong tie rule (ties must go to the even code), a wrong midpoint or a missing clamp at ±6."""
    v = probe_values()
    got = e2m1_encode(torch.from_numpy(v)).tolist()
    want = [ref_e2m1(float(x)) for x in v]
    assert got == want
    dec = e2m1_decode(torch.tensor(want, dtype=torch.uint8)).tolist()
    assert dec == [math.copysign(MAGS[c & 7], -1.0 if c & 8 else 1.0) for c in want]


def test_pack_and_decode_nibble_order():
    """Catches swapped nibbles: element 2i sits in the low nibble, 2i+1 in the high one, on the encode's
    packing and on the decode's pair table (every byte value, in rows)."""
    codes = torch.randint(0, 16, (3, 10), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    want = [[int(r[2 * i]) + 16 * int(r[2 * i + 1]) for i in range(5)] for r in codes]
    assert packed.tolist() == want
    every = torch.arange(256, dtype=torch.uint8).view(4, 64)
    got = e2m1_decode_packed(every).tolist()
    assert got == [[v for b in row for v in (e2m1_decode(b & 15).item(), e2m1_decode(b >> 4).item())] for row in every]
    assert torch.equal(e2m1_decode_packed(packed), e2m1_decode(codes))


def test_format_sizes():
    """Catches a wrong byte count on the ledger: nvfp4 pays one E4M3 byte per 16 and 4 per segment."""
    assert NVFP4.payload_bytes(64) == 32 and NVFP4.scale_bytes(64, 2) == 4 + 8
    assert MXFP4.scale_bytes(64, 2) == 2 and MXFP4.bytes_per_element == 0.5 + 1 / 32
    assert FP4_FORMATS == {"nvfp4": NVFP4, "mxfp4": MXFP4}


def _blocks(seed, n=256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n // 16, generator=g) * 3).repeat_interleave(16)
    return x


@pytest.mark.parametrize("seed", range(4))
def test_nvfp4_block_scale_is_e4m3_round_up(seed):
    """Catches round-to-nearest block scales (the block maximum would clip) and a wrong segment scale."""
    x = _blocks(seed)
    enc = encode_fp4(x, NVFP4)
    s = float(x.abs().max()) / (6 * 448)
    assert enc.segment_scales.tolist() == [pytest.approx(s, rel=1e-6)]
    amax = x.view(-1, 16).abs().amax(1).double()
    ratio = (amax / (6 * enc.segment_scales.double())).tolist()
    for bits, r in zip(enc.block_scales.tolist(), ratio):
        want = int(torch.searchsorted(E4M3_GRID, torch.tensor(min(r, 448.0), dtype=torch.float64)))
        assert abs(bits - want) <= 1 and E4M3_GRID[bits] >= r * (1 - 1e-6)
        assert bits == 0 or E4M3_GRID[bits - 1] < r * (1 + 1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_mxfp4_scale_is_smallest_power_of_two_that_fits(seed):
    """Catches the OCP floor rule (which clips) or an off-by-one exponent: 6 * 2^e >= amax > 3 * 2^e."""
    x = _blocks(seed)
    enc = encode_fp4(x, MXFP4)
    for bits, a in zip(enc.block_scales.tolist(), x.view(-1, 32).abs().amax(1).tolist()):
        e = bits - 127
        assert 6.0 * 2.0**e >= a > 3.0 * 2.0**e
    assert enc.segment_scales.tolist() == [1.0]


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4])
@pytest.mark.parametrize("seed", range(3))
def test_no_saturation_error_bound(fmt, seed):
    """Catches saturation or a wrong decode order: each element is within half an E2M1 step (at its
    magnitude) times its block's scale, computed here from the stored scale bytes."""
    x = _blocks(seed, 512)
    lengths = torch.tensor([128, 384]) if fmt.segment_scale else None
    enc = encode_fp4(x, fmt, lengths)
    y = decode_fp4(enc, fmt, lengths).double()
    if fmt.scale == "e4m3":
        seg = torch.tensor([float(enc.segment_scales[0])] * 128 + [float(enc.segment_scales[1])] * 384)
        bs = E4M3_GRID[enc.block_scales.long()].repeat_interleave(16) * seg.double()
    else:
        bs = torch.tensor([2.0 ** (b - 127) for b in enc.block_scales.tolist()]).repeat_interleave(32)
    u = x.double().abs() / bs
    assert float(u.max()) <= E2M1_MAX * (1 + 1e-6)
    half = torch.where(u < 2, 0.25, torch.where(u < 4, 0.5, 1.0))
    assert bool(((y - x.double()).abs() <= half * bs * (1 + 1e-5) + 1e-30).all())


def test_segment_scales_are_per_segment():
    """Catches one scale for the whole tensor: a tiny segment next to a huge one keeps its own precision."""
    x = torch.cat([torch.randn(32) * 1e-6, torch.randn(32) * 1e6])
    lengths = torch.tensor([32, 32])
    y = roundtrip_fp4(x, NVFP4, lengths)
    enc = encode_fp4(x, NVFP4, lengths)
    assert enc.segment_scales[0] < 1e-8 < 1e2 < enc.segment_scales[1]
    assert float((y[:32] - x[:32]).abs().max()) <= float(x[:32].abs().max()) / 6
    assert not torch.equal(y[:32], torch.zeros(32))


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4])
def test_zero_and_nonfinite_blocks(fmt):
    """Catches NaN from an all-zero block (0/0) and a NaN or Inf lost in a block (the NaN check after the
    reduction must fire for the whole block), and amax polluted by the Inf in other blocks."""
    b = fmt.block
    x = torch.randn(4 * b)
    x[:b] = 0
    x[b + 3] = float("nan")
    x[2 * b + 1] = float("-inf")
    y = roundtrip_fp4(x, fmt)
    assert torch.equal(y[:b], torch.zeros(b))
    assert bool(y[b : 3 * b].isnan().all())
    assert bool(torch.isfinite(y[3 * b :]).all())
    assert float((y[3 * b :] - x[3 * b :]).abs().max()) <= float(x[3 * b :].abs().max()) / 4
    nan_code = 0x7F if fmt.scale == "e4m3" else 0xFF
    assert encode_fp4(x, fmt).block_scales.tolist()[:3] == [0, nan_code, nan_code]
    in_place = encode_fp4(x.clone(), fmt, scratch=True)  # the two-level node sums' encode: same codes
    assert in_place.block_scales.tolist()[:3] == [0, nan_code, nan_code]
    assert torch.equal(in_place.codes, encode_fp4(x, fmt).codes)
    assert roundtrip_fp4(torch.zeros(2 * b), fmt).tolist() == [0.0] * (2 * b)
