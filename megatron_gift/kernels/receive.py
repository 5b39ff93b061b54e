"""Triton kernels of the receiver that read or write a buffer of messages at positions given by a
small table (imports triton; see the package docstring for when they run).

A *table* describes where a sequence sits in a buffer of messages (``kernels.placement.Placement``):
``ends [p]`` (int64, inclusive cumsum of the source shards' sizes) and ``delta [p]`` (int64), on
the device; element ``k`` of the sequence, in shard ``j = #{t : ends[t] <= k}``, is at buffer
position ``k + delta[j]``. A kernel finds ``j`` by bisection over the table (``ceil(log2(p+1))``
loads), once per scaling group where a group never crosses a shard (the layout cuts them at
shard boundaries), else once per element; no per-element index is ever materialised.

- ``decode_placed``: one message per shard all-gathered (``comm.quantized.decode_gathered``): the
  codes and scales of a segment read at their table positions, decoded (``fused``'s decode-sum of
  one row) and written in the output's dtype, ``T⁻¹`` after it (``fused.unwhiten``).
- ``sum_rows``: the FP32 sum of R senders' float values (plain values, or the BF16/FP32 wire of
  the two-level intra-node stage), in rank order (``acc = -0``, then ``acc += x_i``: the bits of
  ``reference.ordered_sum``), ``÷ R`` when averaging, written in the output's dtype, optionally at
  a table's positions; ``take``: one message's values read at a table's positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..numerics.fp8 import CodecConfig
from ..numerics.whitening import LowRankWhitening
from .fused import (
    _add_rows,
    _chunk,
    _ends,
    _fmt_args,
    _n_chunks,
    _rows,
    _shard_delta,
    _shard_of,
    _store_as,
    _table,
    _Tiling,
    _units,
    outputs,
    store_arg,
    unwhiten,
)

BLOCK = 1024  # elements of a program of _sum_kernel
# Where _sum_kernel's table applies: nowhere, to the reads (one message), to the writes.
_PLAIN, _READ, _WRITE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _decode_placed_kernel(
    out_ptr,
    ends_ptr,
    code_ptr,
    scale_ptr,
    table_ptr,
    code_delta_ptr,
    scale_delta_ptr,
    n_table,
    steps,
    seq_at,
    group_at,
    n_units,
    rows,
    cols,
    n_row_blocks,
    units_per_row,
    scale_row_stride,
    scale_col_stride,
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
    """``out = dec(codes, scales)`` of ``[rows, cols]`` whose element ``i`` is sequence element
    ``seq_at + i`` and whose group ``u`` is group ``group_at + u``, each read at its table position
    (the shard found once per unit). Bytes: reads the codes (1 per element) and the scales once,
    the table per unit (cached); writes ``out``."""
    start, length, row, col0, umask, unit, scale_index = _units(
        ends_ptr, n_units, rows, cols, units_per_row, scale_row_stride, scale_col_stride, UNIT_W, BU, LAYOUT
    )
    n_chunks = _n_chunks(length, W, ONE_CHUNK)
    j = _shard_of(table_ptr, n_table, steps, seq_at + start, umask)
    code_shift = (seq_at + tl.load(code_delta_ptr + j, mask=umask, other=0))[:, None]
    scale_at = group_at + scale_index + tl.load(scale_delta_ptr + j, mask=umask, other=0)
    for ch in range(n_chunks):
        _, flat, mask = _chunk(start, length, umask, ch, W)
        acc = tl.full([BU, W], -0.0, tl.float32)
        acc = _add_rows(
            acc, code_ptr, scale_ptr, 1, 0, 0, flat + code_shift, scale_at, mask, umask, MANT, BIAS, NO_INF, E8M0
        )
        _store_as(out_ptr + flat, acc, mask, BF16)


@triton.jit
def _add_values(acc, x_ptr, k, stride, offs, mask):
    """``acc + x_0 + x_1 + ...`` (left to right) over the ``k`` rows of one part, read as FP32."""
    ptrs = x_ptr + offs
    for _ in range(k):
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        ptrs += stride
    return acc


@triton.jit
def _sum_kernel(
    out_ptr,
    x0_ptr,
    k0,
    stride0,
    x1_ptr,
    k1,
    stride1,
    x2_ptr,
    k2,
    stride2,
    table_ptr,
    delta_ptr,
    n_table,
    steps,
    seq_at,
    n,
    world,
    AVERAGE: tl.constexpr,
    PLACE: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16: tl.constexpr,
):
    """``out = Σ_i x_i`` (``÷ world`` when ``AVERAGE``) over the rows of three parts, FP32 in row
    order; with ``PLACE``, the reads (``_READ``: one row) or the writes (``_WRITE``) of element ``i``
    at the table position of sequence element ``seq_at + i``. Bytes: reads every row once (its
    dtype), the table per element (cached); writes ``out`` once (its dtype)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    src = offs
    dst = offs
    if PLACE != _PLAIN:
        k = seq_at + offs
        shifted = k + _shard_delta(table_ptr, delta_ptr, n_table, steps, k, mask)
        if PLACE == _READ:
            src = shifted
        else:
            dst = shifted
    acc = tl.full([BLOCK], -0.0, tl.float32)
    acc = _add_values(acc, x0_ptr, k0, stride0, src, mask)
    acc = _add_values(acc, x1_ptr, k1, stride1, src, mask)
    acc = _add_values(acc, x2_ptr, k2, stride2, src, mask)
    if AVERAGE:
        acc = tl.math.div_rn(acc, tl.full(acc.shape, 1.0, tl.float32) * world)
    _store_as(out_ptr + dst, acc, mask, BF16)


def decode_placed(
    src,
    rows: int,
    cols: int,
    whitening: LowRankWhitening | None,
    cfg: CodecConfig,
    lengths: torch.Tensor | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """See ``kernels.decode_placed``: one launch (+ a cumsum with ``lengths``, + two with whitening).
    The scales' table is read at the codes' shard (a group lies in one shard)."""
    tiling = _Tiling.of(cfg, rows, cols, None if lengths is None else lengths.numel())
    codes, ends, code_delta, shards, steps, seq_at = _table(src.codes, None)
    acc, out = outputs(rows, cols, whitening, out, codes.device)
    dest, bf16 = store_arg(acc)
    _decode_placed_kernel[(tiling.programs,)](
        dest,
        _ends(lengths, acc),
        codes,
        src.scales.out,
        ends,
        code_delta,
        src.scales.table.delta,
        shards,
        steps,
        seq_at,
        src.scales.at,
        tiling.n_units,
        rows,
        cols,
        *tiling.args(),
        BF16=bf16,
        enable_fp_fusion=False,
        **tiling.constexprs(),
        **_fmt_args(cfg, "decode_sum_unwhiten"),
    )
    return unwhiten(acc, out, whitening)


def sum_rows(parts: Sequence[torch.Tensor], average: bool, out=None) -> torch.Tensor | None:
    """See ``kernels.sum_rows``: one launch, whatever the number of rows (``out`` a tensor, a
    ``kernels.Place`` or None)."""
    parts = [p for p in _rows(parts) if p.shape[0] > 0]
    n, device = parts[0].shape[1], parts[0].device
    if out is None or isinstance(out, torch.Tensor):
        out = out if out is not None else torch.empty(n, device=device)
        _launch_sum(out, parts, None, n, average, _PLAIN)
        return out
    _launch_sum(out.out, parts, out, n, average, _WRITE)
    return None


def take(src, out: torch.Tensor) -> torch.Tensor:
    """See ``kernels.take``: one launch (``src`` a ``kernels.Place``)."""
    _launch_sum(out, [src.out.view(1, -1)], src, out.numel(), False, _READ)
    return out


def _launch_sum(out, parts, place, n, average, mode) -> None:
    unused = (parts[0], 0, 0)
    part_args = [a for p in parts for a in (p, p.shape[0], p.stride(0))]
    part_args += [a for _ in range(3 - len(parts)) for a in unused]
    _, ends, delta, shards, steps, at = _table(place, out)
    world = sum(p.shape[0] for p in parts)
    dest, bf16 = store_arg(out)
    _sum_kernel[(triton.cdiv(n, BLOCK),)](
        dest,
        *part_args,
        ends,
        delta,
        shards,
        steps,
        at,
        n,
        world,
        AVERAGE=average,
        PLACE=mode.value,
        BLOCK=BLOCK,
        BF16=bf16,
    )


def _decode_placed_traffic(a: dict) -> tuple[int, int]:
    n, groups = a["rows"] * a["cols"], a["LAYOUT"] == 2
    scales = (
        a["n_units"]
        if groups
        else {(0, 0): 1, (1, 0): a["rows"]}.get((a["scale_row_stride"], a["scale_col_stride"]), a["n_units"])
    )
    read = n * a["code_ptr"].element_size() + scales * a["scale_ptr"].element_size()
    read += (a["ends_ptr"].element_size() * a["n_units"] if groups else 0) + 16 * a["n_table"]
    return read, n * a["out_ptr"].element_size()


def _sum_traffic(a: dict) -> tuple[int, int]:
    rows = sum(a[f"k{i}"] * a[f"x{i}_ptr"].element_size() for i in range(3))
    table = 16 * a["n_table"] if a["PLACE"] != _PLAIN.value else 0
    return a["n"] * rows + table, a["n"] * a["out_ptr"].element_size()


# (bytes read, bytes written) of a launch from its bound arguments (the meter's convention).
TRAFFIC = {"_decode_placed_kernel": _decode_placed_traffic, "_sum_kernel": _sum_traffic}
