"""One refresh's factor builds on the rank that owns the layers, and the fixed-size record each
build is sent in. No torch.distributed here (``refresh_sync.RefreshSync`` sends the records).

A build runs in five stages that alternate between the statistics' device and the host, with one
host transfer between them (``HostCopy``), batched over every layer of the refresh::

    grams             device  summed EMA -> averages (FP64); sketch: [ΩᵀY, YᵀY, ΩᵀΩ] (k x k),
                              exact statistics: A itself                          -> host
    cores             host    Nyström core (shift, Cholesky, k x k eigh) or A's eigh: B, λ  -> device
    whitening_grams   device  V = (Y + νΩ) B, residual diagonal, and per damping candidate δ:
                              D_δ, W_δ = D_δ^{-1/2} V Λ^{1/2}, S_δ = W_δᵀ W_δ (r x r)   -> host
    whitening_cores   host    S_δ = P diag(s) Pᵀ (r x r eigh)                          -> device
    finish            device  Q_δ, c_δ, c'_δ; the wire's error (FP8, or four bits between nodes:
                              ``fp4.FP4Wire``) on the owner's own gradient
                              (``profile.damping_errors``) of each T_δ (``--gift-damping auto``:
                              the choice, ``profile.damping_choice``) and of the previous build's
                              T, which never saw this gradient (the cold-start rule,
                              ``profile.held_out_gate``: Euclidean unless it beat plain FP8),
                              all on the device; the record

(the maths: ``numerics.whitening``). Host stages run FP64 LAPACK on k x k and r x r matrices only;
device stages never wait for the host. A stage that raises marks its layer ``FAILED`` (the rest
go on), so the record of every layer is always written: its header tells every rank what happened.

Output side (``numerics.two_sided``): a layer with output-gradient statistics ``B`` (``d_out``)
builds ``T_out`` from them in the same stages, exactly as ``T_in`` from ``A`` (each stage's parts of
a layer: the input side's, then the output side's). The damping choice is then joint, over the
candidates ``kinds`` names (``SIDE_KINDS``): ``(δ_in, T_out = I)`` for every δ_in (``input``) and/or
``(δ_in, δ_out)`` over the grid x grid (``both``), each measured as ``TwoSidedWhitening`` by
``profile.damping_errors``; the held-out check runs on the previous build's best pair. An output
side without tokens (``B`` is folded a step late: none at the first refresh), non-finite, or left
at rank 0 (a diagonal ``T_out`` gains nothing: ``two_sided``) offers no candidate: the input side
goes on alone, and the output header says why.

Record of one layer (``RecordLayout``), per side (``input``: size ``d_in``, ``A``; then, for a layer
with output statistics, ``output``: size ``d_out``, ``B``), factor rank ``r``, bytes::

    FP64: header [status, rank, choice, damping, trace, held_out, rotate]   (each side's, input first)
    FP32: D^{-1/2} [d] | D^{1/2} [d] | Q [d, r] | c [r] | c' [r]     (each side's; padded to 8 bytes)

``status`` is the side's ``BuildStatus``, ``rank`` its factor's actual rank (0 for the diagonal
fallback; columns beyond it are zero), ``choice`` the chosen damping (-1: Euclidean, ``T = I``; on the
output side: δ_out of the chosen pair, -1 where that pair has no output side), ``damping`` the one
the factor and ``T`` use, ``trace`` tr A (tr B), ``held_out`` 1 where this ``T`` is part of the best
pair, the next refresh's held-out check (always on the input side), ``rotate`` 1 where the four-bit
exchange is to rotate the layer's ``U`` (``--gift-rotation auto``'s choice; 0 on the output side).

The record carries what every rank sends with (``T``) and what every rank must agree on (the
header), not the FP64 factor ``(d, V, λ)`` it was built from: that stays on the owner
(``FactorSide.factor``; the telemetry's geometry and checkpoints read it
there), which cuts the record by about two thirds (``d_in·(8r + 8)`` of its ``d_in·(12r + 16)`` bytes).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .fp8 import CodecConfig
from .profile import damping_choice, damping_errors, held_out_gate
from .two_sided import TwoSidedWhitening
from .whitening import (
    LowRankWhitening,
    gram_eigh,
    nystrom_basis,
    nystrom_core,
    residual_factor,
    sketch_grams,
    top_eigenpairs,
    whitening_gram,
    whitening_tensors,
)

logger = logging.getLogger(__name__)


class BuildStatus(enum.IntEnum):
    """Outcome of one layer's build, as every rank reads it from the record header."""

    OK = 0
    SKIPPED = 1  # no tokens, or a zero trace: the previous transform stays
    NONFINITE = 2  # non-finite summed statistics: the previous transform stays, the EMA restarts
    INDEFINITE = 3  # the Nyström core never became positive definite: the damped diagonal alone (rank 0)
    FAILED = 4  # the owner's build raised: every rank stops with the same message


HEADER = ("status", "rank", "choice", "damping", "trace", "held_out", "rotate")  # each side's (module doc)
_FP32_KEYS = ("d_inv_sqrt", "d_sqrt", "q", "c", "c_inv")  # LowRankWhitening.tensors()
_RANK_COLS = ("q", "c", "c_inv")  # columns beyond the built rank stay zero
# ``--gift-side`` -> the candidate kinds of a layer with output statistics (module doc)
SIDE_KINDS = {"input": ("input",), "both": ("both",), "auto": ("input", "both")}


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one layer's record (module doc); ``d_out`` 0: no output side. ``views`` gives
    each side's fields: ``{"input": {"header", "d_inv_sqrt", ...}, "output": {...}}``."""

    d_in: int
    rank: int
    d_out: int = 0
    out_rank: int = 0

    def _parts(self):
        """``(dtype, [(side, name, shape)])`` of the FP64 part, then the FP32 part."""
        sides = [("input", self.d_in, self.rank)] + ([("output", self.d_out, self.out_rank)] if self.d_out else [])
        yield torch.float64, [(side, "header", (len(HEADER),)) for side, _, _ in sides]
        yield (
            torch.float32,
            [
                (side, name, shape)
                for side, d, r in sides
                for name, shape in (("d_inv_sqrt", (d,)), ("d_sqrt", (d,)), ("q", (d, r)), ("c", (r,)), ("c_inv", (r,)))
            ],
        )

    @property
    def nbytes(self) -> int:
        n = sum(math.prod(shape) * dtype.itemsize for dtype, fields in self._parts() for *_, shape in fields)
        return -(-n // 8) * 8

    def views(self, buf: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        """Each side's typed views of the record in the ``uint8`` buffer ``buf`` (its first ``nbytes``;
        8-aligned)."""
        out, pos = {}, 0
        for dtype, fields in self._parts():
            sizes = [math.prod(shape) for *_, shape in fields]
            n = sum(sizes) * dtype.itemsize
            for (side, name, shape), t in zip(fields, buf[pos : pos + n].view(dtype).split(sizes)):
                out.setdefault(side, {})[name] = t.view(shape) if len(shape) > 1 else t
            pos += n
        return out


class HostCopy:
    """``tensors`` (any dtype, read as FP64) copied to the host in one transfer: on CUDA into pinned
    memory without blocking, ``wait()`` then waits for that copy only (a CUDA event); elsewhere a no-op."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device):
        self.shapes = [t.shape for t in tensors]
        flat = (
            torch.cat([t.reshape(-1).double() for t in tensors])
            if tensors
            else torch.zeros(0, dtype=torch.float64, device=device)
        )
        self.event = None
        if flat.is_cuda:
            self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flat

    def wait(self) -> list[torch.Tensor]:
        """The host copies, shaped as the tensors given (the one host synchronisation of this transfer)."""
        if self.event is not None:
            self.event.synchronize()
        out, pos = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            out.append(self.host[pos : pos + n].view(shape))
            pos += n
        return out


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host FP64 ``tensors`` on ``device`` in one copy (from pinned memory, non-blocking, on CUDA)."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).double() for t in tensors])
    flat = (flat.pin_memory() if torch.device(device).type == "cuda" else flat).to(device, non_blocking=True)
    out, pos = [], 0
    for t in tensors:
        out.append(flat[pos : pos + t.numel()].view(t.shape))
        pos += t.numel()
    return out


@dataclass
class FactorSide:
    """One side of an owned layer's build: its summed EMA (views of the summed statistics), its status
    (the same on every rank), its stages' intermediate tensors, ``held_out`` (this side's ``T`` of the
    previous build's best pair; None: none yet, or that pair had no such side) and, set by ``finish``,
    ``factor``: ``(d, V, λ)`` FP64 of the record's ``T`` (its built rank), the owner's alone."""

    rank: int  # the factor's configured rank (``KFACStatistics.factor_rank``)
    sums: dict[str, torch.Tensor]  # summed EMA sums: {"y", "diag"} (sketch) or {"xtx"}
    tokens: torch.Tensor  # summed EMA token count (0-d)
    omega: torch.Tensor | None  # the sketch's Ω (None: exact statistics)
    held_out: LowRankWhitening | None = None
    status: BuildStatus = BuildStatus.OK
    work: dict = field(default_factory=dict)
    factor: tuple | None = None

    @property
    def building(self) -> bool:
        return self.status in (BuildStatus.OK, BuildStatus.INDEFINITE)

    @property
    def width(self) -> int:
        return next(iter(self.sums.values())).shape[0]


@dataclass
class OwnedLayer:
    """One layer a rank builds: its input side (``A``), its output side (``B``; None: input side
    only), its local gradient of the refresh step (the damping choice and the held-out check) and,
    during ``finish``, its record (views of its slot of the send buffer)."""

    name: str
    input: FactorSide
    output: FactorSide | None = None
    grad: torch.Tensor | None = None
    record: dict | None = None

    @property
    def layout(self) -> RecordLayout:
        out = self.output
        return RecordLayout(self.input.width, self.input.rank, out.width if out else 0, out.rank if out else 0)

    @property
    def building(self) -> bool:
        return self.input.building

    @property
    def out_building(self) -> bool:
        return self.output is not None and self.output.building


class FactorBuild:
    """The builds of the layers one rank owns in one refresh (module doc). ``candidates``: the
    dampings to choose from (``auto``) or the one configured damping (``auto`` False), on each side;
    ``kinds`` (``SIDE_KINDS``): the candidates of a layer with output statistics. With one configured
    damping and two candidates (``auto`` side: ``(δ, I)`` and ``(δ, δ)``), the better one is chosen.
    ``wire``: what the candidates' errors are measured on (``profile.damping_errors``: a ``CodecConfig``
    for FP8, or the wire's round trip, ``fp4.FP4Wire``); ``rotated_wire`` (``--gift-rotation auto``):
    the same wire with the rotation, each candidate's error the smaller of the two, and the record's
    ``rotate`` says which one the chosen candidate had."""

    def __init__(
        self,
        layers: list[OwnedLayer],
        candidates: tuple[float, ...],
        auto: bool,
        wire: CodecConfig | Callable[[torch.Tensor], torch.Tensor],
        max_shifts: int,
        kinds: tuple[str, ...] = ("input",),
        rotated_wire: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        if not kinds or set(kinds) - {"input", "both"}:
            raise ValueError(f"candidate kinds must be 'input' and/or 'both', got {kinds!r}")
        self.layers, self.candidates, self.auto, self.wire, self.max_shifts = layers, candidates, auto, wire, max_shifts
        self.kinds, self.rotated_wire = kinds, rotated_wire

    def _each(self, stage: str, fn, parts=None) -> list[list[torch.Tensor]]:
        """``fn(layer[, its parts])`` for every layer still building; a layer that raises is FAILED
        (logged here, with the traceback) and contributes no parts."""
        out = []
        parts = parts if parts is not None else [None] * len(self.layers)
        for layer, mine in zip(self.layers, parts):
            if not layer.building:
                out.append([])
                continue
            try:
                out.append(fn(layer) if mine is None else fn(layer, mine))
            except Exception:  # noqa: BLE001 - reported to every rank through the record header
                logger.exception("megatron-gift: building the factor of %s failed (%s)", layer.name, stage)
                layer.input.status, layer.input.work = BuildStatus.FAILED, {}
                out.append([])
        return out

    # -- one side's stages (``side``: a ``FactorSide``, A's or B's)
    @staticmethod
    def _grams(side) -> torch.Tensor:
        w, scale = side.work, side.tokens.double()
        if side.omega is None:  # diag a copy: a view would hold A (d x d, FP64) through the step's reductions
            a = side.sums["xtx"].double() / scale
            w["diag"] = torch.diagonal(a).clone()
            gram = a + a.T
            del a
            return gram.mul_(0.5)
        w["y"], w["diag"] = side.sums["y"].double() / scale, side.sums["diag"].double() / scale
        return sketch_grams(w["y"], side.omega.double())  # Ω in FP64 made where used: not held across the step

    def _core(self, side, gram: torch.Tensor) -> list[torch.Tensor]:
        if side.omega is None:
            v, lam = top_eigenpairs(gram, [side.rank])[side.rank]
            return [v, lam]
        core = nystrom_core(gram, side.rank, self.max_shifts)
        side.work["nu"] = core.nu
        if not core.ok:
            side.status = BuildStatus.INDEFINITE
        return [core.basis, core.lam]

    def _whitening_gram(self, side, basis: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        w = side.work
        v = basis if side.omega is None else nystrom_basis(w["y"], side.omega.double(), w["nu"], basis)
        base = residual_factor(w["diag"], v, lam, 0.0)
        deltas = torch.stack([torch.full((), c, dtype=torch.float64, device=v.device) for c in self.candidates])
        d = base.d + deltas.unsqueeze(1) * (base.trace_a / base.d.shape[0])  # [C, d]
        # what stage 3 needs, no more: the FP64 statistics go now; W (C x the basis) is rebuilt there
        side.work = dict(v=v, lam=lam, d=d, deltas=deltas, trace=base.trace_a)
        return whitening_gram(d, v, lam)[1]

    @staticmethod
    def _candidates(side, s: torch.Tensor, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """``tensors()`` of every candidate's ``T`` (``[C, ...]`` FP32)."""
        w = side.work
        return whitening_tensors(w["d"], whitening_gram(w["d"], w["v"], w["lam"])[0], s, p)

    # -- the stages, batched over the layers
    def grams(self) -> list[list[torch.Tensor]]:
        """Device stage 1: per layer, what its host cores need (the input side's, then the output side's)."""
        return self._each(
            "statistics", lambda layer: [self._grams(side) for side in (layer.input, layer.output) if side is not None]
        )

    def cores(self, host: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Host stage 1: per layer ``[basis or V, λ]`` of each side still building."""

        def one(layer, parts):
            out = self._core(layer.input, parts[0])
            return out + self._core(layer.output, parts[1]) if layer.out_building else out

        return self._each("Nyström core", one, host)

    def whitening_grams(self, dev: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Device stage 2: per layer ``[S_δ for every candidate]`` (``[C, r, r]``) of each side."""

        def one(layer, parts):
            out = [self._whitening_gram(layer.input, *parts[:2])]
            return out + [self._whitening_gram(layer.output, *parts[2:])] if layer.out_building else out

        return self._each("whitening", one, dev)

    def whitening_cores(self, host: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Host stage 2: per layer ``[s, P]`` of every ``S_δ`` of each side."""
        return self._each("whitening core", lambda layer, parts: [t for gram in parts for t in gram_eigh(gram)], host)

    def _pairs(self, layer, dev) -> tuple[list[tuple[int, int]], tuple[torch.Tensor, torch.Tensor] | None]:
        """The layer's candidates as indices into the damping grid, ``(δ_in index, δ_out index or -1 for
        T_out = I)``: on the host, and, when some have an output side, as two ``[P]`` device tensors
        built by fills (no host-to-device copy); None when all are input-only (the grid itself)."""
        n = len(self.candidates)
        out = layer.output
        usable = out is not None and out.status is BuildStatus.OK and out.rank > 0
        kinds = self.kinds if usable else ("input",)
        host = ([(i, -1) for i in range(n)] if "input" in kinds else []) + (
            [(i, o) for i in range(n) for o in range(n)] if "both" in kinds else []
        )
        if "both" not in kinds:
            return host, None
        grid = torch.arange(n, device=dev)
        ins, outs = [grid.unsqueeze(1).expand(n, n).reshape(-1)], [grid.repeat(n)]
        if "input" in kinds:
            ins.insert(0, grid)
            outs.insert(0, torch.full((n,), -1, dtype=torch.long, device=dev))
        return host, (torch.cat(ins), torch.cat(outs))

    @staticmethod
    def _write(rec: dict, side, cand: dict, idx: torch.Tensor, values: list) -> None:
        """One side's part of the record (``rec``: that side's views): its header (status, built rank,
        then ``values``, 0-d device tensors), then ``T`` of candidate ``idx`` (a 0-d device index); its
        factor kept in ``side.factor`` (copies: the build's work is dropped)."""
        w = side.work
        r = w["v"].shape[1]
        head = rec["header"]
        head[0].fill_(float(side.status))
        head[1].fill_(float(r))
        head[2:].copy_(torch.stack([v.double() for v in values]))
        pick = lambda t: t.index_select(0, idx.view(1))[0]  # noqa: E731
        side.factor = (pick(w["d"]), w["v"].clone(), w["lam"].clone())
        for k in _FP32_KEYS:
            t = pick(cand[k])
            (rec[k][..., :r] if k in _RANK_COLS else rec[k]).copy_(t)

    def finish(self, dev: list[list[torch.Tensor]], records: list[dict[str, torch.Tensor]]) -> None:
        """Device stage 3: every layer's record (``RecordLayout.views`` of its slot of the send buffer)."""

        def one(layer, parts):
            w, rec = layer.input.work, layer.record
            cand = self._candidates(layer.input, *parts[:2])
            dev_ = w["d"].device
            if layer.grad is None:
                raise RuntimeError("no local gradient was kept for the damping choice and the held-out check")
            cand_out = self._candidates(layer.output, *parts[2:]) if layer.out_building else None
            pairs, idx = self._pairs(layer, dev_)
            t_in = lambda j: LowRankWhitening.from_tensors({k: t[j] for k, t in cand.items()})  # noqa: E731
            t_out = lambda j: LowRankWhitening.from_tensors({k: t[j] for k, t in cand_out.items()})  # noqa: E731
            whitenings = (
                [t_in(i) if o < 0 else TwoSidedWhitening(t_in(i), t_out(o)) for i, o in pairs]
                if self.auto or len(pairs) > 1
                else []
            )
            held = layer.input.held_out
            if held is not None and layer.output is not None and layer.output.held_out is not None:
                held = TwoSidedWhitening(held, layer.output.held_out)
            held_out = [held] if held is not None else []
            errs = damping_errors(layer.grad, whitenings + held_out, self.wire)  # [Euclidean, *whitenings, held-out]
            rotate = torch.zeros_like(errs, dtype=torch.bool)
            if self.rotated_wire is not None:  # each with or without the rotation: the smaller error
                rotated = damping_errors(layer.grad, whitenings + held_out, self.rotated_wire)
                rotate = torch.isfinite(rotated) & ~(errs <= rotated)  # a non-finite unrotated error loses
                errs = torch.where(rotate, rotated, errs)
            if self.auto:
                chosen, best = damping_choice(errs[: 1 + len(whitenings)])
            elif whitenings:  # one damping, two kinds of candidates: the better one (Euclidean is no candidate)
                best = damping_choice(errs[: 1 + len(whitenings)])[1]
                chosen = best + 1
            else:
                chosen, best = (
                    torch.ones((), dtype=torch.long, device=dev_),
                    torch.zeros((), dtype=torch.long, device=dev_),
                )
            chosen = held_out_gate(chosen, errs[0], errs[-1] if held_out else None)
            at = lambda t, i: t.index_select(0, i.view(1))[0]  # noqa: E731
            minus1 = torch.full((1,), -1.0, dtype=torch.float64, device=dev_)
            b_in = best if idx is None else at(idx[0], best)
            choices = torch.cat([minus1, w["deltas"] if idx is None else w["deltas"].index_select(0, idx[0])])
            kept = torch.ones((), dtype=torch.float64, device=dev_)  # the input T of the best pair: held out
            values = [at(choices, chosen), at(w["deltas"], b_in), w["trace"], kept, at(rotate, chosen).double()]
            self._write(rec["input"], layer.input, cand, b_in, values)
            if layer.output is None:
                return []
            if not layer.out_building:  # skipped or non-finite: the input side alone, and the header says so
                for slot, value in zip(
                    rec["output"]["header"], (float(layer.output.status), 0.0, -1.0, -1.0, 0.0, 0.0)
                ):
                    slot.fill_(value)
                return []
            wo = layer.output.work
            if (
                idx is None
            ):  # no output candidate (a rank-0 T_out): its factor for the profiles, nothing chosen or held out
                b_out = torch.zeros((), dtype=torch.long, device=dev_)
                out_choice, has_out = minus1[0], torch.zeros((), dtype=torch.float64, device=dev_)
            else:  # T_out of the best pair if it has one, else of the best pair that has one
                # (its factor, for the profiles)
                p_out = idx[1]
                e = (
                    errs[1 : 1 + len(whitenings)]
                    if whitenings
                    else torch.zeros(len(pairs), dtype=errs.dtype, device=dev_)
                )
                e = torch.where(torch.isfinite(e) & (p_out >= 0), e, torch.inf)
                has_out = at(p_out, best) >= 0
                b_out = torch.where(has_out, at(p_out, best), at(p_out, e.argmin()).clamp_min(0))
                out_choice = at(
                    torch.cat(
                        [minus1, torch.where(p_out >= 0, wo["deltas"].index_select(0, p_out.clamp_min(0)), -1.0)]
                    ),
                    chosen,
                )
            values = [out_choice, at(wo["deltas"], b_out), wo["trace"], has_out, torch.zeros_like(has_out)]
            self._write(rec["output"], layer.output, cand_out, b_out, values)
            return []

        for layer, rec in zip(self.layers, records):
            for side in rec.values():
                for k in ("header", *_RANK_COLS):  # columns beyond the built rank stay zero
                    side[k].zero_()
            layer.record = rec
        self._each("damping choice", one, dev)
        for layer, rec in zip(self.layers, records):
            layer.record = None
            for side in (layer.input, layer.output):
                if side is not None:
                    side.work = {}
            if not layer.building:  # skipped, or failed in any stage (perhaps after writing part of its record)
                rec["input"]["header"][0].fill_(float(layer.input.status))
                rec["input"]["header"][5].zero_()  # nothing held out
                if "output" in rec:
                    out = rec["output"]["header"]
                    out[2:4].fill_(-1.0)  # nothing chosen, nothing held out
                    out[5].zero_()
                    out[0].fill_(float(layer.output.status))
