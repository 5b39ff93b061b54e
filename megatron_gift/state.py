"""The plugin's reduction state, free of Megatron (in the spirit of PyTorch's ``PowerSGDState``):
one object holds what the bucket-group hooks need between steps, with its own state dict.

Per parameter (``GiftParam``): mode, K-FAC statistics, factor, ``T`` and damping choice. Per rank:
the step, whether this step's statistics are still being collected, the refresh in flight (built
and sent, not yet installed), the non-finite flag and the byte ledger. The error-feedback
residuals live in the bucket groups' buffers; the methods that need them take ``residuals``:
``(residual of one parameter as [rows, cols], its GiftParam)`` pairs.

A refresh (step t, see ``is_refresh_step``) runs beside the training, on the statistics' device
(on CUDA on a stream of its own), and is installed one step later:

* the first bucket-group sync of step t folds every layer's statistics into its local EMA, sums
  the EMAs over each statistics group (one FP32 all-reduce per group for all layers) and starts
  each layer's build on its owner (``numerics.refresh``: the device part of the Nyström core);
* each bucket group's sync keeps, on the owner, a copy of the layer's local gradient (``--gift-damping
  auto`` chooses the damping from it);
* ``after_reductions`` (Megatron's ``finish_grad_sync``) waits for the statistics (host wait 1),
  solves the k x k cores on the host and enqueues the whitening Grams;
* ``close_step`` (the start of step t+1, or a checkpoint) waits for them (host wait 2), solves
  the r x r cores, enqueues the damping choice and the records, and sends every record of a
  reduction group in ONE all-gather of fixed-size slots (a slot per rank, sized from the layouts
  alone, so every rank sends and receives the same byte counts whatever a build did);
* the first sync of step t+1 reads the received headers (host wait 3), installs every layer's
  factor and ``T`` (copied out of the received buffer: every rank holds the owner's bits) and carries
  the error-feedback residuals over; a failed build stops every rank with the same message.

Each host wait is on a CUDA event recorded well before it (the statistics early in step t's
backward, the Grams before Megatron's optimizer step, the records before step t+1's forward), so
the GPU keeps its queue; a steady step has none. ``host_waits`` counts them.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .comm.ledger import CommLedger
from .config import GiftConfig, Mode
from .numerics.kfac import KFACStatistics
from .numerics.refresh import HEADER, BuildStatus, FactorBuild, HostCopy, OwnedLayer, RecordLayout, to_device
from .numerics.whitening import MAX_SHIFTS, LowRankFactor, LowRankWhitening

logger = logging.getLogger(__name__)

# torch >= 2.10 renamed all_gather_into_tensor; NGC containers may carry either.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


def _flat(parts: list[list]) -> list:
    return [t for p in parts for t in p]


def _unflat_groups(flat: list, parts: list[list[list]]) -> list[list[list]]:
    """``flat`` (as ``_flat(_flat(parts))``) shaped back into per-group, per-layer lists like ``parts``."""
    it = iter(flat)
    return [[[next(it) for _ in layer] for layer in group] for group in parts]


@dataclass
class _GroupRefresh:
    """One reduction group's part of a refresh: its layers (one order on all ranks), each record's
    layout and place in the gathered buffer (its owner's slot), and this rank's own builds."""

    group: dist.ProcessGroup
    layers: list[GiftParam]
    layouts: list[RecordLayout]
    offsets: list[int]  # byte offset of each record in the gathered buffer: owner · slot + place in the slot
    slot: int  # bytes of every rank's slot: the most any rank owns
    build: FactorBuild  # of this rank's layers, in ``layers`` order
    recv: torch.Tensor | None = None
    received: list[dict] | None = None  # every record's typed views of ``recv``

    def views(self, i: int, buf: torch.Tensor, base: int = 0) -> dict[str, torch.Tensor]:
        """Typed views of layer ``i``'s record in ``buf``, which starts at byte ``base`` of the gathered buffer."""
        a = self.offsets[i] - base
        return self.layouts[i].views(buf[a : a + self.layouts[i].nbytes])


@dataclass
class _Refresh:
    """A refresh in flight: its layers, their builds, and the host copy the next stage waits for."""

    layers: list[GiftParam]  # every GIFT layer, in one order on all ranks
    groups: list[_GroupRefresh]
    owned: dict[int, OwnedLayer]  # id(GiftParam) -> this rank's build of it
    copy: HostCopy
    parts: list | None  # per group, per own layer: the tensors ``copy`` carries
    stage: int = 1  # 1: statistics summed, 2: whitening Grams enqueued, 3: records sent


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
        self.refresh_state: _Refresh | None = None
        self.host_waits = 0  # host synchronisations of refreshes so far (3 per refresh: module doc)
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=device)
        self.last_step_bytes: dict[str, int] = {}
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

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
        """Commit (or, after a NaN/Inf anywhere, drop) the step's ``error_feedbacks`` residuals, send
        a refresh started in this step and move the step's byte count to ``last_step_bytes``; False
        (a no-op) when no step is open. No host synchronisation but the refresh's own (module doc)."""
        if not self.step_open:
            return False
        applied = True
        if self.config.error_feedback:
            flag = self.nonfinite.to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # a NaN anywhere skips the step everywhere
            applied = flag == 0  # on the device: each residual keeps its old value where not applied
        for ef in error_feedbacks:
            ef.commit(applied)
        self.nonfinite.zero_()
        self._send_refresh()
        self.last_step_bytes = self.ledger.as_dict()
        self.ledger.reset()
        self.step_open = False
        return True

    # -- factors ----------------------------------------------------------------------------
    def assign_owners(self, layers) -> None:
        """Each GIFT layer's owner in its reduction group, from the ``(GiftParam, group)`` pairs in one
        order on all ranks: largest record first, to the rank that owns the fewest bytes so far
        (lowest rank on ties). The all-gather's slot is the largest rank's share, so balancing the
        bytes keeps its padding small (round-robin over Llama's four layer shapes at 64 ranks gave
        slots 1.9x the mean); the build work, about proportional, is balanced with it."""
        by_group: dict = {}
        for g, group in layers:
            by_group.setdefault(group, []).append(g)
        for group, members in by_group.items():
            load = [0] * group.size()
            sizes = [RecordLayout(g.stats.d_in, g.stats.factor_rank(self.config.rank)).nbytes for g in members]
            for i in sorted(range(len(members)), key=lambda i: -sizes[i]):  # stable: layer order on ties
                members[i].owner = min(range(len(load)), key=lambda r: load[r])
                load[members[i].owner] += sizes[i]

    def at_sync(self, all_layers, layers, remap) -> None:
        """At every bucket group's sync, before its reduction. The first of the step (every forward
        of the step is done) installs the last refresh's factors, folds each GIFT layer's statistics
        into its local EMA and, on a refresh step, starts the next refresh. Then the ``layers``
        ``(GiftParam, reduction group, local gradient)`` of the bucket group that this rank builds
        keep their gradient for the damping choice (``--gift-damping auto``). ``all_layers()``:
        ``(GiftParam, reduction group)`` of every GIFT layer, in one order on all ranks; ``remap(g,
        old T, new T)`` carries ``g``'s residual over."""
        if self.collect_statistics:
            self.collect_statistics = False
            self.install(remap)
            every = list(all_layers())
            KFACStatistics.fold_all([g.stats for g, _ in every])  # local compute only
            if self.is_refresh_step(self.step) and every:
                self._start_refresh(every)
        r = self.refresh_state
        if r is not None and r.stage == 1 and self.config.damping is None:
            for g, _, grad in layers:
                if id(g) in r.owned:
                    r.owned[id(g)].grad = grad.detach().clone()

    def after_reductions(self) -> None:
        """Once the step's reductions are enqueued (``finish_grad_sync``): the refresh's k x k cores."""
        if self.refresh_state is not None and self.refresh_state.stage == 1:
            self._cores()

    @contextlib.contextmanager
    def _side(self):
        """Where the refresh's device work runs: on CUDA a stream of its own, after the current one's work."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield

    def _wait(self) -> list[torch.Tensor]:
        self.host_waits += 1
        return self.refresh_state.copy.wait()

    def _start_refresh(self, every) -> None:
        """Stage 1 (module doc): sum the statistics, flag each layer, start this rank's builds."""
        cfg = self.config
        candidates = cfg.damping_candidates if cfg.damping is None else (cfg.damping,)
        layers = [g for g, _ in every]
        with self._side():
            summed = self.sum_statistics(layers)
            # per layer [finite, tokens > 0, trace > 0] in a fixed number of launches: max |x| of each
            # summed tensor (NaN and ±Inf stay non-finite) and Σ diag(A) = ‖diag‖₁ (diag(A) ≥ 0)
            diags = [sums["diag"] if "diag" in sums else torch.diagonal(sums["xtx"]) for sums, _ in (summed[id(g)] for g in layers)]
            pieces = [t for (sums, tokens), diag in zip((summed[id(g)] for g in layers), diags) for t in (next(iter(sums.values())), diag, tokens)]
            maxabs = torch.stack(torch._foreach_norm(pieces, float("inf"))).view(len(layers), 3)
            tokens = torch.stack([summed[id(g)][1] for g in layers])
            flags = torch.stack([torch.isfinite(maxabs).all(1), tokens > 0, torch.stack(torch._foreach_norm(diags, 1)) > 0], 1)
            by_group: dict = {}
            for g, group in every:
                by_group.setdefault(group, []).append(g)
            groups, owned = [], {}
            for group, members in by_group.items():
                layouts = [RecordLayout(g.stats.d_in, g.stats.factor_rank(cfg.rank)) for g in members]
                used, places = [0] * group.size(), []
                for g, layout in zip(members, layouts):
                    places.append(used[g.owner])
                    used[g.owner] += layout.nbytes
                slot = max(used)
                mine = [OwnedLayer(g.name, layout.rank, *summed[id(g)], g.stats.omega)
                        for g, layout in zip(members, layouts) if g.owner == group.rank()]  # fmt: skip
                owned.update({id(g): o for g, o in zip([g for g in members if g.owner == group.rank()], mine)})
                build = FactorBuild(mine, candidates, cfg.damping is None, cfg.codec, MAX_SHIFTS)
                groups.append(_GroupRefresh(group, members, layouts, [g.owner * slot + p for g, p in zip(members, places)], slot, build))
            parts = [gr.build.grams() for gr in groups]
            self.refresh_state = _Refresh(layers, groups, owned, HostCopy([flags, *_flat(_flat(parts))], self.device), parts)

    def _cores(self) -> None:
        """Stage 2: host wait 1, each layer's status from the summed statistics (the same on every
        rank), the k x k cores on the host, the whitening Grams enqueued."""
        r = self.refresh_state
        flags, *rest = self._wait()
        for g, (finite, has_tokens, has_trace) in zip(r.layers, flags.tolist()):
            status = BuildStatus.OK
            if not finite:
                logger.warning("megatron-gift: non-finite activations in %s; keeping its previous factor", g.name)
                g.stats.reset_ema()
                status = BuildStatus.NONFINITE
            elif not has_tokens:
                status = BuildStatus.SKIPPED
            elif not has_trace:
                logger.warning("megatron-gift: %s saw only zero activations; keeping its previous factor", g.name)
                status = BuildStatus.SKIPPED
            if id(g) in r.owned and status is not BuildStatus.OK:
                r.owned[id(g)].status = status
        out = [gr.build.cores(p) for gr, p in zip(r.groups, _unflat_groups(rest, r.parts))]
        with self._side():
            dev = _unflat_groups(to_device(_flat(_flat(out)), self.device), out)
            r.parts = [gr.build.whitening_grams(p) for gr, p in zip(r.groups, dev)]
            r.copy, r.stage = HostCopy(_flat(_flat(r.parts)), self.device), 2

    def _send_refresh(self) -> None:
        """Stage 3: host wait 2, the r x r cores on the host, the records built and all-gathered."""
        r = self.refresh_state
        if r is None or r.stage == 3:
            return
        if r.stage == 1:
            self._cores()
        out = [gr.build.whitening_cores(p) for gr, p in zip(r.groups, _unflat_groups(self._wait(), r.parts))]
        for gr in r.groups:  # long-lived (the installed transforms are views of it): on the compute stream
            gr.recv = torch.empty(gr.slot * gr.group.size(), dtype=torch.uint8, device=self.device)
        with self._side():
            dev = _unflat_groups(to_device(_flat(_flat(out)), self.device), out)
            works = []
            for gr, parts in zip(r.groups, dev):
                me = gr.group.rank()
                send = torch.zeros(gr.slot, dtype=torch.uint8, device=self.device)
                mine = [i for i, g in enumerate(gr.layers) if g.owner == me]
                gr.build.finish(parts, [gr.views(i, send, me * gr.slot) for i in mine])
                for layer in gr.build.layers:  # the kept gradients were made on the compute stream
                    if layer.grad is not None and self._stream is not None:
                        layer.grad.record_stream(self._stream)
                    layer.grad = None
                if self._stream is not None:
                    gr.recv.record_stream(self._stream)
                n = gr.group.size()
                if n > 1:
                    works.append(_all_gather(gr.recv, send, group=gr.group, async_op=True))
                    self.ledger.add("all_gather", "factors", (n - 1) * gr.slot)  # ring all-gather: slots out
                else:
                    gr.recv.copy_(send)
            for work in works:
                work.wait()  # the refresh stream waits for the all-gathers (a GPU-side wait on CUDA)
            for gr in r.groups:
                gr.received = [gr.views(i, gr.recv) for i in range(len(gr.layers))]
            headers = [rec["header"] for gr in r.groups for rec in gr.received]
            r.copy, r.stage, r.parts = HostCopy(headers, self.device), 3, None

    def install(self, remap) -> None:
        """Host wait 3: every rank reads the received headers and installs each built layer's factor
        and ``T`` (copied out of the received buffer); ``remap(g, old T, new T)`` carries residuals over."""
        r = self.refresh_state
        if r is None:
            return
        if r.stage < 3:
            self._send_refresh()
        headers = iter(self._wait())
        self.refresh_state = None
        failed = []
        for gr in r.groups:
            for i, g in enumerate(gr.layers):
                head = dict(zip(HEADER, next(headers).tolist()))
                status = BuildStatus(int(head["status"]))
                if status is BuildStatus.FAILED:
                    failed.append(f"{g.name} (rank {g.owner} of its reduction group)")
                if status not in (BuildStatus.OK, BuildStatus.INDEFINITE):
                    continue
                if status is BuildStatus.INDEFINITE:
                    logger.warning("megatron-gift: the Nyström core of %s stayed indefinite after %d shifts (non-finite or "
                                   "corrupt statistics?): using the diagonal of A alone for this factor", g.name, MAX_SHIFTS)  # fmt: skip
                self._install(g, gr.received[i], head, remap)
        if failed:
            raise RuntimeError(f"megatron-gift: building the factor of {', '.join(failed)} failed (the owner's log has "
                               f"the traceback); stopping on every rank")  # fmt: skip

    @staticmethod
    def _install(g: GiftParam, rec: dict, head: dict, remap) -> None:
        # Copies, not views: the gathered buffer (R slots of the largest owner's share) is then freed,
        # where views would hold it, growing with the group size, until the next refresh.
        rec = {k: t.clone() for k, t in rec.items()}
        rank, choice = int(head["rank"]), head["choice"]
        cols = lambda t: t if rank == t.shape[-1] else t[..., :rank].contiguous()  # noqa: E731
        factor = LowRankFactor(rec["d"], cols(rec["v"]), cols(rec["lam"]), head["trace_a"], head["damping"])
        if choice < 0:  # Euclidean chosen: T = I, the factor kept for the profiles
            new, damping = LowRankWhitening.identity(g.stats.d_in, device=rec["d"].device), None
        else:
            new = LowRankWhitening.from_tensors({k: cols(rec[k]) if k in ("q", "c", "c_inv") else rec[k]
                                                 for k in ("d_inv_sqrt", "d_sqrt", "q", "c", "c_inv")})  # fmt: skip
            damping = choice
        if g.mode is Mode.GIFT:
            remap(g, g.whitening, new)
        g.factor, g.whitening, g.damping = factor, new, damping

    def sum_statistics(self, layers) -> dict[int, tuple]:
        """Every GIFT layer's local EMA ``(sums, tokens)`` summed over its statistics groups: one
        FP32 all-reduce per group for all layers at once (views of its result). By linearity this is
        the EMA of the global statistics."""
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
                out[id(g)] = (sums, flat[pos])
                pos += 1
        return out

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
        chosen), "factor", "residual"}}}``. Everything but ``residual`` (the error-feedback residual in the
        parameter's quantized coordinates, this rank's own) is identical on all ranks that hold it.

        A refresh still in flight is finished and installed first: nothing reads ``T`` between the
        end of a step and the next step's first sync, where it would be installed anyway."""
        residuals = list(residuals)
        self.install(lambda g, old, new: self.remap_residual(g, old, new, residuals))
        params = {}
        for g in self.params.values():
            entry = {"mode": g.mode.value}
            if g.stats is not None:
                entry["stats"] = _to(g.stats.state_dict(), "cpu")
            if g.whitening is not None:
                entry["whitening"] = _to(g.whitening.tensors(), "cpu")
                entry["damping"] = g.damping
            if g.factor is not None:
                f = g.factor
                entry["factor"] = {"d": _to(f.d, "cpu"), "v": _to(f.v, "cpu"), "lam": _to(f.lam, "cpu"), "trace_a": float(f.trace_a),
                                   "damping": float(f.damping)}  # fmt: skip
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
        self.refresh_state = None
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
        f = entry.get("factor")
        if f is not None and g.stats is not None and f["d"].shape == (g.stats.d_in,):
            g.factor = LowRankFactor(f["d"], f["v"], f["lam"], float(f["trace_a"]), float(f["damping"]))
        return True
