"""The plugin's reduction state, free of Megatron and of collectives (in the spirit of PyTorch's
``PowerSGDState``): what the bucket-group hooks need between steps, with its own state dict.

Per parameter (``GiftParam``): mode, K-FAC statistics, ``T`` and damping choice (on every rank), the
factor ``T`` was built from (on the rank that built it), and for a two-sided layer
(``numerics.two_sided``) their output-side twins. Per rank:
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
from .comm.schedule import MAX_STAGES
from .config import GiftConfig, Mode
from .numerics.kfac import KFACStatistics
from .numerics.whitening import LowRankFactor, LowRankWhitening


@dataclass
class GiftParam:
    """Plugin state of one FP8-communicated parameter."""

    name: str
    mode: Mode  # what its gradient is sent as now
    candidate: bool = False  # keeps K-FAC statistics and a whitening: may be sent GIFT
    stats: KFACStatistics | None = None
    factor: LowRankFactor | None = None  # its owner only (the refresh's record carries T, not the factor)
    whitening: LowRankWhitening | None = None
    sketch_seed: int = 0  # seed of its statistics' Nyström sketch (the same on every rank)
    owner: int = 0  # rank in its bucket group's reduction group that builds its factor
    expert: bool = False  # an expert-parallel weight: replicated over the expert data-parallel group
    stats_groups: list = field(default_factory=list)
    damping: float | None = None  # relative damping of its current T; None: no T yet, or Euclidean chosen (T = I)
    held_out: LowRankWhitening | None = None  # its owner only: the best T of the last build, checked on the next
    # refresh's gradient before a new T is trusted (the cold-start rule, ``profile.held_out_gate``; checkpointed)
    out_stats: KFACStatistics | None = (
        None  # B = E[g gᵀ] over the layer's output gradients (d = weight rows); None: input side only
    )
    out_stats_groups: list = field(default_factory=list)  # groups B's EMA is summed over at a refresh
    out_factor: LowRankFactor | None = None  # its owner only, like factor
    output_whitening: LowRankWhitening | None = None  # T_out in use; None: no output side
    out_damping: float | None = None  # relative damping of T_out in use (None: no output side)
    out_held_out: LowRankWhitening | None = (
        None  # its owner only: T_out of the last build's best pair (None: it had none)
    )


def _to(tree, device):
    """A copy of a nested dict of tensors on ``device``."""
    if isinstance(tree, dict):
        return {k: _to(v, device) for k, v in tree.items()}
    return tree.to(device, copy=True) if isinstance(tree, torch.Tensor) else tree


class GiftState:
    """Statistics, factors, damping choices and step of one model chunk's plugin parameters."""

    def __init__(self, config: GiftConfig, device: torch.device):
        self.config = config
        self.device = torch.device(device)
        self.params: dict[torch.nn.Parameter, GiftParam] = {}
        self.ledger = CommLedger()
        self.step = -1  # index of the current iteration once open_step() opened it
        self.step_open = False
        self.collect_statistics = True  # the forward hooks add statistics until the step's first sync
        self.nonfinite = torch.zeros(MAX_STAGES, dtype=torch.bool, device=device)  # per stage: read with .any()
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
        n = self.config.refresh_interval
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
        "stats" (step accumulators and local per-step EMA), "whitening", "damping" (None: Euclidean
        chosen), "factor", "held_out", "residual"}}}``. Everything but ``residual`` (the error-feedback
        residual in the parameter's quantized coordinates, this rank's own), ``stats``, ``factor`` and
        ``held_out`` (on the layer's factor owner only) is identical on all ranks that hold it. A
        two-sided layer adds its output side's twins: ``output_whitening`` and ``out_damping`` (absent:
        no output side in use) beside theirs, and the per-rank ones inside their twins' entries,
        ``stats["out"]`` (``B``'s statistics), ``factor["out"]`` (``B``'s factor) and
        ``held_out["out"]`` (``T_out`` of the held-out pair), so that whatever keeps the per-rank state
        apart (``megatron.checkpoint.split_state``) keeps them with it.
        A refresh in flight is the caller's to install first (``RefreshSync.install``)."""
        params = {}
        for gp in self.params.values():
            entry = {"mode": gp.mode.value}
            if gp.stats is not None:
                entry["stats"] = _to(gp.stats.state_dict(), "cpu")
                if gp.out_stats is not None:
                    entry["stats"]["out"] = _to(gp.out_stats.state_dict(), "cpu")
            if gp.whitening is not None:
                entry["whitening"] = _to(gp.whitening.tensors(), "cpu")
                entry["damping"] = gp.damping
            if gp.output_whitening is not None:
                entry["output_whitening"] = _to(gp.output_whitening.tensors(), "cpu")
                entry["out_damping"] = gp.out_damping
            if (
                gp.held_out is not None
            ):  # the factor owner's held-out T (the cold-start rule), like the residual its own
                entry["held_out"] = _to(gp.held_out.tensors(), "cpu")
                if gp.out_held_out is not None:
                    entry["held_out"]["out"] = _to(gp.out_held_out.tensors(), "cpu")
            if (
                gp.factor is not None or gp.out_factor is not None
            ):  # the factor owner's (an output factor alone: the input side skipped)
                entry["factor"] = _factor_state(gp.factor) if gp.factor is not None else {}
                if gp.out_factor is not None:
                    entry["factor"]["out"] = _factor_state(gp.out_factor)
            params[gp.name] = entry
        for view, gp in residuals:
            params[gp.name]["residual"] = view.to("cpu", copy=True)
        return {"step": self.step, "params": params}

    def load_state_dict(self, state: dict, residuals, device: torch.device, local: bool = True) -> list[str]:
        """Restore ``state_dict()`` output (its modes already chosen); returns the parameters left fresh.

        ``local=False``: the per-rank state (K-FAC statistics, error-feedback residuals) belongs to
        the ranks of another data-parallel layout: it starts afresh, without counting as missing."""
        self.step = int(state["step"])  # the next open_step() opens the following step
        self.step_open = False
        missing = []
        for gp in self.params.values():
            entry = state["params"].get(gp.name)
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
        this configuration. A checkpoint without the output side's keys (an older one, or saved with
        the input side only) leaves it fresh: no output side until the next refresh builds one."""
        if gp.stats is not None and local:
            saved = entry.get("stats")
            if not _fits(gp.stats, saved) or (
                gp.out_stats is not None and "out" in saved and not _fits(gp.out_stats, saved["out"])
            ):
                return False
            gp.stats.load_state_dict(saved)
            if gp.out_stats is not None and "out" in saved:
                gp.out_stats.load_state_dict(saved["out"])
        if "whitening" in entry:
            gp.whitening = _whitening(entry["whitening"])
            gp.damping = entry.get("damping")
        # the T_out the residual was saved with, even for a layer now without output statistics (the next
        # refresh installs a map without it and carries the residual over); None when none was in use
        gp.output_whitening = _whitening(entry["output_whitening"]) if "output_whitening" in entry else None
        gp.out_damping = entry.get("out_damping") if gp.output_whitening is not None else None
        held = entry.get("held_out") if local else None
        if held is not None:
            gp.held_out = _whitening(held)
            gp.out_held_out = _whitening(held["out"]) if "out" in held else None
        else:  # another layout (or an older checkpoint): a restored T was trusted when saved, so it stands as
            # the held-out T of the next refresh; a layer saved as Euclidean waits one refresh for its check
            gp.held_out = gp.whitening if gp.whitening is not None and gp.damping is not None else None
            gp.out_held_out = gp.output_whitening if gp.held_out is not None else None
        # the factors: the owner's, per rank like the held-out T (another layout: none until the next refresh)
        saved = (entry.get("factor") or {}) if local else {}
        gp.factor = _factor(saved, gp.stats)
        gp.out_factor = _factor(saved.get("out"), gp.out_stats)
        return True


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
    """A saved ``LowRankWhitening.tensors()`` (without a nested ``"out"``) as a transform owning copies of them."""
    return LowRankWhitening.from_tensors({k: t.clone() for k, t in saved.items() if k != "out"})
