"""Triton kernels of the receiver that read or write a buffer of messages at positions given by a
small table (imports triton; see the package docstring for when they run).

A *table* describes where a sequence sits in a buffer of messages (``comm.packing.Placement``):
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
from .fused import _Tiling, _add_rows, _chunk, _ends, _fmt_args, _rows, _store_as, _units, outputs, store_arg, unwhiten

BLOCK = 1024  # elements of a program of _sum_kernel
# Where _sum_kernel's table applies: nowhere, to the reads (one message), to the writes.
_PLAIN, _READ, _WRITE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


def _steps(table) -> int:
    """Bisection steps over a table of ``p`` shards: ``ceil(log2(p + 1))``."""
    return table.ends.numel().bit_length()


@triton.jit
def _shard_of(ends_ptr, n_table, steps, k, mask):
    """``j = #{t : ends[t] <= k}`` for each ``k`` (int64), by bisection over the ``n_table`` ends."""
    lo = tl.zeros_like(k)
    hi = lo + n_table
    for _ in range(steps):
        live = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(ends_ptr + mid, mask=mask & live, other=0)
        right = live & (end <= k)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(live & ~right, mid, hi)
    return lo


@triton.jit
def _decode_placed_kernel(
    out_ptr, ends_ptr, code_ptr, scale_ptr, table_ptr, code_delta_ptr, scale_delta_ptr, n_table, steps,
    seq_at, group_at, n_units, rows, cols, n_row_blocks, units_per_row, scale_row_stride, scale_col_stride,
    UNIT_W: tl.constexpr, W: tl.constexpr, BU: tl.constexpr, LAYOUT: tl.constexpr, ONE_CHUNK: tl.constexpr,
    MANT: tl.constexpr, BIAS: tl.constexpr, NO_INF: tl.constexpr, E8M0: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """``out = dec(codes, scales)`` of ``[rows, cols]`` whose element ``i`` is sequence element
    ``seq_at + i`` and whose group ``u`` is group ``group_at + u``, each read at its table position
    (the shard found once per unit). Bytes: reads the codes (1 per element) and the scales once,
    the table per unit (cached); writes ``out``."""
    start, length, row, col0, umask, unit, scale_index, n_chunks = _units(
        ends_ptr, n_units, rows, cols, n_row_blocks, units_per_row, scale_row_stride, scale_col_stride,
        UNIT_W, W, BU, LAYOUT, ONE_CHUNK,
    )  # fmt: skip
    j = _shard_of(table_ptr, n_table, steps, seq_at + start, umask)
    code_shift = (seq_at + tl.load(code_delta_ptr + j, mask=umask, other=0))[:, None]
    scale_at = group_at + scale_index + tl.load(scale_delta_ptr + j, mask=umask, other=0)
    for ch in range(n_chunks):
        _, flat, mask = _chunk(start, length, umask, ch, W)
        acc = tl.full([BU, W], -0.0, tl.float32)
        acc = _add_rows(acc, code_ptr, scale_ptr, 1, 0, 0, flat + code_shift, scale_at, mask, umask,
                        MANT, BIAS, NO_INF, E8M0)  # fmt: skip
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
    out_ptr, x0_ptr, k0, stride0, x1_ptr, k1, stride1, x2_ptr, k2, stride2,
    table_ptr, delta_ptr, n_table, steps, seq_at, n, world,
    AVERAGE: tl.constexpr, PLACE: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
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
        shifted = k + tl.load(delta_ptr + _shard_of(table_ptr, n_table, steps, k, mask), mask=mask, other=0)
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


def decode_placed(codes: torch.Tensor, scales: torch.Tensor, code_table, scale_table, seq_at: int, group_at: int,
                  rows: int, cols: int, whitening: LowRankWhitening | None, cfg: CodecConfig,
                  lengths: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """See ``kernels.decode_placed``: one launch (+ a cumsum with ``lengths``, + two with whitening)."""
    tiling = _Tiling.of(cfg, rows, cols, None if lengths is None else lengths.numel())
    acc, out = outputs(rows, cols, whitening, out, codes.device)
    dest, bf16 = store_arg(acc)
    _decode_placed_kernel[(tiling.programs,)](
        dest, _ends(lengths, acc), codes, scales, code_table.ends, code_table.delta, scale_table.delta,
        code_table.ends.numel(), _steps(code_table), seq_at, group_at, tiling.n_units, rows, cols, *tiling.args(),
        BF16=bf16, enable_fp_fusion=False, **tiling.constexprs(), **_fmt_args(cfg, "decode_sum_unwhiten"),
    )  # fmt: skip
    return unwhiten(acc, out, whitening)


def sum_rows(parts: Sequence[torch.Tensor], average: bool, out: torch.Tensor | None = None,
             place: tuple | None = None) -> torch.Tensor:  # fmt: skip
    """See ``kernels.sum_rows``: one launch, whatever the number of rows."""
    parts = [p for p in _rows(parts) if p.shape[0] > 0]
    n, device = parts[0].shape[1], parts[0].device
    if out is None:
        out = torch.empty(n, device=device)
    table, at = place if place is not None else (None, 0)
    _launch_sum(out, parts, table, at, n, average, _WRITE if place is not None else _PLAIN)
    return out


def take(src: torch.Tensor, table, at: int, out: torch.Tensor) -> torch.Tensor:
    """See ``kernels.take``: one launch."""
    _launch_sum(out, [src.view(1, -1)], table, at, out.numel(), False, _READ)
    return out


def _launch_sum(out, parts, table, at, n, average, place) -> None:
    unused = (parts[0], 0, 0)
    part_args = [a for p in parts for a in (p, p.shape[0], p.stride(0))]
    part_args += [a for _ in range(3 - len(parts)) for a in unused]
    table_args = (table.ends, table.delta, table.ends.numel(), _steps(table)) if table is not None else (out, out, 0, 0)
    world = sum(p.shape[0] for p in parts)
    dest, bf16 = store_arg(out)
    _sum_kernel[(triton.cdiv(n, BLOCK),)](
        dest, *part_args, *table_args, at, n, world, AVERAGE=average, PLACE=place.value, BLOCK=BLOCK, BF16=bf16,
    )  # fmt: skip


def _decode_placed_bytes(a: dict) -> tuple[int, int]:
    n, groups = a["rows"] * a["cols"], a["LAYOUT"] == 2
    scales = a["n_units"] if groups else {(0, 0): 1, (1, 0): a["rows"]}.get(
        (a["scale_row_stride"], a["scale_col_stride"]), a["n_units"])  # fmt: skip
    read = n * a["code_ptr"].element_size() + scales * a["scale_ptr"].element_size()
    read += (a["ends_ptr"].element_size() * a["n_units"] if groups else 0) + 16 * a["n_table"]
    return read, n * a["out_ptr"].element_size()


def _sum_bytes(a: dict) -> tuple[int, int]:
    rows = sum(a[f"k{i}"] * a[f"x{i}_ptr"].element_size() for i in range(3))
    table = 16 * a["n_table"] if a["PLACE"] != _PLAIN.value else 0
    return a["n"] * rows + table, a["n"] * a["out_ptr"].element_size()


# (bytes read, bytes written) of a launch from its bound arguments (the meter's convention).
TRAFFIC = {"_decode_placed_kernel": _decode_placed_bytes, "_sum_kernel": _sum_bytes}
