"""Fused Triton kernels for the two hot paths of a GIFT gradient exchange, with the pure-PyTorch
code as reference and fallback:

- sender, ``whiten_encode``: ``U = G T`` (``T_outᵀ G T`` with an output side; ``+ e`` with error
  feedback, the new residual written)
  and its FP8 codes and scales in one pass over ``G`` after the small ``G Q`` (1x128 block scales;
  MX and TENSOR scaling, and ROW without ``lengths``, take two passes), written straight into a buffer
  of messages at the positions of a per-layout table (``into``) or returned; ``whiten_place``:
  ``G T`` (or the values as they are) cast to a float wire dtype at the table's positions
  (``kernels/place.py``);
- receiver, ``decode_sum_unwhiten``: decode R ranks' messages, sum them in FP32 in rank order,
  ``÷ R`` if averaging, and apply ``T⁻¹``: one launch for the sum whatever R, written straight
  into the caller's ``out`` (a bucket slice) in its dtype; ``decode_placed``, the same for one
  all-gathered message per shard read at a table's positions (``kernels/receive.py``);
  ``sum_rows`` / ``take``, the FP32 rank sum of float values (plain values, a BF16/FP32 wire)
  and a placed read, one launch each; ``output_inverse``, the output side's ``T_out⁻ᵀ`` on a rank's
  elements of a two-sided parameter, one launch per parameter (``kernels/output.py``);
- the four-bit exchange's encode into its messages and decode-sum (``kernels/fp4.py``, through
  ``CodecOps.fp4``; bit for bit ``numerics.fp4``).

Each agrees with ``reference_whiten_encode`` / ``reference_decode_sum_unwhiten``: ``U`` and
``T⁻¹`` to FP32 rounding (true FP32: no TF32 whatever cuBLAS is told); the codes and scales bit
for bit those of ``fp8.encode(U)`` / ``fp8.encode_flat(U, lengths)`` (so those of the reference
where there is no whitening), and the rank sum bit for bit. The kernels' math is in
``kernels/fused.py``. They run where ``available(device)``: on CUDA, or on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, set before the first call here: triton reads it when the
kernels are defined), for every format whose table entry names them (``WireFormat.kernels``: E4M3
and E5M2), scaling and block size, with or without ``lengths`` and messages in up to
``fused.MAX_PARTS`` non-empty parts (TENSOR scaling with ``lengths`` through ``TensorUnits``). The
reference runs instead for other formats, for an output side given with its ``Pre`` (rows of a
parameter), for more parts, for empty inputs, elsewhere, and without triton.
The kernel path never synchronises the host with the device.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..numerics.fp8 import CodecConfig, Encoded, Scaling
from ..numerics.two_sided import OutputRows
from ..numerics.two_sided import output_inverse as reference_output_inverse  # the reference lives with its math
from ..numerics.whitening import LowRankWhitening
from ..numerics.wire import KERNELS
from .placement import Place, Placement, RowsAt
from .reference import (
    _write,
    ordered_sum,
    reference_decode_placed,
    reference_decode_sum_unwhiten,
    reference_sum_rows,
    reference_take,
    reference_whiten_encode,
    reference_whiten_place,
)

__all__ = [
    "available",
    "CodecOps",
    "ordered_sum",
    "Place",
    "RowsAt",
    "StackedWhitening",
    "Placed",
    "whiten_encode",
    "whiten_place",
    "decode_sum_unwhiten",
    "decode_placed",
    "sum_rows",
    "take",
    "output_inverse",
    "unwhiten",
    "reference_whiten_encode",
    "reference_whiten_place",
    "reference_decode_sum_unwhiten",
]


@functools.cache
def _fused():
    """The kernel module, or None where triton does not import."""
    try:
        from . import fused
    except ImportError:
        return None
    return fused


@functools.cache
def _place():
    """The placed-cast kernel module (imports triton; only where ``_fused()`` is not None)."""
    from . import place

    return place


@functools.cache
def _output():
    """The output-side inverse's kernel module (imports triton; only where ``_fused()`` is not None)."""
    from . import output

    return output


def _fp4():
    """The four-bit codec's kernel module (imports triton; only where ``_fused()`` is not None)."""
    from . import fp4

    return fp4


def _receive():
    """The placed receive kernels (``kernels/receive.py``), or None where triton does not import."""
    try:
        from . import receive
    except ImportError:
        return None
    return receive


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: triton imports, and ``device`` is CUDA or
    the interpreter is on."""
    device = torch.device(device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _fused() is not None


def _lengths(cfg: CodecConfig, lengths: torch.Tensor | None) -> torch.Tensor | None:
    """``lengths`` as the kernels take them: one per-tensor group is the matrix codec's own."""
    return None if lengths is not None and cfg.scaling is Scaling.TENSOR and lengths.numel() == 1 else lengths


def _use_kernels(kernel: str, fused: bool, device: torch.device, numel: int, cfg: CodecConfig) -> bool:
    """Whether ``kernel`` runs rather than the reference (module doc)."""
    return fused and numel > 0 and kernel in cfg.fmt.kernels and available(device)


TENSOR_UNIT = 512  # columns of a unit of a per-tensor group given by lengths (read in chunks of fused.TILE)


@dataclass(frozen=True)
class TensorUnits:
    """Per-tensor scaling groups given by ``lengths`` (a weight's piece in a shard, many rows long) cut where
    a row ends and every ``TENSOR_UNIT`` columns, so that the kernels take them as groups of one row: the
    units' ``lengths`` (int64), each unit's ``group`` and the groups' count ``n``. Built on the device from
    the shapes alone (no host sync; a cut on a group's end leaves an empty unit): ~10 small launches, a
    unit index per ``TENSOR_UNIT`` elements."""

    lengths: torch.Tensor
    group: torch.Tensor
    n: int

    @classmethod
    def of(cls, lengths: torch.Tensor, rows: int, cols: int) -> TensorUnits:
        dev, n = lengths.device, lengths.numel()
        ends = torch.cumsum(lengths, 0, dtype=torch.int64)
        starts = torch.arange(rows, device=dev)[:, None] * cols + torch.arange(0, cols, TENSOR_UNIT, device=dev)
        bounds = torch.sort(torch.cat([starts.view(-1)[1:], ends])).values  # the units' ends: cuts, the groups' ends
        unit_lengths = torch.diff(bounds, prepend=bounds.new_zeros(1))
        group = torch.searchsorted(ends, bounds - unit_lengths, right=True).clamp_(max=n - 1)
        return cls(unit_lengths, group, n)

    def scales(self, group_scales: torch.Tensor) -> torch.Tensor:
        """Each unit's copy of its group's scale (``[..., n]`` to ``[..., units]``)."""
        return group_scales.index_select(-1, self.group)

    def place(self, buf: torch.Tensor, shards: int = 1) -> Place:
        """``buf`` (the units' scales, one each) as a ``Place`` of its own, where the kernels put or find them
        (``shards``: as many as the codes' table, whose shard ``decode_placed`` reads the scales' at)."""
        return Placement.whole(buf.numel(), buf.device, shards).at(buf, 0)


@dataclass(frozen=True)
class Placed:
    """Where an encoding goes: its codes (memory order) and its scales (one per group, in order)."""

    codes: Place
    scales: Place


def whiten_encode(
    g: torch.Tensor,
    whitening: LowRankWhitening | None,
    cfg: CodecConfig,
    out: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    fused: bool = True,
    into: Placed | None = None,
    feedback: tuple[torch.Tensor, torch.Tensor] | None = None,
    output: OutputRows | None = None,
) -> Encoded | None:
    """``fp8.encode(G T)`` of ``g [rows, cols]`` (``T = I`` when ``whitening`` is None): payload
    ``[rows, cols]`` codes, scales ``cfg.groups(rows, cols)`` (flat, one per group, with
    ``lengths``: groups in memory order other than the matrix codec's, each inside one row unless
    the scaling is per tensor); ``out``, when given, receives the encoded values in FP32 (``G T``,
    ``+ e`` with ``feedback``); ``fused=False`` takes the PyTorch reference wherever the kernels could run.

    ``into``: the codes and scales are written straight into a buffer at the positions of its
    tables (``Placed``), nothing returned; every group must lie inside one shard of the tables (the
    layout's groups, cut at shard boundaries, do). ``feedback = (e, e')``: FP32 tensors of ``g``'s
    numel (contiguous; ``e'`` may be ``e`` itself, each element read before it is written); ``Ũ = G T + e``
    is encoded and ``e' ← Ũ - dec(q(Ũ))`` written (error feedback).

    ``output``: the output side too, ``U = T_outᵀ G T`` (``two_sided.OutputRows``, on ``g``'s rows; with
    ``lengths`` each group inside one row). Without its ``Pre`` (``g`` the whole parameter) the kernels
    form it in the read of ``G`` that gives ``T``'s projection and ``T_outᵀ`` row by row in the pass:
    ``G`` is read twice, as with ``T`` alone; with it (rows of a parameter) the reference runs."""
    flat, lengths = lengths is not None, _lengths(cfg, lengths)
    if _use_kernels("whiten_encode", fused, g.device, g.numel(), cfg) and (output is None or output.pre is None):
        if lengths is None or cfg.scaling is not Scaling.TENSOR:
            enc = _fused().whiten_encode(
                g, whitening, cfg, out=out, lengths=lengths, into=into, feedback=feedback, output=output
            )
            return enc if enc is None or not flat else Encoded(enc.payload, enc.scales.reshape(-1))
        units, scratch = TensorUnits.of(lengths, *g.shape), None
        if into is not None:  # the codes placed; the units' scales to a scratch, the groups' placed after
            scratch = Placed(into.codes, units.place(torch.empty_like(units.group, dtype=into.scales.out.dtype)))
        enc = _fused().whiten_encode(
            g,
            whitening,
            cfg,
            out=out,
            lengths=units.lengths,
            into=scratch,
            feedback=feedback,
            output=output,
            groups=(units.group, units.n),
        )
        if into is None:
            return enc
        _write(into.scales, enc.scales)
        return None
    return reference_whiten_encode(
        g, whitening, cfg, out=out, lengths=lengths, into=into, feedback=feedback, output=output
    )


def whiten_place(
    x: torch.Tensor | RowsAt,
    whitening: LowRankWhitening | Sequence[LowRankWhitening] | None,
    into: Place,
    fused: bool = True,
    output: OutputRows | None = None,
    stacked: StackedWhitening | None = None,
) -> None:
    """``x [rows, cols]`` (``G T`` in FP32 where ``whitening`` is given, ``T_outᵀ G T`` with ``output``
    as in ``whiten_encode``) cast to ``into.out``'s dtype, element ``i`` (memory order) written at its
    position of ``into`` (``Place``): the float intra-node wire and the plain values. ``x`` may be a
    ``RowsAt``, its rows read where they lie, with one input-side whitening per matrix (``whitening``: their
    list, ``stacked`` their factors stacked where the caller keeps them; one launch each for ``G Q`` and
    the pass whatever the matrices). ``fused``: the Triton kernel wherever it can run (``available``;
    ``output`` without its ``Pre``), else the PyTorch reference."""
    if x.numel() == 0:  # nothing to place (a rank whose shards hold none of a parameter's rows)
        return None
    if isinstance(x, RowsAt):
        if output is not None or whitening is None or len(whitening) != len(x.spans):
            raise ValueError("whiten_place reads rows in place (RowsAt) with one input-side whitening per matrix")
        if fused and available(x.buffer.device):
            return _place().whiten_place(x, stacked or StackedWhitening.of(whitening), into)
        for (r0, n), w in zip(x.spans, whitening):  # each matrix's rows at its span of the sequence
            if n:
                reference_whiten_place(x.gathered(r0, n), w, Place(into.out, into.table, into.at + r0 * x.cols))
        return None
    if fused and available(x.device) and (output is None or output.pre is None):
        return _place().whiten_place(x, whitening, into, output)
    return reference_whiten_place(x, whitening, into, output)


@dataclass(frozen=True)
class StackedWhitening:
    """The factors the sender's kernels read of several whitenings of one width and rank, stacked (matrix ``m``
    at ``[m]``): what ``whiten_place`` passes them for a ``RowsAt`` of several matrices. One matrix: its own
    tensors (no copy). Four launches to build: a caller that uses them every step keeps them (``comm.sum_first``)."""

    d_inv_sqrt: torch.Tensor
    q: torch.Tensor
    q_t: torch.Tensor
    c: torch.Tensor
    rank: int

    @classmethod
    def of(cls, ws: Sequence[LowRankWhitening]) -> StackedWhitening:
        if len(ws) == 1:
            w = ws[0]
            return cls(w.d_inv_sqrt, w.q, w.q_t, w.c, w.rank)
        if len({(w.d_inv_sqrt.numel(), w.rank) for w in ws}) != 1:
            raise ValueError("stacked whitenings need one width and one rank")
        stack = [torch.stack([getattr(w, name) for w in ws]) for name in ("d_inv_sqrt", "q", "q_t", "c")]
        return cls(*stack, ws[0].rank)


def decode_sum_unwhiten(
    payloads: torch.Tensor | Sequence[torch.Tensor],
    scales: torch.Tensor | Sequence[torch.Tensor],
    rows: int,
    cols: int,
    whitening: LowRankWhitening | None,
    cfg: CodecConfig,
    average: bool,
    lengths: torch.Tensor | None = None,
    fused: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(Σ_i dec(payloads[i], scales[i]) [÷ R]) T⁻¹`` as ``[rows, cols]`` from ``R`` ranks'
    messages: ``payloads [R, rows·cols]`` codes, ``scales [R, groups]`` as ``fp8.encode`` made them
    (grouped by ``lengths`` when given), each also as a sequence of parts whose rows in turn are the
    ranks in order (``reference``'s module doc); ``fused`` as in ``whiten_encode``. Written into
    ``out`` (contiguous, ``rows·cols`` elements, FP32/BF16/FP16: the FP32 result rounded once) and
    returned as ``[rows, cols]``; a new FP32 tensor without it."""
    parts = [p for p in ([payloads] if isinstance(payloads, torch.Tensor) else payloads) if p.shape[0] > 0]
    lengths = _lengths(cfg, lengths)
    if (
        parts
        and _use_kernels("decode_sum_unwhiten", fused, parts[0].device, rows * cols, cfg)
        and len(parts) <= _fused().MAX_PARTS
    ):
        if lengths is not None and cfg.scaling is Scaling.TENSOR:  # each unit given its group's scale
            units = TensorUnits.of(lengths, rows, cols)
            lengths = units.lengths
            scales = units.scales(scales) if isinstance(scales, torch.Tensor) else [units.scales(s) for s in scales]
        return _fused().decode_sum_unwhiten(
            payloads, scales, rows, cols, whitening, cfg, average, lengths=lengths, out=out
        )
    return reference_decode_sum_unwhiten(
        payloads, scales, rows, cols, whitening, cfg, average, lengths=lengths, out=out
    )


def decode_placed(
    src: Placed,
    rows: int,
    cols: int,
    whitening: LowRankWhitening | None,
    cfg: CodecConfig,
    lengths: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    fused: bool = True,
) -> torch.Tensor:
    """``dec(c, s) T⁻¹`` as ``[rows, cols]`` (written into ``out`` as ``decode_sum_unwhiten`` does) of
    one message per shard in a buffer, read where ``src`` places them (``Placed``, as ``whiten_encode``
    writes): element ``i`` of the matrix is element ``i`` of ``src.codes``, and its group ``u`` (the
    matrix codec's, or ``lengths``') element ``u`` of ``src.scales``. Each group lies in one shard of
    the tables' source."""
    lengths = _lengths(cfg, lengths)
    if _use_kernels("decode_sum_unwhiten", fused, src.codes.out.device, rows * cols, cfg):
        if lengths is not None and cfg.scaling is Scaling.TENSOR:  # each unit given its group's scale
            units = TensorUnits.of(lengths, rows, cols)
            group_scales = _receive().take(src.scales, torch.empty(units.n, device=src.scales.out.device))
            scales = units.place(units.scales(group_scales), src.codes.table.delta.numel())
            src, lengths = Placed(src.codes, scales), units.lengths
        return _receive().decode_placed(src, rows, cols, whitening, cfg, lengths, out)
    return reference_decode_placed(src, rows, cols, whitening, cfg, lengths, out)


def _use_sum(fused: bool, parts: Sequence[torch.Tensor], out: torch.Tensor | None) -> bool:
    """Whether ``receive._sum_kernel`` runs: float dtypes, at most three non-empty parts, values to sum."""
    parts = [p for p in parts if p.shape[0] > 0]
    floats = (torch.float32, torch.bfloat16, torch.float16)
    return (
        fused
        and parts
        and parts[0].shape[-1] > 0
        and available(parts[0].device)
        and len(parts) <= 3
        and all(p.dtype in floats for p in parts)
        and (out is None or out.dtype in floats)
    )


def sum_rows(
    parts: torch.Tensor | Sequence[torch.Tensor],
    average: bool,
    out: torch.Tensor | Place | None = None,
    fused: bool = True,
) -> torch.Tensor | None:
    """``Σ_i x_i`` over the rows of ``parts`` (``[k, n]`` each, FP32/BF16/FP16, inner stride 1; the
    rows, part after part, the senders in order), FP32 in row order (``ordered_sum``'s bits), ``÷ R``
    when averaging; into ``out`` (``[n]``, the FP32 result rounded once to its dtype; a new FP32
    tensor when None) or, ``out`` a ``Place``, element ``i`` at its position (nothing returned)."""
    parts = [parts] if isinstance(parts, torch.Tensor) else list(parts)
    if isinstance(out, Place) and parts[0].shape[-1] == 0 and fused and available(parts[0].device):
        return None  # nothing to place: no launch (the reference runs its ops on empty tensors, as on every rank)
    if _use_sum(fused, parts, out.out if isinstance(out, Place) else out):
        return _receive().sum_rows(parts, average, out)
    return reference_sum_rows(parts, average, out)


def take(src: Place, out: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """``out[i]`` = element ``i`` of ``src`` (a ``Place`` read back; ``out`` contiguous, cast to its dtype)."""
    if _use_sum(fused, [src.out.view(1, -1)[:, : out.numel()]], out):
        return _receive().take(src, out)
    return reference_take(src, out)


def output_inverse(
    w: LowRankWhitening,
    values: torch.Tensor,
    cols: int,
    e0: int,
    proj: torch.Tensor,
    out: torch.Tensor,
    fused: bool = True,
) -> None:
    """``out = T_out⁻ᵀ W`` on elements ``[e0, e0 + n)`` of a two-sided parameter ``[d_out, cols]``
    (``w``: ``T_out``; ``values [n]`` FP32; ``proj``: the whole ``P = Qᵀ W`` ``[r, cols]``), computed in
    FP32 and rounded once to ``out``'s dtype (``numerics.two_sided.output_inverse``, the reference):
    one Triton launch wherever the kernels can run (``fused``, ``available``), else the reference."""
    if fused and values.numel() > 0 and available(values.device):
        return _output().output_inverse(w, values, cols, e0, proj, out)
    return reference_output_inverse(w, values, cols, e0, proj, out)


def unwhiten(s: torch.Tensor, whitening: LowRankWhitening, out: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """``out ← S T⁻¹`` of an FP32 sum ``S [rows, cols]`` (contiguous; ``out`` the same shape, FP32 or BF16:
    the FP32 result rounded once), returned: the kernels' two launches (``fused.unwhiten``, ``S Q`` then the
    pass) wherever they can run, else ``LowRankWhitening.inverse``. The two agree to FP32 rounding."""
    if fused and s.numel() > 0 and available(s.device) and out.dtype in (torch.float32, torch.bfloat16):
        return _fused().unwhiten(s, out, whitening)
    out.copy_(whitening.inverse(s))
    return out


@dataclass(frozen=True)
class CodecOps:
    """A reduction's codec calls, chosen once: the fused Triton kernels wherever they can run
    (``fused``; each call still falls back to the reference where its own case needs it) or the
    PyTorch reference throughout. The reduction's stages call these, never passing a flag."""

    fused: bool

    @classmethod
    def resolve(cls, device: torch.device, use: bool | None, codec: CodecConfig) -> CodecOps:
        """From the ``kernels`` setting ``use`` (``GiftConfig.exchange.kernels``: None on CUDA where the
        kernels are ``available``; True wherever they are available, the CPU included when Triton's
        interpreter is on (slow: for tests); False never), and never for a wire format whose table
        entry does not name them all. Every rank of a group passes the same."""
        if use is False or (use is None and device.type != "cuda") or codec.fmt.kernels != KERNELS:
            return cls(False)
        return cls(available(device))

    def whiten_encode(self, g, whitening, cfg, **kw) -> Encoded | None:
        return whiten_encode(g, whitening, cfg, fused=self.fused, **kw)

    def whiten_place(self, x, whitening, into, output=None, stacked=None) -> None:
        return whiten_place(x, whitening, into, fused=self.fused, output=output, stacked=stacked)

    def decode_sum_unwhiten(self, payloads, scales, rows, cols, whitening, cfg, average, **kw) -> torch.Tensor:
        return decode_sum_unwhiten(payloads, scales, rows, cols, whitening, cfg, average, fused=self.fused, **kw)

    def decode_placed(self, src, rows, cols, whitening, cfg, **kw) -> torch.Tensor:
        return decode_placed(src, rows, cols, whitening, cfg, fused=self.fused, **kw)

    def sum_rows(self, parts, average, out=None) -> torch.Tensor | None:
        return sum_rows(parts, average, out, fused=self.fused)

    def take(self, src, out) -> torch.Tensor:
        return take(src, out, fused=self.fused)

    def output_inverse(self, w, values, cols, e0, proj, out) -> None:
        return output_inverse(w, values, cols, e0, proj, out, fused=self.fused)

    def unwhiten(self, s, whitening, out) -> torch.Tensor:
        return unwhiten(s, whitening, out, fused=self.fused)

    def fp4(self, device: torch.device):
        """The four-bit exchange's kernels (``kernels/fp4.py``: ``encode_placed``, ``decode_sum``) where they
        run (``fused``, ``available``), else None: the caller takes ``numerics.fp4``, their reference."""
        return _fp4() if self.fused and available(device) else None
