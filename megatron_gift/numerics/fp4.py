"""FP4 codecs (NVFP4, MXFP4): FP32 tensors to packed 4-bit E2M1 codes plus block scales, and back.

Pure tensor code (no torch.distributed). E2M1 codes are 4 bits: bit 3 is the sign, bits 0..2 index the
magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} (code = 2 * exponent field + mantissa; 0.5 is the subnormal at
code 1). Rounding is to nearest, ties to the even code; finite values beyond ±6 clamp to ±6.

NVFP4 (blocks of 16, E4M3 block scales, one FP32 scale per segment):
    s = amax_seg / (6 * 448)                   (FP32; 1 for an all-zero segment; at least FP32's tiny)
    b = round_up_e4m3(amax_block / (6 * s))    (0 for an all-zero block)
    q = e2m1(x / (b * s)),   x̂ = (e2m1_value(q) * b) * s
b is rounded UP onto the E4M3 grid so no element of the block saturates; Transformer Engine's
NVFP4BlockScaling rounds it to nearest and lets the block's maximum clip.

MXFP4 (blocks of 32, E8M0 scales, no segment scale):
    e = ceil(log2(amax_block / 6)),   q = e2m1(x / 2^e),   x̂ = e2m1_value(q) * 2^e
rounded up, so nothing saturates; the OCP MX rule e = floor(log2 amax) - 2 can clip the maximum.

Amax is taken over finite values. A block holding a NaN or ±Inf gets the scale format's NaN code (E4M3
0x7F, E8M0 0xFF) and decodes to NaN as a whole, so a NaN check after the reduction still fires.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import divisor
from .rotation import BlockHadamard

E2M1_MAX = 6.0
E4M3_MAX = 448.0
_E4M3_NAN = 0x7F
_E8M0_NAN = 0xFF
_E8M0_BIAS = 127
# Midpoints between consecutive magnitudes; a tie goes up only when the upper code is even.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass(frozen=True)
class FP4Format:
    """An FP4 wire format: E2M1 elements, one ``scale``-format scale per ``block`` elements, and for
    nvfp4 an FP32 scale per segment."""

    name: str
    block: int
    scale: str
    segment_scale: bool
    label: str

    def payload_bytes(self, n: int) -> int:
        """Bytes of packed E2M1 codes for ``n`` elements."""
        return n // 2

    def scale_bytes(self, n: int, segments: int) -> int:
        """Bytes of block scales (one byte each) plus the FP32 segment scales."""
        return n // self.block + (4 * segments if self.segment_scale else 0)

    @property
    def bytes_per_element(self) -> float:
        """Payload plus block scale per element (the per-segment scale is not counted)."""
        return 0.5 + 1.0 / self.block


NVFP4 = FP4Format("nvfp4", 16, "e4m3", True, "nvfp4")
MXFP4 = FP4Format("mxfp4", 32, "e8m0", False, "mxfp4")
FP4_FORMATS = {"nvfp4": NVFP4, "mxfp4": MXFP4}


@dataclass
class FP4Encoded:
    """Packed codes (uint8 [n // 2]), block scales (uint8 [n // block]) and segment scales (float32); a
    decode takes codes and block scales also as ``[rows, ...]`` (views into messages, rows one after another)."""

    codes: torch.Tensor
    block_scales: torch.Tensor
    segment_scales: torch.Tensor


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim: element 2i in the low nibble, 2i+1 in the high."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def e2m1_encode(y: torch.Tensor, scratch: bool = False) -> torch.Tensor:
    """E2M1 codes (uint8) of ``y``: nearest magnitude, ties to the even code, clamped to ±6; NaN gives 0.
    ``scratch``: ``y`` is the caller's temporary, overwritten by its magnitudes (no copy of its size)."""
    sign = torch.signbit(y).to(torch.uint8) << 3
    a = y.abs_() if scratch else y.abs()
    mag = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for k, m in enumerate(_MIDPOINTS):
        mag += (a >= m) if k % 2 else (a > m)
    return mag.bitwise_or_(sign)


_E2M1_VALUES: dict[str, torch.Tensor] = {}  # device -> the 16 code values (``_e2m1_values``)


def _e2m1_values(device: torch.device) -> torch.Tensor:
    """FP32 values of the 16 E2M1 codes: magnitude ``m/2`` for ``m < 2`` (0, 0.5), else ``2^(e-1) (1 + man/2)``
    with ``e = m >> 1``, ``man = m & 1``, negated where bit 3 is set (-0 for code 8); computed on the device
    once per device (no table copied from host memory)."""
    key = str(device)
    if key not in _E2M1_VALUES:
        c = torch.arange(16, dtype=torch.int32, device=device)
        mag, e = c & 7, (c & 7) >> 1
        frac = 1.0 + (mag & 1).to(torch.float32) * 0.5
        v = torch.where(e == 0, (mag & 1).to(torch.float32) * 0.5, torch.ldexp(frac, e - 1))
        _E2M1_VALUES[key] = torch.where((c & 8) != 0, -v, v)
    return _E2M1_VALUES[key]


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """FP32 values of E2M1 codes (``_e2m1_values``), looked up by an int32 index."""
    return _e2m1_values(codes.device)[codes.to(torch.int32)]


_E2M1_PAIRS: dict[str, torch.Tensor] = {}  # device -> each byte's two code values (``e2m1_decode_packed``)


def e2m1_decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """FP32 values of packed codes along the last dim (two per byte, low nibble first: ``pack_nibbles``),
    each byte's pair looked up in a ``[256, 2]`` table made on the device once: 6 B per value at the peak
    (half an int32 index and the value; unpacking first held 9: the codes, their index, the value)."""
    key = str(packed.device)
    if key not in _E2M1_PAIRS:
        b = torch.arange(256, dtype=torch.int32, device=packed.device)
        _E2M1_PAIRS[key] = torch.stack((e2m1_decode(b & 0xF), e2m1_decode(b >> 4)), dim=1)
    return _E2M1_PAIRS[key][packed.to(torch.int32)].reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _e4m3_round_up(v: torch.Tensor) -> torch.Tensor:
    """E4M3 bits (uint8) of the smallest E4M3 value >= v (v >= 0, clamped to 448)."""
    v = v.clamp(max=E4M3_MAX)
    bits = v.to(torch.float8_e4m3fn).view(torch.uint8)
    below = bits.view(torch.float8_e4m3fn).float() < v
    return bits + below.to(torch.uint8)


def _segment_ids(lengths: torch.Tensor | None, n: int, block: int, device) -> tuple[torch.Tensor, int]:
    if lengths is None:
        return torch.zeros(n // block, dtype=torch.long, device=device), 1
    ends = (lengths.to(device=device, dtype=torch.long) // block).cumsum(0)
    # block b lies in the segment after the last one ending at or before it: the same ops for one
    # segment as for many (repeat_interleave takes other ops for one) and no read back to the host
    ids = torch.searchsorted(ends, torch.arange(n // block, device=device), right=True)
    return ids, lengths.numel()


def encode_fp4(
    x: torch.Tensor, fmt: FP4Format, lengths: torch.Tensor | None = None, scratch: bool = False
) -> FP4Encoded:
    """Encode FP32 ``x`` [n] (n a multiple of ``fmt.block``) in ``fmt``; ``lengths`` are segment lengths
    (multiples of the block, summing to n; None: one segment). ``scratch``: ``x`` (FP32) is the caller's
    temporary, scaled and overwritten in place (no FP32 copy of its size)."""
    x = x.reshape(-1).float()
    n = x.numel()
    blocks = x.view(-1, fmt.block)
    a = blocks.abs()  # the one temporary of x's size before the scaled values
    bad = ~torch.isfinite(a.amax(dim=1))  # amax propagates NaN: a block-level test, no mask per element
    amax = a.nan_to_num_(nan=0.0, posinf=0.0).amax(dim=1)  # the finite values'
    del a
    ids, nseg = _segment_ids(lengths, n, fmt.block, x.device)
    if fmt.segment_scale:
        seg_amax = torch.zeros(nseg, dtype=torch.float32, device=x.device)
        seg_amax = seg_amax.scatter_reduce(0, ids, amax, reduce="amax")
        s = torch.where(seg_amax > 0, seg_amax / divisor(E2M1_MAX * E4M3_MAX, x.device), torch.ones_like(seg_amax))
        s = s.clamp(min=torch.finfo(torch.float32).tiny)
        s_blk = s[ids]
        bits = _e4m3_round_up(amax / (E2M1_MAX * s_blk))
        b = bits.view(torch.float8_e4m3fn).float()
        scale = b * s_blk
        bits = torch.where(bad, torch.full_like(bits, _E4M3_NAN), bits)
    else:
        s = torch.ones(nseg, dtype=torch.float32, device=x.device)
        _, k = torch.frexp(amax / E2M1_MAX)
        e = k.to(torch.int32)
        one = torch.ones_like(amax)
        e = e + (torch.ldexp(one * E2M1_MAX, e) < amax).to(torch.int32)
        e = e - (torch.ldexp(one * E2M1_MAX, e - 1) >= amax).to(torch.int32)
        e = torch.where(amax > 0, e, torch.full_like(e, -_E8M0_BIAS)).clamp(-_E8M0_BIAS, _E8M0_BIAS)
        scale = torch.ldexp(one, e)
        bits = torch.where(bad, torch.full_like(e, _E8M0_NAN), e + _E8M0_BIAS).to(torch.uint8)
    y = blocks.div_(scale[:, None]) if scratch else blocks / scale[:, None]
    y.masked_fill_(~(scale > 0)[:, None], 0.0)  # zero where the scale is 0 or NaN
    codes = pack_nibbles(e2m1_encode(y, scratch=True).view(-1))
    return FP4Encoded(codes, bits, s)


def _block_scale_values(bits: torch.Tensor, fmt: FP4Format) -> torch.Tensor:
    if fmt.scale == "e4m3":
        return bits.view(torch.float8_e4m3fn).float()
    e = bits.to(torch.int32) - _E8M0_BIAS
    v = torch.ldexp(torch.ones(bits.shape, dtype=torch.float32, device=bits.device), e)
    return torch.where(bits == _E8M0_NAN, torch.full_like(v, float("nan")), v)


def decode_fp4(enc: FP4Encoded, fmt: FP4Format, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 values [n] of ``enc``: ``(e2m1_value * b) * s`` (nvfp4) or ``e2m1_value * 2^e`` (mxfp4)."""
    n = enc.codes.numel() * 2
    out = e2m1_decode_packed(enc.codes).view(-1, fmt.block)  # a new tensor: scaled in place
    out.mul_(_block_scale_values(enc.block_scales, fmt).reshape(-1)[:, None])  # a new tensor: reshaped in place
    if fmt.segment_scale:
        ids, _ = _segment_ids(lengths, n, fmt.block, enc.codes.device)
        out.mul_(enc.segment_scales[ids][:, None])
    return out.reshape(-1)


def roundtrip_fp4(x: torch.Tensor, fmt: FP4Format, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """``decode_fp4(encode_fp4(x))``: the values the receiver sees."""
    return decode_fp4(encode_fp4(x, fmt, lengths), fmt, lengths)


@dataclass(frozen=True)
class FP4Wire:
    """The four-bit wire as the refresh's damping choice measures it (``profile.damping_errors``): a
    matrix ``U [rows, cols]`` sent as one segment, after a rotation along its rows where one is given
    (``numerics.rotation.BlockHadamard``): ``U -> dec(enc(U H)) Hᵀ``. Four bits favour another damping
    than FP8 (docs/fidelity.md, "Four bits between nodes")."""

    fmt: FP4Format
    rotation: BlockHadamard | None = None

    def __call__(self, u: torch.Tensor) -> torch.Tensor:
        v = u if self.rotation is None else self.rotation.apply(u)
        v = roundtrip_fp4(v.reshape(-1), self.fmt).view_as(v)
        return v if self.rotation is None else self.rotation.inverse(v)
