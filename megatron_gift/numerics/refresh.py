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
    finish            device  Q_δ, c_δ, c'_δ; the FP8 error on the owner's own gradient
                              (``profile.damping_errors``) of each T_δ (``--gift-damping auto``:
                              the choice, ``profile.damping_choice``) and of the previous build's
                              T, which never saw this gradient (the cold-start rule,
                              ``profile.held_out_gate``: Euclidean unless it beat plain FP8),
                              all on the device; the record

(the maths: ``numerics.whitening``). Host stages run FP64 LAPACK on k x k and r x r matrices only;
device stages never wait for the host. A stage that raises marks its layer ``FAILED`` (the rest
go on), so the record of every layer is always written: its header tells every rank what happened.

Record of one layer with input size ``d_in`` and factor rank ``r`` (``RecordLayout``), bytes::

    FP64: header [status, rank, choice, damping, tr A] | d [d_in] | V [d_in, r] | λ [r]
    FP32: D^{-1/2} [d_in] | D^{1/2} [d_in] | Q [d_in, r] | c [r] | c' [r]   (padded to 8 bytes)

``rank`` is the factor's actual rank (0 for the diagonal fallback; columns beyond it are zero),
``choice`` the chosen damping (-1: Euclidean, ``T = I``), ``damping`` the one ``d`` and ``T`` use.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field

import torch

from .fp8 import CodecConfig
from .profile import damping_choice, damping_errors, held_out_gate
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


HEADER = ("status", "rank", "choice", "damping", "trace_a")
_FP32_KEYS = ("d_inv_sqrt", "d_sqrt", "q", "c", "c_inv")  # LowRankWhitening.tensors()


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one layer's record (module doc)."""

    d_in: int
    rank: int

    def _parts(self):
        """``(dtype, [(name, shape)])`` of the FP64 part, then the FP32 part."""
        d, r = self.d_in, self.rank
        yield torch.float64, [("header", (len(HEADER),)), ("d", (d,)), ("v", (d, r)), ("lam", (r,))]
        yield torch.float32, [("d_inv_sqrt", (d,)), ("d_sqrt", (d,)), ("q", (d, r)), ("c", (r,)), ("c_inv", (r,))]

    @property
    def nbytes(self) -> int:
        n = sum(math.prod(shape) * dtype.itemsize for dtype, fields in self._parts() for _, shape in fields)
        return -(-n // 8) * 8

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of the record in the ``uint8`` buffer ``buf`` (its first ``nbytes``; 8-aligned)."""
        out, pos = {}, 0
        for dtype, fields in self._parts():
            sizes = [math.prod(shape) for _, shape in fields]
            n = sum(sizes) * dtype.itemsize
            for (name, shape), t in zip(fields, buf[pos : pos + n].view(dtype).split(sizes)):
                out[name] = t.view(shape) if len(shape) > 1 else t
            pos += n
        return out


class HostCopy:
    """``tensors`` (any dtype, read as FP64) copied to the host in one transfer: on CUDA into pinned
    memory without blocking, ``wait()`` then waits for that copy only (a CUDA event); elsewhere a no-op."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device):
        self.shapes = [t.shape for t in tensors]
        flat = torch.cat([t.reshape(-1).double() for t in tensors]) if tensors else torch.zeros(0, dtype=torch.float64, device=device)
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
class OwnedLayer:
    """One layer a rank builds: its summed EMA (views of the all-reduced statistics), its record in
    the send buffer, its local gradient of the refresh step (the damping choice and the held-out
    check) and ``held_out``, the best ``T`` of its previous build (None: none yet)."""

    name: str
    rank: int  # the factor's configured rank (``KFACStatistics.factor_rank``)
    sums: dict[str, torch.Tensor]  # summed EMA sums: {"y", "diag"} (sketch) or {"xtx"}
    tokens: torch.Tensor  # summed EMA token count (0-d)
    omega: torch.Tensor | None  # the sketch's Ω (None: exact statistics)
    grad: torch.Tensor | None = None
    held_out: LowRankWhitening | None = None
    status: BuildStatus = BuildStatus.OK
    work: dict = field(default_factory=dict)  # the stages' intermediate tensors

    @property
    def layout(self) -> RecordLayout:
        return RecordLayout(next(iter(self.sums.values())).shape[0], self.rank)

    @property
    def building(self) -> bool:
        return self.status in (BuildStatus.OK, BuildStatus.INDEFINITE)


class FactorBuild:
    """The builds of the layers one rank owns in one refresh (module doc). ``candidates``: the
    dampings to choose from (``auto``) or the one configured damping (``auto`` False)."""

    def __init__(self, layers: list[OwnedLayer], candidates: tuple[float, ...], auto: bool, codec: CodecConfig,
                 max_shifts: int):  # fmt: skip
        self.layers, self.candidates, self.auto, self.codec, self.max_shifts = layers, candidates, auto, codec, max_shifts

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
                layer.status, layer.work = BuildStatus.FAILED, {}
                out.append([])
        return out

    def grams(self) -> list[list[torch.Tensor]]:
        """Device stage 1: per layer, what its host core needs."""

        def one(layer):
            w, scale = layer.work, layer.tokens.double()
            if layer.omega is None:
                a = layer.sums["xtx"].double() / scale
                w["diag"] = torch.diagonal(a)
                return [0.5 * (a + a.T)]
            w["y"], w["diag"] = layer.sums["y"].double() / scale, layer.sums["diag"].double() / scale
            w["omega"] = layer.omega.double()
            return [sketch_grams(w["y"], w["omega"])]

        return self._each("statistics", one)

    def cores(self, host: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Host stage 1: per layer ``[basis or V, λ]`` for the device."""

        def one(layer, parts):
            if layer.omega is None:
                v, lam = top_eigenpairs(parts[0], [layer.rank])[layer.rank]
                return [v, lam]
            core = nystrom_core(parts[0], layer.rank, self.max_shifts)
            layer.work["nu"] = core.nu
            if not core.ok:
                layer.status = BuildStatus.INDEFINITE
            return [core.basis, core.lam]

        return self._each("Nyström core", one, host)

    def whitening_grams(self, dev: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Device stage 2: per layer ``[S_δ for every candidate]`` (``[C, r, r]``)."""

        def one(layer, parts):
            w = layer.work
            basis, lam = parts
            v = basis if layer.omega is None else nystrom_basis(w["y"], w["omega"], w["nu"], basis)
            base = residual_factor(w["diag"], v, lam, 0.0)
            deltas = torch.stack([torch.full((), c, dtype=torch.float64, device=v.device) for c in self.candidates])
            d = base.d + deltas.unsqueeze(1) * (base.trace_a / base.d.shape[0])  # [C, d_in]
            # what stage 3 needs, no more: the FP64 statistics go now; W (C x the basis) is rebuilt there
            layer.work = dict(v=v, lam=lam, d=d, deltas=deltas, trace=base.trace_a)
            return [whitening_gram(d, v, lam)[1]]

        return self._each("whitening", one, dev)

    def whitening_cores(self, host: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Host stage 2: per layer ``[s, P]`` of every ``S_δ``."""
        return self._each("whitening core", lambda layer, parts: list(gram_eigh(parts[0])), host)

    def finish(self, dev: list[list[torch.Tensor]], records: list[dict[str, torch.Tensor]]) -> None:
        """Device stage 3: every layer's record (``RecordLayout.views`` of its slot of the send buffer)."""

        def one(layer, parts):
            w, rec = layer.work, layer.work["record"]
            s, p = parts
            cand = whitening_tensors(w["d"], whitening_gram(w["d"], w["v"], w["lam"])[0], s, p)  # [C, ...] FP32
            dev_ = w["d"].device
            if layer.grad is None:
                raise RuntimeError("no local gradient was kept for the damping choice and the held-out check")
            whitenings = [LowRankWhitening.from_tensors({k: t[j] for k, t in cand.items()})
                          for j in range(len(self.candidates))] if self.auto else []  # fmt: skip
            held_out = [layer.held_out] if layer.held_out is not None else []
            errs = damping_errors(layer.grad, whitenings + held_out, self.codec)  # [Euclidean, *whitenings, held-out]
            if self.auto:
                chosen, best = damping_choice(errs[: 1 + len(whitenings)])
            else:
                chosen, best = torch.ones((), dtype=torch.long, device=dev_), torch.zeros((), dtype=torch.long, device=dev_)
            chosen = held_out_gate(chosen, errs[0], errs[-1] if held_out else None)
            choices = torch.cat([torch.full((1,), -1.0, dtype=torch.float64, device=dev_), w["deltas"]])
            pick = lambda t: t.index_select(0, best.view(1))[0]  # noqa: E731
            r = w["v"].shape[1]
            rec["header"][0].fill_(float(layer.status))
            rec["header"][1].fill_(float(r))
            rec["header"][2:].copy_(torch.stack([choices.index_select(0, chosen.view(1))[0], pick(w["deltas"]), w["trace"]]))
            rec["d"].copy_(pick(w["d"]))
            rec["lam"][:r].copy_(w["lam"])
            rec["v"][:, :r].copy_(w["v"])
            for k in _FP32_KEYS:
                t = pick(cand[k])
                (rec[k][..., :r] if k in ("q", "c", "c_inv") else rec[k]).copy_(t)
            layer.work = {}
            return []

        for layer, rec in zip(self.layers, records):
            for k in ("header", "v", "lam", "q", "c", "c_inv"):  # columns beyond the built rank stay zero
                rec[k].zero_()
            layer.work["record"] = rec
        self._each("damping choice", one, dev)
        for layer, rec in zip(self.layers, records):
            if not layer.building:  # skipped, or failed in any stage (perhaps after writing part of its record)
                rec["header"][0].fill_(float(layer.status))
