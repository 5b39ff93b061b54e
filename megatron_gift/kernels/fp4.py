"""Triton kernels of the four-bit exchange (``comm.fp4_reduce``; imports triton): the FP4 encode of a
coded sequence straight into a buffer of messages, and the decode and rank-order FP32 sum of the
senders' messages for the own shard. The numerics are ``numerics.fp4``'s (its module doc), bit for
bit: E2M1 codes by comparisons with the midpoints, E4M3 / E8M0 block scales by integer arithmetic
on the FP32 bits (``fused._fp8_code`` / ``_fp8_value``), divisions IEEE-rounded (``div_rn``), so
that the interpreter on a CPU runs what the GPU runs.

Tiling: a program owns ``BB`` consecutive blocks and reads a block as its even and odd elements
(the low and high nibbles of its bytes). A block's segment (NVFP4's FP32 scale) is found by a
binary search of the segments' ends (``fused._shard_of``).

Encode (``encode_placed``): NVFP4 takes two passes over ``x``: ``_fp4_amax_kernel`` takes the
finite maximum of each block and an atomic maximum into its segment's (the FP32 bits of a
non-negative value order as int32; the maximum is the same in any order), after one memset;
``_fp4_encode_kernel`` recomputes the block maxima, forms the scales and writes codes, block scales and
(by each segment's first block) the segment scale at the packing's positions. MXFP4: one pass.

Decode (``decode_sum``): per element ``Σ_i (e2m1(q_i) · b_i) · s_i`` over the senders' rows in
order, from ``-0`` (``-0 + x = x``: ``reference.ordered_sum``'s bits), one launch whatever their
number.

Rotation (``rotate_blocks``): the randomised Hadamard ``x ↦ fwht(x ⊙ s)`` (inverse ``fwht(x) ⊙ s``) of
blocks of a sequence, in place, one launch: each block's butterflies in registers, partner ``i ^ h``
by ``tl.gather``, the same additions in the same order as ``numerics.rotation.fwht``. The encode's
passes take the same butterflies on their 64-element chunks where given a rotation table
(``_load_blocks``): the sender rotates without a pass of its own, and the decode's takes ``Hᵀ`` before it
stores: neither does the owner. No wrapper reads device data on
the host."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..numerics.fp4 import E2M1_MAX, E4M3_MAX, FP4Format
from .fused import _finite_amax, _fp8_code, _fp8_value, _shard_delta, _shard_of
from .placement import Placement, Source

BLOCKS = 64  # blocks per program (1024 NVFP4 elements)
# numerics.fp4's constants as the kernels may read them (constexpr globals)
_TINY = tl.constexpr(1.1754943508222875e-38)  # FP32's smallest normal: the least segment scale
_EMAX = tl.constexpr(E2M1_MAX)
_SMAX = tl.constexpr(E4M3_MAX)
_SEG = tl.constexpr(E2M1_MAX * E4M3_MAX)


@triton.jit
def _e2m1_code(y):
    """E2M1 codes (int32) of FP32 ``y``: the magnitude index counts the midpoints below ``|y|`` (ties
    to the even code: ``>`` before an odd code, ``>=`` before an even one), the sign bit is ``y``'s."""
    a = tl.abs(y)
    mag = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    mag += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return mag | (((y.to(tl.int32, bitcast=True) >> 31) & 1) << 3)


@triton.jit
def _e2m1_value(code):
    """FP32 value of E2M1 codes (int32): ``m/2`` for magnitude index ``m < 2``, else ``2^(e-1)(1 + man/2)``."""
    mag = code & 7
    e = mag >> 1
    half = (mag & 1).to(tl.float32) * 0.5
    v = tl.where(e == 0, half, (1.0 + half) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def _pow2(e):
    """``2^e`` in FP32 for int32 ``e`` (subnormal below -126, 0 below -149, Inf above 127)."""
    normal = ((tl.minimum(tl.maximum(e, -126), 127) + 127) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(e + 149, 0), 22)).to(tl.float32, bitcast=True)
    v = tl.where(e >= -126, normal, tl.where(e >= -149, sub, 0.0))
    return tl.where(e > 127, float("inf"), v)


@triton.jit
def _butterflies(x, col, LOG: tl.constexpr, SCALE: tl.constexpr):
    """``fwht`` of each row of ``x [*, 2^LOG]`` (``col``: its columns): butterfly h = 2^k is ``x_i + x_{i^h}``
    where bit h of i is clear, else ``x_{i^h} - x_i``, then the scale (``numerics.rotation.fwht``'s order)."""
    for k in tl.static_range(LOG):
        partner = tl.gather(x, tl.broadcast_to((col ^ (1 << k))[None, :], x.shape), 1)
        x = tl.where(((col & (1 << k)) != 0)[None, :], partner - x, x + partner)
    return x * SCALE


@triton.jit
def _read(x_ptr, at, key, m, src_ptr, src_ends_ptr, src_delta_ptr, src_from_ptr, src_n, src_steps, SRC: tl.constexpr):
    """FP32 values of the coded sequence at ``at`` (int64, any shape; ``m`` the elements to read): ``x[at]``,
    or with ``SRC`` (a source table, ``encode_placed``'s ``source``) ``src[at + delta[j]]`` where run ``j``
    holding ``key`` (``at``, or its block's start: runs are whole blocks) is the source's (``from[j] != 0``),
    ``x[at + delta[j]]`` elsewhere (the own runs where the source put them in ``x``): each element loaded
    once, from one of the two."""
    if SRC == 0:
        return tl.load(x_ptr + at, mask=m, other=0.0)
    j = tl.minimum(_shard_of(src_ends_ptr, src_n, src_steps, key, m), src_n - 1)
    d = tl.load(src_delta_ptr + j, mask=m, other=0)
    held = tl.load(src_from_ptr + j, mask=m, other=0) != 0
    s = tl.load(src_ptr + at + d, mask=m & held, other=0.0).to(tl.float32)
    return tl.where(held, s, tl.load(x_ptr + at + d, mask=m & (held == 0), other=0.0))


@triton.jit
def _load_blocks(
    x_ptr,
    blk,
    bmask,
    n_blocks,
    rot_ptr,
    signs_ptr,
    src_ptr,
    src_ends_ptr,
    src_delta_ptr,
    src_from_ptr,
    src_n,
    src_steps,
    BLOCK: tl.constexpr,
    BB: tl.constexpr,
    RB: tl.constexpr,
    RLOG: tl.constexpr,
    RSCALE: tl.constexpr,
    SRC: tl.constexpr,
):
    """The even and odd elements ``[BB, BLOCK/2]`` of blocks ``blk`` (this program's ``BB`` consecutive ones,
    read by ``_read``); with ``RB > 0`` each ``RB``-element chunk whose entry in ``rot_ptr`` is a sign row
    (``>= 0``) rotated first, ``fwht(x ⊙ s)`` in registers (``_rotate_kernel``'s arithmetic), the others as
    they are."""
    m = bmask[:, None]
    if RB == 0:
        off = blk[:, None] * BLOCK + 2 * tl.arange(0, BLOCK // 2)[None, :]
        key = blk[:, None] * BLOCK
        xe = _read(x_ptr, off, key, m, src_ptr, src_ends_ptr, src_delta_ptr, src_from_ptr, src_n, src_steps, SRC)
        xo = _read(x_ptr, off + 1, key, m, src_ptr, src_ends_ptr, src_delta_ptr, src_from_ptr, src_n, src_steps, SRC)
    else:
        c = tl.program_id(0).to(tl.int64) * (BB * BLOCK // RB) + tl.arange(0, BB * BLOCK // RB)
        cmask = c * RB < n_blocks * BLOCK
        col = tl.arange(0, RB)
        at = c[:, None] * RB + col[None, :]
        x = _read(
            x_ptr,
            at,
            at,
            at < n_blocks * BLOCK,
            src_ptr,
            src_ends_ptr,
            src_delta_ptr,
            src_from_ptr,
            src_n,
            src_steps,
            SRC,
        )
        row = tl.load(rot_ptr + c, mask=cmask, other=-1)
        on = (row >= 0)[:, None]
        s = tl.load(signs_ptr + tl.maximum(row, 0)[:, None] * RB + col[None, :], mask=cmask[:, None] & on, other=1.0)
        x = tl.where(on, _butterflies(x * s, col, RLOG, RSCALE), x)
        xe, xo = tl.split(tl.reshape(x, (BB, BLOCK // 2, 2)))
    return xe, xo


@triton.jit
def _block_amax(xe, xo, m):
    """The finite maximum of each block (its even and odd elements ``xe``, ``xo`` ``[BB, BLOCK/2]``, rows
    masked by ``m``) and whether it holds a NaN or an Inf."""
    amax = tl.maximum(_finite_amax(xe, m), _finite_amax(xo, m))
    bad = tl.max(((tl.abs(xe) < float("inf")) == 0).to(tl.int32) + ((tl.abs(xo) < float("inf")) == 0).to(tl.int32), 1)
    return amax, bad > 0


# ptxas held _fp4_amax_kernel to 32 registers and spilled 4 B with 32-bit sizes; 64 allowed: 40, none; read in a
# BF16 source, rotated, 64 spilled 4 B on sm_100a: 96 allowed (``bench/compile.py``)
AMAX_OPTIONS = dict(maxnreg=96)
# ptxas held the MXFP4 encode reading a source to 80 registers and spilled 4 B on sm_90a; 128 allowed: the rotated
# encodes spilled; 168 allowed
ENCODE_OPTIONS = dict(maxnreg=168)


@triton.jit
def _fp4_amax_kernel(
    x_ptr,
    seg_ends_ptr,
    n_seg,
    seg_steps,
    amax_ptr,
    n_blocks,
    rot_ptr,
    signs_ptr,
    src_ptr,
    src_ends_ptr,
    src_delta_ptr,
    src_from_ptr,
    src_n,
    src_steps,
    src_elems,
    BLOCK: tl.constexpr,
    BB: tl.constexpr,
    RB: tl.constexpr,
    RLOG: tl.constexpr,
    RSCALE: tl.constexpr,
    SRC: tl.constexpr,
):
    """Each segment's finite maximum into ``amax_ptr`` (int32 bits, zeroed before), in one vector atomic:
    the program's first block carries the maximum over the blocks of its segment here, a block of a
    later segment its own. ``RB > 0``: of the values rotated as ``_load_blocks`` rotates them."""
    blk = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB)
    bmask = blk < n_blocks
    xe, xo = _load_blocks(
        x_ptr,
        blk,
        bmask,
        n_blocks,
        rot_ptr,
        signs_ptr,
        src_ptr,
        src_ends_ptr,
        src_delta_ptr,
        src_from_ptr,
        src_n,
        src_steps,
        BLOCK,
        BB,
        RB,
        RLOG,
        RSCALE,
        SRC,
    )
    amax, _ = _block_amax(xe, xo, bmask[:, None])
    seg = _shard_of(seg_ends_ptr, n_seg, seg_steps, blk * BLOCK, bmask)
    first = tl.min(tl.where(bmask, seg, n_seg))  # the first block's (segments grow with the block)
    bits = amax.to(tl.int32, bitcast=True)
    lead = tl.arange(0, BB) == 0
    bits = tl.where(lead, tl.max(tl.where(bmask & (seg == first), bits, 0)), bits)
    tl.atomic_max(amax_ptr + seg, bits, mask=bmask & (lead | (seg != first)))


@triton.jit
def _fp4_encode_kernel(
    x_ptr,
    seg_ends_ptr,
    n_seg,
    seg_steps,
    amax_ptr,
    n_blocks,
    codes_ptr,
    codes_ends_ptr,
    codes_delta_ptr,
    codes_n,
    codes_steps,
    scales_ptr,
    scales_ends_ptr,
    scales_delta_ptr,
    scales_n,
    scales_steps,
    segs_ptr,
    segs_ends_ptr,
    segs_delta_ptr,
    segs_n,
    segs_steps,
    rot_ptr,
    signs_ptr,
    src_ptr,
    src_ends_ptr,
    src_delta_ptr,
    src_from_ptr,
    src_n,
    src_steps,
    src_elems,
    BLOCK: tl.constexpr,
    BB: tl.constexpr,
    NVFP4: tl.constexpr,
    RB: tl.constexpr,
    RLOG: tl.constexpr,
    RSCALE: tl.constexpr,
    SRC: tl.constexpr,
):
    """Codes, block scales and (NVFP4) segment scales of blocks ``[pid·BB, pid·BB + BB)`` at their
    tables' positions (``placement.Placement``; codes as bytes, two per byte, segment scales FP32), of
    the values rotated as ``_load_blocks`` rotates them where ``RB > 0``::

        NVFP4: s = max(amax_seg / (6·448), tiny) (1 for amax_seg = 0), b = e4m3_up(amax / (6 s)), scale = b·s
        MXFP4: e = ceil(log2(amax / 6)) in [-127, 127] (-127 for amax = 0), scale = 2^e
        code = e2m1(x / scale)  (0 where scale = 0); a block with a NaN or Inf: scale code NaN"""
    blk = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB)
    bmask = blk < n_blocks
    xe, xo = _load_blocks(
        x_ptr,
        blk,
        bmask,
        n_blocks,
        rot_ptr,
        signs_ptr,
        src_ptr,
        src_ends_ptr,
        src_delta_ptr,
        src_from_ptr,
        src_n,
        src_steps,
        BLOCK,
        BB,
        RB,
        RLOG,
        RSCALE,
        SRC,
    )
    amax, bad = _block_amax(xe, xo, bmask[:, None])
    if NVFP4:
        seg = _shard_of(seg_ends_ptr, n_seg, seg_steps, blk * BLOCK, bmask)
        seg_amax = tl.load(amax_ptr + seg, mask=bmask, other=0).to(tl.float32, bitcast=True)
        s = tl.where(seg_amax > 0, tl.math.div_rn(seg_amax, tl.full(seg_amax.shape, _SEG, tl.float32)), 1.0)
        s = tl.maximum(s, _TINY)
        v = tl.minimum(tl.math.div_rn(amax, s * _EMAX), _SMAX)
        bits = _fp8_code(v, 3, 7, _SMAX, True)
        bits += (_fp8_value(bits, 3, 7, True) < v).to(tl.int32)  # rounded up: nothing saturates
        scale = _fp8_value(bits, 3, 7, True) * s
        bits = tl.where(bad, 0x7F, bits)
        start = tl.load(seg_ends_ptr + seg - 1, mask=bmask & (seg > 0), other=0)
        head = bmask & (blk * BLOCK == start)  # the segment's first block writes its scale
        at = seg + _shard_delta(segs_ends_ptr, segs_delta_ptr, segs_n, segs_steps, seg, head)
        tl.store(segs_ptr + at, s, mask=head)
    else:
        q = tl.math.div_rn(amax, tl.full(amax.shape, _EMAX, tl.float32))
        qb = q.to(tl.int32, bitcast=True)
        sub = (q * 18446744073709551616.0).to(tl.int32, bitcast=True)  # q · 2^64: exact, normal
        e = tl.where(q == 0, 0, tl.where(qb < 0x00800000, ((sub >> 23) & 0xFF) - 190, ((qb >> 23) & 0xFF) - 126))
        e += (_pow2(e) * _EMAX < amax).to(tl.int32)  # frexp's exponent corrected: 6·2^(e-1) < amax <= 6·2^e
        e -= (_pow2(e - 1) * _EMAX >= amax).to(tl.int32)
        e = tl.minimum(tl.maximum(tl.where(amax > 0, e, -127), -127), 127)
        scale = _pow2(e)
        bits = tl.where(bad, 0xFF, e + 127)
    sc = tl.broadcast_to(scale[:, None], xe.shape)
    ye = tl.where(sc > 0, tl.math.div_rn(xe, sc), 0.0)
    yo = tl.where(sc > 0, tl.math.div_rn(xo, sc), 0.0)
    packed = _e2m1_code(ye) | (_e2m1_code(yo) << 4)
    k = blk[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
    m = bmask[:, None]
    k += _shard_delta(codes_ends_ptr, codes_delta_ptr, codes_n, codes_steps, blk * (BLOCK // 2), bmask)[:, None]
    tl.store(codes_ptr + k, packed.to(tl.uint8), mask=m)
    at = blk + _shard_delta(scales_ends_ptr, scales_delta_ptr, scales_n, scales_steps, blk, bmask)
    tl.store(scales_ptr + at, bits.to(tl.uint8), mask=bmask)


@triton.jit
def _fp4_decode_sum_kernel(
    msg_ptr,
    msg32_ptr,
    row_bytes,
    senders,
    codes_at,
    scales_at,
    seg_at,
    seg_ends_ptr,
    n_seg,
    seg_steps,
    out_ptr,
    n_blocks,
    rot_ptr,
    signs_ptr,
    BLOCK: tl.constexpr,
    BB: tl.constexpr,
    NVFP4: tl.constexpr,
    RB: tl.constexpr,
    RLOG: tl.constexpr,
    RSCALE: tl.constexpr,
):
    """``out = Σ_i dec(message_i)`` in FP32, the senders' rows in order, for blocks ``[pid·BB, pid·BB + BB)``
    of the own shard: ``(e2m1(q) · b) · s`` (NVFP4; ``s`` the block's segment scale) or ``e2m1(q) · 2^(e-127)``.
    ``RB > 0``: each ``RB``-element chunk whose entry in ``rot_ptr`` is a sign row then times ``Hᵀ``,
    ``fwht(x) ⊙ s`` in registers (``_rotate_kernel``'s inverse arithmetic), before it is stored."""
    blk = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB)
    bmask = blk < n_blocks
    m = bmask[:, None]
    k = blk[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
    if NVFP4:
        seg = _shard_of(seg_ends_ptr, n_seg, seg_steps, blk * BLOCK, bmask)
    acc_e = tl.full(k.shape, -0.0, tl.float32)
    acc_o = tl.full(k.shape, -0.0, tl.float32)
    for i in range(senders):
        row = i * row_bytes
        byte = tl.load(msg_ptr + row + codes_at + k, mask=m, other=0).to(tl.int32)
        bits = tl.load(msg_ptr + row + scales_at + blk, mask=bmask, other=0).to(tl.int32)
        if NVFP4:
            b = _fp8_value(bits, 3, 7, True)
        else:
            b = tl.where(bits == 0xFF, float("nan"), _pow2(bits - 127))
        ve = _e2m1_value(byte & 15) * b[:, None]
        vo = _e2m1_value(byte >> 4) * b[:, None]
        if NVFP4:
            s = tl.load(msg32_ptr + (row + seg_at) // 4 + seg, mask=bmask, other=0.0)
            ve = ve * s[:, None]
            vo = vo * s[:, None]
        acc_e += ve
        acc_o += vo
    if RB == 0:
        off = blk[:, None] * BLOCK + 2 * tl.arange(0, BLOCK // 2)[None, :]
        tl.store(out_ptr + off, acc_e, mask=m)
        tl.store(out_ptr + off + 1, acc_o, mask=m)
    else:
        x = tl.reshape(tl.join(acc_e, acc_o), (BB * BLOCK // RB, RB))  # the blocks' elements in order, by chunk
        c = tl.program_id(0).to(tl.int64) * (BB * BLOCK // RB) + tl.arange(0, BB * BLOCK // RB)
        cmask = c * RB < n_blocks * BLOCK
        col = tl.arange(0, RB)
        row = tl.load(rot_ptr + c, mask=cmask, other=-1)
        on = (row >= 0)[:, None]
        s = tl.load(signs_ptr + tl.maximum(row, 0)[:, None] * RB + col[None, :], mask=cmask[:, None] & on, other=1.0)
        x = tl.where(on, _butterflies(x, col, RLOG, RSCALE) * s, x)
        tl.store(out_ptr + c[:, None] * RB + col[None, :], x, mask=cmask[:, None])


def _table(t: Placement) -> tuple:
    """A placement table as the kernels take it: ``ends, delta, shards, search steps``."""
    n = t.ends.numel()
    return t.ends, t.delta, n, n.bit_length()


def encode_placed(
    x: torch.Tensor,
    fmt: FP4Format,
    seg_ends: torch.Tensor,
    out: torch.Tensor,
    place: dict[str, Placement],
    rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
    source: Source | None = None,
) -> None:
    """``numerics.fp4.encode_fp4(x, fmt, lengths)`` written into the buffer ``out`` (uint8) at the positions
    of ``place`` (``comm.fp4_reduce.FP4Packing.place``: "coded", "groups", "segments"); ``seg_ends``: the
    cumulative segment lengths (int64, on the device). ``rotation`` ``(chunk_rows, signs)``: ``x`` is
    encoded as ``rotate_blocks`` would leave it, chunk ``c`` of ``signs.shape[1]`` elements times ``H`` with
    the signs of row ``chunk_rows[c]`` where that is ``>= 0``, in the passes' registers (``x`` unchanged).
    ``source`` (``placement.Source``): the sequence's runs that lie elsewhere, read there (in their dtype)
    instead of from ``x``, whose elements there are not read: no gathered copy of them, and ``x`` need only
    hold ``source.own`` of the ``source.n`` elements.
    Two launches and a memset for NVFP4, one for MXFP4.

    Essential bytes per element: reads the value (4 B, or the source's size; NVFP4 twice), writes 0.5 B of
    codes and ``1/block`` B of block scales."""
    n = x.numel() if source is None else source.n
    n_blocks = n // fmt.block
    grid = (triton.cdiv(n_blocks, BLOCKS),)
    seg = (seg_ends, seg_ends.numel(), seg_ends.numel().bit_length())
    nv = fmt.segment_scale
    amax = torch.zeros(seg_ends.numel() if nv else 1, dtype=torch.int32, device=x.device)
    rows, signs = rotation if rotation is not None else (seg_ends, x)  # pointers the kernels do not read
    if rotation is not None and n % signs.shape[1]:
        raise ValueError(f"a rotation of {signs.shape[1]}-element chunks needs whole chunks, got {n} values")
    if source is not None and x.numel() < source.own:
        raise ValueError(f"the own sequence holds {x.numel()} values, its source leaves it {source.own}")
    rb = signs.shape[1] if rotation is not None else 0
    rot = dict(RB=rb, RLOG=max(rb, 1).bit_length() - 1, RSCALE=1.0 / math.sqrt(max(rb, 1)))
    if source is None:  # placeholders the kernels do not read
        src, rot["SRC"] = (x, seg_ends, seg_ends, seg_ends, 1, 1, 0), 0
    else:
        t = source.table
        src = (
            source.tensor,
            t.ends,
            t.delta,
            source.held,
            t.ends.numel(),
            t.ends.numel().bit_length(),
            source.elements,
        )
        rot["SRC"] = 2 if source.tensor.dtype == torch.bfloat16 else 1
    if nv:
        _fp4_amax_kernel[grid](
            x, *seg, amax, n_blocks, rows, signs, *src, BLOCK=fmt.block, BB=BLOCKS, **rot, **AMAX_OPTIONS
        )
    _fp4_encode_kernel[grid](
        x,
        *seg,
        amax,
        n_blocks,
        out,
        *_table(place["coded"]),
        out,
        *_table(place["groups"]),
        out.view(torch.float32),
        *_table(place["segments"]),
        rows,
        signs,
        *src,
        BLOCK=fmt.block,
        BB=BLOCKS,
        NVFP4=nv,
        **rot,
        **ENCODE_OPTIONS,
    )


def decode_sum(
    msgs: torch.Tensor,
    n: int,
    fmt: FP4Format,
    codes_at: int,
    scales_at: int,
    seg_at: int,
    seg_ends: torch.Tensor,
    rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``Σ_i decode_fp4(message_i)`` (FP32 ``[n]``, senders in order) of ``msgs [senders, row bytes]`` (uint8,
    rows 4-byte aligned), each holding ``n`` elements' packed codes at byte ``codes_at``, block scales at
    ``scales_at`` and (NVFP4) one FP32 scale per segment at ``seg_at``; ``seg_ends``: the segments' cumulative
    lengths. ``rotation`` ``(chunk_rows, signs)`` as ``encode_placed`` takes it: the sum left as
    ``rotate_blocks(..., inverse=True)`` would leave it, ``Hᵀ`` in the pass. One launch.

    Essential bytes per element: reads ``senders · (0.5 + 1/block)`` B, writes 4 B."""
    senders, row_bytes = msgs.shape
    out = torch.empty(n, dtype=torch.float32, device=msgs.device)
    n_blocks = n // fmt.block
    rows, signs = rotation if rotation is not None else (seg_ends, out)  # pointers the kernel does not read
    if rotation is not None and n % signs.shape[1]:
        raise ValueError(f"a rotation of {signs.shape[1]}-element chunks needs whole chunks, got {n} values")
    rb = signs.shape[1] if rotation is not None else 0
    _fp4_decode_sum_kernel[(triton.cdiv(n_blocks, BLOCKS),)](
        msgs,
        msgs.view(torch.float32),
        row_bytes,
        senders,
        codes_at,
        scales_at,
        seg_at,
        seg_ends,
        seg_ends.numel(),
        seg_ends.numel().bit_length(),
        out,
        n_blocks,
        rows,
        signs,
        BLOCK=fmt.block,
        BB=BLOCKS,
        NVFP4=fmt.segment_scale,
        RB=rb,
        RLOG=max(rb, 1).bit_length() - 1,
        RSCALE=1.0 / math.sqrt(max(rb, 1)),
    )
    return out


@triton.jit
def _rotate_kernel(
    x_ptr,
    starts_ptr,
    rows_ptr,
    signs_ptr,
    n_blocks,
    INVERSE: tl.constexpr,
    BLOCK: tl.constexpr,
    LOG: tl.constexpr,
    SCALE: tl.constexpr,
    BB: tl.constexpr,
):
    """``BB`` blocks of ``BLOCK`` elements of ``x`` from ``starts`` rotated in place; block ``b``'s signs are
    row ``rows[b]`` of ``signs`` ``[*, BLOCK]``."""
    b = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB)
    bmask = b < n_blocks
    start = tl.load(starts_ptr + b, mask=bmask, other=0)
    row = tl.load(rows_ptr + b, mask=bmask, other=0)
    col = tl.arange(0, BLOCK)
    at = start[:, None] + col[None, :]
    m = bmask[:, None]
    x = tl.load(x_ptr + at, mask=m, other=0.0)
    s = tl.load(signs_ptr + row[:, None] * BLOCK + col[None, :], mask=m, other=1.0)
    if not INVERSE:
        x = x * s
    x = _butterflies(x, col, LOG, SCALE)
    if INVERSE:
        x = x * s
    tl.store(x_ptr + at, x, mask=m)


ROTATE_BLOCKS = 16  # blocks per program of ``_rotate_kernel``


def rotate_blocks(
    x: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor, signs: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """The blocks of ``x`` (FP32, contiguous) that start at ``starts`` (int64 element offsets, ``signs.shape[1]``
    elements each) rotated in place, block ``b`` with the signs of row ``rows[b]`` of ``signs`` (FP32 ±1):
    ``fwht(x ⊙ s)``, or ``fwht(x) ⊙ s`` for ``inverse`` (``numerics.rotation``'s arithmetic). One launch;
    returns ``x``. Essential bytes per element rotated: 4 read, 4 written."""
    n_blocks, block = starts.numel(), signs.shape[1]
    if n_blocks:
        _rotate_kernel[(triton.cdiv(n_blocks, ROTATE_BLOCKS),)](
            x,
            starts,
            rows,
            signs,
            n_blocks,
            INVERSE=inverse,
            BLOCK=block,
            LOG=block.bit_length() - 1,
            SCALE=1.0 / math.sqrt(block),
            BB=ROTATE_BLOCKS,
        )
    return x


# -- Memory traffic of each launch (the launch meter; as ``fused.TRAFFIC``) --------------------------------


def _seg_bytes(a: dict) -> int:
    """The segments' ends (int64), read by the blocks' binary searches (cache hits after the first)."""
    return 8 * a["n_seg"]


def _rotation_bytes(a: dict) -> int:
    """With the rotation in the pass (``RB > 0``): each chunk's sign row (int64) and the signs (a few rows)."""
    if not a["RB"]:
        return 0
    return 8 * (a["n_blocks"] * a["BLOCK"] // a["RB"]) + 4 * a["signs_ptr"].numel()


def _value_bytes(a: dict) -> int:
    """The coded values, each read once: from the source where given (its runs in its dtype, with its
    table: ends, delta, flag), else from ``x``."""
    n = a["n_blocks"] * a["BLOCK"]
    if not a["SRC"]:
        return n * a["x_ptr"].element_size()
    held = a["src_elems"]
    return held * a["src_ptr"].element_size() + (n - held) * a["x_ptr"].element_size() + 24 * a["src_n"]


def _amax_traffic(a: dict) -> tuple[int, int]:
    return _value_bytes(a) + _seg_bytes(a) + _rotation_bytes(a), 4 * a["n_seg"]


def _encode_traffic(a: dict) -> tuple[int, int]:
    """The values once (with the rotation's tables), the segment maxima and the three tables; the codes, the
    block scales and (NVFP4) a scale per segment."""
    n, nv = a["n_blocks"] * a["BLOCK"], a["NVFP4"]
    read = _value_bytes(a) + 16 * (a["codes_n"] + a["scales_n"] + a["segs_n"]) + _rotation_bytes(a)
    read += _seg_bytes(a) + 4 * a["n_seg"] if nv else 0
    return read, n // 2 + a["n_blocks"] + (4 * a["n_seg"] if nv else 0)


def _decode_sum_traffic(a: dict) -> tuple[int, int]:
    """Every sender's codes, block scales and (NVFP4) segment scales (with the rotation's tables); the FP32 sum."""
    n, nv = a["n_blocks"] * a["BLOCK"], a["NVFP4"]
    read = a["senders"] * (n // 2 + a["n_blocks"] + (4 * a["n_seg"] if nv else 0)) + (_seg_bytes(a) if nv else 0)
    return read + _rotation_bytes(a), 4 * n


def _rotate_traffic(a: dict) -> tuple[int, int]:
    """Each block's values, its start and sign row (int64), the table of signs once (a few rows, cached);
    the values back."""
    n = a["n_blocks"] * a["BLOCK"]
    return 4 * n + 16 * a["n_blocks"] + 4 * a["signs_ptr"].numel(), 4 * n


TRAFFIC = {
    "_rotate_kernel": _rotate_traffic,
    "_fp4_amax_kernel": _amax_traffic,
    "_fp4_encode_kernel": _encode_traffic,
    "_fp4_decode_sum_kernel": _decode_sum_traffic,
}
