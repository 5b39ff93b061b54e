"""Megatron-Core DDP whose bucket reductions send FP8 (Euclidean or GIFT-whitened) gradients.

``GiftDistributedDataParallel`` builds Megatron's own buffers and bucket groups, then turns
each bucket group into a ``GiftBucketGroup`` whose ``start_grad_sync`` launches
``comm.QuantizedReduce`` (or ``comm.hierarchical.TwoLevelReduce`` where the data-parallel group spans
several nodes with several ranks each) instead of NCCL's reduce-scatter / all-reduce. That one override
serves the overlapped backward-hook path, the synchronous path and the first batch, and
``finish_grad_sync`` (Megatron's) waits on the returned handle. Buckets whose parameters
are all ``off`` keep Megatron's collective untouched.

Per step (``zero_grad_buffer`` marks the start): on refresh steps, forward pre-hooks add each
GIFT layer's input statistics; the first bucket sync of that step sums them over the
data-parallel group and folds them into the EMA for every GIFT layer. Each layer's factor and
``T`` are then built (FP64, CPU) only on its owner rank, the layers spread round-robin over the
reduction group, and broadcast from there: every rank holds the owner's bits by construction.
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
from ..config import GiftConfig, Mode
from ..numerics.error_feedback import ErrorFeedback
from ..numerics.kfac import KFACStatistics
from ..numerics.whitening import LowRankFactor, LowRankWhitening
from .monitor import Monitor

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


def param_modes(named_params, cfg: GiftConfig) -> dict[str, Mode]:
    """Mode of each parameter by name: ``cfg.layers`` → ``cfg.mode``, ``cfg.euclidean_layers`` →
    Euclidean, the rest off. GIFT needs a 2-D weight; other shapes fall back to Euclidean. (With a
    policy, the GIFT ones are its candidates, starting Euclidean.)"""
    modes = {}
    for name, p in named_params:
        if any(re.search(pat, name) for pat in cfg.layers):
            mode = cfg.mode
            if mode is Mode.GIFT and p.dim() != 2:
                mode = Mode.EUCLIDEAN
        elif any(re.search(pat, name) for pat in cfg.euclidean_layers):
            mode = Mode.EUCLIDEAN
        else:
            mode = Mode.OFF
        modes[name] = mode
    return modes


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
        self.gift.refresh_factors()
        use_rs = self.ddp_config.use_distributed_optimizer and not force_all_reduce
        group = self.intra_distributed_optimizer_instance_group if self.ddp_config.use_distributed_optimizer else self.data_parallel_group
        refs = self.gift.monitor.before_reduce(self, group, self.gift.step)
        async_op = self.ddp_config.overlap_grad_reduce
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
        handle = _Handles(handles, after)
        if async_op:
            self.grad_reduce_handle = handle
        else:
            handle.wait()

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
    """The bucket group's reductions; ``after()`` runs once they are complete."""

    def __init__(self, handles, after=None):
        self.handles, self.after = handles, after

    def wait(self):
        with torch.no_grad():
            for h in self.handles:
                h.wait()
            if self.after is not None:
                self.after()


class GiftDistributedDataParallel(DistributedDataParallel):
    """``DistributedDataParallel(config, ddp_config, module, ...)`` plus ``gift_config``."""

    def __init__(self, config, ddp_config, module, *args, gift_config: GiftConfig | None = None, **kwargs):
        if ddp_config.num_distributed_optimizer_instances > 1:
            raise ValueError(
                "megatron-gift does not support num_distributed_optimizer_instances > 1 yet: "
                "set --num-distributed-optimizer-instances 1 or turn --gift-mode off"
            )
        if getattr(ddp_config, "reduce_scatter_with_fp32_accumulation", False):
            raise ValueError(
                "reduce_scatter_with_fp32_accumulation replaces the same collective as megatron-gift "
                "(which already sums in FP32): turn one of them off"
            )
        super().__init__(config, ddp_config, module, *args, **kwargs)
        self.gift_config = gift_config or GiftConfig()
        self.ledger = CommLedger()
        self.step = -1  # index of the current iteration once zero_grad_buffer() opened it
        self._step_open = False
        self.collecting = True
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
        """Forward pre-hooks that add ``XᵀX`` of each GIFT weight's input on refresh steps.

        The statistics are summed over the data-parallel(+context-parallel) group, or the expert
        data-parallel group for experts, and also over tensor-parallel ranks when a
        column-parallel layer sees only ``s/tp`` tokens (sequence parallelism). A row-parallel
        layer's ``in/tp`` columns give a diagonal block of A, consistent per TP shard."""
        hooks = []
        for mod in self.module.modules():
            w = getattr(mod, "weight", None)
            g = self.gift_params.get(w) if isinstance(w, torch.nn.Parameter) else None
            if g is None or not g.candidate:
                continue
            g.stats = KFACStatistics(
                w.shape[1], ema=self.gift_config.ema, sketch=self.gift_config.sketch, seed=g.index, device=w.device
            )
            g.stats_groups = [self.expt_dp_group if g.expert else self.dp_cp_group]
            column_parallel = getattr(w, "tensor_model_parallel", False) and getattr(w, "partition_dim", None) == 0
            if column_parallel and getattr(mod, "sequence_parallel", False) and self.tp_group.size() > 1:
                g.stats_groups.append(self.tp_group)
            hooks.append(mod.register_forward_pre_hook(self._stat_hook(g)))
        for g in self.gift_params.values():
            if g.candidate and g.stats is None:
                logger.warning("megatron-gift: no module takes %s as its .weight; sending it Euclidean", g.name)
                g.mode, g.candidate = Mode.EUCLIDEAN, False
        return hooks

    def _stat_hook(self, g: GiftParam):
        def hook(module, args):
            if self.collecting and module.training and args and isinstance(args[0], torch.Tensor):
                with torch.no_grad():
                    g.stats.accumulate(_layer_input(module, args[0]))

        return hook

    # -- per step -------------------------------------------------------------------------
    def zero_grad_buffer(self):
        """Megatron calls this at the start of every iteration: close the last step, open the next."""
        super().zero_grad_buffer()
        self._close_step()
        self.step += 1
        self.collecting = self._is_refresh_step(self.step)
        self._step_open = True

    def _is_refresh_step(self, step: int) -> bool:
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

    def refresh_factors(self) -> None:
        """On a refresh step, at the first bucket sync (every forward of the step is done): sum
        every GIFT layer's statistics and fold them into its EMA, build each layer's factor and
        ``T`` on its owner rank (all owners at once), then broadcast them. Statistics stop here."""
        if not self.collecting:
            return
        self.collecting = False
        todo = [(g, group) for g, group in self._gift_layers() if self._fold_statistics(g)]
        built = {id(g): self._build(g) for g, group in todo if group.rank() == g.owner}
        for g, group in todo:
            factor, new = self._broadcast_factor(g, group, built.get(id(g)))
            if g.mode is Mode.GIFT:
                self._remap_error_feedback(g, g.whitening, new)
            g.factor, g.whitening = factor, new

    def _gift_layers(self):
        """``(GiftParam, its bucket group's reduction group)`` of every GIFT layer, in one order on all ranks."""
        dist_opt = self.ddp_config.use_distributed_optimizer
        for bg in self.bucket_groups + self.expert_parallel_bucket_groups:
            group = bg.intra_distributed_optimizer_instance_group if dist_opt else bg.data_parallel_group
            for params in getattr(bg, "gift_params", []):
                yield from ((g, group) for g in params if g is not None and g.candidate)

    def _fold_statistics(self, g: GiftParam) -> bool:
        """Sum ``g``'s statistics over its groups and fold them into the EMA; False (on every rank
        alike: the sums are) when the layer saw no tokens or non-finite activations."""
        stats = g.stats
        for group in g.stats_groups:
            n = group.size()
            for t in stats.sums.values():  # a preconditioner's statistics: BF16 on the wire suffices
                wire = t.to(torch.bfloat16)
                dist.all_reduce(wire, group=group)
                t.copy_(wire)
                self.ledger.add("all_reduce", "bf16", 2 * (n - 1) * wire.numel() * 2 // n)
            dist.all_reduce(stats.tokens, group=group)
            self.ledger.add("all_reduce", "fp64", 2 * (n - 1) * 8 // n)
        if float(stats.tokens) == 0:  # the layer saw no training tokens this step
            return False
        if not all(bool(torch.isfinite(t).all()) for t in stats.sums.values()):
            logger.warning("megatron-gift: non-finite activations in %s; keeping its previous factor", g.name)
            stats.reset_accumulators()
            return False
        stats.refresh(ema=0.0 if self.step < self.gift_config.refresh_interval else None)  # warm-up: latest only
        return True

    def _build(self, g: GiftParam) -> tuple[LowRankFactor, LowRankWhitening]:
        factor = g.stats.low_rank_factor(g.stats.factor_rank(self.gift_config.rank), self.gift_config.damping)
        return factor, LowRankWhitening(factor, device=g.stats.tokens.device)

    def _broadcast_factor(self, g: GiftParam, group, built) -> tuple[LowRankFactor, LowRankWhitening]:
        """The owner's factor (FP64, CPU) and ``T`` (FP32) on every rank of ``group``: one broadcast
        of their bytes, FP64 part first. ``built``: ``_build(g)`` on the owner, None elsewhere."""
        n, device = group.size(), g.stats.tokens.device
        if built is None:
            d_in, r = g.stats.d_in, g.stats.factor_rank(self.gift_config.rank)
            factor = LowRankFactor(torch.empty(d_in, dtype=torch.float64), torch.empty(d_in, r, dtype=torch.float64),
                                   torch.empty(r, dtype=torch.float64), 0.0)  # fmt: skip
            built = factor, LowRankWhitening.empty(d_in, r, device=device)
        if n == 1:
            return built
        factor, whitening = built
        trace_a = torch.tensor([factor.trace_a], dtype=torch.float64)
        fp64 = [factor.d, factor.v, factor.lam, trace_a]
        fp32 = list(whitening.tensors().values())
        buf = torch.cat([t.to(device).contiguous().view(-1).view(torch.uint8) for t in fp64 + fp32])
        dist.broadcast(buf, src=dist.get_global_rank(group, g.owner), group=group)
        if group.rank() != g.owner:
            pos = 0
            for t in fp64 + fp32:
                nbytes = t.numel() * t.element_size()
                t.copy_(buf[pos : pos + nbytes].view(t.dtype).view(t.shape))
                pos += nbytes
            factor.trace_a = float(trace_a)
        # a ring broadcast: every rank but one forwards the whole buffer, (n-1)/n of it per rank on average
        for dtype, parts in (("fp64", fp64), ("fp32", fp32)):
            self.ledger.add("broadcast", dtype, (n - 1) * sum(t.numel() * t.element_size() for t in parts) // n)
        return factor, whitening

    def _remap_error_feedback(self, g: GiftParam, old, new) -> None:
        """Carry a residual kept in the old whitened coordinates into the new ones."""
        for view, owner in self._residual_views():
            if owner is g:
                view.copy_(new.apply(old.inverse(view) if old is not None else view))

    # -- checkpoint state -------------------------------------------------------------------
    def gift_state_dict(self) -> dict:
        """This rank's plugin state after the current step (call it after the optimizer step), on
        the CPU and keyed by parameter name: ``{"step", "params": {name: {"mode", "stats",
        "whitening", "residual"}}, "policy"}`` (``policy``: the layer decisions of ``--gift-layers
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
            params[g.name] = entry
        for view, g in self._residual_views():
            params[g.name]["residual"] = view.to("cpu", copy=True)
        state = {"step": self.step, "params": params}
        if self.monitor.policy is not None:
            state["policy"] = self.monitor.policy.state_dict()
        return state

    def load_gift_state_dict(self, state: dict, residuals: bool = True) -> list[str]:
        """Restore ``gift_state_dict()`` output; returns the parameters left fresh (and logs them).

        ``residuals=False``: keep the error-feedback residuals at zero (they belong to the ranks
        of another data-parallel layout) without counting them as missing."""
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
            if entry is None or entry["mode"] != g.mode.value or not self._load_param(g, _to(entry, device)):
                missing.append(g.name)
        for view, g in self._residual_views():
            entry = state["params"].get(g.name, {})
            if not residuals or g.name in missing:
                view.zero_()
            elif "residual" in entry and entry["residual"].shape == view.shape:
                view.copy_(entry["residual"])
            else:
                view.zero_()
                missing.append(g.name)
        if missing:
            logger.warning("megatron-gift: no usable saved state for %d parameter(s), starting them fresh: %s", len(missing), missing)
        return missing

    def _load_param(self, g: GiftParam, entry: dict) -> bool:
        """Statistics and transform of one parameter; False if they don't fit this configuration."""
        if g.stats is not None:
            saved = entry.get("stats")
            if saved is None or any(saved["sums"][k].shape != t.shape for k, t in g.stats.sums.items()):
                return False
            g.stats.load_state_dict(saved)
        if "whitening" in entry:
            w = entry["whitening"]
            g.whitening = LowRankWhitening.empty(w["q"].shape[0], w["q"].shape[1], device=w["q"].device)
            for k, t in g.whitening.tensors().items():
                t.copy_(w[k])
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
