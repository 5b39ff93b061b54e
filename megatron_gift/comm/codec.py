"""A bucket's values into messages and back: the per-chunk work of every quantized reduction.

Work is cut into chunks of at most ``budget`` elements (aligned to scaling groups, and to whole
rows where a GIFT transform applies), so the temporaries of the PyTorch path stay bounded; each
chunk costs a fixed number of ops whatever the number of peers (``packing`` places a chunk in
every message at once, ``kernels.decode_sum_unwhiten`` sums every peer's message at once). The
number of chunks depends on the layout and the budget, not on the data-parallel size.

Sender (``encode_bucket``)::

    U = G T            per GIFT weight, whole rows (``kernels.whiten_encode``; G elsewhere)
    Ũ = U + e          with error feedback (then the residual e ← Ũ - dec(q(Ũ)) is staged)
    codes, scales of q(Ũ) → each shard's message        (``cast_bucket``: U in a float wire dtype)

Receiver (``reduce_coded``, ``sum_plain``): the FP32 sum of every sender's codes (or plain values)
of one segment part, senders in rank order, ÷ R when averaging, ``T⁻¹`` of whole rows when given,
written straight into its destination (a bucket slice, a message section) in that one's dtype.
The fused kernels take a whole part in one launch (``CHUNK``: None); the PyTorch path cuts it
into chunks of ``CHUNK[False]`` elements.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..numerics.error_feedback import ErrorFeedback
from ..numerics.fp8 import decode_flat, encode_flat
from .layout import BucketLayout, Part, ShardPlan
from .packing import Packing, Rows

# Elements per chunk: the PyTorch path (~24 bytes of temporaries per element), the fused kernels
# (which hold no large temporaries; the placement index takes ~32 bytes per element).
BUDGET = {False: 1 << 14, True: 1 << 20}
# Elements of a segment part per receiver chunk: the fused kernels hold no temporaries but their
# output, so they take a whole part (None); the PyTorch reference holds ~24 bytes per element of
# each sender's message in a chunk, bounded by chunks of 16M elements (and, as R senders' copies of
# a part are at most the bucket, by ~24 bytes per element of the bucket). Not divided by the number
# of senders: the ops of a part are the same at any data-parallel size.
CHUNK = {False: 1 << 24, True: None}


def views(buf: torch.Tensor, layout: BucketLayout) -> dict[str, torch.Tensor]:
    """``buf`` (uint8, a multiple of 4 bytes) viewed in each sequence's dtype (coded: the format's codes)."""
    return {"coded": buf.view(layout.coded_dtype()), "groups": buf.view(layout.codec.scale_dtype()),
            "off": buf.view(layout.plain_dtypes[0]), "bf16": buf.view(torch.bfloat16)}  # fmt: skip


def _segment_chunks(layout: BucketLayout, i: int, budget: int, whiten: bool):
    s, at = layout.segments[i], layout.seg_at[i]
    return layout.chunks(i, at, at + s.rows * s.cols, budget, whole_rows=whiten)


def encode_bucket(buf: torch.Tensor, pk: Packing, flat: torch.Tensor, layout: BucketLayout, transforms,
                  use_kernels: bool, error_feedback: ErrorFeedback | None = None) -> None:  # fmt: skip
    """Every coded value of ``flat`` (whitened where ``transforms`` has a ``T``) as codes of the
    format and scales into its message in ``buf`` (the module doc's sender); ``pk``'s source is the bucket."""
    out, cfg = views(buf, layout), layout.codec
    use_kernels = use_kernels and error_feedback is None  # the kernel cannot add the residual before encoding
    for i in layout.coded_segments:
        s, at, t = layout.segments[i], layout.seg_at[i], transforms[i]
        for k0, k1 in _segment_chunks(layout, i, BUDGET[use_kernels], t is not None):
            g0, g1 = layout.group_range(k0, k1)
            lengths = layout.lengths(g0, g1, flat.device)
            x = flat[s.start + k0 - at : s.start + k1 - at]
            x = x.view(-1, s.cols) if t is not None else x.view(1, -1)
            if error_feedback is None:
                enc = kernels.whiten_encode(x, t, cfg, lengths=lengths, fused=use_kernels)
            else:
                u = error_feedback.compensate(t.apply(x.float()) if t is not None else x, k0)
                enc = encode_flat(u.view(-1), lengths, cfg)
                error_feedback.stage(u, decode_flat(enc, lengths, cfg), k0)
            out["coded"].index_copy_(0, pk.place["coded"].index(k0, k1), enc.payload.view(-1))
            out["groups"].index_copy_(0, pk.place["groups"].index(g0, g1), enc.scales.view(-1))


def cast_bucket(buf: torch.Tensor, pk: Packing, flat: torch.Tensor, layout: BucketLayout, transforms,
                wire: torch.dtype) -> None:  # fmt: skip
    """Every coded value of ``flat`` (whitened where ``transforms`` has a ``T``) in the float
    ``wire`` dtype into its message in ``buf``."""
    out = buf.view(wire)
    for i in layout.coded_segments:
        s, at, t = layout.segments[i], layout.seg_at[i], transforms[i]
        for k0, k1 in _segment_chunks(layout, i, BUDGET[False], t is not None):
            x = flat[s.start + k0 - at : s.start + k1 - at]
            u = t.apply(x.view(-1, s.cols).float()) if t is not None else x
            out.index_copy_(0, pk.place["coded"].index(k0, k1), u.reshape(-1).to(wire))


def plain_bucket(buf: torch.Tensor, pk: Packing, flat: torch.Tensor, layout: BucketLayout) -> None:
    """The values of ``off`` and ``bf16`` parameters, in the bucket's dtype and in BF16, into their messages."""
    out = views(buf, layout)
    for c, name in enumerate(("off", "bf16")):
        for i in layout.plain_segments[c]:
            s, at = layout.segments[i], layout.seg_at[i]
            for k0 in range(0, s.rows * s.cols, BUDGET[False]):
                k1 = min(s.rows * s.cols, k0 + BUDGET[False])
                values = flat[s.start + k0 : s.start + k1].to(layout.plain_dtypes[c])
                out[name].index_copy_(0, pk.place[name].index(at + k0, at + k1), values)


def sum_plain(rows: Rows, layout: BucketLayout, c: int, k0: int, k1: int, average: bool, fused: bool,
              out: torch.Tensor | None = None, place: tuple | None = None) -> torch.Tensor:  # fmt: skip
    """FP32 sum over the senders (rank order) of plain class ``c``'s values ``[k0, k1)`` of the
    message, ÷ R when averaging, into ``out`` / at ``place`` (``kernels.sum_rows``)."""
    return kernels.sum_rows(rows.plain(c, k0, k1, layout.plain_dtypes[c]), average, out, place, fused=fused)


def reduce_coded(rows: Rows, layout: BucketLayout, plan: ShardPlan, k0: int, k1: int, shape: tuple[int, int],
                 whitening, average: bool, fused: bool, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``(Σ_i dec(message_i) [÷ R]) T⁻¹`` (``T⁻¹`` where ``whitening`` is given) of coded values
    ``[k0, k1)`` of the bucket's coded sequence from ``rows``' messages of shard ``plan``: ``shape``,
    into ``out`` when given (else FP32; the fused kernels where ``fused`` and they can run)."""
    g0, g1, lengths = layout.group_slice(k0, k1, rows.parts[0].device)
    payloads = rows.coded(k0 - plan.coded_lo, k1 - plan.coded_lo, layout.coded_dtype())
    scales = rows.scales(g0 - plan.group_lo, g1 - plan.group_lo, layout.codec.scale_dtype())
    return kernels.decode_sum_unwhiten(payloads, scales, *shape, whitening, layout.codec, average, lengths=lengths,
                                       fused=fused, out=out)  # fmt: skip


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
