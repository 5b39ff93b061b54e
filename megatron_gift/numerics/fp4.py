"""FP4 (E2M1) codec with block scales: NVFP4 (16-element blocks, E4M3 block scales, an FP32 scale
per segment) and MXFP4 (32-element blocks, E8M0 scales). Pure tensor code (no torch.distributed).

Written on branch fp4wire to the API agreed with branch fp4 (which had not landed by 00:40 UTC):
the minimal encode/decode the exchange needs; branch fp4's module replaces it where they differ.

E2M1 codes are 4 bits: sign bit 3, magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} as codes 0..7; round to
nearest, ties to the even code; finite values beyond ±6 clamp to ±6. Two codes per byte, element
2i in the low nibble.

NVFP4: segment scale ``s = amax_seg / (6 · 448)`` (1 for an all-zero segment, clamped to FP32's
smallest normal); block scale ``b = amax_block / (6 s)`` rounded *up* onto the E4M3 grid, so no
element saturates (Transformer Engine's ``NVFP4BlockScaling`` rounds it to nearest and lets the
block maximum clip); element ``e2m1(x / (b s))``; decode ``(e2m1 · b) · s``. MXFP4: scale
``2^ceil(log2(amax_block / 6))`` (rounded up: nothing saturates; the OCP MX rule
``floor(log2 amax) - 2`` can clip). A block holding a NaN or ±Inf gets the scale format's NaN code
(E4M3 0x7F, E8M0 0xFF) and decodes to NaN; amax is over the finite values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E2M1_MAX = 6.0
_E4M3_MAX = 448.0
_E8M0_BIAS = 127
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between consecutive magnitudes; a tie goes to the even code
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass(frozen=True)
class FP4Format:
    """One FP4 format: block size, block-scale format, whether each segment has an FP32 scale."""

    name: str
    block: int
    scale: str
    segment_scale: bool
    label: str

    def payload_bytes(self, n: int) -> int:
        return n // 2

    def scale_bytes(self, n: int, segments: int) -> int:
        return n // self.block + (4 * segments if self.segment_scale else 0)

    @property
    def bytes_per_element(self) -> float:
        return 0.5 + 1 / self.block


NVFP4 = FP4Format("nvfp4", 16, "e4m3", True, "nvfp4")
MXFP4 = FP4Format("mxfp4", 32, "e8m0", False, "mxfp4")
FP4_FORMATS = {"nvfp4": NVFP4, "mxfp4": MXFP4}


@dataclass
class FP4Encoded:
    """Packed codes ``[n // 2]``, block scales ``[n // block]`` (uint8), segment scales (FP32)."""

    codes: torch.Tensor
    block_scales: torch.Tensor
    segment_scales: torch.Tensor


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., n]`` (n even) two per byte: element 2i in the low nibble, 2i+1 in the high one."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """``pack_nibbles``' inverse: ``[..., n]`` codes."""
    out = torch.empty((*packed.shape[:-1], n), dtype=torch.uint8, device=packed.device)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Codes of FP32 ``y`` (finite), round to nearest, ties to the even code, clamped to ±6."""
    a = y.abs()
    mid = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=y.device)
    lower = torch.bucketize(a, mid, right=False)  # a <= midpoint -> the lower code
    upper = torch.bucketize(a, mid, right=True)  # a < midpoint
    # on a midpoint (lower != upper) the even one of the two neighbouring codes
    mag = torch.where((lower != upper) & (lower % 2 == 1), upper, lower)
    sign = (y < 0) | ((y == 0) & torch.signbit(y))
    return (mag.to(torch.uint8) | (sign.to(torch.uint8) << 3)).to(torch.uint8)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """FP32 values of E2M1 codes."""
    table = torch.tensor(_MAGNITUDES, dtype=torch.float32, device=codes.device)
    v = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -v, v)


def _e4m3_round_up(x: torch.Tensor) -> torch.Tensor:
    """``x`` (finite, >= 0) rounded up onto the E4M3 grid (saturating at 448)."""
    q = x.clamp(max=_E4M3_MAX).to(torch.float8_e4m3fn).float()
    step = torch.where(q < x, 1, 0).to(torch.uint8)
    bits = q.to(torch.float8_e4m3fn).view(torch.uint8) + step
    return bits.clamp(max=0x7E).view(torch.float8_e4m3fn).float()


def _segments(n: int, lengths) -> torch.Tensor:
    """Segment lengths on the host (int64): ``lengths``, else one segment of ``n``."""
    if lengths is None:
        return torch.tensor([n], dtype=torch.int64)
    return torch.as_tensor(lengths, dtype=torch.int64).cpu()


def encode_fp4(x: torch.Tensor, fmt: FP4Format, lengths=None) -> FP4Encoded:
    """``x [n]`` (n a multiple of ``fmt.block``) in ``fmt`` (module doc); ``lengths``: the segments
    (each a multiple of the block, summing to n; None: one), NVFP4's FP32 scale each."""
    x = x.float().reshape(-1)
    n = x.numel()
    seg = _segments(n, lengths)
    blocks = x.view(-1, fmt.block)
    bad = ~torch.isfinite(blocks).all(1)
    finite = blocks.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    amax_block = finite.amax(1)
    seg_blocks = (seg // fmt.block).to(x.device)
    if fmt.segment_scale:
        amax_seg = torch.segment_reduce(amax_block, "max", lengths=seg_blocks, unsafe=True)
        tiny = torch.finfo(torch.float32).tiny
        s = torch.where(amax_seg > 0, (amax_seg / (E2M1_MAX * _E4M3_MAX)).clamp_min(tiny), torch.ones_like(amax_seg))
        s_block = torch.repeat_interleave(s, seg_blocks, output_size=blocks.shape[0])
        b = _e4m3_round_up(amax_block / (E2M1_MAX * s_block))
        b = torch.where(amax_block > 0, b, torch.zeros_like(b))
        scale = (b * s_block)[:, None]
        y = torch.where(scale > 0, blocks / torch.where(scale > 0, scale, torch.ones_like(scale)), blocks * 0)
        bs = b.to(torch.float8_e4m3fn).view(torch.uint8)
        bs = torch.where(bad, torch.full_like(bs, 0x7F), bs)
        segs = s.float()
    else:
        e = torch.ceil(torch.log2(amax_block / E2M1_MAX)).clamp(-_E8M0_BIAS, _E8M0_BIAS)
        e = torch.where(amax_block > 0, e, torch.full_like(e, -_E8M0_BIAS))
        y = blocks / torch.exp2(e)[:, None]
        bs = (e + _E8M0_BIAS).to(torch.uint8)
        bs = torch.where(bad, torch.full_like(bs, 0xFF), bs)
        segs = torch.ones(seg.numel(), dtype=torch.float32, device=x.device)
    codes = _e2m1_codes(torch.where(torch.isfinite(y), y, torch.zeros_like(y)).reshape(-1))
    return FP4Encoded(pack_nibbles(codes), bs, segs)


def decode_fp4(enc: FP4Encoded, fmt: FP4Format, lengths=None) -> torch.Tensor:
    """FP32 ``[n]`` of an encoding by ``encode_fp4`` with the same ``lengths``."""
    n = enc.codes.numel() * 2
    v = _e2m1_values(unpack_nibbles(enc.codes, n)).view(-1, fmt.block)
    bs = enc.block_scales.reshape(-1)
    if fmt.segment_scale:
        seg = _segments(n, lengths)
        b = bs.view(torch.float8_e4m3fn).float()
        s = torch.repeat_interleave(enc.segment_scales.float(), (seg // fmt.block).to(v.device), output_size=bs.numel())
        out = (v * b[:, None]) * s[:, None]
        nan = bs == 0x7F
    else:
        out = v * torch.exp2(bs.float() - _E8M0_BIAS)[:, None]
        nan = bs == 0xFF
    return torch.where(nan[:, None], torch.full_like(out, float("nan")), out).reshape(-1)


def roundtrip_fp4(x: torch.Tensor, fmt: FP4Format, lengths=None) -> torch.Tensor:
    """``decode_fp4(encode_fp4(x))``."""
    return decode_fp4(encode_fp4(x, fmt, lengths), fmt, lengths)
