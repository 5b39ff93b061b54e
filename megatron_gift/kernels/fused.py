"""Triton kernels of the two hot paths (imports triton; see the package docstring for when).

Shapes: gradient ``G [rows, cols]`` FP32, whitening rank ``r``, ``Q [cols, r]``, ``R`` ranks.
A program owns a tile of ``BLOCK_R`` rows x ``WIDTH`` columns: one scaling group per row for
BLOCK/MX scaling, 128 columns otherwise.

Sender, ``whiten_encode``: ``P = G (D^{-1/2} Q) diag(c)`` ([rows, r], torch.matmul), then per tile::

    U = G D^{-1/2} + P Qᵀ                   (= G T, r FP32 rank-1 updates)
    amax = max |U| over the finite values of each group
    s = max(amax / fp8_max, 2^-126), 1 where amax = 0   (FP32, as fp8.scales_from_amax)
    code = fp8(clamp(U / s, ±fp8_max))     (RNE by integer bit manipulation)

BLOCK scaling does all of it in one pass. TENSOR/ROW/MX groups span tiles (or need E8M0
scales): a first pass writes the per-tile amax, ``fp8.scales_from_amax`` turns the groups'
maxima into scales, and a second pass recomputes ``U`` and encodes it.

Receiver, ``decode_sum_unwhiten``: per tile ``S = Σ_{i<R} fp8⁻¹(code_i) · s_i`` in FP32, rank 0
first and in rank order (as ``reference.rank_order_sum``), ``÷ R`` when averaging; then
``P' = S Q diag(c')`` (torch.matmul) and ``S T⁻¹ = (S + P' Qᵀ) D^{1/2}`` in place.

The FP8 codes are built and read with integer arithmetic on the FP32 bits (no FP8 dtypes),
which Triton's CPU interpreter runs as well as the GPU, and divisions are IEEE-rounded
(``div_rn``), so codes, scales and the rank sum are bit for bit those of ``numerics.fp8``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics.fp8 import CodecConfig, Encoded, FP8Format, Scaling, scale_values, scales_from_amax
from ..numerics.whitening import LowRankWhitening

TILE = 128  # columns of a tile where the scaling group is not a 1 x block group
MAX_TILE = 4096  # elements of a tile: BLOCK_R shrinks as groups grow; wider groups take the reference

# The passes of _whiten_encode_kernel.
_AMAX, _ENCODE, _FUSED_BLOCK = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _plus_low_rank(x, p_ptr, qt_ptr, r, c, rmask, cmask, rank, cols):
    """``x + P[r, :] Qᵀ[:, c]`` for an FP32 tile ``x``, by ``rank`` rank-1 updates."""
    for k in range(rank):
        pk = tl.load(p_ptr + r * rank + k, mask=rmask, other=0.0)
        qk = tl.load(qt_ptr + k * cols + c, mask=cmask, other=0.0)
        x += pk[:, None] * qk[None, :]
    return x


@triton.jit
def _fp8_code(y, MANT: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr, E4M3: tl.constexpr):
    """FP8 code (int32, 0..255) of FP32 ``y`` as torch's cast of ``clamp(y, ±FMAX)`` gives it;
    NaN keeps its sign, Inf is E4M3's NaN 0x7F or E5M2's signed Inf."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    fin = tl.minimum(mag, tl.full(mag.shape, FMAX, tl.float32).to(tl.int32, bitcast=True))
    # Normal range: round the 23-bit mantissa to MANT bits, ties to even, then rebias.
    shift: tl.constexpr = 23 - MANT
    normal = ((fin + ((1 << (shift - 1)) - 1) + ((fin >> shift) & 1)) >> shift) - ((127 - BIAS) << MANT)
    # Subnormal range (|y| < 2^(1-BIAS)): |y| / 2^(1-BIAS-MANT) < 2^MANT, rounded to an integer
    # by adding 2^23 (exact product; ties to even).
    sub = fin.to(tl.float32, bitcast=True) * (2.0 ** (MANT + BIAS - 1)) + 8388608.0
    sub = sub.to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(fin < ((128 - BIAS) << 23), sub, normal) | sign
    if E4M3:
        special = tl.where(mag > 0x7F800000, 0x7F | sign, 0x7F)
    else:
        special = tl.where(mag > 0x7F800000, 0x7F, 0x7C) | sign
    return tl.where(mag >= 0x7F800000, special, code)


@triton.jit
def _fp8_value(code, MANT: tl.constexpr, BIAS: tl.constexpr, E4M3: tl.constexpr):
    """FP32 value of an FP8 ``code`` (int32), with torch's bits for NaN."""
    e = (code >> MANT) & ((1 << (7 - MANT)) - 1)
    m = code & ((1 << MANT) - 1)
    normal = ((e + (127 - BIAS)) << 23) | (m << (23 - MANT))
    sub = (m.to(tl.float32) * (2.0 ** (1 - BIAS - MANT))).to(tl.int32, bitcast=True)
    if E4M3:
        special = (code & 0x7F) == 0x7F
    else:
        special = e == (1 << (7 - MANT)) - 1
    nan_or_inf = 0x7F800000 | (m << (23 - MANT)) | tl.where(m != 0, 0x400000, 0)
    mag = tl.where(e == 0, sub, tl.where(special, nan_or_inf, normal))
    return (mag | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _whiten_encode_kernel(
    g_ptr, dinv_ptr, p_ptr, qt_ptr, u_ptr, code_ptr, scale_ptr, amax_ptr,
    rows, cols, rank, scale_row_stride, scale_col_stride,
    WIDTH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    WHITEN: tl.constexpr, STORE_U: tl.constexpr, PASS: tl.constexpr,
    MANT: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr, E4M3: tl.constexpr,
):
    pid_c = tl.program_id(1)
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    j = tl.arange(0, BLOCK_C)
    c = pid_c * WIDTH + j
    rmask = r < rows
    cmask = (j < WIDTH) & (c < cols)
    mask = rmask[:, None] & cmask[None, :]
    offs = r[:, None] * cols + c[None, :]
    u = tl.load(g_ptr + offs, mask=mask, other=0.0)
    if WHITEN:
        u = u * tl.load(dinv_ptr + c, mask=cmask, other=0.0)[None, :]
        u = _plus_low_rank(u, p_ptr, qt_ptr, r, c, rmask, cmask, rank, cols)
    if PASS != _ENCODE:
        a = tl.abs(u)
        amax = tl.max(tl.where(a < float("inf"), a, 0.0), axis=1)
    if PASS == _AMAX:
        tl.store(amax_ptr + r * tl.num_programs(1) + pid_c, amax, mask=rmask)
    else:
        if PASS == _FUSED_BLOCK:  # the FP32 scale of fp8.scales_from_amax
            s = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, FMAX, tl.float32)), 2.0**-126)
            s = tl.where(amax.to(tl.int32, bitcast=True) > 0, s, 1.0)
            tl.store(scale_ptr + r * scale_row_stride + pid_c, s, mask=rmask)
        else:
            s = tl.load(scale_ptr + r * scale_row_stride + pid_c * scale_col_stride, mask=rmask, other=1.0)
        y = tl.math.div_rn(u, tl.broadcast_to(s[:, None], u.shape))
        tl.store(code_ptr + offs, _fp8_code(y, MANT, BIAS, FMAX, E4M3).to(tl.uint8), mask=mask)
        if STORE_U:
            tl.store(u_ptr + offs, u, mask=mask)


@triton.jit
def _decode_sum_kernel(
    code_ptr, scale_ptr, out_ptr, world, n, n_groups, rows, cols, scale_row_stride, scale_col_stride,
    AVERAGE: tl.constexpr, WIDTH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    MANT: tl.constexpr, BIAS: tl.constexpr, E4M3: tl.constexpr,
):
    pid_c = tl.program_id(1)
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    j = tl.arange(0, BLOCK_C)
    c = pid_c * WIDTH + j
    rmask = r < rows
    mask = rmask[:, None] & ((j < WIDTH) & (c < cols))[None, :]
    offs = r[:, None] * cols + c[None, :]
    codes = code_ptr + offs
    scales = scale_ptr + r * scale_row_stride + pid_c * scale_col_stride
    acc = _fp8_value(tl.load(codes, mask=mask, other=0).to(tl.int32), MANT, BIAS, E4M3)
    acc = acc * tl.load(scales, mask=rmask, other=1.0)[:, None]
    for _ in range(1, world):
        codes += n
        scales += n_groups
        x = _fp8_value(tl.load(codes, mask=mask, other=0).to(tl.int32), MANT, BIAS, E4M3)
        acc += x * tl.load(scales, mask=rmask, other=1.0)[:, None]
    if AVERAGE:
        acc = tl.math.div_rn(acc, tl.full(acc.shape, 1.0, tl.float32) * world)
    tl.store(out_ptr + offs, acc, mask=mask)


@triton.jit
def _unwhiten_kernel(
    u_ptr, dsqrt_ptr, p_ptr, qt_ptr, rows, cols, rank, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask, cmask = r < rows, c < cols
    mask = rmask[:, None] & cmask[None, :]
    offs = r[:, None] * cols + c[None, :]
    u = _plus_low_rank(tl.load(u_ptr + offs, mask=mask, other=0.0), p_ptr, qt_ptr, r, c, rmask, cmask, rank, cols)
    tl.store(u_ptr + offs, u * tl.load(dsqrt_ptr + c, mask=cmask, other=0.0)[None, :], mask=mask)


def _fmt_args(fmt: FP8Format) -> dict:
    e4m3 = fmt is FP8Format.E4M3
    return dict(MANT=fmt.mantissa_bits, BIAS=7 if e4m3 else 15, E4M3=e4m3)


def _tiling(cfg: CodecConfig, rows: int, cols: int) -> tuple[int, int, int, int, int]:
    """``(WIDTH, BLOCK_R, BLOCK_C, scale_row_stride, scale_col_stride)``: the tile and where a
    tile's row finds its scale in the flat scales."""
    if cfg.scaling in (Scaling.BLOCK, Scaling.MX):
        width, strides = cfg.block, (cfg.groups(rows, cols)[1], 1)
    else:
        width, strides = TILE, ((1, 0) if cfg.scaling is Scaling.ROW else (0, 0))
    block_c = triton.next_power_of_2(width)
    block_r = max(1, min(16, MAX_TILE // block_c, triton.next_power_of_2(rows)))
    return width, block_r, block_c, *strides


def whiten_encode(
    g: torch.Tensor, whitening: LowRankWhitening | None, cfg: CodecConfig, out: torch.Tensor | None = None
) -> Encoded:
    rows, cols = g.shape
    g = g.float().contiguous()
    width, block_r, block_c, srs, scs = _tiling(cfg, rows, cols)
    payload = torch.empty(rows, cols, dtype=torch.uint8, device=g.device)
    if whitening is not None:
        p = (g @ (whitening.q * whitening.d_inv_sqrt[:, None])) * whitening.c
        transform = (whitening.d_inv_sqrt, p, whitening.q.T.contiguous(), whitening.rank)
    else:
        transform = (g, g, g, 0)  # pointers the kernel does not read

    def launch(pass_: tl.constexpr, scales: torch.Tensor, amax: torch.Tensor = g, fusion: bool = False) -> None:
        dinv, p, qt, rank = transform
        _whiten_encode_kernel[(triton.cdiv(rows, block_r), triton.cdiv(cols, width))](
            g, dinv, p, qt, out if out is not None else g, payload, scales, amax, rows, cols, rank, srs, scs,
            WIDTH=width, BLOCK_R=block_r, BLOCK_C=block_c, WHITEN=whitening is not None, STORE_U=out is not None,
            PASS=pass_.value, FMAX=cfg.fmt.max, enable_fp_fusion=fusion, **_fmt_args(cfg.fmt),
        )

    if cfg.scaling is Scaling.BLOCK:
        scales = torch.empty(cfg.groups(rows, cols), dtype=cfg.scale_dtype(), device=g.device)
        launch(_FUSED_BLOCK, scales, fusion=True)
        return Encoded(payload=payload, scales=scales)
    # Two passes, without FMA contraction so that both compute the same U bit for bit.
    amax = torch.empty(rows, triton.cdiv(cols, width), device=g.device)
    launch(_AMAX, g, amax)
    if cfg.scaling is Scaling.ROW:
        amax = amax.amax(dim=1)
    elif cfg.scaling is Scaling.TENSOR:
        amax = amax.amax().reshape(1)
    scales = scales_from_amax(amax.reshape(-1), cfg).view(cfg.groups(rows, cols))
    launch(_ENCODE, scale_values(scales, cfg).reshape(-1).contiguous())
    return Encoded(payload=payload, scales=scales)


def decode_sum_unwhiten(
    payloads: torch.Tensor,
    scales: torch.Tensor,
    rows: int,
    cols: int,
    whitening: LowRankWhitening | None,
    cfg: CodecConfig,
    average: bool,
) -> torch.Tensor:
    world = payloads.shape[0]
    payloads = payloads.reshape(world, -1).contiguous()
    values = scale_values(scales.reshape(world, -1), cfg).contiguous()
    width, block_r, block_c, srs, scs = _tiling(cfg, rows, cols)
    out = torch.empty(rows, cols, device=payloads.device)
    # No FMA contraction: each rank's value q·s is rounded before it is added, as in the reference.
    _decode_sum_kernel[(triton.cdiv(rows, block_r), triton.cdiv(cols, width))](
        payloads, values, out, world, payloads.shape[1], values.shape[1], rows, cols, srs, scs,
        AVERAGE=average, WIDTH=width, BLOCK_R=block_r, BLOCK_C=block_c, enable_fp_fusion=False,
        **_fmt_args(cfg.fmt),
    )
    if whitening is not None:
        p = (out @ whitening.q) * whitening.c_inv
        block_r = min(16, triton.next_power_of_2(rows))
        _unwhiten_kernel[(triton.cdiv(rows, block_r), triton.cdiv(cols, TILE))](
            out, whitening.d_sqrt, p, whitening.q.T.contiguous(), rows, cols, whitening.rank,
            BLOCK_R=block_r, BLOCK_C=TILE, enable_fp_fusion=True,
        )
    return out
