"""The pure-PyTorch hot paths that the Triton kernels fuse: the reference they are tested
against and the path taken wherever Triton cannot run. Built from ``numerics`` without
restating its math; ``ordered_sum`` is the receivers' summation order, which ``comm`` uses too.

Messages are given as *parts*: a sequence of ``[k_i, n]`` tensors whose rows, taken part after
part, are the senders in rank order (a reduction whose own message is kept out of the collective
passes the rows before it, its own row, and the rows after it). Each part's inner dimension is
contiguous; its rows may be strided (views into a receive buffer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..numerics.fp8 import (
    CodecConfig,
    Encoded,
    decode_flat,
    divisor,
    encode_flat,
    group_lengths,
    repeat_groups,
    scale_values,
)
from ..numerics.geometry import even_spans
from ..numerics.rotation import fwht
from ..numerics.two_sided import OutputRows
from ..numerics.whitening import LowRankWhitening

Parts = Sequence[torch.Tensor]


def _as_parts(t: torch.Tensor | Parts) -> list[torch.Tensor]:
    return [t] if isinstance(t, torch.Tensor) else list(t)


# The most values a receive's decode makes at once (``ordered_sum``'s ``budget``): its temporaries are a
# few bytes per value whatever the number of senders (at DP 512, 511 rows of a shard otherwise).
DECODE_VALUES = 1 << 24
# The fewest blocks it takes its senders' rows in (``ordered_sum``'s ``blocks``; some empty with fewer than
# 4 senders): a quarter of the rows at once, about a bucket's (p - 1) / 4p values, in as many ops at any p.
DECODE_BLOCKS = 4


def _rows(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows ``[a, b)`` of ``t``: ``t`` itself where that is all of them (no view op)."""
    return t if (a, b) == (0, t.shape[0]) else t[a:b]


def ordered_sum(
    parts: Parts, value=None, budget: int | None = None, width: int | None = None, blocks: int = 1
) -> torch.Tensor:
    """``Σ_i x_i`` over the rows of ``parts`` (``[k, n]`` each; some may be empty), accumulated in FP32
    in row order: ``acc = x_0``, then ``acc += x_1``, ... (the same order on every rank). ``value(i, a, b)``,
    where given, makes rows ``[a, b)`` of part ``i`` (a decode) when the sum reaches them; a part narrower
    than FP32 is cast there. Each part is taken in ``B`` blocks of rows, ``B`` the fewest that keep the
    values of all parts' rows over ``B`` within ``budget`` (none without one; ``width`` values per row,
    else the parts' last dimension) and at least ``blocks`` (some empty where the rows are fewer): one
    block's FP32 rows live beside the sum at a time, and ``B`` depends on the total rows, not on how a
    rank's parts split them nor (below the budget) on how many there are.

    One op per block, whatever the number of rows: on the CPU ``index_add_`` adds the rows of its source
    one after another in index order (the same ops whichever parts or blocks are empty); on CUDA
    ``cumsum`` along dim 0 runs a sequential loop per column in FP32 (ScanUtils.cuh,
    ``tensor_kernel_scan_outer_dim``), whose last row is the sum (none for an empty block).
    ``tests/unit/test_kernels.py`` holds both to a Python loop, bit for bit."""
    values = sum(p.shape[0] for p in parts) * (width or parts[0].shape[-1])
    blocks = max(1, blocks, 0 if budget is None else -(-values // budget))
    spans = [even_spans(0, p.shape[0], blocks) for p in parts]
    first = next(i for i, p in enumerate(parts) if p.shape[0] > 0)
    rows = (lambda i, a, b: _rows(parts[i], a, b)) if value is None else value
    head = rows(first, *spans[first][0])
    acc = head[:1].to(torch.float32, copy=True)
    for i in range(len(parts)):
        for j, (a, b) in enumerate(spans[i]):
            if (i, j) == (first, 0):
                x, head = head, None
            else:
                x = rows(i, a, b)
            rest = x[int((i, j) == (first, 0)) :].float()  # no copy where the rows are FP32 already
            if acc.device.type == "cuda":
                if rest.shape[0]:  # an empty block adds nothing: no copy and scan of the sum for it
                    acc = torch.cumsum(torch.cat([acc, rest]), 0)[-1:]
            else:
                acc.index_add_(0, torch.zeros(rest.shape[0], dtype=torch.long, device=acc.device), rest)
            del x, rest
    return acc[0]


def decode_rows(payloads: torch.Tensor, scales: torch.Tensor, lengths: torch.Tensor, cfg: CodecConfig) -> torch.Tensor:
    """FP32 values ``[k, n]`` of ``k`` flat encodings: ``payloads [k, n]`` codes, ``scales [k, G]``
    (one per group of ``lengths [G]``, summing to n), decoded as ``fp8.decode_flat`` does, row by row."""
    n = payloads.shape[1]  # the scales repeated first: their index is freed before the codes' values are made
    return cfg.fmt.scaled(payloads, repeat_groups(scale_values(scales, cfg), lengths, n, dim=1))


def _write(into, values: torch.Tensor) -> None:
    """``values`` (cast to ``into.out``'s dtype) where a ``kernels.Place`` puts them: ``index_put_`` at
    its table's ``index`` (an int32 index per element where the positions fit)."""
    index = into.table.index(into.at, into.at + values.numel())
    into.out.index_put_((index,), values.reshape(-1).to(into.out.dtype))


def _read(src, n: int) -> torch.Tensor:
    """The ``n`` elements a ``kernels.Place`` points at, by ``index_select`` at its table's ``index``."""
    return src.out.index_select(0, src.table.index(src.at, src.at + n))


def sender_values(g: torch.Tensor, whitening: LowRankWhitening | None, output: OutputRows | None) -> torch.Tensor:
    """``T_outᵀ G T_in`` in FP32 of ``g [rows, cols]``: ``output`` (``T_outᵀ`` on ``g``'s rows; ``Pre``
    computed from ``g`` where not given) and ``whitening`` (``T_in``) each where given."""
    x = output.with_pre(g).apply(g) if output is not None else g.float()
    return whitening.apply(x) if whitening is not None else x


def reference_whiten_encode(
    g: torch.Tensor,
    whitening: LowRankWhitening | None,
    cfg: CodecConfig,
    out: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    into=None,
    feedback: tuple[torch.Tensor, torch.Tensor] | None = None,
    output: OutputRows | None = None,
) -> Encoded | None:
    """``fp8.encode(G T)`` (``G`` when ``whitening`` is None; ``T_outᵀ G T`` with ``output``:
    ``sender_values``) of ``g [rows, cols]``; ``out``, when
    given, receives the encoded values in FP32. ``lengths``: the scaling groups in memory order
    (each inside one row unless the scaling is per tensor), when they are not the matrix codec's
    own (groups cut at shard boundaries); the scales then come flat, one per group. ``into`` and
    ``feedback`` as in ``kernels.whiten_encode``: ``index_put_`` at the tables' positions; ``Ũ = U + e``
    encoded, ``e' = Ũ - dec(q(Ũ))``."""
    rows, cols = g.shape
    u = sender_values(g, whitening, output)
    if feedback is not None:  # Ũ made where e' goes (e itself, in place), then e' = Ũ - dec: no copy of Ũ beside it
        u = torch.add(u, feedback[0].view_as(u), out=feedback[1].view_as(u))
    if out is not None:
        out.copy_(u)
    flat_lengths = lengths if lengths is not None else group_lengths(rows, cols, cfg, device=g.device)
    enc = encode_flat(u.reshape(-1), flat_lengths, cfg)
    if feedback is not None:
        u.reshape(-1).sub_(decode_flat(enc, flat_lengths, cfg))
    if into is not None:
        _write(into.codes, enc.payload)
        _write(into.scales, enc.scales)
        return None
    return Encoded(
        payload=enc.payload.view(g.shape),
        scales=enc.scales if lengths is not None else enc.scales.view(cfg.groups(rows, cols)),
    )


def reference_whiten_place(
    x: torch.Tensor, whitening: LowRankWhitening | None, into, output: OutputRows | None = None
) -> None:
    """``kernels.whiten_place``: ``x T`` (FP32, ``T_outᵀ x T`` with ``output``: ``sender_values``; ``x``
    where neither is given) in ``into.out``'s dtype, ``index_put_`` at the table's positions of
    ``[at, at + numel)``."""
    _write(into, x if whitening is None and output is None else sender_values(x, whitening, output))


def reference_decode_sum_unwhiten(
    payloads: torch.Tensor | Parts,
    scales: torch.Tensor | Parts,
    rows: int,
    cols: int,
    whitening: LowRankWhitening | None,
    cfg: CodecConfig,
    average: bool,
    lengths: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(Σ_i dec(payloads[i], scales[i]) [÷ R]) T⁻¹`` as FP32 ``[rows, cols]`` from ``R`` ranks'
    messages: ``payloads [R, rows·cols]`` codes (``cfg.fmt.code_dtype``), ``scales [R, groups]`` as
    ``fp8.encode`` made them (or as ``lengths`` groups them), each possibly given as parts (module
    doc); the rank sum is ``ordered_sum``'s. With ``out`` (``rows·cols`` elements, contiguous), cast
    into it and returned."""
    if lengths is None:
        lengths = group_lengths(rows, cols, cfg, device=_as_parts(payloads)[0].device)
    payloads, scales = _as_parts(payloads), _as_parts(scales)
    acc = ordered_sum(
        payloads,
        lambda i, a, b: decode_rows(payloads[i][a:b], scales[i][a:b], lengths, cfg),  # slices at any b - a
        DECODE_VALUES,
        blocks=DECODE_BLOCKS,
    )
    if average:
        acc /= divisor(sum(p.shape[0] for p in payloads), acc.device)
    acc = acc.view(rows, cols)
    acc = whitening.inverse(acc) if whitening is not None else acc
    return acc if out is None else out.view(rows, cols).copy_(acc)


def reference_decode_placed(
    src,
    rows: int,
    cols: int,
    whitening: LowRankWhitening | None,
    cfg: CodecConfig,
    lengths: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kernels.decode_placed`` by ``index_select`` at the tables' ``index`` (an int64 index per element)."""
    if lengths is None:
        lengths = group_lengths(rows, cols, cfg, device=src.codes.out.device)
    payload, scale = _read(src.codes, rows * cols), _read(src.scales, lengths.numel())
    return reference_decode_sum_unwhiten(payload[None], scale[None], rows, cols, whitening, cfg, False, lengths, out)


def reference_sum_rows(parts: Parts, average: bool, out=None) -> torch.Tensor | None:
    """``kernels.sum_rows``: ``ordered_sum`` of the parts in FP32, then ``÷ R``, cast into ``out``
    (a ``kernels.Place``: ``index_put_`` at its table's ``index``)."""
    parts = _as_parts(parts)
    acc = ordered_sum(parts)
    if average:
        acc.div_(divisor(sum(p.shape[0] for p in parts), acc.device))
    if out is not None and not isinstance(out, torch.Tensor):
        return _write(out, acc)
    return acc if out is None else out.copy_(acc)


def reference_take(src, out: torch.Tensor) -> torch.Tensor:
    """``kernels.take`` by ``index_select`` at the table's ``index``."""
    return out.copy_(_read(src, out.numel()))


def reference_rotate_blocks(
    x: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor, signs: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """``kernels.fp4.rotate_blocks``: the blocks of ``x`` at ``starts`` gathered, rotated with their rows of
    ``signs`` (``fwht(x ⊙ s)``; inverse ``fwht(x) ⊙ s``) and scattered back in place; returns ``x``."""
    block = signs.shape[1]
    at = (starts[:, None] + torch.arange(block, device=x.device)).reshape(-1)
    blocks, s = x.index_select(0, at).view(-1, block), signs.index_select(0, rows)
    blocks = fwht(blocks, block, scratch=True).mul_(s) if inverse else fwht(blocks.mul_(s), block, scratch=True)
    return x.index_copy_(0, at, blocks.view(-1))
