"""The plugin's reduction state, free of Megatron and of collectives (in the spirit of PyTorch's
``PowerSGDState``): what the bucket-group hooks need between steps, with its own state dict.

Per parameter (``GiftParam``): mode, and for a GIFT layer one ``SideState`` per whitened side: its
input side's (K-FAC statistics of what the weight multiplies, ``T_in``) and, for a two-sided layer
(``numerics.two_sided``), its output side's (statistics of its output gradients, ``T_out``). Per rank:
the step, whether this step's statistics are still being collected, the non-finite flag and the
byte ledger. The error-feedback residuals live in the bucket groups' buffers; the methods that
need them take ``residuals``: ``(residual of one parameter as [rows, cols], its GiftParam)`` pairs.
The refresh that rebuilds factors and ``T`` across ranks, with its collectives and host waits, is
``refresh_sync.RefreshSync``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .comm.ledger import CommLedger
from .comm.schedule import StageFlags
from .config import GiftConfig, Mode
from .numerics.kfac import KFACStatistics
from .numerics.whitening import LowRankFactor, LowRankWhitening

SIDES = ("input", "output")
"""The names of a layer's sides, in the order they are built, sent and saved."""


@dataclass
class SideState:
    """One side of a GIFT layer: its statistics (``A`` over the inputs, or ``B = E[g gᵀ]`` over the
    output gradients), the groups they are summed over at a refresh, the factor built from them (on
    its owner only), the whitening in use and its relative damping (None: no ``T`` yet, or Euclidean
    chosen: ``T = I``), and ``held_out``: the owner's best ``T`` of the last build, checked on the next
    refresh's gradient before a new ``T`` is trusted (the cold-start rule, ``profile.held_out_gate``);
    ``rotate``: the four-bit exchange rotates it (``--gift-rotation auto``'s choice at the last refresh)."""

    stats: KFACStatistics | None = None
    groups: list = field(default_factory=list)
    factor: LowRankFactor | None = None
    whitening: LowRankWhitening | None = None
    damping: float | None = None
    held_out: LowRankWhitening | None = None
    rotate: bool = False


@dataclass
class GiftParam:
    """Plugin state of one parameter communicated by the plugin. ``output`` is None where the layer has
    no output side (``--gift-side input``, or not a two-sided layer); a checkpoint's ``T_out`` may give
    one without statistics, which the next refresh replaces."""

    name: str
    mode: Mode  # what its gradient is sent as now
    candidate: bool = False  # keeps K-FAC statistics and a whitening: may be sent GIFT
    sketch_seed: int = 0  # seed of its statistics' Nyström sketch (the same on every rank)
    owner: int = 0  # rank in its bucket group's reduction group that builds its factors
    expert: bool = False  # an expert-parallel weight: replicated over the expert data-parallel group
    input: SideState = field(default_factory=SideState)
    output: SideState | None = None

    def sides(self):
        """``(name, SideState)`` of each side it has, the input side first."""
        return [(name, s) for name, s in zip(SIDES, (self.input, self.output)) if s is not None]


def _to(tree, device):
    """A copy of a nested dict of tensors on ``device``."""
    if isinstance(tree, dict):
        return {k: _to(v, device) for k, v in tree.items()}
    return tree.to(device, copy=True) if isinstance(tree, torch.Tensor) else tree


class GiftState:
    """Statistics, factors, damping choices and step of one model chunk's plugin parameters; ``nonfinite``,
    where its reductions flag a NaN/Inf they wrote (``comm.schedule.StageFlags``)."""

    def __init__(self, config: GiftConfig, device: torch.device):
        self.config = config
        self.device = torch.device(device)
        self.params: dict[torch.nn.Parameter, GiftParam] = {}
        self.ledger = CommLedger()
        self.step = -1  # index of the current iteration once open_step() opened it
        self.step_open = False
        self.collect_statistics = True  # the forward hooks add statistics until the step's first sync
        self.nonfinite = StageFlags(device)
        self.last_step_bytes: dict[str, int] = {}

    # -- per step ---------------------------------------------------------------------------
    def open_step(self) -> None:
        self.step += 1
        self.collect_statistics = True
        self.step_open = True

    def is_refresh_step(self, step: int) -> bool:
        """Every ``refresh_interval`` steps, and before the first interval also at steps 1, 2, 4,
        8, ...: activations drift fastest early in training, and a stale factor amplifies FP8
        error instead of shrinking it."""
        if self.config.whitening is None:  # no GIFT layer: no factor to rebuild
            return False
        n = self.config.whitening.refresh_interval
        return step % n == 0 or (step < n and step & (step - 1) == 0)

    def close_step(self) -> bool:
        """Move the step's byte count to ``last_step_bytes`` and clear the non-finite flag; False (a
        no-op) when no step is open. The step's collectives come first (``RefreshSync.close_step``)."""
        if not self.step_open:
            return False
        self.nonfinite.zero_()
        self.last_step_bytes = self.ledger.as_dict()
        self.ledger.reset()
        self.step_open = False
        return True

    @staticmethod
    def remap_residual(gp: GiftParam, old, new, residuals) -> None:
        """Carry ``gp``'s residual kept in the old whitened coordinates into the new ones."""
        for view, owner in residuals:
            if owner is gp:
                view.copy_(new.apply(old.inverse(view) if old is not None else view))

    # -- checkpoint state -------------------------------------------------------------------
    def state_dict(self, residuals) -> dict:
        """This rank's state on the CPU, keyed by parameter name: ``{"step", "params": {name: {"mode",
        "sides": {side: {"stats", "whitening", "damping", "rotate", "factor", "held_out"}}, "residual"}}}``
        with a side's keys present where it holds them (``damping`` and ``rotate`` beside ``whitening``;
        damping None: Euclidean chosen). ``residual`` (the error-feedback residual in the parameter's
        quantized coordinates), ``stats`` (step accumulators and local per-step EMA), ``factor`` and
        ``held_out`` (on the layer's factor owner only) are this rank's own (``PER_RANK``: what keeps
        per-rank state apart, ``megatron.checkpoint.split_state``, moves them); the rest is identical on
        all ranks that hold it. A refresh in flight is the caller's to install first (``RefreshSync.install``)."""
        params = {}
        for gp in self.params.values():
            entry = {"mode": gp.mode.value}
            sides = {name: _side_state(side) for name, side in gp.sides()}
            sides = {name: s for name, s in sides.items() if s}
            if sides:
                entry["sides"] = sides
            params[gp.name] = entry
        for view, gp in residuals:
            params[gp.name]["residual"] = view.to("cpu", copy=True)
        return {"step": self.step, "params": params}

    def load_state_dict(self, state: dict, residuals, device: torch.device, local: bool = True) -> list[str]:
        """Restore ``state_dict()`` output (its modes already chosen; a parameter in the format before
        ``SideState``, ``upgrade_entry``, is read as well); returns the parameters left fresh.

        ``local=False``: the per-rank state (K-FAC statistics, error-feedback residuals) belongs to
        the ranks of another data-parallel layout: it starts afresh, without counting as missing."""
        self.step = int(state["step"])  # the next open_step() opens the following step
        self.step_open = False
        missing = []
        for gp in self.params.values():
            entry = state["params"].get(gp.name)
            entry = upgrade_entry(entry) if entry is not None else None
            if entry is None or entry["mode"] != gp.mode.value or not self._load_param(gp, _to(entry, device), local):
                missing.append(gp.name)
        for view, gp in residuals:
            entry = state["params"].get(gp.name, {})
            if not local or gp.name in missing:
                view.zero_()
            elif "residual" in entry and entry["residual"].shape == view.shape:
                view.copy_(entry["residual"])
            else:
                view.zero_()
                missing.append(gp.name)
        return missing

    @staticmethod
    def _load_param(gp: GiftParam, entry: dict, local: bool) -> bool:
        """Statistics (``local``) and transforms of one parameter, both sides; False if they don't fit
        this configuration. A checkpoint without an output side (saved with the input side only) leaves
        it fresh: no ``T_out`` until the next refresh builds one. A ``T_out`` saved for a layer now
        without output statistics is restored all the same: the residual was saved in its coordinates
        (the next refresh installs a map without it and carries the residual over)."""
        saved = entry.get("sides", {})
        inp, out = saved.get("input", {}), saved.get("output", {})
        if local:
            for side, s in gp.sides():
                if s.stats is not None and (side == "input" or "stats" in out):
                    if not _fits(s.stats, saved.get(side, {}).get("stats")):
                        return False
            for side, s in gp.sides():
                if s.stats is not None and "stats" in saved.get(side, {}):
                    s.stats.load_state_dict(saved[side]["stats"])
        if "whitening" in inp:
            gp.input.whitening, gp.input.damping = _whitening(inp["whitening"]), inp.get("damping")
            gp.input.rotate = bool(inp.get("rotate", False))
        if "whitening" in out and gp.output is None:
            gp.output = SideState()
        if gp.output is not None:
            w = out.get("whitening")
            gp.output.whitening = _whitening(w) if w is not None else None
            gp.output.damping = out.get("damping") if w is not None else None
        if local and "held_out" in inp:
            gp.input.held_out = _whitening(inp["held_out"])
            if gp.output is not None:
                gp.output.held_out = _whitening(out["held_out"]) if "held_out" in out else None
        else:  # another layout (or an older checkpoint): a restored T was trusted when saved, so it stands as
            # the held-out T of the next refresh; a layer saved as Euclidean waits one refresh for its check
            trusted = gp.input.whitening is not None and gp.input.damping is not None
            gp.input.held_out = gp.input.whitening if trusted else None
            if gp.output is not None:
                gp.output.held_out = gp.output.whitening if trusted else None
        # the factors: the owner's, per rank like the held-out T (another layout: none until the next refresh)
        for side, s in gp.sides():
            s.factor = _factor(saved.get(side, {}).get("factor") if local else None, s.stats)
        return True


PER_RANK = ("stats", "factor", "held_out")
"""A side's keys that are one rank's own (its statistics; the factor owner's factor and held-out ``T``)."""


def _side_state(side: SideState) -> dict:
    """``side`` as the CPU tensors of ``GiftState.state_dict``'s entry for it."""
    entry = {}
    if side.stats is not None:
        entry["stats"] = _to(side.stats.state_dict(), "cpu")
    if side.whitening is not None:
        entry["whitening"] = _to(side.whitening.tensors(), "cpu")
        entry["damping"], entry["rotate"] = side.damping, side.rotate
    if side.held_out is not None:  # the factor owner's held-out T (the cold-start rule), like the residual its own
        entry["held_out"] = _to(side.held_out.tensors(), "cpu")
    if side.factor is not None:  # the factor owner's
        entry["factor"] = _factor_state(side.factor)
    return entry


def upgrade_entry(entry: dict) -> dict:
    """A parameter's entry as ``GiftState.state_dict`` writes it, from the format before ``SideState``
    (checkpoint version 1: the input side's keys at the top, the output side's as ``output_whitening``
    and ``out_damping`` beside them and under ``"out"`` inside ``stats``, ``factor`` and ``held_out``);
    an entry already in today's format is returned as it is."""
    if "sides" in entry or not any(
        k in entry for k in ("stats", "whitening", "held_out", "factor", "output_whitening")
    ):
        return entry
    inp, out = {}, {}
    for key in PER_RANK:
        if key in entry:
            nested = dict(entry[key])
            if "out" in nested:
                out[key] = nested.pop("out")
            if nested:  # a factor entry of the output side alone is {"out": ...}
                inp[key] = nested
    if "whitening" in entry:
        inp["whitening"], inp["damping"] = entry["whitening"], entry.get("damping")
    if "output_whitening" in entry:
        out["whitening"], out["damping"] = entry["output_whitening"], entry.get("out_damping")
    new = {k: v for k, v in entry.items() if k in ("mode", "residual")}
    new["sides"] = {"input": inp, **({"output": out} if out else {})}
    return new


def _fits(stats: KFACStatistics, saved: dict | None) -> bool:
    """Whether ``saved`` (``KFACStatistics.state_dict()``) can be loaded into ``stats``."""
    return (
        saved is not None
        and "ema_tokens" in saved
        and all(saved["sums"][k].shape == t.shape for k, t in stats.sums.items())
    )


def _factor_state(f: LowRankFactor) -> dict:
    return {
        "d": _to(f.d, "cpu"),
        "v": _to(f.v, "cpu"),
        "lam": _to(f.lam, "cpu"),
        "trace_a": float(f.trace_a),
        "damping": float(f.damping),
    }


def _factor(saved: dict | None, stats: KFACStatistics | None) -> LowRankFactor | None:
    """A saved ``_factor_state`` as the factor of ``stats``'s layer side, or None (none saved, or of another width)."""
    if not saved or "d" not in saved or stats is None or saved["d"].shape != (stats.d_in,):
        return None
    return LowRankFactor(saved["d"], saved["v"], saved["lam"], float(saved["trace_a"]), float(saved["damping"]))


def _whitening(saved: dict) -> LowRankWhitening:
    """A saved ``LowRankWhitening.tensors()`` as a transform owning copies of them."""
    return LowRankWhitening.from_tensors({k: t.clone() for k, t in saved.items()})
