"""Megatron-Core DDP whose bucket reductions send FP8 (Euclidean or GIFT-whitened) gradients.

``GiftDistributedDataParallel`` builds Megatron's own buffers and bucket groups, then turns
each bucket group into a ``GiftBucketGroup`` whose ``start_grad_sync`` launches
``comm.QuantizedReduce`` (or ``comm.hierarchical.TwoLevelReduce`` where the data-parallel group spans
several nodes with several ranks each) instead of NCCL's reduce-scatter / all-reduce. That one override
serves the overlapped backward-hook path, the synchronous path and the first batch, and
``finish_grad_sync`` (Megatron's) waits on the returned handle. Buckets whose parameters
are all ``off`` keep Megatron's collective untouched.

Per step (``zero_grad_buffer`` marks the start): forward pre-hooks add each GIFT layer's input
statistics; the first bucket sync of the step folds them into the rank's local per-step EMA
(local compute only). On refresh steps that first sync also sums the local EMAs over the
data-parallel group (FP32; by linearity the EMA of the global statistics), and each bucket
group's sync then builds its layers' factors and ``T`` (FP64, CPU) only on their owner ranks
(the layers spread round-robin over the reduction group), choosing the damping there from the
owner's own local gradient (``--gift-damping auto``), and broadcasts them with the choice:
every rank holds the owner's bits by construction.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from ..comm.hierarchical import TwoLevelPipeline, start_reduction
from ..comm.layout import BucketLayout, Segment
from ..comm.quantized import CommLedger
from ..comm.topology import TwoLevelGroups, build_groups, ranks_per_node_from_env
from ..config import GiftConfig, Mode, param_modes
from ..numerics.error_feedback import ErrorFeedback
from ..numerics.kfac import KFACStatistics
from ..numerics.profile import choose_damping
from ..numerics.whitening import LowRankFactor, LowRankWhitening
from .monitor import Monitor
from ..upstream import check_version

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
    index: int = 0
    owner: int = 0  # rank in its bucket group's reduction group that builds its factor
    expert: bool = False  # an expert-parallel weight: replicated over the expert data-parallel group
    stats_groups: list = field(default_factory=list)
    damping: float | None = None  # relative damping of its current T; None: no T yet, or Euclidean chosen (T = I)


def _to(tree, device):
    """A copy of a nested dict of tensors on ``device``."""
    if isinstance(tree, dict):
        return {k: _to(v, device) for k, v in tree.items()}
    return tree.to(device, copy=True) if isinstance(tree, torch.Tensor) else tree


def _layer_input(module, x: torch.Tensor) -> torch.Tensor:
    """The linear map's input: Transformer Engine's fused norm+linear gets the pre-norm tensor,
    so its norm is applied here (RMSNorm or LayerNorm, with zero-centred gamma)."""
    ln_weight = getattr(module, "layer_norm_weight", None)
    if ln_weight is None:
        return x
    w = ln_weight.float() + (1.0 if getattr(module, "zero_centered_gamma", False) else 0.0)
    xf = x.float()
    if getattr(module, "normalization", "LayerNorm") == "RMSNorm":
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps) * w
    bias = getattr(module, "layer_norm_bias", None)
    return torch.nn.functional.layer_norm(xf, (xf.shape[-1],), w, None if bias is None else bias.float(), module.eps)


def refuse_unsupported(config, ddp_config, gift_config: GiftConfig) -> None:
    """``ValueError`` (``RuntimeError`` for an untested megatron-core) for what the plugin cannot serve.

    CUDA graphs: ``start_grad_sync`` would have to wait on each graph's weight-gradient event, and
    a replayed graph does not run the forward pre-hooks that collect GIFT's statistics."""
    check_version()
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


def _is_linear(module) -> bool:
    """Whether ``module`` multiplies its floating-point input by its ``weight`` (a linear layer:
    ``torch.nn.Linear``, Megatron's and Transformer Engine's ``*Linear`` classes)."""
    return isinstance(module, torch.nn.Linear) or any(c.__name__.endswith("Linear") for c in type(module).__mro__)


class GiftBucketGroup(_ParamAndGradBucketGroup):
    """A Megatron bucket group whose gradient reduction is quantized (see module doc)."""

    gift: "GiftDistributedDataParallel"
    gift_layouts: list[BucketLayout]
    gift_params: list[list[GiftParam | None]]
    gift_error_feedback: list[ErrorFeedback | None]
    gift_groups: TwoLevelGroups

    def start_grad_sync(self, force_all_reduce: bool | None = False):
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return
        assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
        self._prepare_grads()
        self.gift.refresh_factors(self)
        use_rs = self.ddp_config.use_distributed_optimizer and not force_all_reduce
        group = self.intra_distributed_optimizer_instance_group if self.ddp_config.use_distributed_optimizer else self.data_parallel_group
        refs = self.gift.monitor.before_reduce(self, group, self.gift.step)
        # as Megatron: with several instances finish_grad_sync waits on a stream, not on a handle
        async_op = self.ddp_config.overlap_grad_reduce and self.ddp_config.num_distributed_optimizer_instances == 1
        handles = []
        for bucket, layout, params, ef in zip(self.buckets, self.gift_layouts, self.gift_params, self.gift_error_feedback):
            transforms = [p.whitening if p is not None and p.mode is Mode.GIFT else None for p in params]
            handles.append(
                start_reduction(
                    bucket.grad_data,
                    layout,
                    self.gift_groups,
                    transforms,
                    self.gift.gift_config.intra_node,
                    ef,
                    self.gift.pipeline,
                    average=self.ddp_config.average_in_collective,
                    all_reduce=not use_rs,
                    ledger=self.gift.ledger,
                    async_op=async_op,
                    nonfinite=self.gift.nonfinite,
                )
            )
        after = None
        if refs is not None:
            after = lambda: self.gift.monitor.after_reduce(self, group, refs, self.ddp_config.average_in_collective)  # noqa: E731
        inter = None
        if use_rs and self.ddp_config.num_distributed_optimizer_instances > 1:
            inter = self._all_reduce_across_instances
        handle = _Handles(handles, after, inter)
        if async_op:
            self.grad_reduce_handle = handle
        else:
            handle.wait()

    def _all_reduce_across_instances(self) -> None:
        """Several distributed-optimizer instances: sum this rank's reduced shard of every bucket
        over the instances in FP32 (averaged with ``average_in_collective``), as Megatron's
        inter-instance all-reduce does after the intra-instance reduce-scatter."""
        group = self.inter_distributed_optimizer_instance_group
        n, r = group.size(), self.intra_distributed_optimizer_instance_rank
        for bucket in self.buckets:
            size = bucket.grad_data.numel() // self.intra_distributed_optimizer_instance_size
            shard = bucket.grad_data[r * size : (r + 1) * size]
            total = shard.float()  # the shard itself when the buffer is FP32
            dist.all_reduce(total, group=group)
            if self.ddp_config.average_in_collective:
                total /= n
            if total is not shard:
                shard.copy_(total)
            self.gift.ledger.add("all_reduce", "fp32", 2 * (n - 1) * total.numel() * 4 // n)

    def _prepare_grads(self) -> None:
        """Megatron's pre-collective steps: extra main-grad copies, NaN check, gradient scaling."""
        for bucket in self.buckets:
            for param in bucket.params_with_extra_main_grads:
                if getattr(param, "main_grad_copy_in_grad_buffer", None) is not None:
                    param.main_grad_copy_in_grad_buffer.copy_(param.main_grad)
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self.check_grads(
                check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
                check_for_large=self.ddp_config.check_for_large_grads,
            )
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor


class _Handles:
    """The bucket group's reductions; then ``inter()`` (the reduction across distributed-optimizer
    instances) and ``after()`` run, once."""

    def __init__(self, handles, after=None, inter=None):
        self.handles, self.after, self.inter = handles, after, inter

    def wait(self):
        with torch.no_grad():
            for h in self.handles:
                h.wait()
            if self.inter is not None:
                self.inter()
            if self.after is not None:
                self.after()


class GiftDistributedDataParallel(DistributedDataParallel):
    """``DistributedDataParallel(config, ddp_config, module, ...)`` plus ``gift_config``."""

    def __init__(self, config, ddp_config, module, *args, gift_config: GiftConfig | None = None, **kwargs):
        self.gift_config = gift_config or GiftConfig()
        refuse_unsupported(config, ddp_config, self.gift_config)
        super().__init__(config, ddp_config, module, *args, **kwargs)
        self.ledger = CommLedger()
        self.step = -1  # index of the current iteration once zero_grad_buffer() opened it
        self._step_open = False
        self.collecting = True
        self._global_stats: dict[int, tuple] = {}  # id(GiftParam) -> its summed EMA, on a refresh step until built
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self._device())
        self.last_step_bytes: dict[str, int] = {}
        # names as in the model, without the prefixes of wrappers such as Float16Module
        named = [(re.sub(r"^(module\.)+", "", n), p) for n, p in self.module.named_parameters() if p.requires_grad]
        self._param_names = {p: n for n, p in named}
        modes = param_modes(named, self.gift_config)
        if not self.gift_config.loopback:  # a group of one sends nothing: keep Megatron's gradient, bit for bit
            modes = {n: modes[n] if self._reduction_size(p) > 1 else Mode.OFF for n, p in named}
        self.monitor = Monitor(self.gift_config, self.set_mode, verbose=not dist.is_initialized() or dist.get_rank() == 0)
        self.gift_params: dict[torch.nn.Parameter, GiftParam] = {}
        for i, (name, p) in enumerate(named):
            if modes[name] is not Mode.OFF:
                candidate = modes[name] is Mode.GIFT
                mode = self.monitor.policy.mode(name) if candidate and self.monitor.policy else modes[name]
                expert = not getattr(p, "allreduce", True)
                self.gift_params[p] = GiftParam(name, mode, candidate, index=i, expert=expert)
        self._stat_hooks = self._register_stat_hooks()
        self._bucket_of: dict[int, tuple] = {}  # id(GiftParam) -> (bucket group, bucket index)
        for bg in self.bucket_groups + self.expert_parallel_bucket_groups:
            self._convert(bg)
        self.pipeline = TwoLevelPipeline()
        self._place_groups()
        assigned: dict = {}  # each GIFT layer's factor is built on one rank: round-robin per group
        for g, group in self._gift_layers():
            g.owner = assigned.get(group, 0) % group.size()
            assigned[group] = assigned.get(group, 0) + 1
        counts = {m.value: sum(1 for g in self.gift_params.values() if g.mode is m) for m in Mode if m is not Mode.OFF}
        auto = f", {sum(g.candidate for g in self.gift_params.values())} chosen by measurement" if self.monitor.policy else ""
        logger.info("megatron-gift: %s; parameters: %s (the rest off%s)", self.gift_config, counts, auto)

    def _reduction_size(self, p: torch.nn.Parameter) -> int:
        """Ranks that reduce ``p``'s gradient: the (expert) data-parallel group of its bucket group."""
        return (self.intra_dp_cp_group if getattr(p, "allreduce", True) else self.intra_expt_dp_group).size()

    def _device(self):
        for p in self.module.parameters():
            return p.device
        return torch.device("cpu")

    # -- construction ---------------------------------------------------------------------
    def _convert(self, bg: _ParamAndGradBucketGroup) -> None:
        """Plan every bucket of ``bg`` and switch its class; groups with nothing to quantize stay Megatron's."""
        dist_opt = self.ddp_config.use_distributed_optimizer
        group = bg.intra_distributed_optimizer_instance_group if dist_opt else bg.data_parallel_group
        plans = []
        for bucket in bg.buckets:
            entries = []
            for p in bucket.params_list:
                start, end = bucket.param_to_index[p]
                g = self.gift_params.get(p)
                rows = p.shape[0] if p.dim() > 1 else 1
                mode = g.mode if g is not None else Mode.OFF
                entries.append((Segment(start, rows, (end - start) // rows, mode, self._param_names[p]), g))
            entries.sort(key=lambda e: e[0].start)
            plans.append(entries)
        if all(seg.mode is Mode.OFF for entries in plans for seg, _ in entries):
            return
        bg.__class__ = GiftBucketGroup
        bg.gift = self
        bg.gift_layouts, bg.gift_params, bg.gift_error_feedback = [], [], []
        for i, (bucket, entries) in enumerate(zip(bg.buckets, plans)):
            bg.gift_layouts.append(self._layout(bucket, [seg for seg, _ in entries], group.size()))
            bg.gift_params.append([g for _, g in entries])
            bg.gift_error_feedback.append(self._error_feedback(bg.gift_layouts[-1], bucket))
            for g in bg.gift_params[-1]:
                if g is not None:
                    self._bucket_of[id(g)] = (bg, i)

    def _place_groups(self) -> None:
        """Each converted bucket group's topology and two-level subgroups (collective over all ranks)."""
        dist_opt = self.ddp_config.use_distributed_optimizer
        converted = [bg for bg in self.bucket_groups + self.expert_parallel_bucket_groups if isinstance(bg, GiftBucketGroup)]
        groups = [bg.intra_distributed_optimizer_instance_group if dist_opt else bg.data_parallel_group for bg in converted]
        cfg = self.gift_config
        rpn = ranks_per_node_from_env(cfg.ranks_per_node)
        for bg, placed in zip(converted, build_groups(groups, rpn, two_level=cfg.exchange == "auto")):
            bg.gift_groups = placed
            if placed.intra is not None and cfg.error_feedback:
                logger.info("megatron-gift: error feedback keeps the flat exchange (its residual is per rank and bucket)")

    def _layout(self, bucket, segments: list[Segment], shards: int) -> BucketLayout:
        return BucketLayout(bucket.grad_data.numel(), shards, segments, self.gift_config.codec, bucket.grad_data.dtype)

    def _error_feedback(self, layout: BucketLayout, bucket) -> ErrorFeedback | None:
        return ErrorFeedback(layout.n_coded, device=bucket.grad_data.device) if self.gift_config.error_feedback else None

    def set_mode(self, g: GiftParam, mode: Mode) -> None:
        """Send ``g`` as ``mode`` from now on: re-plan its bucket; an error-feedback residual moves
        between whitened and plain coordinates (and is dropped when ``g`` leaves FP8)."""
        if mode is g.mode:
            return
        bg, i = self._bucket_of[id(g)]
        layout, params, ef = bg.gift_layouts[i], bg.gift_params[i], bg.gift_error_feedback[i]
        mine = {id(p) for p in params if p is not None}
        residuals = {id(p): view.clone() for view, p in self._residual_views() if id(p) in mine}
        old, g.mode = g.mode, mode
        segments = [dataclasses.replace(seg, mode=p.mode) if p is not None else seg for seg, p in zip(layout.segments, params)]
        bg.gift_layouts[i] = self._layout(bg.buckets[i], segments, layout.num_shards)
        bg.gift_error_feedback[i] = self._error_feedback(bg.gift_layouts[i], bg.buckets[i])
        if ef is None:
            return
        for view, p in self._residual_views():
            r = residuals.get(id(p))
            if r is None:
                continue
            if p is g and g.whitening is not None:  # whitened coordinates: plain ones while there is no T
                r = g.whitening.inverse(r) if old is Mode.GIFT else g.whitening.apply(r)
            view.copy_(r)

    def _register_stat_hooks(self):
        """Forward pre-hooks that add ``XᵀX`` (sketched) of each GIFT weight's input every step.

        The statistics are summed over the data-parallel(+context-parallel) group, or the expert
        data-parallel group for experts, and also over the layer's tensor-parallel group (for
        experts the expert tensor-parallel group) when a column-parallel layer sees only ``s/tp``
        tokens (sequence parallelism). A row-parallel layer's ``in/tp`` columns give a diagonal
        block of A, consistent per TP shard. Only linear layers (weight times a floating-point
        input) are whitened: a weight that is no linear layer's (an embedding's, whose input is
        token ids; a tied output layer's) is sent Euclidean."""
        hooks = []
        for mod in self.module.modules():
            w = getattr(mod, "weight", None)
            g = self.gift_params.get(w) if isinstance(w, torch.nn.Parameter) else None
            if g is None or not g.candidate or not _is_linear(mod):
                continue
            g.stats = KFACStatistics(
                w.shape[1], ema=self.gift_config.ema, sketch=self.gift_config.sketch, seed=g.index, device=w.device
            )
            g.stats_groups = [self.expt_dp_group if g.expert else self.dp_cp_group]
            column_parallel = getattr(w, "tensor_model_parallel", False) and getattr(w, "partition_dim", None) == 0
            tp_group = self._tensor_parallel_group(mod, g)
            if column_parallel and getattr(mod, "sequence_parallel", False) and tp_group.size() > 1:
                g.stats_groups.append(tp_group)
            hooks.append(mod.register_forward_pre_hook(self._stat_hook(g)))
        for g in self.gift_params.values():
            if g.candidate and g.stats is None:
                logger.warning(
                    "megatron-gift: %s is no linear layer's weight (whitening needs a floating-point input it "
                    "multiplies, e.g. not an embedding's token ids); sending it Euclidean", g.name
                )
                g.mode, g.candidate = Mode.EUCLIDEAN, False
        return hooks

    def _tensor_parallel_group(self, mod, g: GiftParam):
        """The group a sequence-parallel layer splits its tokens over: the layer's own
        (``tp_group``), else the expert tensor-parallel group for experts, the dense one otherwise."""
        own = getattr(mod, "tp_group", None)
        if isinstance(own, dist.ProcessGroup):
            return own
        if g.expert:
            from megatron.core import parallel_state

            return parallel_state.get_expert_tensor_parallel_group()
        return self.tp_group

    def _stat_hook(self, g: GiftParam):
        def hook(module, args):
            # a forward inside a backward pass is activation recomputation: its micro-batch was counted
            recomputed = torch._C._current_graph_task_id() != -1
            if self.collecting and module.training and not recomputed and args and isinstance(args[0], torch.Tensor):
                with torch.no_grad():
                    g.stats.accumulate(_layer_input(module, args[0]))

        return hook

    # -- per step -------------------------------------------------------------------------
    def zero_grad_buffer(self):
        """Megatron calls this at the start of every iteration: close the last step, open the next."""
        super().zero_grad_buffer()
        self._close_step()
        self.step += 1
        self.collecting = True
        self._step_open = True

    def is_refresh_step(self, step: int) -> bool:
        """Every ``refresh_interval`` steps, and before the first interval also at steps 1, 2, 4,
        8, ...: activations drift fastest early in training, and a stale factor amplifies FP8
        error instead of shrinking it."""
        n = self.gift_config.refresh_interval
        return step % n == 0 or (step < n and step & (step - 1) == 0)

    def _close_step(self) -> None:
        """Commit (or, after a NaN/Inf anywhere, drop) the step's error-feedback residuals and
        move its byte count to ``last_step_bytes``; a no-op when no step is open."""
        if not self._step_open:
            return
        applied = True
        if self.gift_config.error_feedback:
            flag = self.nonfinite.to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # a NaN anywhere skips the step everywhere
            applied = not bool(flag.item())
        for bg in self.bucket_groups + self.expert_parallel_bucket_groups:
            for ef in getattr(bg, "gift_error_feedback", []):
                if ef is not None:
                    ef.commit(applied)
        self.nonfinite.zero_()
        self.last_step_bytes = self.ledger.as_dict()
        self.ledger.reset()
        self._step_open = False
        self.monitor.close(self.step, self._segments(), self.last_step_bytes)

    def _segments(self):
        """``(GiftParam, Segment, bucket element size)`` of every plugin parameter."""
        for bg in self.bucket_groups + self.expert_parallel_bucket_groups:
            for bucket, layout, params in zip(bg.buckets, getattr(bg, "gift_layouts", []), getattr(bg, "gift_params", [])):
                for seg, g in zip(layout.segments, params):
                    if g is not None:
                        yield g, seg, bucket.grad_data.element_size()

    def refresh_factors(self, bucket_group) -> None:
        """At every bucket group's sync. The first of the step (every forward of the step is done)
        folds each GIFT layer's statistics into its local EMA and, on a refresh step, sums those
        over the statistics groups. Then, on a refresh step, the layers of ``bucket_group`` get
        their factor, damping and ``T``, built on the owner (whose gradient is ready now) and
        broadcast."""
        if self.collecting:
            self.collecting = False
            for g, _ in self._gift_layers():  # local compute only: non-finite values are caught in the sums
                g.stats.fold()
            if self.is_refresh_step(self.step):
                self._global_stats = self._sum_statistics()
        todo = [(g, grp, grad, self._global_stats.pop(id(g))) for g, grp, grad in self._gift_layers_of(bucket_group)
                if id(g) in self._global_stats]  # fmt: skip
        built = {id(g): self._build(g, grad, summed) for g, grp, grad, summed in todo if grp.rank() == g.owner}
        for g, group, _, _ in todo:
            factor, new, damping = self._broadcast_factor(g, group, built.get(id(g)))
            if damping is None:
                new = LowRankWhitening.identity(g.stats.d_in, device=g.stats.tokens.device)
            if g.mode is Mode.GIFT:
                self._remap_error_feedback(g, g.whitening, new)
            g.factor, g.whitening, g.damping = factor, new, damping

    def _gift_layers(self):
        """``(GiftParam, its bucket group's reduction group)`` of every GIFT layer, in one order on all ranks."""
        for bg in self.bucket_groups + self.expert_parallel_bucket_groups:
            yield from ((g, group) for g, group, _ in self._gift_layers_of(bg))

    def _gift_layers_of(self, bg):
        """``(GiftParam, reduction group, local gradient [rows, cols])`` of the GIFT layers of one bucket group."""
        group = bg.intra_distributed_optimizer_instance_group if self.ddp_config.use_distributed_optimizer else bg.data_parallel_group
        for bucket, layout, params in zip(bg.buckets, getattr(bg, "gift_layouts", []), getattr(bg, "gift_params", [])):
            for seg, g in zip(layout.segments, params):
                if g is not None and g.candidate:
                    yield g, group, bucket.grad_data[seg.start : seg.end].view(seg.rows, seg.cols)

    def _sum_statistics(self) -> dict[int, tuple]:
        """Every GIFT layer's local EMA ``(sums, tokens)`` summed over its statistics groups: one
        FP32 all-reduce per group for all layers at once. By linearity this is the EMA of the
        global statistics. Layers whose sum saw no tokens or is non-finite are left out (the same
        on every rank: the sums are); a non-finite one also restarts its EMA, with a warning."""
        by_groups: dict[tuple, list[GiftParam]] = {}
        for g, _ in self._gift_layers():
            by_groups.setdefault(tuple(g.stats_groups), []).append(g)
        out = {}
        for groups, layers in by_groups.items():
            parts = [t for g in layers for t in (*g.stats.ema_sums.values(), g.stats.ema_tokens.reshape(1))]
            flat = torch.cat([t.reshape(-1).float() for t in parts])
            for group in groups:
                dist.all_reduce(flat, group=group)
                n = group.size()
                self.ledger.add("all_reduce", "fp32", 2 * (n - 1) * flat.numel() * 4 // n)
            pos = 0
            for g in layers:
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

    def _build(self, g: GiftParam, grad: torch.Tensor, summed: tuple) -> tuple[LowRankFactor, LowRankWhitening, float | None]:
        """Factor, ``T`` and damping of ``g`` from its summed EMA ``summed`` (on its owner). ``--gift-damping
        auto``: the candidate with the least local error on ``grad`` (this rank's own gradient), or
        None for Euclidean; the factor and ``T`` then use the best damping among the candidates."""
        cfg = self.gift_config
        factor = g.stats.low_rank_factor(g.stats.factor_rank(cfg.rank), 0.0, ema=summed)
        if cfg.damping is not None:
            chosen = best = cfg.damping
        else:
            chosen, errs = choose_damping(grad, factor, cfg.damping_candidates, cfg.codec)
            best = min(cfg.damping_candidates, key=lambda c: errs[c])
        factor = factor.with_damping(best)
        return factor, LowRankWhitening(factor, device=g.stats.tokens.device), chosen

    def _broadcast_factor(self, g: GiftParam, group, built) -> tuple[LowRankFactor, LowRankWhitening, float | None]:
        """The owner's factor (FP64, CPU), ``T`` (FP32) and damping choice on every rank of ``group``:
        one broadcast of their bytes, FP64 part first. ``built``: ``_build(g, ...)`` on the owner,
        None elsewhere."""
        n, device = group.size(), g.stats.tokens.device
        if built is None:
            d_in, r = g.stats.d_in, g.stats.factor_rank(self.gift_config.rank)
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

    def _remap_error_feedback(self, g: GiftParam, old, new) -> None:
        """Carry a residual kept in the old whitened coordinates into the new ones."""
        for view, owner in self._residual_views():
            if owner is g:
                view.copy_(new.apply(old.inverse(view) if old is not None else view))

    # -- checkpoint state -------------------------------------------------------------------
    def gift_state_dict(self) -> dict:
        """This rank's plugin state after the current step (call it after the optimizer step), on
        the CPU and keyed by parameter name: ``{"step", "params": {name: {"mode", "stats" (step
        accumulators and local per-step EMA), "whitening", "damping" (None: Euclidean chosen),
        "residual"}}, "policy"}`` (``policy``: the layer decisions of ``--gift-layers
        auto``). Everything but ``residual`` (the error-feedback residual
        in the parameter's quantized coordinates, this rank's own) is identical on all ranks
        that hold the parameter."""
        self._close_step()
        params = {}
        for g in self.gift_params.values():
            entry = {"mode": g.mode.value}
            if g.stats is not None:
                entry["stats"] = _to(g.stats.state_dict(), "cpu")
            if g.whitening is not None:
                entry["whitening"] = _to(g.whitening.tensors(), "cpu")
                entry["damping"] = g.damping
            params[g.name] = entry
        for view, g in self._residual_views():
            params[g.name]["residual"] = view.to("cpu", copy=True)
        state = {"step": self.step, "params": params}
        if self.monitor.policy is not None:
            state["policy"] = self.monitor.policy.state_dict()
        return state

    def load_gift_state_dict(self, state: dict, local: bool = True) -> list[str]:
        """Restore ``gift_state_dict()`` output; returns the parameters left fresh (and logs them).

        ``local=False``: the per-rank state (K-FAC statistics, error-feedback residuals) belongs to
        the ranks of another data-parallel layout: it starts afresh, without counting as missing."""
        self.step = int(state["step"])  # the next zero_grad_buffer() opens the following step
        self._step_open = False
        device = self._device()
        policy = self.monitor.policy
        if policy is not None and "policy" in state:  # the layer decisions, before anything else is placed
            policy.load_state_dict(state["policy"])
            for g in self.gift_params.values():
                if g.candidate:
                    self.set_mode(g, policy.mode(g.name))
        missing = []
        for g in self.gift_params.values():
            entry = state["params"].get(g.name)
            if entry is None or entry["mode"] != g.mode.value or not self._load_param(g, _to(entry, device), local):
                missing.append(g.name)
        for view, g in self._residual_views():
            entry = state["params"].get(g.name, {})
            if not local or g.name in missing:
                view.zero_()
            elif "residual" in entry and entry["residual"].shape == view.shape:
                view.copy_(entry["residual"])
            else:
                view.zero_()
                missing.append(g.name)
        if missing:
            logger.warning("megatron-gift: no usable saved state for %d parameter(s), starting them fresh: %s", len(missing), missing)
        return missing

    def _load_param(self, g: GiftParam, entry: dict, local: bool) -> bool:
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

    def _residual_views(self):
        """(error-feedback residual of one parameter as ``[rows, cols]``, its GiftParam) pairs."""
        for bg in self.bucket_groups + self.expert_parallel_bucket_groups:
            for layout, params, ef in zip(getattr(bg, "gift_layouts", []), getattr(bg, "gift_params", []), getattr(bg, "gift_error_feedback", [])):
                if ef is None:
                    continue
                for seg, g in zip(layout.segments, params):
                    if g is not None and seg.mode in (Mode.EUCLIDEAN, Mode.GIFT):
                        c = layout.coded_index(seg.start)
                        yield ef.residual[c : c + seg.rows * seg.cols].view(seg.rows, seg.cols), g
