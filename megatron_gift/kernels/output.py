"""Triton kernel of the receiver's output-side inverse (``numerics.two_sided.output_inverse``; imports
triton; see the package docstring for when it runs).

Shapes: a two-sided parameter ``[d_out, cols]`` (``T_out``: ``d_sqrt [d_out]``, ``Q [d_out, r]``
contiguous, ``c' [r]``), the rank's elements ``[e0, e0 + n)`` of it (row-major; a head piece of a
row, whole rows, a tail piece: ``two_sided.row_blocks``) given flat as ``W [n]`` (FP32), the whole
``P = Qᵀ W`` ``[r, cols]`` (FP32, contiguous). Per element ``t`` (``e = e0 + t``, ``i = e // cols``,
``j = e % cols``)::

    G[t] = d_sqrt[i] (W[t] + Σ_k (Q[i, k] c'_k) P[k, j])      (FP32, r rank-1 updates)

rounded once to ``out``'s dtype (BF16 to nearest even on the bits, ``fused._store_as``). One launch
per parameter: programs tile the rows ``i0..i1`` the elements touch (``BLOCK_R`` rows by
``BLOCK_C`` columns; a single row only its columns), elements outside ``[e0, e0 + n)`` masked, so the
head piece, the whole rows and the tail piece need no launches of their own. ``c' ⊙`` is applied to
``Q``'s row entries (``r`` products per row, not per element). Bytes (essential): reads ``W`` once,
``d_sqrt`` and ``Q`` on the touched rows, ``P`` on the touched columns and ``c'``; writes ``out`` once.
No temporaries; the launch depends on shapes only (no host synchronisation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics.whitening import LowRankWhitening
from .fused import TILE, _store_as, store_arg

ROWS = 16  # rows of a program (sharing the loads of P's columns)


@triton.jit
def _output_inverse_kernel(
    w_ptr,
    out_ptr,
    dsqrt_ptr,
    q_ptr,
    cinv_ptr,
    p_ptr,
    n,
    e0,
    row0,
    col0,
    rows,
    cols,
    rank,
    n_row_blocks,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BF16: tl.constexpr,
):
    """A ``BLOCK_R x BLOCK_C`` tile of rows ``row0 + ...`` and columns ``col0 + ...`` of ``G`` (module
    doc), its elements inside ``[e0, e0 + n)`` read from ``W`` and written to ``out`` at ``e - e0``."""
    pid = tl.program_id(0)
    i = row0 + (pid % n_row_blocks).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = col0 + (pid // n_row_blocks).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    imask, jmask = i < row0 + rows, j < cols
    t = i[:, None] * cols + j - e0
    mask = imask[:, None] & jmask & (t >= 0) & (t < n)
    used = tl.max(mask.to(tl.int32), axis=0)[None, :] > 0  # the columns the tile's elements use
    x = tl.load(w_ptr + t, mask=mask, other=0.0)
    for k in range(rank):
        qk = tl.load(q_ptr + i * rank + k, mask=imask, other=0.0) * tl.load(cinv_ptr + k)
        x += qk[:, None] * tl.load(p_ptr + k * cols + j, mask=used, other=0.0)
    _store_as(out_ptr + t, x * tl.load(dsqrt_ptr + i, mask=imask, other=0.0)[:, None], mask, BF16)


def output_inverse(
    w: LowRankWhitening, values: torch.Tensor, cols: int, e0: int, proj: torch.Tensor, out: torch.Tensor
) -> None:
    """See ``kernels.output_inverse``: one launch (``values`` non-empty)."""
    n = values.numel()
    row0 = e0 // cols
    rows = (e0 + n - 1) // cols - row0 + 1
    col0, width = (e0 - row0 * cols, n) if rows == 1 else (0, cols)  # one row: its piece's columns only
    block_r = min(ROWS, triton.next_power_of_2(rows))
    n_rb = triton.cdiv(rows, block_r)
    dest, bf16 = store_arg(out)
    _output_inverse_kernel[(n_rb * triton.cdiv(width, TILE),)](
        values,
        dest,
        w.d_sqrt,
        w.q,
        w.c_inv,
        proj,
        n,
        e0,
        row0,
        col0,
        rows,
        cols,
        w.rank,
        n_rb,
        BLOCK_R=block_r,
        BLOCK_C=TILE,
        BF16=bf16,
        enable_fp_fusion=True,
    )


def _output_inverse_traffic(a: dict) -> tuple[int, int]:
    """``(bytes read, bytes written)`` of one launch from its bound arguments: ``W`` once, ``d_sqrt`` and
    ``Q`` on the ``rows`` touched, ``P`` on the columns touched (``min(cols, n)``: a piece of one row, or
    rows whose pieces cover every column at least once) and ``c'``; ``out`` once."""
    n, rows, rank = a["n"], a["rows"], a["rank"]
    read = n * a["w_ptr"].element_size() + 4 * (rows * (1 + rank) + rank * min(a["cols"], n) + rank)
    return read, n * a["out_ptr"].element_size()


# Kernel name -> (bytes read, bytes written) of a launch from its bound arguments (and "grid").
TRAFFIC = {"_output_inverse_kernel": _output_inverse_traffic}
