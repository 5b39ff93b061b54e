"""Megatron-Core DDP whose bucket reductions send FP8 (Euclidean or GIFT-whitened) gradients: the adapter.

``GiftDistributedDataParallel`` builds Megatron's own buffers and bucket groups, then turns each
bucket group with something to quantize into a ``bucket_group.GiftBucketGroup`` (the collective),
registers the forward hooks that collect GIFT's input statistics, and delegates the per-step
state (statistics, factors, damping choices, residuals, step) to ``state.GiftState``. Buckets
whose parameters are all ``off`` keep Megatron's collective untouched.

Per step (``zero_grad_buffer`` marks the start): forward pre-hooks add each GIFT layer's input
statistics; the first bucket sync of the step folds them into the rank's local per-step EMA
(local compute only). With ``--gift-side both`` / ``auto`` tensor hooks on the layers' outputs
add the statistics of their gradients during the backward (every micro-batch's, recomputed
forwards' included, once), folded when the step closes (the next ``zero_grad_buffer``, or a
checkpoint): a refresh at step t uses ``B`` up to step t-1. ``B`` carries the loss's scale (a loss
scale, ``1/num_microbatches``), which relative damping cancels while it is constant; a dynamic FP16
loss scale weights the EMA's steps by theirs until the EMA forgets a change (~1/(1-ema) steps). On
refresh steps that first sync also sums the local EMAs over the data-parallel group (FP32; by
linearity the EMA of the global statistics) and starts each layer's build on its owner rank (the
layers spread over the reduction group by record size); each bucket group's sync keeps the owner's
local gradient for the damping choice (``--gift-damping auto``); ``finish_grad_sync`` and the
close of the step finish the builds (on the statistics' device), one all-gather per reduction
group sends every factor and ``T`` with the choice, and the next step's first sync installs them:
every rank holds the owner's bits by construction (``refresh_sync.RefreshSync``: the stages and
their host synchronisations).

Each converted bucket group gets its ``GiftBucket`` records and one ``ReductionContext``
(``bucket_group``); the DDP walks its converted groups' records, never a group's internals.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from ..comm.fp4_reduce import ROTATION_BLOCK
from ..comm.layout import BucketLayout, Segment
from ..comm.ledger import CommLedger
from ..comm.schedule import Arena, ReductionQueue, StageStreams, default_schedule
from ..comm.topology import build_groups, nodes_of_ranks
from ..config import Exchange, GiftConfig, IntraNode, Mode, Rotation, Side, param_modes
from ..numerics.error_feedback import ErrorFeedback
from ..numerics.kfac import KFACStatistics
from ..refresh_sync import RefreshSync
from ..state import GiftParam, GiftState, SideState
from ..upstream import check_upstream
from .bucket_group import GiftBucket, GiftBucketGroup, ReductionContext, reduction_group, sent_map
from .layer_inputs import opaque_modules, refuse_opaque, weight_input
from .monitor import Monitor
from .param_gather import DeltaParamSync, enable_delta_param_gather, refuse_delta_param_gather

__all__ = ["GiftBucketGroup", "GiftDistributedDataParallel", "GiftParam", "refuse_unsupported"]

logger = logging.getLogger(__name__)


def refuse_unsupported(config, ddp_config, gift_config: GiftConfig) -> None:
    """``ValueError`` (``UntestedMegatronError`` for changed Megatron-Core functions) for what the plugin cannot serve.

    CUDA graphs: ``start_grad_sync`` would have to wait on each graph's weight-gradient event, and
    a replayed graph does not run the forward pre-hooks that collect GIFT's statistics."""
    check_upstream(allow_untested=gift_config.allow_untested_megatron)
    graphs = [f for f in ("enable_cuda_graph", "external_cuda_graph") if getattr(config, f, False)]
    if getattr(config, "cuda_graph_impl", "none") != "none":
        graphs.append(f"cuda_graph_impl={config.cuda_graph_impl!r}")
    if graphs:
        raise ValueError(
            f"megatron-gift does not support CUDA graphs ({', '.join(graphs)}): its reduction does not wait on "
            "graph-replayed weight gradients and its statistics hooks are not replayed; drop --enable-cuda-graph / "
            "--external-cuda-graph / --cuda-graph-impl, or turn GIFT off"
        )
    if getattr(ddp_config, "reduce_scatter_with_fp32_accumulation", False):
        raise ValueError(
            "reduce_scatter_with_fp32_accumulation replaces the same collective as megatron-gift "
            "(which already sums in FP32): turn one of them off"
        )
    monitored = gift_config.log_interval or gift_config.policy is not None
    if ddp_config.num_distributed_optimizer_instances > 1 and monitored:
        raise ValueError(
            "megatron-gift's telemetry and --gift-layers auto compare with a reduction inside one distributed-"
            "optimizer instance: with num_distributed_optimizer_instances > 1 set --gift-log-interval 0 and "
            "choose the layers by pattern"
        )
    if gift_config.param_gather is not None:
        refuse_delta_param_gather(ddp_config)


class GiftDistributedDataParallel(DistributedDataParallel):
    """``DistributedDataParallel(config, ddp_config, module, ...)`` plus ``gift_config``."""

    def __init__(self, config, ddp_config, module, *args, gift_config: GiftConfig | None = None, **kwargs):
        self.gift_config = gift_config or GiftConfig()
        refuse_unsupported(config, ddp_config, self.gift_config)
        super().__init__(config, ddp_config, module, *args, **kwargs)
        self.gift_state = GiftState(self.gift_config, self._device())
        self.refresh = RefreshSync(self.gift_state, w.side if (w := self.gift_config.whitening) else Side.INPUT)
        # names as in the model, without the prefixes of wrappers such as Float16Module
        named = [(re.sub(r"^(module\.)+", "", n), p) for n, p in self.module.named_parameters() if p.requires_grad]
        self._param_names = {p: n for n, p in named}
        modes = param_modes(named, self.gift_config)
        # a group of one sends nothing: keep Megatron's gradient, bit for bit (unless loopback asks otherwise)
        if not self.gift_config.exchange.loopback:
            modes = {n: modes[n] if self._reduction_size(p) > 1 else Mode.OFF for n, p in named}
        self.monitor = Monitor(
            self.gift_config, self.set_mode, verbose=not dist.is_initialized() or dist.get_rank() == 0
        )
        for i, (name, p) in enumerate(named):
            if modes[name] is not Mode.OFF:
                candidate = modes[name] is Mode.GIFT
                mode = self.monitor.policy.mode(name) if candidate and self.monitor.policy else modes[name]
                expert = not getattr(p, "allreduce", True)
                self.gift_params[p] = GiftParam(name, mode, candidate, sketch_seed=i, expert=expert)
        self._out_stats: list[KFACStatistics] = []  # B of every two-sided layer, folded at the close of a step
        self._stat_hooks = self._register_stat_hooks()
        inflight = self.gift_config.exchange.inflight_mb
        arena = Arena.shared(self._device(), None if inflight is None else inflight << 20, logger.warning)
        self.queue = ReductionQueue(StageStreams(self._device()), self._schedule(), arena=arena)
        context = ReductionContext(self.gift_config, self.gift_state, self.monitor, self.queue, self._at_sync)
        self._bucket_of: dict[int, GiftBucket] = {}  # id(GiftParam) -> its bucket
        for bg in self._bucket_groups():
            self._convert(bg, context)
        self._place_groups()
        self.queue.arena.plan([n for bg in self._converted() for n in bg.footprints()])
        self.param_gather_ledger = CommLedger()  # bytes of the delta parameter all-gather (not reset per step)
        if (gather := self.gift_config.param_gather) is not None:
            enable_delta_param_gather(
                self, gather.full_every, self.param_gather_ledger, gather.check_every, self.gift_config.exchange.kernels
            )
        self.refresh.assign_owners(list(self._gift_layers()))
        counts = {
            m.value: sum(1 for gp in self.gift_params.values() if gp.mode is m) for m in Mode if m is not Mode.OFF
        }
        auto = (
            f", {sum(gp.candidate for gp in self.gift_params.values())} chosen by measurement"
            if self.monitor.policy
            else ""
        )
        logger.info("megatron-gift: %s; parameters: %s (the rest off%s)", self.gift_config, counts, auto)

    # the state the training loop, the checkpoint hooks, tests and benchmarks read
    @property
    def step(self) -> int:
        """Index of the current iteration once ``zero_grad_buffer()`` opened it (-1 before)."""
        return self.gift_state.step

    @property
    def gift_params(self) -> dict[torch.nn.Parameter, GiftParam]:
        return self.gift_state.params

    @property
    def ledger(self) -> CommLedger:
        return self.gift_state.ledger

    @property
    def last_step_bytes(self) -> dict[str, int]:
        """Bytes this rank sent in the last closed step, by ``collective/dtype``."""
        return self.gift_state.last_step_bytes

    def _reduction_size(self, p: torch.nn.Parameter) -> int:
        """Ranks that reduce ``p``'s gradient: the (expert) data-parallel group of its bucket group."""
        return (self.intra_dp_cp_group if getattr(p, "allreduce", True) else self.intra_expt_dp_group).size()

    def _device(self):
        for p in self.module.parameters():
            return p.device
        return torch.device("cpu")

    # -- construction ---------------------------------------------------------------------
    def _convert(self, bg: _ParamAndGradBucketGroup, context: ReductionContext) -> None:
        """Plan every bucket of ``bg`` and switch its class; groups with nothing to quantize stay Megatron's."""
        shards = reduction_group(bg).size()
        plans = []
        for bucket in bg.buckets:
            entries = []
            for p in bucket.params_list:
                start, end = bucket.param_to_index[p]
                gp = self.gift_params.get(p)
                rows = p.shape[0] if p.dim() > 1 else 1
                mode = gp.mode if gp is not None else Mode.OFF
                entries.append((Segment(start, rows, (end - start) // rows, mode, self._param_names[p]), gp))
            entries.sort(key=lambda e: e[0].start)
            plans.append(entries)
        if all(seg.mode is Mode.OFF for entries in plans for seg, _ in entries):
            return
        bg.__class__ = GiftBucketGroup
        bg.gift_context, bg.gift_buckets = context, []
        for bucket, entries in zip(bg.buckets, plans):
            layout = self._layout(bucket, [seg for seg, _ in entries], shards)
            record = GiftBucket(bucket, layout, [gp for _, gp in entries], self._error_feedback(layout, bucket))
            bg.gift_buckets.append(record)
            for _, gp in record.segments():
                self._bucket_of[id(gp)] = record

    def _schedule(self):
        """``GiftConfig.exchange.schedule``, else the device's default (``comm.schedule``); the same on every
        rank (a rank with other settings would issue its collectives in another order: refused)."""
        schedule = self.gift_config.exchange.schedule or default_schedule(self._device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, schedule.value)
            if len(set(everyone)) > 1:
                raise ValueError(
                    f"megatron-gift: ranks chose different reduction schedules ({sorted(set(everyone))}): set "
                    "CUDA_DEVICE_MAX_CONNECTIONS the same on every rank, or pass --gift-schedule"
                )
        return schedule

    def _place_groups(self) -> None:
        """Each converted bucket group's topology and two-level subgroups (collective over all ranks)."""
        converted = self._converted()
        groups = [reduction_group(bg) for bg in converted]
        cfg = self.gift_config
        rpn = nodes_of_ranks(cfg.exchange.ranks_per_node)  # the hosts, gathered once here (issue 35 item 4)
        for bg, placed in zip(converted, build_groups(groups, rpn, two_level=cfg.exchange.topology is Exchange.AUTO)):
            bg.gift_groups = placed
            if placed.intra is not None and cfg.wire.error_feedback:
                logger.info(
                    "megatron-gift: error feedback keeps the flat exchange (its residual is per rank and bucket)"
                )

    def _layout(self, bucket, segments: list[Segment], shards: int) -> BucketLayout:
        """The bucket's plan, checked once here (``BucketLayout.check``: the same refusal on every rank).
        With four bits between nodes and no distributed optimizer, the all-reduce's shards (the plugin's
        own) are whole blocks (64 columns with the rotation); the reduce-scatter's are Megatron's."""
        cfg, dist_opt = self.gift_config, self.ddp_config.use_distributed_optimizer
        if cfg.exchange.intra_node is IntraNode.REDUCE_SCATTER and not dist_opt:
            raise ValueError(
                "megatron-gift: --gift-intra-node reduce-scatter reduce-scatters Megatron's equal shards: it needs "
                "--use-distributed-optimizer (or use --gift-intra-node bf16)"
            )
        fmt = cfg.wire.inter_node_format
        block = None if fmt.block is None else fmt.block if cfg.wire.rotation is Rotation.NONE else ROTATION_BLOCK
        layout = BucketLayout(
            bucket.grad_data.numel(),
            shards,
            segments,
            cfg.wire.codec,
            bucket.grad_data.dtype,
            align=block if block is not None and not dist_opt else 1,
        )
        layout.check(reduce_scatter=dist_opt)
        if fmt.block is not None:  # four bits between nodes: every boundary on a whole block
            layout.check_blocks(fmt.block, f"--gift-inter-node-format {fmt.value}")
            if cfg.wire.rotation is not Rotation.NONE:  # H acts on 64-column blocks of a row
                layout.check_blocks(ROTATION_BLOCK, f"--gift-rotation {cfg.wire.rotation.value}")
        return layout

    def _error_feedback(self, layout: BucketLayout, bucket) -> ErrorFeedback | None:
        return (
            ErrorFeedback(layout.n_coded, device=bucket.grad_data.device)
            if self.gift_config.wire.error_feedback
            else None
        )

    def set_mode(self, gp: GiftParam, mode: Mode) -> None:
        """Send ``gp`` as ``mode`` from now on: re-plan its bucket; an error-feedback residual moves
        between whitened and plain coordinates (and is dropped when ``gp`` leaves FP8)."""
        if mode is gp.mode:
            return
        b = self._bucket_of[id(gp)]
        ef = b.error_feedback
        bucket_params = {id(p) for _, p in b.segments()}
        residuals = {id(p): view.clone() for view, p in self._residual_views() if id(p) in bucket_params}
        old, gp.mode = gp.mode, mode
        segments = [
            dataclasses.replace(seg, mode=p.mode) if p is not None else seg
            for seg, p in zip(b.layout.segments, b.params)
        ]
        b.layout = self._layout(b.bucket, segments, b.layout.num_shards)
        b.error_feedback = self._error_feedback(b.layout, b.bucket)
        if ef is None:
            return
        for view, p in self._residual_views():
            r = residuals.get(id(p))
            if r is None:
                continue
            t = sent_map(gp)
            if p is gp and t is not None:  # whitened coordinates (both sides'): plain ones while there is no T
                r = t.inverse(r) if old is Mode.GIFT else t.apply(r)
            view.copy_(r)

    def _register_stat_hooks(self):
        """Forward pre-hooks that add ``XᵀX`` (sketched) of each GIFT weight's input every step.

        The statistics are summed over the data-parallel(+context-parallel) group, or the expert
        data-parallel group for experts, and also over the layer's tensor-parallel group (for
        experts the expert tensor-parallel group) when a column-parallel layer sees only ``s/tp``
        tokens (sequence parallelism). A row-parallel layer's ``in/tp`` columns give a diagonal
        block of A, consistent per TP shard. Only linear layers (weight times a floating-point
        input) are whitened, from the statistics of what the weight multiplies
        (``layer_inputs.weight_input``: Transformer Engine's fused norm applied first); a linear
        layer whose input cannot be determined is refused; a weight that is no linear layer's (an
        embedding's, whose input is token ids; a tied output layer's) is sent Euclidean."""
        hooks = []
        opaque = opaque_modules(self.module)
        for mod in self.module.modules():
            w = getattr(mod, "weight", None)
            gp = self.gift_params.get(w) if isinstance(w, torch.nn.Parameter) else None
            if gp is None or not gp.candidate:
                continue
            if mod in opaque:
                raise refuse_opaque(gp.name, opaque[mod])
            weight_in = weight_input(mod, gp.name)
            if weight_in is None:
                continue
            gp.input.stats = KFACStatistics(
                w.shape[1],
                ema=self.gift_config.whitening.ema,
                sketch=self.gift_config.whitening.sketch,
                seed=gp.sketch_seed,
                device=w.device,
            )
            gp.input.groups = [self.expt_dp_group if gp.expert else self.dp_cp_group]
            column_parallel = getattr(w, "tensor_model_parallel", False) and getattr(w, "partition_dim", None) == 0
            tp_group = self._tensor_parallel_group(mod, gp)
            if column_parallel and getattr(mod, "sequence_parallel", False) and tp_group.size() > 1:
                gp.input.groups.append(tp_group)
            hooks.append(mod.register_forward_pre_hook(self._stat_hook(gp, weight_in)))
            if self._two_sided():
                hooks.append(self._register_output_side(mod, gp, w, tp_group, len(self._param_names)))
        for gp in self.gift_params.values():
            if gp.candidate and gp.input.stats is None:
                logger.warning(
                    "megatron-gift: %s is no linear layer's weight (whitening needs a floating-point input it "
                    "multiplies, e.g. not an embedding's token ids); sending it Euclidean",
                    gp.name,
                )
                gp.mode, gp.candidate = Mode.EUCLIDEAN, False
        return hooks

    def _two_sided(self) -> bool:
        """Whether GIFT layers keep output statistics: ``--gift-side both`` / ``auto`` with a low-rank
        part (a rank-0 ``T_out`` is diagonal: it scales whole rows, which the codec's row and block
        scales already do, so the reduction never applies one: ``comm.output_side``)."""
        return self.gift_config.whitening is not None and self.gift_config.whitening.two_sided

    def _register_output_side(self, mod, gp: GiftParam, w: torch.nn.Parameter, tp_group, n_params: int):
        """``gp.output``'s statistics (``B = E[g gᵀ]`` over ``mod``'s output gradients ``g [..., w.shape[0]]``)
        and the forward hook that collects them (``_output_hook``); returns its handle.

        Summed at a refresh over the layer's (expert) data-parallel group, plus its tensor-parallel
        group where each TP rank's output holds other tokens: a row-parallel layer's under sequence
        parallelism (its output is reduce-scattered to ``s/tp`` tokens; the weight's gradient uses all
        of them, all-gathered in the backward). A column-parallel weight ``[d_out/tp, d_in]`` sees
        its own output columns: a diagonal block of the full ``B``, nothing to sum over TP. Experts
        with Megatron's explicit expert communication reduce outside the layer: every expert-TP
        rank gets the same gradients. The sketch's seed is the input side's plus the number of
        parameters: distinct from every input seed, the same on every rank."""
        cfg = self.gift_config
        out = gp.output = SideState(
            KFACStatistics(
                w.shape[0],
                ema=cfg.whitening.ema,
                sketch=cfg.whitening.sketch,
                seed=n_params + gp.sketch_seed,
                device=w.device,
            ),
            [self.expt_dp_group if gp.expert else self.dp_cp_group],
        )
        row_parallel = getattr(w, "tensor_model_parallel", False) and getattr(w, "partition_dim", None) == 1
        scattered = getattr(mod, "sequence_parallel", False) and not getattr(mod, "explicit_expert_comm", False)
        if row_parallel and scattered and tp_group.size() > 1:
            out.groups.append(tp_group)
        self._out_stats.append(out.stats)
        return mod.register_forward_hook(self._output_hook(gp, tp_group))

    def _output_hook(self, gp: GiftParam, tp_group):
        """A forward hook that registers, on the layer's output (the first element of Megatron's
        ``(output, bias)``), a tensor hook adding the output's gradient to its output side's statistics (a copy:
        the gradient itself is left as it is). Only an output that requires grad gets one: with
        activation recomputation the no-grad forward registers nothing and the recomputed one (inside
        the backward) does, so every micro-batch's gradient is counted once. A column-parallel
        output gathered over TP (``gather_output``) contributes this rank's own columns."""
        stats = gp.output.stats
        width = stats.d_in

        def add(g: torch.Tensor) -> None:
            if g.shape[-1] != width:
                tp = tp_group.size()
                if g.shape[-1] != width * tp:
                    raise RuntimeError(
                        f"megatron-gift: the output of {gp.name}'s layer has {g.shape[-1]} features where its weight "
                        f"has {width} rows: its output gradient is not the weight's; use --gift-side input"
                    )
                g = g.narrow(-1, tp_group.rank() * width, width)  # gathered over TP: this rank's block
            with torch.no_grad():
                stats.accumulate(g)

        def hook(module, args, output):
            y = output[0] if isinstance(output, (tuple, list)) else output
            if module.training and isinstance(y, torch.Tensor) and y.requires_grad:
                y.register_hook(add)

        return hook

    def _tensor_parallel_group(self, mod, gp: GiftParam):
        """The group a sequence-parallel layer splits its tokens over: the layer's own
        (``tp_group``), else the expert tensor-parallel group for experts, the dense one otherwise."""
        own = getattr(mod, "tp_group", None)
        if isinstance(own, dist.ProcessGroup):
            return own
        if gp.expert:
            from megatron.core import parallel_state

            return parallel_state.get_expert_tensor_parallel_group()
        return self.tp_group

    def _stat_hook(self, gp: GiftParam, weight_in):
        """Adds ``weight_in(input)`` (``layer_inputs.weight_input``: what the weight multiplies) to ``gp``'s
        statistics."""

        def hook(module, args):
            # a forward inside a backward pass is activation recomputation: its micro-batch was counted
            recomputed = torch._C._current_graph_task_id() != -1
            if (
                self.gift_state.collect_statistics
                and module.training
                and not recomputed
                and args
                and isinstance(args[0], torch.Tensor)
            ):
                with torch.no_grad():
                    gp.input.stats.accumulate(weight_in(args[0]))

        return hook

    # -- per step -------------------------------------------------------------------------
    def zero_grad_buffer(self):
        """Megatron calls this at the start of every iteration: close the last step, open the next."""
        super().zero_grad_buffer()
        self._close_step()
        self.gift_state.open_step()

    def is_refresh_step(self, step: int) -> bool:
        """Whether ``step`` rebuilds the factors (``GiftState.is_refresh_step``)."""
        return self.gift_state.is_refresh_step(step)

    def _close_step(self) -> None:
        """Close the open step (``RefreshSync.close_step``) and hand it to the monitor; a no-op when no step is open."""
        efs = (b.error_feedback for b in self.gift_buckets() if b.error_feedback is not None)
        if self.refresh.close_step(efs):
            # the step's output gradients are all in (they arrive during the backward, after the
            # step's first sync, where A is folded): a refresh at step t sees B up to step t-1
            KFACStatistics.fold_all(self._out_stats)
            self.monitor.close(self.step, self._segments(), self.last_step_bytes)

    def _bucket_groups(self) -> list:
        return self.bucket_groups + self.expert_parallel_bucket_groups

    def _converted(self) -> list[GiftBucketGroup]:
        """The bucket groups whose reduction the plugin runs, in one order on all ranks."""
        return [bg for bg in self._bucket_groups() if isinstance(bg, GiftBucketGroup)]

    def gift_buckets(self):
        """Every converted bucket's ``GiftBucket``, in one order on all ranks."""
        return (b for bg in self._converted() for b in bg.gift_buckets)

    def _segments(self):
        """``(GiftParam, Segment, bucket element size)`` of every plugin parameter."""
        for b in self.gift_buckets():
            for seg, gp in b.segments():
                yield gp, seg, b.grad.element_size()

    def _at_sync(self, bucket_group: GiftBucketGroup) -> None:
        """At every bucket group's sync, before its reduction (``RefreshSync.at_sync``): the first of
        the step installs the last refresh, folds the step's statistics and on a refresh step starts
        the next; then, on a refresh step, the owner keeps ``bucket_group``'s local gradients."""
        self.refresh.at_sync(self._gift_layers_of(bucket_group), self._remap)

    def finish_grad_sync(self, *args, **kwargs):
        """Megatron's, then the next stage of a refresh in flight (``RefreshSync.after_reductions``)."""
        super().finish_grad_sync(*args, **kwargs)
        self.refresh.after_reductions()

    def _remap(self, gp: GiftParam, old, new) -> None:
        GiftState.remap_residual(gp, old, new, self._residual_views())

    def _gift_layers(self):
        """``(GiftParam, its bucket group's reduction group)`` of every GIFT layer, in one order on all ranks."""
        for bg in self._converted():
            yield from ((gp, group) for gp, group, _ in self._gift_layers_of(bg))

    def _gift_layers_of(self, bg: GiftBucketGroup):
        """``(GiftParam, reduction group, local gradient [rows, cols])`` of the GIFT layers of one bucket group."""
        group = reduction_group(bg)
        for b in bg.gift_buckets:
            for seg, gp in b.segments():
                if gp.candidate:
                    yield gp, group, b.local_grad(seg)

    def restart_param_gather(self) -> None:
        """The parameters changed outside the optimizer (a checkpoint load): the next
        ``zero_grad_buffer()`` gathers them in full before the delta gather resumes."""
        for bg in self._bucket_groups():
            if isinstance(bg, DeltaParamSync):
                bg.delta.prev = None

    # -- checkpoint state -------------------------------------------------------------------
    def gift_state_dict(self) -> dict:
        """This rank's plugin state after the current step (call it after the optimizer step), on
        the CPU and keyed by parameter name: ``GiftState.state_dict`` plus ``"policy"`` (the layer
        decisions of ``--gift-layers auto``)."""
        self._close_step()
        residuals = list(self._residual_views())
        # a refresh in flight is installed first: nothing reads T between the end of a step and the
        # next step's first sync, where it would be installed anyway
        self.refresh.install(lambda gp, old, new: GiftState.remap_residual(gp, old, new, residuals))
        state = self.gift_state.state_dict(residuals)
        if self.monitor.policy is not None:
            state["policy"] = self.monitor.policy.state_dict()
        return state

    def load_gift_state_dict(self, state: dict, local: bool = True) -> list[str]:
        """Restore ``gift_state_dict()`` output; returns the parameters left fresh (and logs them).

        ``local=False``: the per-rank state (K-FAC statistics, error-feedback residuals) belongs to
        the ranks of another data-parallel layout: it starts afresh, without counting as missing."""
        policy = self.monitor.policy
        if policy is not None and "policy" in state:  # the layer decisions, before anything else is placed
            policy.load_state_dict(state["policy"])
            for gp in self.gift_params.values():
                if gp.candidate:
                    self.set_mode(gp, policy.mode(gp.name))
        self.refresh.discard()
        missing = self.gift_state.load_state_dict(state, self._residual_views(), self._device(), local)
        if missing:
            logger.warning(
                "megatron-gift: no usable saved state for %d parameter(s), starting them fresh: %s",
                len(missing),
                missing,
            )
        return missing

    def _residual_views(self):
        """(error-feedback residual of one parameter as ``[rows, cols]``, its GiftParam) pairs."""
        for b in self.gift_buckets():
            if b.error_feedback is None:
                continue
            for seg, gp in b.segments():
                if seg.mode in (Mode.EUCLIDEAN, Mode.GIFT):
                    c = b.layout.coded_index(seg.start)
                    yield b.error_feedback.residual[c : c + seg.rows * seg.cols].view(seg.rows, seg.cols), gp
