"""The factor refresh across ranks: ``numerics.refresh``'s builds with the collectives and host waits
around them, driven by the adapter at fixed points of a step. ``state.GiftState`` holds what it
reads and installs (statistics, factors, ``T``, step, ledger); this holds the refresh in flight.

It sits beside ``state`` and not in ``comm`` (the quantized gradient collectives and their
layouts) because it reads and writes the plugin's per-parameter state, and not in ``megatron``
because it needs no Megatron: tests and ``bench refresh`` drive it on plain process groups.

A refresh (step t, see ``GiftState.is_refresh_step``) runs beside the training, on the statistics'
device (on CUDA on a stream of its own), and is installed one step later:

* the first bucket-group sync of step t folds every layer's statistics into its local EMA, sums
  the EMAs over each statistics group onto the layer's owner (``sum_statistics``: one FP32
  reduce-scatter per reduction group, the layers packed by owner into equal slots, after one FP32
  all-reduce per other group) and starts each layer's build on its owner (``numerics.refresh``:
  the device part of the Nyström core);
* each bucket group's sync keeps, on the owner, a copy of the layer's local gradient (``--gift-damping
  auto`` chooses the damping from it, and the cold-start rule checks the previous build's ``T`` on it);
* ``after_reductions`` (Megatron's ``finish_grad_sync``) waits for the statistics' checks and
  Grams of the layers this rank owns (host wait 1), solves the k x k cores on the host and
  enqueues the whitening Grams;
* ``close_step`` (the start of step t+1, or a checkpoint) waits for them (host wait 2), solves
  the r x r cores, enqueues the damping choice and the records, and sends every record of a
  reduction group in ONE all-gather of fixed-size slots (a slot per rank, sized from the layouts
  alone, so every rank sends and receives the same byte counts whatever a build did); where those
  slots would hold over ``GATHER_BOUND`` (2) times the records' bytes (more ranks than layers), each
  owning rank broadcasts its share alone instead, packed back to back, the broadcasts in one
  coalesced group on CUDA: every rank then receives the records once (issue 35 item 3), the same bits;
* the first sync of step t+1 reads the received headers (host wait 3), installs every layer's
  ``T`` (copied out of the received buffer: every rank holds the owner's bits; the FP64 factor it
  was built from only on the owner, which kept it) and carries the error-feedback residuals over;
  what every rank must agree on comes from the headers: a layer with non-finite statistics
  restarts its EMA on every rank there, a failed build stops every rank with the same message.

A layer with an output side (``GiftParam.output``, statistics of its output gradients) builds
``T_out`` in the same refresh: ``B``'s EMA is summed in the same collectives (over its side's
``groups`` as ``A`` over the input side's), built in the same stages, and its record shares the layer's slot of the
all-gather; the damping choice is joint (``numerics.refresh``).
``B`` is folded a step late (its gradients arrive after the step's first sync), so a refresh at
step t sees ``B`` up to step t-1 and the first refresh none: its output side is skipped.

Each host wait is on a CUDA event recorded well before it (the statistics early in step t's
backward, the Grams before Megatron's optimizer step, the records before step t+1's forward), so
the GPU keeps its queue; a steady step has none. ``host_waits`` counts them.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._compat import all_gather as _all_gather
from ._compat import reduce_scatter as _reduce_scatter
from .comm.fp4_reduce import exchange_rotation
from .comm.ledger import ring_all_reduce_bytes
from .config import GiftConfig, InterNodeFormat, Mode, Rotation
from .numerics.fp4 import FP4_FORMATS, FP4Wire
from .numerics.kfac import KFACStatistics
from .numerics.refresh import (
    HEADER,
    SIDE_KINDS,
    BuildStatus,
    FactorBuild,
    FactorSide,
    HostCopy,
    OwnedLayer,
    RecordLayout,
    to_device,
)
from .numerics.two_sided import sent_map
from .numerics.whitening import MAX_SHIFTS, LowRankFactor, LowRankWhitening
from .state import SIDES, GiftParam, GiftState

logger = logging.getLogger(__name__)

# The record all-gather's equal slots (the largest owner's share) are kept while the group's slots hold
# at most this many times the records' bytes; above it, each owner broadcasts its share alone.
GATHER_BOUND = 2


def damping_wire(cfg: GiftConfig):
    """What a refresh measures the damping candidates' errors on (``FactorBuild``'s ``wire`` and
    ``rotated_wire``): the wire GIFT layers are sent in, FP8 (``cfg.codec``) or the four-bit format
    between nodes, rotated as the exchange rotates it (``--gift-rotation hadamard``: the same signs from
    ``--seed``); with ``auto`` the four-bit format unrotated and rotated (the refresh chooses)."""
    if cfg.wire.inter_node_format is InterNodeFormat.FP8:
        return cfg.wire.codec, None
    fmt, rotation = FP4_FORMATS[cfg.wire.inter_node_format.value], cfg.wire.rotation
    hadamard = exchange_rotation(rotation, cfg.wire.rotation_seed)
    if rotation is Rotation.AUTO:
        return FP4Wire(fmt, None), FP4Wire(fmt, hadamard)
    return FP4Wire(fmt, hadamard), None


def record_layout(gp: GiftParam, rank: int) -> RecordLayout:
    """The layout of ``gp``'s record at the configured ``rank`` (its output side's too, if it has one)."""
    a, b = gp.input.stats, gp.output.stats if gp.output is not None else None
    return RecordLayout(a.d_in, a.factor_rank(rank), b.d_in if b else 0, b.factor_rank(rank) if b else 0)


# what a side's statistics are of, and what a layer does without them
_WHAT = {
    "input": ("activations", "keeping its previous T"),
    "output": ("output gradients", "whitening its input side alone"),
}


def _same_ranks(a, b) -> bool:
    """Whether the groups ``a`` and ``b`` hold the same ranks (Megatron hands one object around; a
    caller's groups may be distinct objects over the same ranks)."""
    return a is b or (a.size() == b.size() and dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b))


def _packed(stats: KFACStatistics) -> list[torch.Tensor]:
    """What of ``stats`` a refresh sums: its EMA sums, then its token count as ``[1]``."""
    return [*stats.ema_sums.values(), stats.ema_tokens.reshape(1)]


def _unpack(stats: KFACStatistics, flat: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """``(sums, tokens)`` as views of ``flat`` (``_packed(stats)`` flattened, summed)."""
    sums, pos = {}, 0
    for k, t in stats.ema_sums.items():
        sums[k] = flat[pos : pos + t.numel()].view(t.shape)
        pos += t.numel()
    return sums, flat[pos]


def _flat(parts: list[list]) -> list:
    return [t for p in parts for t in p]


def _places(parts: list[list[list]]) -> list[list[list]]:
    """``parts``' nesting with ``None`` for each tensor: what ``_unflat_groups`` needs once a ``HostCopy``
    carries the values (the tensors themselves, kept, would hold a second copy of every Gram through the
    step's reductions)."""
    return [[[None] * len(layer) for layer in group] for group in parts]


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
    shares: list[int] | None = None  # bytes each rank owns, packed back to back (broadcasts); None: equal slots
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
    sides: list[
        tuple[GiftParam, str]
    ]  # the statistics this rank builds from, as ``(layer, "input" | "output")``: flagged in this order
    groups: list[_GroupRefresh]
    owned: dict[int, OwnedLayer]  # id(GiftParam) -> this rank's build of it
    copy: HostCopy
    parts: list | None  # per group, per own layer: the places of the tensors ``copy`` carries (``_places``)
    stage: int = 1  # 1: statistics summed, 2: whitening Grams enqueued, 3: records sent


class RefreshSync:
    """The refresh of one ``GiftState``'s factors across ranks, and the close of its steps (module doc)."""

    def __init__(self, state: GiftState, side="input"):
        """``side`` (``--gift-side``: ``input``, ``both``, ``auto``, or the config's enum of them): the
        damping candidates of the layers with output statistics (``numerics.refresh.SIDE_KINDS``)."""
        side = getattr(side, "value", side)
        if side not in SIDE_KINDS:
            raise ValueError(f"megatron-gift: side must be one of {', '.join(SIDE_KINDS)}, got {side!r}")
        self.state, self.side = state, side
        self.config, self.device = state.config, state.device
        self.wire, self.rotated_wire = damping_wire(state.config)  # what the candidates' errors are measured on
        self.pending: _Refresh | None = None  # the refresh in flight (built and sent, not yet installed)
        self.layers: list = []  # (GiftParam, reduction group) of every GIFT layer (assign_owners)
        self.host_waits = 0  # host synchronisations of refreshes so far (3 per refresh: module doc)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def discard(self) -> None:
        """Forget a refresh in flight (a checkpoint load replaces what it would install)."""
        self.pending = None

    def close_step(self, error_feedbacks) -> bool:
        """The close of the open step: commit (or, after a NaN/Inf anywhere, drop) the step's
        ``error_feedbacks`` residuals, send a refresh started in this step, then
        ``GiftState.close_step``; False (a no-op) when no step is open. No host synchronisation but
        the refresh's own (module doc)."""
        if not self.state.step_open:
            return False
        applied = True
        if self.config.wire.error_feedback:
            flag = self.state.nonfinite.any().to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # a NaN anywhere skips the step everywhere
            applied = flag == 0  # on the device: each residual keeps its old value where not applied
        for ef in error_feedbacks:
            ef.commit(applied)
        self._send_refresh()
        return self.state.close_step()

    # -- factors ----------------------------------------------------------------------------
    def assign_owners(self, layers) -> None:
        """Each GIFT layer's owner in its reduction group, from the ``(GiftParam, group)`` pairs in one
        order on all ranks: largest record first, to the rank that owns the fewest bytes so far
        (lowest rank on ties; a two-sided layer's record holds both sides). The all-gather's slot is the
        largest rank's share, so balancing the bytes keeps its padding small (round-robin over Llama's
        four layer shapes at 64 ranks gave slots 1.9x the mean); the build work, about proportional, is
        balanced with it. The pairs are kept: every refresh folds and builds these layers."""
        self.layers = list(layers)
        by_group: dict = {}
        for gp, group in self.layers:
            if gp.output is not None and gp.output.stats is not None and self.side == "input":
                raise ValueError(f"megatron-gift: {gp.name} keeps output-gradient statistics but the side is 'input'")
            by_group.setdefault(group, []).append(gp)
        for group, members in by_group.items():
            load = [0] * group.size()
            sizes = [record_layout(gp, self.config.whitening.rank).nbytes for gp in members]
            for i in sorted(range(len(members)), key=lambda i: -sizes[i]):  # stable: layer order on ties
                members[i].owner = min(range(len(load)), key=lambda r: load[r])
                load[members[i].owner] += sizes[i]

    def at_sync(self, layers, remap) -> None:
        """At every bucket group's sync, before its reduction. The first of the step (every forward
        of the step is done) installs the last refresh's factors, folds each GIFT layer's statistics
        (``assign_owners``'s layers) into its local EMA and, on a refresh step, starts the next
        refresh. Then the ``layers`` ``(GiftParam, reduction group, local gradient)`` of the bucket
        group that this rank builds keep their gradient for the damping choice and the held-out
        check. ``remap(gp, old T, new T)`` carries ``gp``'s residual over."""
        if self.state.collect_statistics:
            self.state.collect_statistics = False
            self.install(remap)
            every = self.layers
            KFACStatistics.fold_all([gp.input.stats for gp, _ in every])  # local compute only
            if self.state.is_refresh_step(self.state.step) and every:
                self._start_refresh(every)
        r = self.pending
        if r is not None and r.stage == 1:
            for gp, _, grad in layers:
                if id(gp) in r.owned:
                    r.owned[id(gp)].grad = grad.detach().clone()

    def after_reductions(self) -> None:
        """Once the step's reductions are enqueued (``finish_grad_sync``): the refresh's k x k cores."""
        if self.pending is not None and self.pending.stage == 1:
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
        return self.pending.copy.wait()

    def _start_refresh(self, every) -> None:
        """Stage 1 (module doc): sum the statistics, flag each layer, start this rank's builds."""
        cfg = self.config
        candidates = cfg.whitening.damping_candidates if cfg.whitening.damping is None else (cfg.whitening.damping,)
        layers = [gp for gp, _ in every]
        with self._side():
            summed = self.sum_statistics(every)  # this rank's own layers' statistics
            sides = [(gp, side) for gp in layers for side in SIDES if (id(gp), side) in summed]
            # per statistics [finite, tokens > 0, trace > 0] in a fixed number of launches: max |x| of each
            # summed tensor (NaN and ±Inf stay non-finite) and Σ diag(A) = ‖diag‖₁ (diag(A) ≥ 0)
            ordered = [summed[id(gp), side] for gp, side in sides]
            diags = [sums["diag"] if "diag" in sums else torch.diagonal(sums["xtx"]) for sums, _ in ordered]
            pieces = [
                t for (sums, tokens), diag in zip(ordered, diags) for t in (next(iter(sums.values())), diag, tokens)
            ]
            flags = torch.zeros(0, 3, dtype=torch.bool, device=self.device)
            if sides:
                maxabs = torch.stack(torch._foreach_norm(pieces, float("inf"))).view(len(sides), 3)
                tokens = torch.stack([tokens for _, tokens in ordered])
                flags = torch.stack(
                    [torch.isfinite(maxabs).all(1), tokens > 0, torch.stack(torch._foreach_norm(diags, 1)) > 0], 1
                )
            by_group: dict = {}
            for gp, group in every:
                by_group.setdefault(group, []).append(gp)
            groups, owned = [], {}
            for group, members in by_group.items():
                layouts = [record_layout(gp, cfg.whitening.rank) for gp in members]
                used, places = [0] * group.size(), []
                for gp, layout in zip(members, layouts):
                    places.append(used[gp.owner])
                    used[gp.owner] += layout.nbytes
                slot, shares = max(used), None
                if group.size() * slot > GATHER_BOUND * sum(used):  # equal slots: mostly padding (more ranks
                    # than layers): each owner's share broadcast from it, packed back to back (issue 35 item 3)
                    shares = used
                mine = [
                    OwnedLayer(
                        gp.name,
                        FactorSide(layout.rank, *summed[id(gp), "input"], gp.input.stats.omega, gp.input.held_out),
                        FactorSide(
                            layout.out_rank, *summed[id(gp), "output"], gp.output.stats.omega, gp.output.held_out
                        )
                        if layout.d_out
                        else None,
                    )
                    for gp, layout in zip(members, layouts)
                    if gp.owner == group.rank()
                ]
                owned.update({id(gp): o for gp, o in zip([gp for gp in members if gp.owner == group.rank()], mine)})
                build = FactorBuild(
                    mine,
                    candidates,
                    cfg.whitening.damping is None,
                    self.wire,
                    MAX_SHIFTS,
                    SIDE_KINDS[self.side],
                    self.rotated_wire,
                )
                starts = [sum(shares[:o]) if shares else o * slot for o in range(group.size())]
                offsets = [starts[gp.owner] + p for gp, p in zip(members, places)]
                groups.append(_GroupRefresh(group, members, layouts, offsets, slot, build, shares))
            parts = [gr.build.grams() for gr in groups]
            copy = HostCopy([flags, *_flat(_flat(parts))], self.device)
            self.pending = _Refresh(layers, sides, groups, owned, copy, _places(parts))

    def _cores(self) -> None:
        """Stage 2: host wait 1, the status of each side of this rank's layers from their summed
        statistics (every rank reads it from the record header at install), the k x k cores on the
        host, the whitening Grams enqueued."""
        r = self.pending
        flags, *rest = self._wait()
        for (gp, side), (finite, has_tokens, has_trace) in zip(r.sides, flags.tolist()):
            status = BuildStatus.OK
            if not finite:  # logged, and the EMA restarted, on every rank at install
                status = BuildStatus.NONFINITE
            elif not has_tokens:  # an output side at the first refresh: B is folded a step late
                status = BuildStatus.SKIPPED
            elif not has_trace:
                logger.warning("megatron-gift: %s saw only zero %s; %s", gp.name, *_WHAT[side])
                status = BuildStatus.SKIPPED
            if status is not BuildStatus.OK:
                owned = r.owned[id(gp)]
                getattr(owned, side).status = status
        out = [gr.build.cores(p) for gr, p in zip(r.groups, _unflat_groups(rest, r.parts))]
        with self._side():
            dev = _unflat_groups(to_device(_flat(_flat(out)), self.device), out)
            parts = [gr.build.whitening_grams(p) for gr, p in zip(r.groups, dev)]
            r.copy, r.stage, r.parts = HostCopy(_flat(_flat(parts)), self.device), 2, _places(parts)

    def _send_refresh(self) -> None:
        """Stage 3: host wait 2, the r x r cores on the host, the records built and all-gathered."""
        r = self.pending
        if r is None or r.stage == 3:
            return
        if r.stage == 1:
            self._cores()
        out = [gr.build.whitening_cores(p) for gr, p in zip(r.groups, _unflat_groups(self._wait(), r.parts))]
        for gr in r.groups:  # long-lived (the installed transforms are views of it): on the compute stream
            n = sum(gr.shares) if gr.shares else gr.slot * gr.group.size()
            gr.recv = torch.empty(n, dtype=torch.uint8, device=self.device)
        with self._side():
            dev = _unflat_groups(to_device(_flat(_flat(out)), self.device), out)
            works = []
            for gr, parts in zip(r.groups, dev):
                me = gr.group.rank()
                if gr.shares:
                    works += self._broadcast_records(gr, parts)
                    continue
                send = torch.zeros(gr.slot, dtype=torch.uint8, device=self.device)
                mine = [i for i, gp in enumerate(gr.layers) if gp.owner == me]
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
                    self.state.ledger.add(
                        "all_gather", "factors", (n - 1) * gr.slot
                    )  # ring all-gather: slots out
                else:
                    gr.recv.copy_(send)
            for work in works:
                work.wait()  # the refresh stream waits for the all-gathers (a GPU-side wait on CUDA)
            for gr in r.groups:
                gr.received = [gr.views(i, gr.recv) for i in range(len(gr.layers))]
            headers = [rec[side]["header"] for gr in r.groups for rec in gr.received for side in SIDES if side in rec]
            r.copy, r.stage, r.parts = HostCopy(headers, self.device), 3, None

    def _broadcast_records(self, gr: _GroupRefresh, parts) -> list:
        """``gr``'s records where equal slots would be mostly padding: this rank's share built into its
        place in ``gr.recv`` (zeroed first, as a slot is), then one broadcast per owning rank, in rank
        order, of its share alone, all in one coalesced group: each rank receives the records' bytes once
        (the same bits as the all-gather's records)."""
        me, at = gr.group.rank(), 0
        starts = []
        for share in gr.shares:
            starts.append(at)
            at += share
        own = gr.recv[starts[me] : starts[me] + gr.shares[me]]
        own.zero_()
        mine = [i for i, gp in enumerate(gr.layers) if gp.owner == me]
        gr.build.finish(parts, [gr.views(i, gr.recv) for i in mine])
        for layer in gr.build.layers:
            if layer.grad is not None and self._stream is not None:
                layer.grad.record_stream(self._stream)
            layer.grad = None
        if self._stream is not None:
            gr.recv.record_stream(self._stream)
        # one coalesced group on CUDA (one NCCL group launch): the broadcasts follow one another around the
        # ring instead of each paying the ring's latency in turn, which at hundreds of ranks dwarfs their
        # bytes; gloo has no such group (its broadcasts run one after another, as the host waits anyway)
        device = gr.recv.device if gr.recv.device.type == "cuda" else None
        with dist._coalescing_manager(group=gr.group, device=device, async_ops=True) as grouped:
            for owner, (start, share) in enumerate(zip(starts, gr.shares)):
                if share:
                    dist.broadcast(
                        gr.recv[start : start + share], dist.get_global_rank(gr.group, owner), group=gr.group
                    )
                    if owner == me:
                        self.state.ledger.add("broadcast", "factors", share)
        return [grouped]

    def install(self, remap) -> None:
        """Host wait 3: every rank reads the received headers and installs each built layer's factor
        and ``T`` (copied out of the received buffer); ``remap(gp, old T, new T)`` carries residuals over."""
        r = self.pending
        if r is None:
            return
        if r.stage < 3:
            self._send_refresh()
        headers = iter(self._wait())
        self.pending = None
        failed = []
        for gr in r.groups:
            for i, gp in enumerate(gr.layers):
                head = dict(zip(HEADER, next(headers).tolist()))
                out_head = dict(zip(HEADER, next(headers).tolist())) if gr.layouts[i].d_out else None
                for (side, s), h in zip(gp.sides(), (head, out_head)):
                    if h is not None and BuildStatus(int(h["status"])) is BuildStatus.NONFINITE:
                        logger.warning(
                            "megatron-gift: non-finite %s in %s; %s", _WHAT[side][0], gp.name, _WHAT[side][1]
                        )
                        s.stats.reset_ema()  # on every rank: the next refresh sums fresh EMAs
                status = BuildStatus(int(head["status"]))
                if status is BuildStatus.FAILED:
                    failed.append(f"{gp.name} (rank {gp.owner} of its reduction group)")
                if status not in (BuildStatus.OK, BuildStatus.INDEFINITE):
                    continue
                if status is BuildStatus.INDEFINITE:
                    logger.warning(
                        "megatron-gift: the Nyström core of %s stayed indefinite after %d shifts (non-finite or "
                        "corrupt statistics?): using the diagonal of A alone for this factor",
                        gp.name,
                        MAX_SHIFTS,
                    )
                self._install(gp, gr.received[i], head, out_head, remap, r.owned.get(id(gp)))
        if failed:
            raise RuntimeError(
                f"megatron-gift: building the factor of {', '.join(failed)} failed (the owner's log has "
                f"the traceback); stopping on every rank"
            )

    @staticmethod
    def _install(gp: GiftParam, rec: dict, head: dict, out_head: dict | None, remap, owned: OwnedLayer | None) -> None:
        """Install one built layer from its record: ``T`` (identity when Euclidean was chosen), with an
        output side its ``T_out`` (None unless the chosen pair has one) and its damping;
        ``remap`` gets the old and the new map the gradient is sent through. The owner (``owned``: its
        build) also installs the factors it built, and keeps the best pair for its next held-out check."""

        def side(name: str, head: dict, built):
            """One side's factor (the owner's build) and the ``T`` its record carries. Copies, not views:
            the gathered buffer (R slots of the largest owner's share) is then freed, where views would
            hold it, growing with the group size, until the next refresh."""
            rank = int(head["rank"])
            factor = LowRankFactor(*built, head["trace"], head["damping"]) if built is not None else None
            fields = {
                k: t[..., :rank] if k in ("q", "c", "c_inv") else t for k, t in rec[name].items() if k != "header"
            }
            return factor, LowRankWhitening.from_tensors({k: t.clone() for k, t in fields.items()})

        choice = head["choice"]
        factor, best = side("input", head, owned and owned.input.factor)
        if choice < 0:  # Euclidean chosen (or not yet trusted): T = I, the factor kept for the profiles
            new, damping = LowRankWhitening.identity(gp.input.stats.d_in, device=best.d_sqrt.device), None
        else:
            new, damping = best, choice
        output = gp.output
        out_factor = output.factor if output is not None else None
        new_out, out_best = None, None  # a skipped output side: the input side alone
        if out_head is not None:
            out_status = BuildStatus(int(out_head["status"]))
            if out_status is BuildStatus.INDEFINITE:
                logger.warning(
                    "megatron-gift: the Nyström core of %s's output gradients stayed indefinite after %d shifts: "
                    "whitening its input side alone",
                    gp.name,
                    MAX_SHIFTS,
                )
            if out_status in (BuildStatus.OK, BuildStatus.INDEFINITE):
                out_factor, t_out = side("output", out_head, owned and owned.output.factor)
                new_out = t_out if choice >= 0 and out_head["choice"] >= 0 else None
                out_best = t_out if out_head["held_out"] > 0 else None
        if gp.mode is Mode.GIFT:
            remap(gp, sent_map(gp.input.whitening, output.whitening if output else None), sent_map(new, new_out))
        # the next build's held-out check (the best pair), on the rank that runs it
        mine = owned is not None
        gp.input.factor, gp.input.whitening, gp.input.damping = factor, new, damping
        gp.input.rotate = head["rotate"] > 0  # --gift-rotation auto's choice for the chosen T
        gp.input.held_out = best if mine and head["held_out"] > 0 else None
        if output is not None:
            output.factor, output.whitening, output.held_out = out_factor, new_out, out_best if mine else None
            output.damping = out_head["choice"] if new_out is not None else None
            if output.stats is None:  # a checkpoint's T_out without output statistics: replaced now
                gp.output = None

    def sum_statistics(self, every) -> dict[tuple[int, str], tuple]:
        """The EMA ``(sums, tokens)`` of every statistics of the layers this rank owns, summed over its
        statistics groups (by linearity the EMA of the global statistics), keyed ``(id(GiftParam),
        side)`` (``side``: ``"input"`` or ``"output"``, each side's statistics over its ``groups``);
        views of the collectives' FP32 results. ``every``: ``(GiftParam, reduction group)`` of every
        GIFT layer, in one order on all ranks.

        Only the owner needs the sum, so a statistics whose groups include its layer's reduction
        group (the owners' group) is reduce-scattered over it: every layer's statistics of that group
        packed by owner into equal slots (the largest rank's share, sized from the layouts alone), one
        call per reduction group, which sends ``(R-1)/R`` of the payload where an all-reduce sends twice
        that, as long as the slots are full: where ``R`` slots hold more than twice the payload (more
        ranks than layers to own) the group's statistics are all-reduced instead. Its other groups (TP
        under sequence parallelism) are summed first, by one all-reduce per group of each distinct tuple
        of them. A statistics whose groups do not include the owners' group (several
        distributed-optimizer instances: summed over the full data-parallel group) is all-reduced over
        all of them in the same calls, and its owner reads its share of the result."""
        first: dict[tuple, list] = {}  # groups summed over by all-reduces -> statistics ``(key, stats)``
        scatter: dict = {}  # reduction group -> statistics ``(key, stats, owner)`` reduce-scattered over it
        reduced = []  # this rank's statistics summed by the all-reduces alone ``(key, stats)``
        for gp, group in every:
            for side, s in gp.sides():
                stats, groups = s.stats, s.groups
                if stats is None:
                    continue
                at = next((i for i, g in enumerate(groups) if _same_ranks(g, group)), None)
                rest = tuple(groups) if at is None else tuple(groups[:at]) + tuple(groups[at + 1 :])
                if rest:
                    first.setdefault(rest, []).append(((id(gp), side), stats))
                if at is not None:
                    scatter.setdefault(group, []).append(((id(gp), side), stats, gp.owner))
                elif gp.owner == group.rank():
                    reduced.append(((id(gp), side), stats))
        summed: dict = {}  # key -> flat FP32 sum (so far) of ``_packed(stats)``
        for groups, members in first.items():
            flat = torch.cat([t.reshape(-1).float() for _, st in members for t in _packed(st)])
            for group in groups:
                dist.all_reduce(flat, group=group)
                self.state.ledger.add("all_reduce", "fp32", ring_all_reduce_bytes(group.size(), flat.numel() * 4))
            pos = 0
            for key, st in members:
                n = sum(t.numel() for t in _packed(st))
                summed[key], pos = flat[pos : pos + n], pos + n
        out = {key: _unpack(st, summed[key]) for key, st in reduced}
        for group, members in scatter.items():
            size = lambda st: sum(t.numel() for t in _packed(st))  # noqa: E731
            n, me = group.size(), group.rank()
            by_owner = [[(key, st) for key, st, owner in members if owner == r] for r in range(n)]
            slot = max(sum(size(st) for _, st in mine) for mine in by_owner)
            if n * slot > 2 * sum(size(st) for _, st, _ in members):  # equal slots would send more than a ring
                # all-reduce (2 (R-1)/R of the payload): many ranks own little or nothing (more ranks than layers)
                flat = torch.cat(
                    [
                        summed[key] if key in summed else torch.cat([t.reshape(-1).float() for t in _packed(st)])
                        for key, st, _ in members
                    ]
                )
                dist.all_reduce(flat, group=group)
                self.state.ledger.add("all_reduce", "fp32", ring_all_reduce_bytes(n, flat.numel() * 4))
                pos = 0
                for key, st, owner in members:
                    if owner == me:
                        out[key] = _unpack(st, flat[pos : pos + size(st)])
                    pos += size(st)
                continue
            pad = torch.zeros(slot, dtype=torch.float32, device=self.device)
            pieces = []
            for mine in (
                by_owner
            ):  # each owner's statistics (summed over the other groups first, if any), then zeros up to the slot
                for key, st in mine:
                    pieces += [summed[key]] if key in summed else [t.reshape(-1).float() for t in _packed(st)]
                pieces.append(pad[: slot - sum(size(st) for _, st in mine)])
            send = torch.cat(pieces)
            recv = torch.empty(slot, dtype=torch.float32, device=self.device)
            if n > 1:
                _reduce_scatter(recv, send, group=group)
                self.state.ledger.add(
                    "reduce_scatter", "fp32", (n - 1) * slot * 4
                )  # ring reduce-scatter: slots out
            else:
                recv.copy_(send)
            pos = 0
            for key, st in by_owner[me]:
                out[key] = _unpack(st, recv[pos : pos + size(st)])
                pos += size(st)
        return out
