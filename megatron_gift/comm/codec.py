"""A bucket's values into messages and back: the per-chunk work of every quantized reduction.

Sender (``encode_bucket``, ``cast_bucket``, ``plain_bucket``): each segment in one call of the
kernels' entry points, which write straight into the messages at the positions of the packing's
tables (``kernels.Place``): on the fused path a fixed few launches per segment, whatever its size
and the number of messages; the PyTorch path cuts a segment into chunks of ``CHUNK`` elements
(aligned to scaling groups, and to whole rows where a GIFT transform applies) to bound its
temporaries::

    U = G T            per GIFT weight, whole rows (``kernels.whiten_encode``; G elsewhere);
                       T_outᵀ G T with an output side (``outputs``), T_outᵀ applied row by row in the
                       same pass (its ``Pre``, a sum over all rows, from the read of G that gives G Q)
    Ũ = U + e          with error feedback (then the residual e ← Ũ - dec(q(Ũ)), in place)
    codes, scales of q(Ũ) → each shard's message        (``cast_bucket``: U in a float wire dtype)

Receiver (``reduce_coded``, ``sum_plain``): the FP32 sum of every sender's codes (or plain values)
of one segment part, senders in rank order, ÷ R when averaging, ``T⁻¹`` of whole rows when given,
written straight into its destination (a bucket slice, a message section) in that one's dtype.
The fused kernels take a whole part in one launch; the PyTorch path cuts it into chunks of
``CHUNK`` elements.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..numerics.error_feedback import ErrorFeedback
from ..numerics.two_sided import OutputRows
from .layout import BucketLayout, Part, ShardPlan
from .packing import Packing, Received


def views(buf: torch.Tensor, layout: BucketLayout) -> dict[str, torch.Tensor]:
    """``buf`` (uint8, a multiple of 4 bytes) viewed in each sequence's dtype (coded: the format's codes)."""
    return {
        "coded": buf.view(layout.coded_dtype()),
        "groups": buf.view(layout.codec.scale_dtype()),
        "off": buf.view(layout.plain_dtypes[0]),
        "bf16": buf.view(torch.bfloat16),
    }


# Elements per chunk of the PyTorch path, where temporaries grow with the chunk (the fused kernels
# take whole segments and segment parts: no chunks). Sender: FP32 ``U`` (and ``Ũ``), the encode's
# temporaries (at most 8 bytes per element: ``U / s`` in the repeated scales, their int32 index, the
# codes) and the placement index (``Placement.index``: 4 bytes per element in int32), so a few hundred
# MiB at a time. Receiver: one part of the senders' messages decoded at a time (``kernels.ordered_sum``),
# 4 bytes per element of it beside at most 4 more (tests/unit/test_pytorch_path_memory.py; R senders'
# copies of a part are at most the bucket). Not divided by the number of senders: the ops of a part
# are the same at any data-parallel size.
CHUNK = 1 << 24


def _segment_chunks(layout: BucketLayout, i: int, fused: bool, whiten: bool) -> list[tuple[int, int]]:
    """Coded ranges ``[k0, k1)`` of segment ``i`` as one sender call each: the whole segment on the fused
    path, else chunks of about ``CHUNK`` elements cut at group (with ``whiten``, row) boundaries."""
    s, at = layout.segments[i], layout.seg_at[i]
    if fused:
        return [(at, at + s.rows * s.cols)]
    return layout.chunks(i, at, at + s.rows * s.cols, CHUNK, whole_rows=whiten)


def _sends(flat: torch.Tensor, layout: BucketLayout, transforms, outputs: dict | None, fused: bool):
    """Per sender call of each coded segment ``i``: ``(i, k0, k1, x, T, T_outᵀ)``: ``x`` the coded values
    ``[k0, k1)`` read from the bucket, ``[rows, cols]`` (whole rows) where a transform applies, else
    ``[1, n]``; ``T_outᵀ`` (``OutputRows``) on ``x``'s rows where ``outputs`` has the segment's
    ``T_out``, its ``Pre`` left to the call on the fused path (one call: the whole segment), else
    computed once here from the whole segment for its chunks."""
    outputs = outputs or {}
    for i in layout.coded_segments:
        s, at, t, w = layout.segments[i], layout.seg_at[i], transforms[i], outputs.get(i)
        rows = t is not None or w is not None
        out = None
        if w is not None:
            out = OutputRows.of(w)
            if not fused:
                out = out.with_pre(flat[s.start : s.end].view(s.rows, s.cols))
        for k0, k1 in _segment_chunks(layout, i, fused, rows):
            x = flat[s.start + k0 - at : s.start + k1 - at]
            rows_of = out.rows((k0 - at) // s.cols, (k1 - at) // s.cols) if out is not None and not fused else out
            yield i, k0, k1, (x.view(-1, s.cols) if rows else x.view(1, -1)), t, rows_of


def encode_bucket(
    buf: torch.Tensor,
    pk: Packing,
    flat: torch.Tensor,
    layout: BucketLayout,
    transforms,
    ops: kernels.CodecOps,
    error_feedback: ErrorFeedback | None = None,
    outputs: dict | None = None,
) -> None:
    """Every coded value of ``flat`` (whitened where ``transforms`` has a ``T``, two-sided where
    ``outputs``, segment index -> ``T_out``, has one; plus the residual with ``error_feedback``, whose
    next residual overwrites it) as codes of the format and scales into its message in ``buf`` (the
    module doc's sender); ``pk``'s source is the bucket, which is only read."""
    out, cfg = views(buf, layout), layout.codec
    for _i, k0, k1, x, t, rows_of in _sends(flat, layout, transforms, outputs, ops.fused):
        g0, g1 = layout.group_range(k0, k1)
        into = kernels.Placed(pk.place["coded"].at(out["coded"], k0), pk.place["groups"].at(out["groups"], g0))
        feedback = error_feedback.feedback(k0, k1 - k0) if error_feedback is not None else None
        ops.whiten_encode(
            x, t, cfg, lengths=layout.lengths(g0, g1, flat.device), into=into, feedback=feedback, output=rows_of
        )


def cast_bucket(
    buf: torch.Tensor,
    pk: Packing,
    flat: torch.Tensor,
    layout: BucketLayout,
    transforms,
    wire: torch.dtype,
    ops: kernels.CodecOps,
    outputs: dict | None = None,
) -> None:
    """Every coded value of ``flat`` (whitened where ``transforms`` has a ``T``, two-sided as in
    ``encode_bucket``) in the float ``wire`` dtype into its message in ``buf``."""
    out = buf.view(wire)
    for _i, k0, _k1, x, t, rows_of in _sends(flat, layout, transforms, outputs, ops.fused):
        ops.whiten_place(x, t, pk.place["coded"].at(out, k0), output=rows_of)


def plain_bucket(
    buf: torch.Tensor, pk: Packing, flat: torch.Tensor, layout: BucketLayout, ops: kernels.CodecOps
) -> None:
    """The values of ``off`` and ``bf16`` parameters, in the bucket's dtype and in BF16, into their
    messages: one call per segment (per ``CHUNK`` of it on the PyTorch path, for its placement index)."""
    out = views(buf, layout)
    for c, name in enumerate(("off", "bf16")):
        for i in layout.plain_segments[c]:
            s, at = layout.segments[i], layout.seg_at[i]
            n = s.rows * s.cols
            step = n if ops.fused else CHUNK
            for k0 in range(0, n, step):
                x = flat[s.start + k0 : s.start + min(n, k0 + step)]
                ops.whiten_place(x.view(1, -1), None, pk.place[name].at(out[name], at + k0))


def sum_plain(
    rows: Received,
    layout: BucketLayout,
    c: int,
    k0: int,
    k1: int,
    average: bool,
    ops: kernels.CodecOps,
    out: torch.Tensor | kernels.Place | None = None,
) -> torch.Tensor | None:
    """FP32 sum over the senders (rank order) of plain class ``c``'s values ``[k0, k1)`` of the
    message, ÷ R when averaging, into ``out`` (a tensor or a ``kernels.Place``; ``kernels.sum_rows``)."""
    return ops.sum_rows(rows.plain(c, k0, k1, layout.plain_dtypes[c]), average, out)


def reduce_coded(
    rows: Received,
    layout: BucketLayout,
    plan: ShardPlan,
    k0: int,
    k1: int,
    shape: tuple[int, int],
    whitening,
    average: bool,
    ops: kernels.CodecOps,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(Σ_i dec(message_i) [÷ R]) T⁻¹`` (``T⁻¹`` where ``whitening`` is given) of coded values
    ``[k0, k1)`` of the bucket's coded sequence from ``rows``' messages of shard ``plan``: ``shape``,
    into ``out`` when given (else FP32; ``ops``: the fused kernels or the reference)."""
    g0, g1, lengths = layout.group_slice(k0, k1, rows.parts[0].device)
    payloads = rows.coded(k0 - plan.coded_lo, k1 - plan.coded_lo, layout.coded_dtype())
    scales = rows.scales(g0 - plan.group_lo, g1 - plan.group_lo, layout.codec.scale_dtype())
    return ops.decode_sum_unwhiten(payloads, scales, *shape, whitening, layout.codec, average, lengths=lengths, out=out)


def part_chunks(layout: BucketLayout, part: Part, chunk: int | None, whitened: bool) -> list[tuple[int, int, int, int]]:
    """``(k0, k1, rows, cols)`` chunks of a segment part (coded range): its whole rows when
    ``whitened`` (the cut rows are the shard's pieces, reduced apart), else all of it; in one
    chunk when ``chunk`` is None, else in chunks of about ``chunk`` elements (``CHUNK``)."""
    s, at = layout.segments[part.seg], layout.seg_at[part.seg]
    k0, k1 = part.at, part.at + part.hi - part.lo
    if whitened:
        r0, r1 = -(-(k0 - at) // s.cols), (k1 - at) // s.cols
        if r1 <= r0:
            return []
        k0, k1 = at + r0 * s.cols, at + r1 * s.cols
    ranges = [(k0, k1)] if chunk is None else layout.chunks(part.seg, k0, k1, chunk, whole_rows=whitened)
    return [(a, b, (b - a) // s.cols, s.cols) if whitened else (a, b, 1, b - a) for a, b in ranges]


def spans(lo: int, n: int, chunk: int | None) -> list[tuple[int, int]]:
    """``[lo, lo + n)`` in consecutive pieces of at most ``chunk`` (plain values: no groups to
    respect; one piece when ``chunk`` is None); one empty piece when ``n`` is 0 (the same ops
    whether a rank holds such values or not)."""
    step = n if chunk is None else chunk
    return [(a, min(a + step, lo + n)) for a in range(lo, lo + n, max(step, 1))] or [(lo, lo)]
