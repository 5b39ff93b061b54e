"""What a quantized reduction put on the wire, per stage and segment: a test-only hook.

``WireRecord`` (a context manager) wraps the entry points every reduction's senders and receivers
call (``kernels.whiten_encode``, ``whiten_place``, ``decode_sum_unwhiten``, ``decode_placed``) and
records, for each call, which stage of which reduction made it (the outermost frame whose ``self``
is a ``comm.quantized.ShardReduction``: ``_send``, ``_intra``, ``_node_sums``, ``_reduce``, ...), the
segment of the bucket the values came from or went to (by address in the reduction's ``flat``;
None for values the reduction computed itself, e.g. node partial sums), the dtype and the bytes of
the message section, and whether the call was given a ``T`` (``whitened``). So a test reads the
path from what was sent (FP8 or a float wire dtype, ``G T`` or ``G``, two-level or flat stages),
not from the DDP's own state. Nothing here runs outside a ``with WireRecord()`` block: the steady
path is untouched.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from .. import kernels

_FLOATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class WireEntry:
    """One call: ``op`` is ``encode`` (FP8 codes and scales written into messages), ``cast`` (coded
    values in a float wire dtype: the two-level intra-node stage), ``plain`` (an ``off`` or ``bf16``
    parameter's values) or ``decode`` (FP8 messages read back, ``T⁻¹`` applied when ``whitened``)."""

    stage: str | None
    op: str
    segment: str | None
    dtype: str
    nbytes: int
    whitened: bool
    output_side: bool = False  # the output side's: ``T_outᵀ G T`` sent (``output`` given), ``W`` received


def _reduction():
    """The outermost caller frame's ``ShardReduction``, its method's name (the stage) and the output side's
    targets that stage was handed (``prev.targets``; {} without); (None, None, {}) outside one."""
    from ..comm.quantized import ShardReduction

    found, frame = (None, None, {}), sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, ShardReduction):
            found = owner, frame.f_code.co_name, getattr(frame.f_locals.get("prev"), "targets", None) or {}
        frame = frame.f_back
    return found


def _within(t: torch.Tensor, base: torch.Tensor) -> bool:
    at = t.data_ptr() - base.data_ptr()
    return t.dtype == base.dtype and 0 <= at < base.numel() * base.element_size()


def _segment(owner, targets: dict, t: torch.Tensor | None) -> tuple[str | None, bool]:
    """The name of the segment of ``owner.flat`` that ``t`` starts in, or whose receiver target it lies
    in (``targets``: the output side's ``W``; then True), ``(None, False)``: neither."""
    if owner is None or t is None or t.numel() == 0:
        return None, False
    for i, (base, _) in targets.items():
        if _within(t, base):
            return owner.layout.segments[i].name, True
    flat = owner.flat
    if not _within(t, flat):
        return None, False
    k = (t.data_ptr() - flat.data_ptr()) // flat.element_size()
    return next((s.name for s in owner.layout.segments if s.start <= k < s.end), None), False


class WireRecord:
    """``entries``: every ``WireEntry`` made while the block runs, in call order (module doc)."""

    def __init__(self):
        self.entries: list[WireEntry] = []
        self._saved = {}

    def _add(self, op, segment_of, dtype, nbytes, whitened, output=False):
        owner, stage, targets = _reduction()
        segment, target = _segment(owner, targets, segment_of)
        self.entries.append(WireEntry(stage, op, segment, dtype, int(nbytes), whitened, output or target))

    def __enter__(self) -> WireRecord:
        names = ("whiten_encode", "whiten_place", "decode_sum_unwhiten", "decode_placed")
        inner = self._saved = {name: getattr(kernels, name) for name in names}

        def whiten_encode(g, whitening, cfg, *args, lengths=None, **kw):
            groups = lengths.numel() if lengths is not None else math.prod(cfg.groups(*g.shape))
            nbytes = g.numel() * cfg.fmt.code_dtype.itemsize + groups * cfg.scale_dtype().itemsize
            self._add("encode", g, cfg.fmt.label, nbytes, whitening is not None, kw.get("output") is not None)
            return inner["whiten_encode"](g, whitening, cfg, *args, lengths=lengths, **kw)

        def whiten_place(x, whitening, into, *args, **kw):
            frame = sys._getframe(1)
            while frame.f_globals.get("__name__") == kernels.__name__:  # through ``CodecOps``, to its caller
                frame = frame.f_back
            dtype, caller = into.out.dtype, frame.f_code.co_name
            op = "plain" if caller == "plain_bucket" else "cast"
            self._add(
                op,
                x,
                _FLOATS.get(dtype, str(dtype)),
                x.numel() * dtype.itemsize,
                whitening is not None,
                kw.get("output") is not None,
            )
            return inner["whiten_place"](x, whitening, into, *args, **kw)

        def decode_sum_unwhiten(payloads, scales, rows, cols, whitening, cfg, *args, out=None, **kw):
            self._add("decode", out, cfg.fmt.label, rows * cols, whitening is not None)
            return inner["decode_sum_unwhiten"](payloads, scales, rows, cols, whitening, cfg, *args, out=out, **kw)

        def decode_placed(src, rows, cols, whitening, cfg, *args, out=None, **kw):
            self._add("decode", out, cfg.fmt.label, rows * cols, whitening is not None)
            return inner["decode_placed"](src, rows, cols, whitening, cfg, *args, out=out, **kw)

        for fn in (whiten_encode, whiten_place, decode_sum_unwhiten, decode_placed):
            setattr(kernels, fn.__name__, fn)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(kernels, name, fn)

    def clear(self) -> None:
        self.entries.clear()

    def stages(self) -> set[str]:
        """The stages that ran: ``_intra`` / ``_node_sums`` only on the two-level path, ``_send`` only on
        the flat one; ``_gather`` / ``_gather_inter`` only for an all-reduce."""
        return {e.stage for e in self.entries if e.stage is not None}

    def sent(self, segment: str) -> set[tuple[str, str, str, bool]]:
        """``(stage, op, dtype, whitened)`` of every sender call (encode, cast) of ``segment``'s values."""
        return {(e.stage, e.op, e.dtype, e.whitened) for e in self.entries if e.segment == segment and e.op != "decode"}

    def received(self, segment: str) -> set[tuple[str, str, bool]]:
        """``(stage, dtype, whitened)`` of every decode written into ``segment``."""
        return {(e.stage, e.dtype, e.whitened) for e in self.entries if e.segment == segment and e.op == "decode"}

    def nbytes(self, segment: str, stage: str | None = None) -> int:
        """Bytes of ``segment``'s message sections written by its senders (``stage``'s alone when given;
        the own shard's included, though it never leaves the rank)."""
        return sum(
            e.nbytes for e in self.entries if e.segment == segment and e.op != "decode" and stage in (None, e.stage)
        )

    def mode(self, segment: str) -> str:
        """What the senders of ``segment`` did, as a plugin mode: ``gift`` (coded, every call given
        ``T``), ``euclidean`` (coded, no call given ``T``), ``bf16`` / ``off`` (plain values in BF16 /
        in the bucket's dtype), ``mixed`` otherwise, ``none`` where nothing was sent; ``+out`` where
        every coded call sent the output side's ``T_outᵀ G T`` (``comm.output_side``)."""
        mode = self._mode(self.sent(segment))
        out = {e.output_side for e in self.entries if e.segment == segment and e.op != "decode"}
        if out == {True, False} or (out == {True} and mode not in ("gift", "euclidean")):
            return "mixed"
        return mode + "+out" if out == {True} else mode

    @staticmethod
    def _mode(calls) -> str:
        ops, dtypes, whitened = {c[1] for c in calls}, {c[2] for c in calls}, {c[3] for c in calls}
        if not calls:
            return "none"
        if ops == {"plain"}:
            return (
                "bf16"
                if dtypes == {"bf16"}
                else ("off" if len(dtypes) == 1 and dtypes <= {"fp32", "fp16"} else "mixed")
            )
        if "plain" in ops or len(whitened) > 1:
            return "mixed"
        return "gift" if whitened == {True} else "euclidean"
