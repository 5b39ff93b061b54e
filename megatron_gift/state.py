"""The plugin's reduction state, free of Megatron (in the spirit of PyTorch's ``PowerSGDState``):
one object holds what the bucket-group hooks need between steps, with its own state dict.

Per parameter (``GiftParam``): mode, K-FAC statistics, factor, ``T`` and damping choice. Per rank:
the step, whether this step's statistics are still being collected, the summed statistics of a
refresh step until each layer's factor is built, the non-finite flag and the byte ledger. The
error-feedback residuals live in the bucket groups' buffers; the methods that need them take
``residuals``: ``(residual of one parameter as [rows, cols], its GiftParam)`` pairs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .comm.ledger import CommLedger
from .config import GiftConfig, Mode
from .numerics.kfac import KFACStatistics
from .numerics.profile import choose_damping
from .numerics.whitening import LowRankFactor, LowRankWhitening

logger = logging.getLogger(__name__)


@dataclass
class GiftParam:
    """Plugin state of one FP8-communicated parameter."""

    name: str
    mode: Mode  # what its gradient is sent as now
    candidate: bool = False  # keeps K-FAC statistics and a whitening: may be sent GIFT
    stats: KFACStatistics | None = None
    factor: LowRankFactor | None = None
    whitening: LowRankWhitening | None = None
    sketch_seed: int = 0  # seed of its statistics' Nyström sketch (the same on every rank)
    owner: int = 0  # rank in its bucket group's reduction group that builds its factor
    expert: bool = False  # an expert-parallel weight: replicated over the expert data-parallel group
    stats_groups: list = field(default_factory=list)
    damping: float | None = None  # relative damping of its current T; None: no T yet, or Euclidean chosen (T = I)


def _to(tree, device):
    """A copy of a nested dict of tensors on ``device``."""
    if isinstance(tree, dict):
        return {k: _to(v, device) for k, v in tree.items()}
    return tree.to(device, copy=True) if isinstance(tree, torch.Tensor) else tree


class GiftState:
    """Statistics, factors, damping choices and step of one model chunk's plugin parameters."""

    def __init__(self, config: GiftConfig, device: torch.device):
        self.config = config
        self.params: dict[torch.nn.Parameter, GiftParam] = {}
        self.ledger = CommLedger()
        self.step = -1  # index of the current iteration once open_step() opened it
        self.step_open = False
        self.collect_statistics = True  # the forward hooks add statistics until the step's first sync
        self.global_stats: dict[int, tuple] = {}  # id(GiftParam) -> its summed EMA, on a refresh step until built
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=device)
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

    def close_step(self, error_feedbacks) -> bool:
        """Commit (or, after a NaN/Inf anywhere, drop) the step's ``error_feedbacks`` residuals and
        move its byte count to ``last_step_bytes``; False (a no-op) when no step is open."""
        if not self.step_open:
            return False
        applied = True
        if self.config.error_feedback:
            flag = self.nonfinite.to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # a NaN anywhere skips the step everywhere
            applied = not bool(flag.item())
        for ef in error_feedbacks:
            ef.commit(applied)
        self.nonfinite.zero_()
        self.last_step_bytes = self.ledger.as_dict()
        self.ledger.reset()
        self.step_open = False
        return True

    # -- factors ----------------------------------------------------------------------------
    def refresh(self, all_layers, layers, remap) -> None:
        """At every bucket group's sync. The first of the step (every forward of the step is done)
        folds each GIFT layer's statistics into its local EMA and, on a refresh step, sums those
        over the statistics groups. Then, on a refresh step, the ``layers`` ``(GiftParam, reduction
        group, local gradient)`` of the bucket group get their factor, damping and ``T``, built on
        the owner (whose gradient is ready now) and broadcast. ``all_layers()``: every GIFT layer, in
        one order on all ranks; ``remap(g, old T, new T)`` carries ``g``'s residual over."""
        if self.collect_statistics:
            self.collect_statistics = False
            for g in all_layers():  # local compute only: non-finite values are caught in the sums
                g.stats.fold()
            if self.is_refresh_step(self.step):
                self.global_stats = self.sum_statistics(all_layers())
        todo = [(g, grp, grad, self.global_stats.pop(id(g))) for g, grp, grad in layers if id(g) in self.global_stats]
        built = {id(g): self.build(g, grad, summed) for g, grp, grad, summed in todo if grp.rank() == g.owner}
        for g, group, _, _ in todo:
            factor, new, damping = self.broadcast_factor(g, group, built.get(id(g)))
            if damping is None:
                new = LowRankWhitening.identity(g.stats.d_in, device=g.stats.tokens.device)
            if g.mode is Mode.GIFT:
                remap(g, g.whitening, new)
            g.factor, g.whitening, g.damping = factor, new, damping

    def sum_statistics(self, layers) -> dict[int, tuple]:
        """Every GIFT layer's local EMA ``(sums, tokens)`` summed over its statistics groups: one
        FP32 all-reduce per group for all layers at once. By linearity this is the EMA of the
        global statistics. Layers whose sum saw no tokens or is non-finite are left out (the same
        on every rank: the sums are); a non-finite one also restarts its EMA, with a warning."""
        by_groups: dict[tuple, list[GiftParam]] = {}
        for g in layers:
            by_groups.setdefault(tuple(g.stats_groups), []).append(g)
        out = {}
        for groups, members in by_groups.items():
            parts = [t for g in members for t in (*g.stats.ema_sums.values(), g.stats.ema_tokens.reshape(1))]
            flat = torch.cat([t.reshape(-1).float() for t in parts])
            for group in groups:
                dist.all_reduce(flat, group=group)
                n = group.size()
                self.ledger.add("all_reduce", "fp32", 2 * (n - 1) * flat.numel() * 4 // n)
            pos = 0
            for g in members:
                sums = {}
                for k, t in g.stats.ema_sums.items():
                    sums[k] = flat[pos : pos + t.numel()].view(t.shape)
                    pos += t.numel()
                tokens = flat[pos].double()
                pos += 1
                if not all(bool(torch.isfinite(t).all()) for t in sums.values()):
                    logger.warning("megatron-gift: non-finite activations in %s; keeping its previous factor", g.name)
                    g.stats.reset_ema()
                elif float(tokens) > 0:
                    out[id(g)] = (sums, tokens)
        return out

    def build(self, g: GiftParam, grad: torch.Tensor, summed: tuple) -> tuple[LowRankFactor, LowRankWhitening, float | None]:
        """Factor, ``T`` and damping of ``g`` from its summed EMA ``summed`` (on its owner). ``--gift-damping
        auto``: the candidate with the least local error on ``grad`` (this rank's own gradient), or
        None for Euclidean; the factor and ``T`` then use the best damping among the candidates."""
        cfg = self.config
        factor = g.stats.low_rank_factor(g.stats.factor_rank(cfg.rank), 0.0, ema=summed)
        if cfg.damping is not None:
            chosen = best = cfg.damping
        else:
            chosen, errs = choose_damping(grad, factor, cfg.damping_candidates, cfg.codec)
            best = min(cfg.damping_candidates, key=lambda c: errs[c])
        factor = factor.with_damping(best)
        return factor, LowRankWhitening(factor, device=g.stats.tokens.device), chosen

    def broadcast_factor(self, g: GiftParam, group, built) -> tuple[LowRankFactor, LowRankWhitening, float | None]:
        """The owner's factor (FP64, CPU), ``T`` (FP32) and damping choice on every rank of ``group``:
        one broadcast of their bytes, FP64 part first. ``built``: ``build(g, ...)`` on the owner,
        None elsewhere."""
        n, device = group.size(), g.stats.tokens.device
        if built is None:
            d_in, r = g.stats.d_in, g.stats.factor_rank(self.config.rank)
            factor = LowRankFactor(torch.empty(d_in, dtype=torch.float64), torch.empty(d_in, r, dtype=torch.float64),
                                   torch.empty(r, dtype=torch.float64), 0.0)  # fmt: skip
            built = factor, LowRankWhitening.empty(d_in, r, device=device), None
        if n == 1:
            return built
        factor, whitening, chosen = built
        header = torch.tensor([factor.trace_a, factor.damping, -1.0 if chosen is None else chosen], dtype=torch.float64)
        fp64 = [factor.d, factor.v, factor.lam, header]
        fp32 = list(whitening.tensors().values())
        buf = torch.cat([t.to(device).contiguous().view(-1).view(torch.uint8) for t in fp64 + fp32])
        dist.broadcast(buf, src=dist.get_global_rank(group, g.owner), group=group)
        if group.rank() != g.owner:
            pos = 0
            for t in fp64 + fp32:
                nbytes = t.numel() * t.element_size()
                t.copy_(buf[pos : pos + nbytes].view(t.dtype).view(t.shape))
                pos += nbytes
            factor.trace_a, factor.damping = float(header[0]), float(header[1])
            chosen = None if header[2] < 0 else float(header[2])
        # a ring broadcast: every rank but one forwards the whole buffer, (n-1)/n of it per rank on average
        for dtype, parts in (("fp64", fp64), ("fp32", fp32)):
            self.ledger.add("broadcast", dtype, (n - 1) * sum(t.numel() * t.element_size() for t in parts) // n)
        return factor, whitening, chosen

    @staticmethod
    def remap_residual(g: GiftParam, old, new, residuals) -> None:
        """Carry ``g``'s residual kept in the old whitened coordinates into the new ones."""
        for view, owner in residuals:
            if owner is g:
                view.copy_(new.apply(old.inverse(view) if old is not None else view))

    # -- checkpoint state -------------------------------------------------------------------
    def state_dict(self, residuals) -> dict:
        """This rank's state on the CPU, keyed by parameter name: ``{"step", "params": {name: {"mode",
        "stats" (step accumulators and local per-step EMA), "whitening", "damping" (None: Euclidean
        chosen), "residual"}}}``. Everything but ``residual`` (the error-feedback residual in the
        parameter's quantized coordinates, this rank's own) is identical on all ranks that hold it."""
        params = {}
        for g in self.params.values():
            entry = {"mode": g.mode.value}
            if g.stats is not None:
                entry["stats"] = _to(g.stats.state_dict(), "cpu")
            if g.whitening is not None:
                entry["whitening"] = _to(g.whitening.tensors(), "cpu")
                entry["damping"] = g.damping
            params[g.name] = entry
        for view, g in residuals:
            params[g.name]["residual"] = view.to("cpu", copy=True)
        return {"step": self.step, "params": params}

    def load_state_dict(self, state: dict, residuals, device: torch.device, local: bool = True) -> list[str]:
        """Restore ``state_dict()`` output (its modes already chosen); returns the parameters left fresh.

        ``local=False``: the per-rank state (K-FAC statistics, error-feedback residuals) belongs to
        the ranks of another data-parallel layout: it starts afresh, without counting as missing."""
        self.step = int(state["step"])  # the next open_step() opens the following step
        self.step_open = False
        missing = []
        for g in self.params.values():
            entry = state["params"].get(g.name)
            if entry is None or entry["mode"] != g.mode.value or not self._load_param(g, _to(entry, device), local):
                missing.append(g.name)
        for view, g in residuals:
            entry = state["params"].get(g.name, {})
            if not local or g.name in missing:
                view.zero_()
            elif "residual" in entry and entry["residual"].shape == view.shape:
                view.copy_(entry["residual"])
            else:
                view.zero_()
                missing.append(g.name)
        return missing

    @staticmethod
    def _load_param(g: GiftParam, entry: dict, local: bool) -> bool:
        """Statistics (``local``) and transform of one parameter; False if they don't fit this configuration."""
        if g.stats is not None and local:
            saved = entry.get("stats")
            if saved is None or "ema_tokens" not in saved or any(saved["sums"][k].shape != t.shape for k, t in g.stats.sums.items()):
                return False
            g.stats.load_state_dict(saved)
        if "whitening" in entry:
            w = entry["whitening"]
            g.whitening = LowRankWhitening.empty(w["q"].shape[0], w["q"].shape[1], device=w["q"].device)
            for k, t in g.whitening.tensors().items():
                t.copy_(w[k])
            g.damping = entry.get("damping")
        return True
