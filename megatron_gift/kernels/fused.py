"""Triton kernels of the two hot paths (imports triton; see the package docstring for when).

Shapes: gradient ``G [rows, cols]`` (FP32, BF16 or FP16, read as FP32), ``n = rows·cols``,
whitening rank ``r``, ``Q [cols, r]``, ``R`` ranks.

Tiling. The flat ``G`` is cut into *units*, contiguous runs inside one scaling group; a program
owns ``BU`` units and reads them in chunks of ``W`` elements (one chunk unless a unit is longer).
The grid is 1-D (dimension 0: up to 2^31-1 programs, so no shape limit). ``_units`` lays them out:

- ``_ORDERED``: without ``lengths``, the matrix codec's groups (BLOCK/MX: 1 x block) or, for
  ROW/TENSOR scaling, ``TILE`` columns of a row (torch reduces their maxima to the group's),
  ``BU`` consecutive ones per program;
- ``_ROW_BLOCKS``: the same units, a program taking the same columns of ``BU`` consecutive rows
  so that they share the loads of ``D`` and ``Q`` (the sender with whitening);
- ``_GROUPS``: with ``lengths`` (groups in memory order, e.g. cut at shard boundaries), a unit is
  a group, found from the inclusive cumsum of ``lengths``, ``BU`` consecutive ones per program;
- ``_ROW_GROUPS``: the same groups for the sender with whitening (each group inside one row, as the
  layout's are): a program takes, for ``BU`` consecutive rows, the groups that start in the same
  ``slot_w`` columns (``_slot_width``: 128 to 512, or a whole row for ROW scaling: ``slot_units`` of
  the codec's groups, more where a shard cuts the row; found per row by a search of the ends in a
  window as wide as the cuts, checked, ``_groups_before``), so that its units share the loads of ``D``
  and ``Qᵀ`` as with ``_ROW_BLOCKS``, and its rows of ``P`` serve ``slot_w`` columns (``4·r/slot_w`` B
  per element).

With ``_ROW_BLOCKS`` and ``_ROW_GROUPS`` a program loops over ``row_steps`` blocks of ``BU`` rows
(more rows per load of ``D`` and ``Qᵀ``; ``_Tiling`` keeps at least ``ROW_PROGRAMS`` programs).

Sender, ``whiten_encode``: ``P = G (D^{-1/2} Q) diag(c)`` ([rows, r], ``_project_kernel``), then
per unit::

    U = G D^{-1/2} + P Qᵀ                   (= G T, r FP32 rank-1 updates)
    amax = max |U| over the finite values of the group
    s = max(amax / fp8_max, 2^-126), 1 where amax = 0   (FP32, as fp8.scales_from_amax)
    code = fp8(clamp(U / s, ±fp8_max))     (RNE by integer bit manipulation)

With an output side (``T_out``: ``D_out``, ``Q_out [rows, r_out]``, ``c_out``; ``numerics.two_sided``)
``U = T_outᵀ G T = (D_out^{-1/2} G + Q_out Pre) T``, ``Pre`` a sum over all rows: ``Pre`` and ``P``
from one read of ``G`` first (``_project_two_sided``), then per unit ``r_out + r`` rank-1 updates::

    Pre T = (c_out ⊙ Q_outᵀ D_out^{-1/2} G) T      [r_out, cols]: per program of OUTPUT_ROWS rows a part
                                                  (D^{-1/2} applied), summed; then its low-rank part
    P     = D_out^{-1/2} G (D^{-1/2} Q) diag(c)     [rows, r]
    U     = D_out^{-1/2} G D^{-1/2} + Q_out (Pre T) + P Qᵀ

With error feedback ``U`` is ``G T + e`` (the residual read at the unit's offsets) and the
encoding pass also writes ``e' = U - fp8⁻¹(code)·s`` (FMA contraction off, so that it is rounded as
the reference rounds it). Placed (``PLACE``), a unit's codes go to ``k + delta[j]`` (``k`` its
source index, ``j`` its shard in the table ``ends``, ``delta``: ``_shard_delta``, one lookup per
unit as a unit never crosses a shard) and its scale likewise by the groups' table.

Where a unit is a whole group and the scale an FP32 one (BLOCK scaling; ROW with ``lengths``) one
kernel does all of it. MX scaling and ROW/TENSOR without ``lengths`` take two: the first writes
each unit's amax, ``fp8.scales_from_amax`` turns the groups' maxima into scales (E8M0 for MX), the
second recomputes ``U`` and encodes it. A unit longer than ``W`` (a block wider than ``MAX_TILE``, a ROW
group given by ``lengths``, padding given as one group) computes ``U`` of its later chunks twice.
TENSOR scaling with ``lengths`` takes the two passes over units (``kernels.TensorUnits``: each group cut at
row ends and every ``TENSOR_UNIT`` columns), their maxima reduced to their groups' by one ``scatter_reduce``.

Receiver, ``decode_sum_unwhiten``: per unit ``S = Σ_{i<R} fp8⁻¹(code_i) · s_i`` in FP32 in rank
order (``acc = -0``, then ``acc += x_i``: the same bits as ``reference.ordered_sum``'s
``acc = x_0; acc += x_1 ...``, since ``-0 + x = x``), over up to ``MAX_PARTS`` parts of rows in
one launch, ``÷ R`` when averaging; then ``P' = S Q diag(c')`` (``_project_kernel``) and
``S T⁻¹ = (S + P' Qᵀ) D^{1/2}``, written into the caller's output in its dtype (``S`` itself where
that is FP32; BF16 rounded to nearest even by integer arithmetic, ``_store_as``).

The FP8 codes and E8M0 scales are built and read with integer arithmetic on the FP32 bits (no
FP8 dtypes), which Triton's CPU interpreter runs as well as the GPU, divisions are IEEE-rounded
(``div_rn``), and FMA contraction is off wherever a product must be rounded as the reference
rounds it or ``U`` is computed twice, so codes, scales and the rank sum are bit for bit those of
``numerics.fp8``. No wrapper reads device data on the host: launches and shapes depend only on
the arguments' shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..numerics.fp8 import CodecConfig, Encoded, Scaling, scales_from_amax
from ..numerics.two_sided import OutputRows
from ..numerics.whitening import LowRankWhitening, ieee_fp32
from .placement import RowsAt

TILE = 128  # columns of a unit where the scaling group is a whole row or tensor
MAX_TILE = 4096  # elements of a chunk: wider groups are read in several chunks
TILE_ELEMENTS = 2048  # elements of a program's tile (BU x W) where its units allow
DECODE_OPTIONS = dict(maxnreg=255)  # the decode-sum's: ptxas held 32 units of 32 elements (i64 sizes) to 128
# registers and spilled 20-24 B; allowed 255, none (``bench/compile.py``)
MAX_UNITS = 32  # units of a program (64 units of 32 elements spilled 4-96 B in the decode-sum and the MX maxima
# pass at 255 registers, ``bench/compile.py``; 32: none)
MAX_PARTS = 3  # parts of rows one decode launch takes (before the own rank, own, after)
_READ_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The passes of _encode_kernel.
_AMAX, _ENCODE, _ONE_PASS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# The unit layouts of _units (module doc): the matrix codec's units in memory order or the same
# columns of consecutive rows, or the groups of ``lengths``.
_ORDERED, _ROW_BLOCKS, _GROUPS, _ROW_GROUPS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
ROW_STEPS = 16  # blocks of BU rows a program of a row layout takes at most
ROW_PROGRAMS = 512  # programs a row layout keeps where the matrix allows (~4 per SM of an H100)
SLOT_WIDTHS = (128, 256, 512)  # columns a _ROW_GROUPS slot may take (BLOCK/MX): the one of fewest bytes is chosen


def _slot_width(unit_w: int, rows: int, cols: int, bu: int, rank: int) -> int:
    """The ``_ROW_GROUPS`` slot width (a multiple of ``unit_w``) of fewest bytes per element beyond ``G``:
    a program's rows of ``P``, ``4·r/w``, against its loads of ``Qᵀ`` and ``D``, ``4·(r + 1)/(bu·steps)``,
    ``steps`` shrinking as wider slots leave fewer programs (``ROW_PROGRAMS``); the narrowest on ties."""
    whole = triton.cdiv(cols, unit_w) * unit_w
    blocks, best = triton.cdiv(rows, bu), None
    for w in sorted({min(whole, max(unit_w, width // unit_w * unit_w)) for width in SLOT_WIDTHS}):
        steps = max(1, min(ROW_STEPS, blocks, blocks * triton.cdiv(cols, w) // ROW_PROGRAMS))
        cost = rank / w + (rank + 1) / (bu * steps)
        if best is None or cost < best[0]:
            best = (cost, w)
    return best[1]


@triton.jit
def _plus_low_rank(x, p_ptr, qt_ptr, r, c, rmask, cmask, rank, cols):
    """``x + P[r, :] Qᵀ[:, c]`` for an FP32 tile ``x`` (rows ``r [B]``, columns ``c [1 or B, W]``),
    by ``rank`` rank-1 updates."""
    for k in range(rank):
        pk = tl.load(p_ptr + r * rank + k, mask=rmask, other=0.0)
        qk = tl.load(qt_ptr + k * cols + c, mask=cmask, other=0.0)
        x += pk[:, None] * qk
    return x


@triton.jit
def _fp8_code(y, MANT: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr, NO_INF: tl.constexpr):
    """FP8 code (int32, 0..255) of FP32 ``y`` as torch's cast of ``clamp(y, ±FMAX)`` gives it;
    NaN keeps its sign, Inf is the NaN 0x7F of a format without Inf (``NO_INF``: E4M3) or the signed
    Inf (E5M2)."""
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
    if NO_INF:
        special = tl.where(mag > 0x7F800000, 0x7F | sign, 0x7F)
    else:
        special = tl.where(mag > 0x7F800000, 0x7F, 0x7C) | sign
    return tl.where(mag >= 0x7F800000, special, code)


@triton.jit
def _fp8_value(code, MANT: tl.constexpr, BIAS: tl.constexpr, NO_INF: tl.constexpr):
    """FP32 value of an FP8 ``code`` (int32), with torch's bits for NaN."""
    e = (code >> MANT) & ((1 << (7 - MANT)) - 1)
    m = code & ((1 << MANT) - 1)
    normal = ((e + (127 - BIAS)) << 23) | (m << (23 - MANT))
    sub = (m.to(tl.float32) * (2.0 ** (1 - BIAS - MANT))).to(tl.int32, bitcast=True)
    if NO_INF:
        special = (code & 0x7F) == 0x7F
    else:
        special = e == (1 << (7 - MANT)) - 1
    nan_or_inf = 0x7F800000 | (m << (23 - MANT)) | tl.where(m != 0, 0x400000, 0)
    mag = tl.where(e == 0, sub, tl.where(special, nan_or_inf, normal))
    return (mag | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _scale_value(s, E8M0: tl.constexpr):
    """FP32 scale of a stored one: an E8M0 code ``e`` is ``2^(e-127)`` (``fp8.scale_values``; code 0
    is the subnormal 2^-127, 255 is +Inf), FP32 scales pass through."""
    if E8M0:
        e = s.to(tl.int32)
        s = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)
    return s


@triton.jit
def _store_as(ptr, x, mask, BF16: tl.constexpr):
    """Store FP32 ``x`` rounded once to ``ptr``'s dtype; BF16 (``ptr`` then the output viewed as
    int16) by integer round-to-nearest-even on the bits as torch rounds (NaN: 0x7FC0), which
    Triton's interpreter, whose own cast truncates, runs as the GPU does."""
    if BF16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        tl.store(ptr, tl.where(x != x, 0x7FC0, rounded).to(tl.int16), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


def store_arg(out: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``out`` as a kernel writes it through ``_store_as``, and its ``BF16`` constexpr."""
    return (out.view(torch.int16), True) if out.dtype is torch.bfloat16 else (out, False)


@triton.jit
def _units(
    ends_ptr,
    n_units,
    rows,
    cols,
    units_per_row,
    scale_row_stride,
    scale_col_stride,
    UNIT_W: tl.constexpr,
    BU: tl.constexpr,
    LAYOUT: tl.constexpr,
):
    """This program's units with ``_ORDERED`` or ``_GROUPS``: ``(start [BU], length [BU, 1], row [BU],
    col0 [BU, 1], mask [BU], unit [BU], scale index [BU])``; ``unit`` numbers the units in memory order."""
    pid = tl.program_id(0).to(tl.int64)
    unit = pid * BU + tl.arange(0, BU)
    mask = unit < n_units
    if LAYOUT == _GROUPS:  # ends = cumsum(lengths)
        end = tl.load(ends_ptr + unit, mask=mask, other=0)
        start = tl.load(ends_ptr + unit - 1, mask=mask & (unit > 0), other=0)
        row = start // cols
        col0 = start - row * cols
        length = end - start
        scale_index = unit
    else:
        row = unit // units_per_row
        kb = unit - row * units_per_row
        col0 = kb * UNIT_W
        start = row * cols + col0
        length = tl.minimum(cols - col0, UNIT_W)
        scale_index = row * scale_row_stride + kb * scale_col_stride
    return start, length[:, None], row, col0[:, None], mask, unit, scale_index


@triton.jit
def _n_chunks(length, W: tl.constexpr, ONE_CHUNK: tl.constexpr):
    """Chunks of ``W`` elements that cover the longest of the units (``length [BU, 1]``)."""
    if ONE_CHUNK:
        chunks = 1
    else:
        chunks = tl.cdiv(tl.max(length), W)
    return chunks


@triton.jit
def _group_start(ends_ptr, t, mask):
    """Flat offset where group ``t`` starts (``ends = cumsum(lengths)``; 0 for ``t <= 0``)."""
    return tl.load(ends_ptr + t - 1, mask=mask & (t > 0), other=0)


@triton.jit
def _first_starting_at(ends_ptr, lo, hi, steps, x, mask):
    """The first group ``t`` in ``[lo, hi]`` that starts at or after ``x`` (``hi`` where none before it
    does), by ``steps >= log2(hi - lo + 1)`` halvings."""
    for _ in range(steps):
        active = mask & (lo < hi)
        mid = (lo + hi) // 2
        before = _group_start(ends_ptr, mid, active) < x
        lo = tl.where(active & before, mid + 1, lo)
        hi = tl.where(active & ~before, mid, hi)
    return lo


@triton.jit
def _groups_before(ends_ptr, n_units, base, extra, window_steps, full_steps, x, mask):
    """``#{t : group t starts before flat offset x}`` (``x [BU]``): searched in ``[base, base + extra]``
    (exact where the groups refine the codec's, as a layout's do: ``base`` codec groups start before
    ``x`` and at most ``extra`` cuts), checked, and searched over all groups for rows where it missed."""
    t = _first_starting_at(
        ends_ptr, tl.minimum(base, n_units), tl.minimum(base + extra, n_units), window_steps, x, mask
    )
    ok = ((t == 0) | (_group_start(ends_ptr, t - 1, mask) < x)) & (
        (t == n_units) | (_group_start(ends_ptr, t, mask) >= x)
    )
    if tl.max((mask & ~ok).to(tl.int32)) > 0:
        t = tl.where(ok, t, _first_starting_at(ends_ptr, t * 0, t * 0 + n_units, full_steps, x, mask & ~ok))
    return t


@triton.jit
def _chunk(start, length, umask, ch, W: tl.constexpr):
    """Offsets in the units, flat offsets and mask (``[BU, W]``) of chunk ``ch`` of the units."""
    off = ch * W + tl.arange(0, W)[None, :]
    return off, start[:, None] + off, umask[:, None] & (off < length)


@triton.jit
def _chunk_u(
    g_ptr,
    dinv_ptr,
    p_ptr,
    qt_ptr,
    e_ptr,
    dout_ptr,
    qo_ptr,
    pre_ptr,
    start,
    length,
    row,
    col0,
    umask,
    ch,
    cols,
    rank,
    rank_out,
    W: tl.constexpr,
    WHITEN: tl.constexpr,
    FEEDBACK: tl.constexpr,
    OUTPUT: tl.constexpr,
):
    """Chunk ``ch`` of the units: ``(U, flat offsets, mask)``, ``[BU, W]`` each; with ``OUTPUT``
    ``U = T_outᵀ G T`` (module doc: ``pre_ptr`` holds ``Pre T``); with ``FEEDBACK``
    ``Ũ = U + e`` (the residual ``e`` at the same offsets)."""
    off, flat, mask = _chunk(start, length, umask, ch, W)
    u = tl.load(g_ptr + flat, mask=mask, other=0.0).to(tl.float32)
    col = col0 + off
    cmask = col < cols
    if OUTPUT:
        u = u * tl.load(dout_ptr + row, mask=umask, other=0.0)[:, None]
    if WHITEN:
        u = u * tl.load(dinv_ptr + col, mask=cmask, other=0.0)
    if OUTPUT:
        u = _plus_low_rank(u, qo_ptr, pre_ptr, row, col, umask, cmask, rank_out, cols)
    if WHITEN:
        u = _plus_low_rank(u, p_ptr, qt_ptr, row, col, umask, cmask, rank, cols)
    if FEEDBACK:
        u = u + tl.load(e_ptr + flat, mask=mask, other=0.0)
    return u, flat, mask


@triton.jit
def _shard_of(ends_ptr, n_shards, steps, k, mask):
    """``j = #{t : ends[t] <= k}``: the shard of a placement table (``kernels.placement.Placement``) that
    holds source index ``k`` (int64, any shape; zero-size shards are passed over), by a binary search
    of ``steps`` (``>= log2(n_shards + 1)``) gathers from the small table."""
    lo = tl.zeros_like(k)
    hi = lo + n_shards
    for _ in range(steps):
        active = mask & (lo < hi)
        mid = (lo + hi) // 2
        end = tl.load(ends_ptr + mid, mask=active, other=0)
        lo = tl.where(active & (end <= k), mid + 1, lo)
        hi = tl.where(active & (end > k), mid, hi)
    return lo


@triton.jit
def _shard_delta(ends_ptr, delta_ptr, n_shards, steps, k, mask):
    """``delta[j]`` of the shard ``j`` holding source index ``k`` (``_shard_of``)."""
    return tl.load(
        delta_ptr + tl.minimum(_shard_of(ends_ptr, n_shards, steps, k, mask), n_shards - 1), mask=mask, other=0
    )


@triton.jit
def _finite_amax(u, mask):
    a = tl.abs(u)
    return tl.max(tl.where(mask & (a < float("inf")), a, 0.0), axis=1)


@triton.jit
def _store_codes(
    u,
    flat,
    mask,
    s,
    code_ptr,
    code_shift,
    u_ptr,
    e_new_ptr,
    STORE_U: tl.constexpr,
    FEEDBACK: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    FMAX: tl.constexpr,
    NO_INF: tl.constexpr,
):
    """The codes of ``u / s`` at ``code_ptr + code_shift + flat``; ``U`` at ``u_ptr + flat`` with
    ``STORE_U``; with ``FEEDBACK`` the new residual ``U - fp8⁻¹(code)·s`` at ``e_new_ptr + flat``."""
    y = tl.math.div_rn(u, tl.broadcast_to(s[:, None], u.shape))
    code = _fp8_code(y, MANT, BIAS, FMAX, NO_INF)
    tl.store(code_ptr + code_shift + flat, code.to(tl.uint8), mask=mask)
    if STORE_U:
        tl.store(u_ptr + flat, u, mask=mask)
    if FEEDBACK:
        tl.store(e_new_ptr + flat, u - _fp8_value(code, MANT, BIAS, NO_INF) * s[:, None], mask=mask)


@triton.jit
def _encode_units(
    g_ptr,
    dinv_ptr,
    p_ptr,
    qt_ptr,
    dout_ptr,
    qo_ptr,
    pre_ptr,
    u_ptr,
    code_ptr,
    scale_ptr,
    amax_ptr,
    cols,
    rank,
    rank_out,
    start,
    length,
    row,
    col0,
    umask,
    unit,
    scale_index,
    code_ends_ptr,
    code_delta_ptr,
    code_shards,
    code_steps,
    code_at,
    scale_out_ptr,
    scale_ends_ptr,
    scale_delta_ptr,
    scale_shards,
    scale_steps,
    scale_at,
    e_ptr,
    e_new_ptr,
    W: tl.constexpr,
    BU: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    WHITEN: tl.constexpr,
    OUTPUT: tl.constexpr,
    STORE_U: tl.constexpr,
    PASS: tl.constexpr,
    PLACE: tl.constexpr,
    FEEDBACK: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    FMAX: tl.constexpr,
    NO_INF: tl.constexpr,
    E8M0: tl.constexpr,
):
    """One pass of ``_encode_kernel`` over ``BU`` units (``_units``' tuple): their maxima (``_AMAX``),
    or their scales and codes (``_ENCODE``: the stored scales; ``_ONE_PASS``: from the maxima)."""
    n_chunks = _n_chunks(length, W, ONE_CHUNK)
    # Where the codes and the scale of each unit go: one table lookup per unit (a unit never
    # crosses a shard of the table); in place (codes at the flat offsets, scales at their index) without PLACE.
    code_shift = tl.zeros([BU, 1], tl.int64)
    scale_dest = scale_index
    if PLACE:
        k = code_at + start
        code_shift = (code_at + _shard_delta(code_ends_ptr, code_delta_ptr, code_shards, code_steps, k, umask))[:, None]
        k = scale_at + scale_index
        scale_dest = k + _shard_delta(scale_ends_ptr, scale_delta_ptr, scale_shards, scale_steps, k, umask)
    chunk_args = (g_ptr, dinv_ptr, p_ptr, qt_ptr, e_ptr, dout_ptr, qo_ptr, pre_ptr, start, length, row, col0, umask)
    u, flat, mask = _chunk_u(*chunk_args, 0, cols, rank, rank_out, W, WHITEN, FEEDBACK, OUTPUT)
    if PASS != _ENCODE:
        amax = _finite_amax(u, mask)
        if not ONE_CHUNK:
            for ch in range(1, n_chunks):
                uc, fc, mc = _chunk_u(*chunk_args, ch, cols, rank, rank_out, W, WHITEN, FEEDBACK, OUTPUT)
                amax = tl.maximum(amax, _finite_amax(uc, mc))
    if PASS == _AMAX:
        tl.store(amax_ptr + unit, amax, mask=umask)
    else:
        if PASS == _ONE_PASS:  # the FP32 scale of fp8.scales_from_amax
            s = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, FMAX, tl.float32)), 2.0**-126)
            s = tl.where(amax.to(tl.int32, bitcast=True) > 0, s, 1.0)
            tl.store(scale_out_ptr + scale_dest, s, mask=umask)
        else:
            stored = tl.load(scale_ptr + scale_index, mask=umask, other=1)
            if PLACE:
                tl.store(scale_out_ptr + scale_dest, stored, mask=umask)
            s = _scale_value(stored, E8M0)
        codes = (s, code_ptr, code_shift, u_ptr, e_new_ptr)  # values only: a tuple keeps no constexpr
        _store_codes(u, flat, mask, *codes, STORE_U, FEEDBACK, MANT, BIAS, FMAX, NO_INF)
        if not ONE_CHUNK:
            for ch in range(1, n_chunks):
                uc, fc, mc = _chunk_u(*chunk_args, ch, cols, rank, rank_out, W, WHITEN, FEEDBACK, OUTPUT)
                _store_codes(uc, fc, mc, *codes, STORE_U, FEEDBACK, MANT, BIAS, FMAX, NO_INF)


@triton.jit
def _encode_kernel(
    g_ptr,
    ends_ptr,
    dinv_ptr,
    p_ptr,
    qt_ptr,
    dout_ptr,
    qo_ptr,
    pre_ptr,
    u_ptr,
    code_ptr,
    scale_ptr,
    amax_ptr,
    n_units,
    rows,
    cols,
    rank,
    rank_out,
    n_row_blocks,
    units_per_row,
    scale_row_stride,
    scale_col_stride,
    row_steps,
    slot_w,
    slot_units,
    codec_per_row,
    extra,
    window_steps,
    full_steps,
    code_ends_ptr,
    code_delta_ptr,
    code_shards,
    code_steps,
    code_at,
    scale_out_ptr,
    scale_ends_ptr,
    scale_delta_ptr,
    scale_shards,
    scale_steps,
    scale_at,
    e_ptr,
    e_new_ptr,
    UNIT_W: tl.constexpr,
    W: tl.constexpr,
    BU: tl.constexpr,
    LAYOUT: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    WHITEN: tl.constexpr,
    OUTPUT: tl.constexpr,
    STORE_U: tl.constexpr,
    PASS: tl.constexpr,
    PLACE: tl.constexpr,
    FEEDBACK: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    FMAX: tl.constexpr,
    NO_INF: tl.constexpr,
    E8M0: tl.constexpr,
):
    """The sender's pass (module doc) over this program's units: ``BU`` units of ``_units``, or with a
    row layout (``_ROW_BLOCKS``, ``_ROW_GROUPS``) column slot ``kb`` of ``row_steps`` blocks of ``BU`` rows
    (``row_steps`` is 1 for the others)."""
    factors = (g_ptr, dinv_ptr, p_ptr, qt_ptr, dout_ptr, qo_ptr, pre_ptr, u_ptr, code_ptr, scale_ptr, amax_ptr)
    tables = (code_ends_ptr, code_delta_ptr, code_shards, code_steps, code_at)
    tables += (scale_out_ptr, scale_ends_ptr, scale_delta_ptr, scale_shards, scale_steps, scale_at, e_ptr, e_new_ptr)
    pid = tl.program_id(0).to(tl.int64)
    kb = pid // n_row_blocks
    for step in range(row_steps):  # one step but with a row layout
        row = ((pid % n_row_blocks) * row_steps + step) * BU + tl.arange(0, BU)
        rmask = row < rows
        n_sets = 1
        if LAYOUT == _ROW_GROUPS:  # the groups that start in columns [kb·slot_w, (kb+1)·slot_w) of each row
            lo = row * cols + kb * slot_w
            base = row * codec_per_row  # the codec's groups of the rows above start before lo and hi
            search = (extra, window_steps, full_steps)
            first = _groups_before(ends_ptr, n_units, base + kb * slot_units, *search, lo, rmask)
            hi = lo + tl.minimum(cols - kb * slot_w, slot_w)
            after = tl.minimum(codec_per_row, (kb + 1) * slot_units)  # the codec's groups before hi in the row
            stop = _groups_before(ends_ptr, n_units, base + after, *search, hi, rmask)
            n_sets = tl.max(tl.where(rmask, stop - first, 0))
        for j in range(n_sets):  # the row's groups in turn
            if LAYOUT == _ROW_GROUPS:
                unit = first + j
                umask = rmask & (unit < stop)
                start = tl.load(ends_ptr + unit - 1, mask=umask & (unit > 0), other=0)
                length = tl.load(ends_ptr + unit, mask=umask, other=0) - start
                col0 = tl.where(umask, start - row * cols, kb * slot_w)[:, None]  # masked: the slot's own columns
                units = (start, length[:, None], row, col0, umask, unit, unit)
            elif LAYOUT == _ROW_BLOCKS:  # unit kb (UNIT_W columns) of each row: one col0 for all
                col0 = kb * UNIT_W
                length = tl.zeros([BU, 1], tl.int64) + tl.minimum(cols - col0, UNIT_W)
                scale_index = row * scale_row_stride + kb * scale_col_stride
                units = (row * cols + col0, length, row, col0, rmask, row * units_per_row + kb, scale_index)
            else:
                units = _units(
                    ends_ptr, n_units, rows, cols, units_per_row, scale_row_stride, scale_col_stride, UNIT_W, BU, LAYOUT
                )
            _encode_units(
                *factors,
                cols,
                rank,
                rank_out,
                *units,
                *tables,
                W,
                BU,
                ONE_CHUNK,
                WHITEN,
                OUTPUT,
                STORE_U,
                PASS,
                PLACE,
                FEEDBACK,
                MANT,
                BIAS,
                FMAX,
                NO_INF,
                E8M0,
            )


@triton.jit
def _add_rows(
    acc,
    code_ptr,
    scale_ptr,
    k,
    code_stride,
    scale_stride,
    flat,
    scale_index,
    mask,
    umask,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    NO_INF: tl.constexpr,
    E8M0: tl.constexpr,
):
    """``acc + x_0 + x_1 + ...`` (left to right) over the ``k`` rows of one part,
    ``x_i = fp8⁻¹(code_i) · s_i``."""
    codes = code_ptr + flat
    scales = scale_ptr + scale_index
    for _ in range(k):
        x = _fp8_value(tl.load(codes, mask=mask, other=0).to(tl.int32), MANT, BIAS, NO_INF)
        acc += x * _scale_value(tl.load(scales, mask=umask, other=1), E8M0)[:, None]
        codes += code_stride
        scales += scale_stride
    return acc


@triton.jit
def _decode_sum_kernel(
    out_ptr,
    ends_ptr,
    code0_ptr,
    scale0_ptr,
    k0,
    code_stride0,
    scale_stride0,
    code1_ptr,
    scale1_ptr,
    k1,
    code_stride1,
    scale_stride1,
    code2_ptr,
    scale2_ptr,
    k2,
    code_stride2,
    scale_stride2,
    world,
    n_units,
    rows,
    cols,
    n_row_blocks,
    units_per_row,
    scale_row_stride,
    scale_col_stride,
    AVERAGE: tl.constexpr,
    UNIT_W: tl.constexpr,
    W: tl.constexpr,
    BU: tl.constexpr,
    LAYOUT: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    NO_INF: tl.constexpr,
    E8M0: tl.constexpr,
    BF16: tl.constexpr,
):
    """``out = Σ_i dec(code_i, s_i) [÷ world]`` (module doc) in ``out``'s dtype. Bytes (essential):
    reads every rank's codes (1 per element) and scales once, writes ``out`` once."""
    start, length, row, col0, umask, unit, scale_index = _units(
        ends_ptr, n_units, rows, cols, units_per_row, scale_row_stride, scale_col_stride, UNIT_W, BU, LAYOUT
    )
    n_chunks = _n_chunks(length, W, ONE_CHUNK)
    for ch in range(n_chunks):
        _, flat, mask = _chunk(start, length, umask, ch, W)
        acc = tl.full([BU, W], -0.0, tl.float32)
        acc = _add_rows(
            acc,
            code0_ptr,
            scale0_ptr,
            k0,
            code_stride0,
            scale_stride0,
            flat,
            scale_index,
            mask,
            umask,
            MANT,
            BIAS,
            NO_INF,
            E8M0,
        )
        acc = _add_rows(
            acc,
            code1_ptr,
            scale1_ptr,
            k1,
            code_stride1,
            scale_stride1,
            flat,
            scale_index,
            mask,
            umask,
            MANT,
            BIAS,
            NO_INF,
            E8M0,
        )
        acc = _add_rows(
            acc,
            code2_ptr,
            scale2_ptr,
            k2,
            code_stride2,
            scale_stride2,
            flat,
            scale_index,
            mask,
            umask,
            MANT,
            BIAS,
            NO_INF,
            E8M0,
        )
        if AVERAGE:
            acc = tl.math.div_rn(acc, tl.full(acc.shape, 1.0, tl.float32) * world)
        _store_as(out_ptr + flat, acc, mask, BF16)


@triton.jit
def _project_kernel(
    x_ptr,
    row_ptr,
    mat_ptr,
    live,
    d_ptr,
    q_ptr,
    coef_ptr,
    out_ptr,
    rows,
    cols,
    rank,
    dout_ptr,
    qo_ptr,
    co_ptr,
    part_ptr,
    rank_out,
    n_rb,
    k_span,
    SCALE_D: tl.constexpr,
    PROJECT: tl.constexpr,
    OUTPUT: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
    BO: tl.constexpr,
    ROW_INDEX: tl.constexpr,
):
    """``out = ((X D) Q) diag(coef)`` ([rows, r]; ``D = diag(d)`` when ``SCALE_D``, else ``I``) where
    ``PROJECT``; with ``ROW_INDEX`` (``RowsAt``) row ``m`` of ``X`` at ``x_ptr + row_ptr[m]`` (padding where
    negative) and ``D``, ``Q`` and ``coef`` those of matrix ``mat_ptr[m]`` of stacks of them (the same for the
    block's ``BM`` rows; ``live`` rows are not padding, which only the meter reads), else row ``m`` at
    ``m·cols``. With ``OUTPUT`` (the output side's ``T_outᵀ``, ``X`` the whole parameter) from the same read
    of ``X``: ``out``'s rows scaled by ``D_out^{-1/2}`` (the projection of ``D_out^{-1/2} X``)
    and this program's share of ``Pre D = c_out ⊙ Q_outᵀ D_out^{-1/2} X D``, its ``BM`` rows' sum
    ``(D_out^{-1/2} Q_out c_out)[m]ᵀ X[m] D``, written as ``part[program] [r_out, cols]`` (the
    programs' parts summed in order after the launch: deterministic, no atomics).

    True FP32 on purpose: ``tl.dot(..., input_precision="ieee")`` never uses TF32, whereas
    ``torch.matmul`` in FP32 does on CUDA wherever ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` (NGC
    images) whatever torch's flags say (~10 mantissa bits in ``P``, hence in ``G T``). FP64
    through torch would need an FP64 copy of ``X`` (8 B/element); this reads ``X`` once, a program
    per ``BM`` rows looping over ``k_span`` columns (split ``ks``: its part of ``out`` at ``out[ks]``,
    ``[splits, rows, r]``, summed after the launch; one split with ``OUTPUT``)."""
    pid = tl.program_id(0).to(tl.int64)
    ks = pid // n_rb
    m = (pid % n_rb) * BM + tl.arange(0, BM)
    j = tl.arange(0, BR)
    mmask, jmask = m < rows, j < rank
    acc = tl.zeros([BM, BR], tl.float32)
    if OUTPUT:
        o = tl.arange(0, BO)
        omask = o < rank_out
        dm = tl.load(dout_ptr + m, mask=mmask, other=0.0)
        qo = tl.load(qo_ptr + m[:, None] * rank_out + o[None, :], mask=mmask[:, None] & omask[None, :], other=0.0)
        qot = tl.trans(qo * dm[:, None] * tl.load(co_ptr + o, mask=omask, other=0.0)[None, :])  # [BO, BM]
    if ROW_INDEX:
        row0 = tl.load(row_ptr + m, mask=mmask, other=-1)
        mmask = mmask & (row0 >= 0)
        mat = tl.load(mat_ptr + (pid % n_rb) * BM)  # the block's first row exists
        d_ptr += mat * cols
        q_ptr += mat * cols * rank
        coef_ptr += mat * rank
    else:
        row0 = m * cols
    k_end = tl.minimum(cols, (ks + 1) * k_span)
    for k0 in range(ks * k_span, k_end, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < k_end
        x = tl.load(x_ptr + row0[:, None] + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        x = x.to(tl.float32)
        if SCALE_D:
            x = x * tl.load(d_ptr + k, mask=kmask, other=0.0)[None, :]
        if OUTPUT:
            part = tl.dot(qot, x, input_precision="ieee")
            tl.store(
                part_ptr + (pid * rank_out + o[:, None]) * cols + k[None, :], part, mask=omask[:, None] & kmask[None, :]
            )
        if PROJECT:
            q = tl.load(q_ptr + k[:, None] * rank + j[None, :], mask=kmask[:, None] & jmask[None, :], other=0.0)
            acc = tl.dot(x, q, acc, input_precision="ieee")
    if PROJECT:
        acc = acc * tl.load(coef_ptr + j, mask=jmask, other=0.0)[None, :]
        if OUTPUT:
            acc = acc * dm[:, None]
        tl.store(out_ptr + (ks * rows + m[:, None]) * rank + j[None, :], acc, mask=mmask[:, None] & jmask[None, :])


@triton.jit
def _unwhiten_kernel(
    u_ptr,
    out_ptr,
    dsqrt_ptr,
    p_ptr,
    qt_ptr,
    rows,
    cols,
    rank,
    n_row_blocks,
    row_steps,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BF16: tl.constexpr,
):
    """``out = (S + P' Qᵀ) D^{1/2}`` of FP32 ``S`` (``u_ptr``), written in ``out``'s dtype (``out``
    may be ``S`` itself), a program taking ``BLOCK_C`` columns of ``row_steps`` blocks of ``BLOCK_R``
    rows (they share its loads of ``Qᵀ`` and ``D^{1/2}``). Bytes: reads ``S`` (4 per element) and ``P'``,
    writes ``out``."""
    pid = tl.program_id(0)
    c = (pid // n_row_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    cmask = c < cols
    d = tl.load(dsqrt_ptr + c, mask=cmask, other=0.0)
    for step in range(row_steps):
        r = ((pid % n_row_blocks).to(tl.int64) * row_steps + step) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < rows
        mask = rmask[:, None] & cmask
        offs = r[:, None] * cols + c
        u = _plus_low_rank(tl.load(u_ptr + offs, mask=mask, other=0.0), p_ptr, qt_ptr, r, c, rmask, cmask, rank, cols)
        _store_as(out_ptr + offs, u * d, mask, BF16)


def _fmt_args(cfg: CodecConfig, kernel: str) -> dict:
    """The format's constants from its table entry; a format whose entry does not name ``kernel`` is
    refused (the bit manipulation above is that of 8-bit IEEE-like codes)."""
    fmt = cfg.fmt
    if kernel not in fmt.kernels:
        raise ValueError(f"the Triton {kernel} does not implement the {fmt.name} wire format (WireFormat.kernels)")
    return dict(MANT=fmt.mantissa_bits, BIAS=fmt.exponent_bias, NO_INF=not fmt.has_inf, E8M0=cfg.scaling is Scaling.MX)


@dataclass(frozen=True)
class _Tiling:
    """The units of an ``[rows, cols]`` matrix (module doc) and the programs over them."""

    layout: int  # _ORDERED, _ROW_BLOCKS, _GROUPS or _ROW_GROUPS
    unit_w: int  # columns of a unit of the matrix codec
    w: int  # elements of a chunk
    bu: int  # units of a program (of each of its row blocks with a row layout)
    n_units: int
    n_row_blocks: int  # programs down the rows of a row layout
    units_per_row: int  # of the matrix codec; a row layout's column slots
    scale_strides: tuple[int, int]  # where unit (row, block) of the matrix codec finds its scale
    row_steps: int = 1  # blocks of bu rows of a row layout's program
    slot_w: int = 0  # columns of a _ROW_GROUPS slot: _slot_width's (a whole row for ROW scaling)
    codec_per_row: int = 1  # the matrix codec's groups in a row (_ROW_GROUPS' search windows)
    slot_units: int = 1  # the matrix codec's groups in a _ROW_GROUPS slot

    @classmethod
    def of(
        cls, cfg: CodecConfig, rows: int, cols: int, n_groups: int | None, row_blocks: bool = False, rank: int = 0
    ) -> _Tiling:
        """``n_groups``: the number of ``lengths`` groups, None for the matrix codec's;
        ``row_blocks``: a program's units share their columns (for whitening's loads), whose rank
        (``r``, plus ``r_out`` two-sided) sizes ``_ROW_GROUPS``' slots."""
        per_group = cfg.scaling in (Scaling.BLOCK, Scaling.MX)
        unit_w = cfg.block if per_group else TILE
        upr = triton.cdiv(cols, unit_w)
        strides = {Scaling.TENSOR: (0, 0), Scaling.ROW: (1, 0)}.get(cfg.scaling, (upr, 1))
        w = min(triton.next_power_of_2(unit_w), MAX_TILE)  # a ROW group with lengths: chunks of TILE
        if not row_blocks:
            layout, n_units = (_ORDERED.value, rows * upr) if n_groups is None else (_GROUPS.value, n_groups)
            bu = max(1, min(TILE_ELEMENTS // w, MAX_UNITS, triton.next_power_of_2(n_units)))
            return cls(layout, unit_w, w, bu, n_units, triton.cdiv(rows, bu), upr, strides)
        layout, n_units, slot_w = _ROW_BLOCKS.value, rows * upr, 0
        codec_per_row, slot_units = (upr if per_group else 1), 1
        bu = max(1, min(TILE_ELEMENTS // w, 16, triton.next_power_of_2(rows)))
        if n_groups is not None:
            slot_w = _slot_width(unit_w, rows, cols, bu, rank) if per_group else cols
            slot_units = slot_w // unit_w if per_group else 1
            layout, n_units, upr = _ROW_GROUPS.value, n_groups, triton.cdiv(cols, slot_w)
        blocks = triton.cdiv(rows, bu)
        steps = max(1, min(ROW_STEPS, blocks, blocks * upr // ROW_PROGRAMS))
        n_row_blocks = triton.cdiv(blocks, steps)
        return cls(layout, unit_w, w, bu, n_units, n_row_blocks, upr, strides, steps, slot_w, codec_per_row, slot_units)

    @property
    def programs(self) -> int:
        if self.layout in (_ROW_BLOCKS.value, _ROW_GROUPS.value):
            return self.n_row_blocks * self.units_per_row
        return triton.cdiv(self.n_units, self.bu)

    @property
    def one_chunk(self) -> bool:
        """Whether every unit fits one chunk (known for the matrix codec's units only)."""
        return self.layout not in (_GROUPS.value, _ROW_GROUPS.value) and self.unit_w <= self.w

    def args(self) -> tuple:
        """The kernels' arguments after ``(n_units, rows, cols[, rank])``."""
        return (self.n_row_blocks, self.units_per_row, *self.scale_strides)

    def row_args(self, rows: int) -> tuple:
        """The encode kernel's arguments after ``args()``: a row layout's ``row_steps``, ``slot_w``, the
        codec's groups in a slot and in a row; the groups beyond the codec's (``extra``: cuts) and the
        halvings of ``_groups_before``'s two searches."""
        extra = max(0, self.n_units - rows * self.codec_per_row) if self.layout == _ROW_GROUPS.value else 0
        steps = (extra.bit_length(), self.n_units.bit_length())
        return (self.row_steps, self.slot_w, self.slot_units, self.codec_per_row, extra, *steps)

    def constexprs(self) -> dict:
        return dict(UNIT_W=self.unit_w, W=self.w, BU=self.bu, LAYOUT=self.layout, ONE_CHUNK=self.one_chunk)


def _ends(lengths: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    """Inclusive cumsum of ``lengths`` (int64, on the device: one launch); ``fallback`` where there
    are none (a pointer the kernels do not read)."""
    return fallback if lengths is None else torch.cumsum(lengths, 0, dtype=torch.int64)


def project_options(bm: int, br: int, output: bool, bk: int = 0) -> dict:
    """Launch options of a ``_project_kernel``: 8 warps where its ``[BM, BR]`` accumulator or its ``[BM, BK]``
    tile of ``X`` has 4096 elements or more, or with ``OUTPUT`` (at 4 warps ptxas chose 32 registers and
    spilled ~5 KB with ``OUTPUT``, 8 B at BM = BK = 64; ``bench/compile.py``); with ``OUTPUT`` up to 255
    registers (left to itself sm_100a's ptxas held BM = 64 to 128 and spilled 4 B at i64 sizes; 147, none)."""
    if output:
        return dict(num_warps=8, maxnreg=255)
    return dict(num_warps=8 if bm * max(br, bk) >= 4096 else 4)


PROJECT_ROWS = 128  # rows of a _project program: they share its loads of Q (4·r/128 B per element of X)
PROJECT_PROGRAMS = 128  # programs _project keeps where the columns allow (~one per SM), splitting the columns


def _project(
    x: torch.Tensor, d: torch.Tensor | None, q: torch.Tensor, coef: torch.Tensor, rows_at: RowsAt | None = None
) -> torch.Tensor:
    """``((X diag(d)) Q) diag(coef)`` ``[rows, r]`` in FP32 (``_project_kernel``): one launch, plus the sum
    of the column splits' parts (in split order) where the rows alone give fewer than ``PROJECT_PROGRAMS``.
    With ``rows_at`` (``RowsAt``) ``x`` is its buffer and ``d``, ``q``, ``coef`` stacks of its matrices'
    (padding rows' projections left unset)."""
    rows, cols = x.shape if rows_at is None else rows_at.shape
    rank = q.shape[-1]
    bm = max(16, min(PROJECT_ROWS, triton.next_power_of_2(rows)))
    br = max(16, triton.next_power_of_2(rank))
    bk = max(16, min(64, 4096 // max(bm, br)))
    n_rb, chunks = triton.cdiv(rows, bm), triton.cdiv(cols, bk)
    k_span = triton.cdiv(chunks, max(1, min(chunks, PROJECT_PROGRAMS // n_rb))) * bk
    splits = triton.cdiv(cols, k_span)
    out = torch.empty(splits, rows, rank, device=x.device)
    _project_kernel[(n_rb * splits,)](
        x,
        *RowsAt.kernel_args(x, rows, rows_at),
        d if d is not None else x,
        q,
        coef,
        out,
        rows,
        cols,
        rank,
        x,
        x,
        x,
        x,
        0,
        n_rb,
        k_span,
        SCALE_D=d is not None,
        PROJECT=True,
        OUTPUT=False,
        BM=bm,
        BK=bk,
        BR=br,
        BO=16,
        ROW_INDEX=rows_at is not None,
        **project_options(bm, br, False, bk),
    )
    return out[0] if splits == 1 else out.sum(0)


OUTPUT_ROWS = 64  # rows of a program that also sums its share of Pre: its parts are r_out/64 of X's size (at 128
# rows and 32 columns a step it spilled 1-5 KB at rank 32, ``bench/compile.py``; 64 x 16: none)
OUTPUT_COLS = 16  # columns of such a program's step


def _project_two_sided(g: torch.Tensor, whitening: LowRankWhitening | None, output: OutputRows) -> tuple:
    """``(P, Pre T)`` of ``U = T_outᵀ G T`` (``T = whitening``, ``I`` when None) from one read of ``G`` (the
    whole parameter): ``P = D_out^{-1/2} G D^{-1/2} Q diag(c)`` ``[rows, r]`` (None without a whitening
    of rank > 0) and ``Pre T``, ``Pre = c_out ⊙ Q_outᵀ D_out^{-1/2} G`` ``[r_out, cols]`` (module doc):
    ``_project_kernel``'s ``OUTPUT`` pass (its parts of ``Pre D^{-1/2}``), their sum, and with ``Q``
    ``Pre T = Pre D^{-1/2} + (Pre D^{-1/2} Q c) Qᵀ``: a ``_project`` and an ``addmm_``, all small."""
    rows, cols = g.shape
    r_out = output.rank
    project = whitening is not None and whitening.rank > 0
    dinv = whitening.d_inv_sqrt if whitening is not None else g
    q, c = (whitening.q, whitening.c) if project else (g, g)
    rank = q.shape[1] if project else 0
    bm = max(16, min(OUTPUT_ROWS, triton.next_power_of_2(rows)))
    programs = triton.cdiv(rows, bm)
    part = torch.empty(programs, r_out, cols, device=g.device)
    p = torch.empty(rows, rank, device=g.device) if project else g
    br = max(16, triton.next_power_of_2(rank))
    _project_kernel[(programs,)](
        g,
        g,
        g,
        rows,
        dinv,
        q,
        c,
        p,
        rows,
        cols,
        rank,
        output.d_inv_sqrt,
        output.q,
        output.c,
        part if r_out else g,
        r_out,
        programs,
        cols,
        SCALE_D=whitening is not None,
        PROJECT=project,
        OUTPUT=True,
        BM=bm,
        BK=OUTPUT_COLS,
        BR=br,
        BO=max(16, triton.next_power_of_2(r_out)),
        ROW_INDEX=False,
        **project_options(bm, br, True),
    )
    pre = part.sum(0)
    if project and r_out:
        with ieee_fp32(g.device):
            pre.addmm_(_project(pre, None, q, c), q.T)
    return (p if project else None), pre


def _table(place, fallback: torch.Tensor) -> tuple:
    """``(out, ends, delta, shards, steps, at)`` of a ``kernels.Place`` for the kernels (``fallback``
    pointers and zeros without one: not read)."""
    if place is None:
        return fallback, fallback, fallback, 0, 0, 0
    ends = place.table.ends
    return place.out, ends, place.table.delta, ends.numel(), ends.numel().bit_length(), place.at


def encode_options(transform: bool, layout: int) -> dict:
    """Launch options of an ``_encode_kernel``: 8 warps where a transform's ``Qᵀ`` is read at each unit's own
    columns (``_GROUPS``, ``_ROW_GROUPS``), whose per-element addresses spilled registers at 4 (16-668 B,
    ``bench/compile.py``), 4 elsewhere; and ``maxnreg`` 255, without which ptxas held the 8-warp MX maxima pass
    to 128 registers and spilled 16-20 B. Each element's ``U`` and each unit's maximum are the same whatever
    the warps, so the codes are too."""
    return dict(num_warps=8 if transform and layout in (_GROUPS.value, _ROW_GROUPS.value) else 4, maxnreg=255)


def sender_factors(
    g: torch.Tensor,
    whitening: LowRankWhitening | None,
    output: OutputRows | None,
    rows_at: RowsAt | None = None,
) -> tuple:
    """What the sender's pass over ``g`` (the whole parameter with ``output``) reads besides ``G``:
    ``(D_in^{-1/2}, P, Q_inᵀ, r_in)`` of ``T_in`` and ``(D_out^{-1/2}, Q_out, Pre T_in, r_out)`` of
    ``T_out`` (module doc; with ``output`` both from ``_project_two_sided``); ``g`` for the pointers
    of a side not given (not read). ``rows_at``: ``g`` its buffer, ``whitening`` its matrices' stacked
    (``RowsAt``; no ``output``)."""
    p, out_side = None, (g, g, g, 0)
    if output is not None:
        p, pre = _project_two_sided(g, whitening, output)
        out_side = (output.d_inv_sqrt, output.q, pre if output.rank else g, output.rank)
    elif whitening is not None and whitening.rank:
        p = _project(g, whitening.d_inv_sqrt, whitening.q, whitening.c, rows_at)
    if whitening is None:
        return (g, g, g, 0), out_side
    return (whitening.d_inv_sqrt, g if p is None else p, whitening.q_t, whitening.rank), out_side


def whiten_encode(
    g: torch.Tensor,
    whitening: LowRankWhitening | None,
    cfg: CodecConfig,
    out: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    into=None,
    feedback: tuple[torch.Tensor, torch.Tensor] | None = None,
    output: OutputRows | None = None,
    groups: tuple[torch.Tensor, int] | None = None,
) -> Encoded | None:
    """See ``kernels.whiten_encode``. Launches: ``G Q`` with whitening (with ``output``: ``sender_factors``'
    few), then one pass (BLOCK, ROW with ``lengths``) or two (the others, with a few small ops on the
    groups' maxima between them), whatever ``g``'s size and the table's.

    ``groups = (group, n)``, TENSOR scaling with ``lengths``: ``lengths`` are units of ``n`` per-tensor
    groups cut smaller (``kernels.TensorUnits``), unit ``u`` in group ``group[u]``; two passes, the units'
    maxima reduced to their groups' between them, every unit encoded with its group's scale. The ``n``
    group scales are returned, with ``into`` too (its scales table then receives the units' copies).

    Essential bytes per element of ``G`` (BLOCK 1x128, FP32 scales): reads ``G`` once (2 B for BF16,
    4 for FP32; GIFT reads it twice, for ``G Q`` and for the pass, and so does the two-sided map,
    ``Pre`` then coming from the first read), writes 1 B of code and 4/128 B of scale; error feedback
    adds 4 B read (``e``) and 4 B written (``e'``); two passes read ``G`` (and ``e``) once more."""
    rows, cols = g.shape
    fmt_args = _fmt_args(cfg, "whiten_encode")
    g = (g if g.dtype in _READ_DTYPES else g.float()).contiguous()
    n_groups = None if lengths is None else lengths.numel()
    rank = (whitening.rank if whitening is not None else 0) + (output.rank if output is not None else 0)
    tiling = _Tiling.of(cfg, rows, cols, n_groups, row_blocks=whitening is not None or output is not None, rank=rank)
    ends = _ends(lengths, g)
    payload = into.codes.out if into is not None else torch.empty(rows, cols, dtype=torch.uint8, device=g.device)
    u_out = out if out is None or out.is_contiguous() else torch.empty(rows, cols, device=g.device)
    residual, new_residual = feedback if feedback is not None else (g, g)
    codes_table = _table(None if into is None else into.codes, g)[1:]
    transform, out_side = sender_factors(g, whitening, output)

    options = encode_options(whitening is not None or output is not None, tiling.layout)

    def launch(pass_: tl.constexpr, scales: torch.Tensor, amax: torch.Tensor = g, fusion: bool = False) -> None:
        scales_table = _table(None if into is None else into.scales, scales)
        _encode_kernel[(tiling.programs,)](
            g,
            ends,
            *transform[:3],
            *out_side[:3],
            u_out if out is not None else g,
            payload,
            scales,
            amax,
            tiling.n_units,
            rows,
            cols,
            transform[3],
            out_side[3],
            *tiling.args(),
            *tiling.row_args(rows),
            *codes_table,
            *scales_table,
            residual,
            new_residual,
            WHITEN=whitening is not None,
            OUTPUT=output is not None,
            STORE_U=out is not None,
            PASS=pass_.value,
            PLACE=into is not None,
            FEEDBACK=feedback is not None,
            FMAX=cfg.fmt.max,
            enable_fp_fusion=fusion and feedback is None,
            **options,
            **tiling.constexprs(),
            **fmt_args,
        )

    # One pass where a unit's maximum is its group's and the scale FP32: BLOCK, or groups given by lengths.
    if cfg.scaling is Scaling.BLOCK or (n_groups is not None and cfg.scaling is not Scaling.MX and groups is None):
        # Placed, the scales go straight to the buffer (the scales argument is then not read).
        scales = (
            into.scales.out
            if into is not None
            else torch.empty(tiling.n_units, dtype=cfg.scale_dtype(), device=g.device)
        )
        # FMA contraction only where U is computed once (and, with feedback, never: e' is
        # rounded as the reference rounds it).
        launch(_ONE_PASS, scales, fusion=tiling.one_chunk)
    else:  # two passes, without FMA contraction so that both compute the same U bit for bit
        # zeros for per-tensor units: an empty unit may be taken by no program
        amax = (torch.zeros if groups is not None else torch.empty)(tiling.n_units, device=g.device)
        launch(_AMAX, g, amax)
        if groups is not None:  # the units' maxima reduced to their per-tensor groups'
            amax = torch.zeros(groups[1], device=g.device).scatter_reduce_(0, groups[0], amax, "amax")
        elif n_groups is None and cfg.scaling is Scaling.ROW:
            amax = amax.view(rows, tiling.units_per_row).amax(dim=1)
        elif n_groups is None and cfg.scaling is Scaling.TENSOR:
            amax = amax.amax().reshape(1)
        scales = scales_from_amax(amax, cfg)
        launch(_ENCODE, scales if groups is None else scales[groups[0]])  # each unit its group's scale
    if u_out is not out:
        out.copy_(u_out)
    if into is not None and groups is None:
        return None
    return Encoded(payload=payload, scales=scales if n_groups is not None else scales.view(cfg.groups(rows, cols)))


# -- Memory traffic of each launch (the launch meter, ``testing/meter.py``) -------------------------
# ``TRAFFIC[kernel name](args) -> (bytes read, bytes written)``: ``args`` are a launch's bound
# arguments by parameter name (tensors, scalars, constexprs) plus ``"grid"``. Each byte of a tensor
# counts once per launch (re-reads inside a program, e.g. of D, Q or a unit's later chunks, are
# cache hits); sizes come from the scalar arguments, element sizes from the tensors' dtypes.
# Whoever adds or changes a kernel updates its entry in the same commit.


def _scale_count(a: dict) -> int:
    """Distinct scales a launch addresses (per rank for a decode): one per unit of ``lengths`` or the
    matrix codec's blocks, one per row (ROW), one (TENSOR)."""
    if a["LAYOUT"] in (_GROUPS.value, _ROW_GROUPS.value):
        return a["n_units"]
    return {(0, 0): 1, (1, 0): a["rows"]}.get((a["scale_row_stride"], a["scale_col_stride"]), a["n_units"])


def _encode_traffic(a: dict) -> tuple[int, int]:
    """``(bytes read, bytes written)`` of one ``_encode_kernel`` launch from its bound arguments: ``G``
    (and ``e``) once per pass; with whitening (a row layout) what each program loads: its slot's
    columns of ``D^{-1/2}`` and ``Qᵀ`` (and ``Pre T``), its rows of ``P`` (and ``D_out^{-1/2}``, ``Q_out``);
    the group ends (with ``_ROW_GROUPS`` two binary searches per row); each unit's stored scale
    (second pass) and table lookups; the codes, scales or maxima, ``U`` and ``e'``."""
    n, units, rank, r_out = a["rows"] * a["cols"], a["n_units"], a["rank"], a["rank_out"]
    read = n * a["g_ptr"].element_size() + (4 * n if a["FEEDBACK"] else 0)
    down, across = a["n_row_blocks"] * a["cols"], a["units_per_row"] * a["rows"]  # slot columns, program rows
    if a["WHITEN"]:
        read += 4 * (down * (1 + rank) + across * rank)
    if a["OUTPUT"]:
        read += 4 * (down * r_out + across * (1 + r_out))
    if a["LAYOUT"] == _GROUPS.value:
        read += 8 * units
    if a["LAYOUT"] == _ROW_GROUPS.value:  # each unit's ends; the searches' windows (around them)
        read += 8 * (units + a["grid"][0] * 2 * a["window_steps"])
    if a["PLACE"]:  # the two tables (their lookups hit the cache)
        read += 16 * (a["code_shards"] + a["scale_shards"])
    if a["PASS"] == _AMAX.value:
        return read, 4 * units
    written = n + (4 * n if a["STORE_U"] else 0) + (4 * n if a["FEEDBACK"] else 0)
    scale_size = a["scale_out_ptr"].element_size()
    scales = _scale_count(a)  # each distinct scale once (a row's units share it)
    if a["PASS"] == _ENCODE.value:
        read += scales * a["scale_ptr"].element_size()
        written += scales * scale_size if a["PLACE"] else 0
    else:
        written += scales * scale_size
    return read, written


def _rows(t: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Parts as ``[k, m]`` tensors with inner stride 1 (rows strided); one tensor may be ``[k, ...]``."""
    parts = [t.reshape(t.shape[0], -1)] if isinstance(t, torch.Tensor) else list(t)
    return [p if p.stride(1) == 1 or p.numel() == 0 else p.contiguous() for p in parts]


def outputs(
    rows: int, cols: int, whitening: LowRankWhitening | None, out: torch.Tensor | None, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, out)`` of a decode: ``out`` (a new FP32 ``[rows, cols]`` when None; else a contiguous
    float tensor of ``rows·cols`` elements, viewed so) and where the FP32 sum goes: ``out`` itself,
    unless ``T⁻¹`` follows and ``out`` is narrower than FP32 (``P' = S Q`` needs ``S`` in FP32)."""
    if out is None:
        out = torch.empty(rows, cols, device=device)
    elif not out.is_contiguous() or out.numel() != rows * cols or out.dtype not in _READ_DTYPES:
        raise ValueError(
            f"a decode writes a contiguous FP32/BF16/FP16 [{rows}, {cols}], got {out.dtype} {tuple(out.shape)}"
        )
    out = out.view(rows, cols)
    narrow = whitening is not None and out.dtype != torch.float32
    return (torch.empty(rows, cols, device=device) if narrow else out), out


def unwhiten(s: torch.Tensor, out: torch.Tensor, whitening: LowRankWhitening | None) -> torch.Tensor:
    """``out ← S T⁻¹`` of the FP32 sum ``S`` (``out`` may be ``S``; ``out``'s dtype): two launches."""
    if whitening is not None:
        rows, cols = s.shape
        p = _project(s, None, whitening.q, whitening.c_inv) if whitening.rank else s
        block_r = min(16, triton.next_power_of_2(rows))
        blocks, col_blocks = triton.cdiv(rows, block_r), triton.cdiv(cols, TILE)
        steps = max(1, min(ROW_STEPS, blocks, blocks * col_blocks // ROW_PROGRAMS))
        n_rb = triton.cdiv(blocks, steps)
        dest, bf16 = store_arg(out)
        _unwhiten_kernel[(n_rb * col_blocks,)](
            s,
            dest,
            whitening.d_sqrt,
            p,
            whitening.q_t,
            rows,
            cols,
            whitening.rank,
            n_rb,
            steps,
            BLOCK_R=block_r,
            BLOCK_C=TILE,
            BF16=bf16,
            enable_fp_fusion=True,
        )
    return out


def decode_sum_unwhiten(
    payloads: torch.Tensor | Sequence[torch.Tensor],
    scales: torch.Tensor | Sequence[torch.Tensor],
    rows: int,
    cols: int,
    whitening: LowRankWhitening | None,
    cfg: CodecConfig,
    average: bool,
    lengths: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See ``kernels.decode_sum_unwhiten``: one to ``MAX_PARTS`` non-empty parts, one launch for the
    rank sum (+ a cumsum with ``lengths``, + two with whitening), written in ``out``'s dtype."""
    parts = [(p, s) for p, s in zip(_rows(payloads), _rows(scales)) if p.shape[0] > 0]
    world = sum(p.shape[0] for p, _ in parts)
    device = parts[0][0].device
    tiling = _Tiling.of(cfg, rows, cols, None if lengths is None else lengths.numel())
    acc, out = outputs(rows, cols, whitening, out, device)
    unused = (parts[0][0], parts[0][1], 0, 0, 0)
    part_args = [a for p, s in parts for a in (p, s, p.shape[0], p.stride(0), s.stride(0))]
    part_args += [a for _ in range(MAX_PARTS - len(parts)) for a in unused]
    # No FMA contraction: each rank's value q·s is rounded before it is added, as in the reference.
    dest, bf16 = store_arg(acc)
    _decode_sum_kernel[(tiling.programs,)](
        dest,
        _ends(lengths, acc),
        *part_args,
        world,
        tiling.n_units,
        rows,
        cols,
        *tiling.args(),
        AVERAGE=average,
        BF16=bf16,
        enable_fp_fusion=False,
        **tiling.constexprs(),
        **_fmt_args(cfg, "decode_sum_unwhiten"),
        **DECODE_OPTIONS,
    )
    return unwhiten(acc, out, whitening)


def _decode_sum_traffic(a: dict) -> tuple[int, int]:
    n, ranks = a["rows"] * a["cols"], a["k0"] + a["k1"] + a["k2"]
    read = ranks * (n * a["code0_ptr"].element_size() + _scale_count(a) * a["scale0_ptr"].element_size())
    read += a["ends_ptr"].element_size() * a["n_units"] if a["LAYOUT"] == _GROUPS.value else 0
    return read, n * a["out_ptr"].element_size()


def _unwhiten_traffic(a: dict) -> tuple[int, int]:
    """``S`` once; what each program loads: its columns of ``D^{1/2}`` and ``Qᵀ``, its rows of ``P'``; ``out``."""
    n, rows, cols, rank = a["rows"] * a["cols"], a["rows"], a["cols"], a["rank"]
    col_blocks = -(-cols // a["BLOCK_C"])
    read = n * a["u_ptr"].element_size() + 4 * (a["n_row_blocks"] * cols * (1 + rank) + col_blocks * rows * rank)
    return read, n * a["out_ptr"].element_size()


def _project_traffic(a: dict) -> tuple[int, int]:
    """``X`` once; what each program loads: its columns of ``Q`` (and ``D``) with ``PROJECT``, its rows of
    ``T_out`` with ``OUTPUT``; the splits' parts of ``P`` and the programs' parts of ``Pre``."""
    rows, cols, rank, r_out, programs = a["rows"], a["cols"], a["rank"], a["rank_out"], a["grid"][0]
    live = a["live"] if a["ROW_INDEX"] else rows  # a RowsAt's padding rows move nothing
    down = a["n_rb"] * cols  # every program row block reads each column once
    read, written = live * cols * a["x_ptr"].element_size() + (4 * down if a["SCALE_D"] else 0), 0
    if a["ROW_INDEX"]:  # each split reads the row starts, each program its block's matrix
        read += 8 * rows * (programs // a["n_rb"]) + 8 * programs
    if a["PROJECT"]:
        read += 4 * (down * rank + programs * rank)
        written += 4 * (programs // a["n_rb"]) * live * rank
    if a["OUTPUT"]:
        read += 4 * (rows * (1 + r_out) + programs * r_out)
        written += 4 * programs * r_out * cols
    return read, written


TRAFFIC = {
    "_encode_kernel": _encode_traffic,
    "_decode_sum_kernel": _decode_sum_traffic,
    "_project_kernel": _project_traffic,
    "_unwhiten_kernel": _unwhiten_traffic,
}
