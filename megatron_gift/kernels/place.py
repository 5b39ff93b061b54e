"""Triton kernel of the placed cast (imports triton; see the package docstring for when it runs).

``whiten_place`` writes ``X [rows, cols]`` (``G T`` where a whitening is given: ``U = X D^{-1/2} +
P Qᵀ`` with ``P = X (D^{-1/2} Q) diag(c)`` from ``fused._project_kernel``; with an output side
``T_outᵀ X T = D_out^{-1/2} X D^{-1/2} + Q_out (Pre T) + P Qᵀ`` as ``fused``'s module doc has it, the
small factors from ``fused.sender_factors``), cast to the buffer's dtype, straight into a buffer of
messages: element ``k = at + i`` of the source goes to ``k + delta[j]``, ``j`` the table's shard of
``k`` (``fused._shard_delta``, per element: a tile may cross a shard boundary anywhere). It serves
the float intra-node wire of the two-level exchange (BF16/FP32 ``U``) and the plain values (``off``:
a copy in the bucket's dtype, ``bf16``: a cast). The cast is the hardware's round-to-nearest-even, as
torch's ``.to``; without whitening the values are read and cast as they are, so the result is bit for
bit the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics.two_sided import OutputRows
from ..numerics.whitening import LowRankWhitening
from .fused import ROW_PROGRAMS, ROW_STEPS, TILE, _plus_low_rank, _shard_delta, sender_factors
from .placement import RowsAt

FLAT_TILE = 1024  # elements of a program without whitening (the values as one row)
# ptxas held the unwhitened placed cast to 96 registers and spilled 4 B with 32-bit sizes; 255 allowed: 111, none
# (``bench/compile.py``; the whitened ones use 164-188 either way)
PLACE_OPTIONS = dict(maxnreg=255)
ROWS = 16  # rows of a block with whitening (a program's blocks share its loads of D and Q), TILE columns


# What _place_kernel does to a value: nothing (out has x's dtype), to FP32, to BF16.
_COPY, _TO_FP32, _TO_BF16 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _bf16(x):
    """BF16 of FP32 ``x`` as torch's CPU cast makes it: round to nearest, ties to even, on the bits
    (the interpreter's own cast truncates); NaN is 0x7FC0."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _place_kernel(
    x_ptr,
    row_ptr,
    mat_ptr,
    live,
    dinv_ptr,
    p_ptr,
    qt_ptr,
    dout_ptr,
    qo_ptr,
    pre_ptr,
    out_ptr,
    ends_ptr,
    delta_ptr,
    shards,
    steps,
    at,
    rows,
    cols,
    rank,
    rank_out,
    n_row_blocks,
    row_steps,
    WHITEN: tl.constexpr,
    OUTPUT: tl.constexpr,
    CAST: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROW_INDEX: tl.constexpr,
):
    """``row_steps`` tiles of ``BLOCK_R x BLOCK_C`` of ``X`` down the same columns (``U`` with ``WHITEN``,
    ``T_outᵀ X T`` with ``OUTPUT``; they share the program's loads of ``D`` and ``Qᵀ``) at their placed
    positions in ``out``: as it is (``_COPY``: the same dtype), in FP32, or in BF16 (``_bf16``). With
    ``ROW_INDEX`` (``RowsAt``) row ``i`` of ``X`` is read at ``x_ptr + row_ptr[i]`` (padding where negative),
    ``D`` and ``Qᵀ`` those of matrix ``mat_ptr[i]`` of stacks of them (one per block of rows; ``live``: the
    rows not padding, for the meter), else row ``i`` at ``i·cols``."""
    pid = tl.program_id(0)
    c = (pid // n_row_blocks).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    cmask = c < cols
    for step in range(row_steps):
        r = ((pid % n_row_blocks).to(tl.int64) * row_steps + step) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < rows
        mask = rmask[:, None] & cmask
        k = r[:, None] * cols + c
        d_at, qt_at = dinv_ptr, qt_ptr
        if ROW_INDEX:
            src = tl.load(row_ptr + r, mask=rmask, other=-1)
            rmask = rmask & (src >= 0)
            mask = rmask[:, None] & cmask
            mat = tl.load(mat_ptr + r, mask=r < rows, other=0)
            mat0 = tl.max(mat, axis=0)  # the block's matrix (padding rows carry theirs)
            d_at += mat0 * cols
            qt_at += mat0 * rank * cols
            x = tl.load(x_ptr + src[:, None] + c, mask=mask, other=0.0)
        else:
            x = tl.load(x_ptr + k, mask=mask, other=0.0)
        if OUTPUT:
            x = x.to(tl.float32) * tl.load(dout_ptr + r, mask=rmask, other=0.0)[:, None]
        if WHITEN:
            x = x.to(tl.float32) * tl.load(d_at + c, mask=cmask, other=0.0)
        if OUTPUT:
            x = _plus_low_rank(x, qo_ptr, pre_ptr, r, c, rmask, cmask, rank_out, cols)
        if WHITEN:
            x = _plus_low_rank(x, p_ptr, qt_at, r, c, rmask, cmask, rank, cols)
        k += at
        dest = k + _shard_delta(ends_ptr, delta_ptr, shards, steps, k, mask)
        if CAST == _TO_BF16:
            x = _bf16(x.to(tl.float32))
        elif CAST == _TO_FP32:
            x = x.to(tl.float32)
        tl.store(out_ptr + dest, x, mask=mask)


def _cast(src: torch.dtype, dst: torch.dtype) -> int:
    if src == dst:
        return _COPY.value
    if dst in (torch.float32, torch.bfloat16):
        return (_TO_FP32 if dst == torch.float32 else _TO_BF16).value
    raise ValueError(f"the placed cast writes FP32 or BF16 (or copies), not {src} to {dst}")


def whiten_place(
    x: torch.Tensor | RowsAt, whitening: LowRankWhitening | None, into, output: OutputRows | None = None
) -> None:
    """See ``kernels.whiten_place``: one launch (+ ``G Q`` and ``Qᵀ`` with a whitening of rank > 0, +
    ``fused.sender_factors``' few with ``output``).

    Essential bytes per element: reads ``x`` once (2 B for BF16, 4 for FP32; GIFT and the two-sided
    map read it twice, for ``G Q`` and ``Pre`` and for the pass; a ``RowsAt`` adds 16 B per row and column block
    of ``TILE``: its rows' starts and matrices), writes the element in the wire dtype (2 B for BF16, 4 for FP32)."""
    rows, cols = x.shape
    rows_at = x if isinstance(x, RowsAt) else None
    x = x.buffer if rows_at is not None else x.contiguous()
    table = into.table
    place = (into.out, table.ends, table.delta, table.ends.numel(), table.ends.numel().bit_length(), into.at)
    mapped = whitening is not None or output is not None
    cast = _cast(torch.float32 if mapped else x.dtype, into.out.dtype)
    if not mapped:
        _place_kernel[(triton.cdiv(x.numel(), FLAT_TILE),)](
            x,
            x,
            x,
            1,
            x,
            x,
            x,
            x,
            x,
            x,
            *place,
            1,
            x.numel(),
            0,
            0,
            1,
            1,
            WHITEN=False,
            OUTPUT=False,
            CAST=cast,
            BLOCK_R=1,
            BLOCK_C=FLAT_TILE,
            ROW_INDEX=False,
            **PLACE_OPTIONS,
        )
        return
    (dinv, p, qt, rank), (dout, qo, pre, rank_out) = sender_factors(x, whitening, output, rows_at)
    block_r = min(ROWS, triton.next_power_of_2(rows))
    blocks, col_blocks = triton.cdiv(rows, block_r), triton.cdiv(cols, TILE)
    row_steps = max(1, min(ROW_STEPS, blocks, blocks * col_blocks // ROW_PROGRAMS))
    n_rb = triton.cdiv(blocks, row_steps)
    _place_kernel[(n_rb * col_blocks,)](
        x,
        *RowsAt.kernel_args(x, rows, rows_at),
        dinv,
        p,
        qt,
        dout,
        qo,
        pre,
        *place,
        rows,
        cols,
        rank,
        rank_out,
        n_rb,
        row_steps,
        WHITEN=whitening is not None,
        OUTPUT=output is not None,
        CAST=cast,
        BLOCK_R=block_r,
        BLOCK_C=TILE,
        ROW_INDEX=rows_at is not None,
        enable_fp_fusion=True,
        **PLACE_OPTIONS,
    )


def _place_traffic(a: dict) -> tuple[int, int]:
    """``(bytes read, bytes written)`` of one ``_place_kernel`` launch from its bound arguments: ``X``
    once; what each program loads: its columns of ``D`` and ``Qᵀ`` (``Pre`` with an output side) and
    its rows of ``P`` (``T_out``'s); the table; each element in ``out``'s dtype. A ``RowsAt``'s padding
    rows move nothing; each program reads its rows' starts and matrices."""
    rows = a["live"] if a["ROW_INDEX"] else a["rows"]
    rank, r_out, col_blocks = a["rank"], a["rank_out"], -(-a["cols"] // a["BLOCK_C"])
    n = rows * a["cols"]
    down, across = a["n_row_blocks"] * a["cols"], col_blocks * rows
    read = n * a["x_ptr"].element_size() + 16 * a["shards"] + (16 * a["rows"] * col_blocks if a["ROW_INDEX"] else 0)
    if a["WHITEN"]:
        read += 4 * (down * (1 + rank) + across * rank)
    if a["OUTPUT"]:
        read += 4 * (down * r_out + across * (1 + r_out))
    return read, n * a["out_ptr"].element_size()


# Kernel name -> (bytes read, bytes written) of a launch from its bound arguments (and "grid").
TRAFFIC = {"_place_kernel": _place_traffic}
