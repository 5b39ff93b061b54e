"""The GPU rules of the reduction path, checked on CPU ranks (gloo, real Megatron-Core training):

- a steady step (no refresh, no profile, no log) makes no host synchronisation in the plugin
  (``testing.dispatch.SyncSanitizer``: the ATen ops that would stop the host on a GPU);
- the kernels a bucket's reduction launches do not grow with the data-parallel size (2, 4 and 8
  ranks, flat and two-level on simulated nodes); on the fused path nor with the bucket's size
  (the tools' launch meter on simulated layouts up to 64 ranks: tests/tools/test_gpu_rules_launches.py).
"""

import contextlib
import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_gift.comm.schedule import StageResult
from megatron_gift.config import GiftConfig, Mode
from megatron_gift.testing import run_on_ranks

MODEL = dict(hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_layers=2)
LINEAR = r"\.linear_(qkv|proj|fc1|fc2)\.weight$"
STEPS = 7  # refresh interval 10: refreshes at 0, 1, 2, 4 (and 8); 6 is steady (``REFRESH_WAITS``)


def _train(rank, world, spec, probe_steps, probe):
    """Train ``STEPS`` steps of a tiny GPTModel through GiftDistributedDataParallel; ``probe()``
    (a dispatch mode) is active during the steps in ``probe_steps``. Returns the probes."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens

    parallel_state.initialize_model_parallel(1, 1)
    model = build_tiny_gpt(**MODEL)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=spec["dist_opt"], overlap_grad_reduce=True, bucket_size=spec.get("bucket_size")
    )
    ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=spec["gift"])
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=spec["dist_opt"]), [ddp]
    )
    probes = {}
    for step in range(STEPS):
        tokens = random_tokens(step, parallel_state.get_data_parallel_rank())
        mode = probe() if step in probe_steps else contextlib.nullcontext()
        with mode:  # the whole iteration: zeroing, forward, backward, finish_grad_sync, optimizer step
            ddp.zero_grad_buffer()
            opt.zero_grad()
            lm_loss(ddp, tokens).backward()
            ddp.finish_grad_sync()
            opt.step()
        if step in probe_steps:
            probes[step] = mode
    parallel_state.destroy_model_parallel()
    return probes


def _sync_worker(rank, world, specs):
    from megatron_gift.testing.dispatch import SyncSanitizer

    out = {}
    for name, spec in specs.items():
        probes = _train(rank, world, spec, {3, 4, 5, 6}, SyncSanitizer)
        out[name] = {step: dict(p.counts()) for step, p in probes.items()}
    return out


def _configs(ranks_per_node=None):
    modes = {"bf16": Mode.BF16, "euclidean": Mode.EUCLIDEAN, "gift": Mode.GIFT}
    out = {}
    for (mode_name, mode), dist_opt in itertools.product(modes.items(), (True, False)):
        gift = GiftConfig.build(mode=mode, layers=(LINEAR,), euclidean_layers=(".*",), ranks_per_node=ranks_per_node)
        out[f"{mode_name}-{'distopt' if dist_opt else 'allreduce'}"] = dict(gift=gift, dist_opt=dist_opt)
    return out


# Host waits the refresh makes (``refresh_sync``'s module doc: wait 1 in the refresh step, waits 2
# and 3 at the start of the next), each on a CUDA event recorded well before it; the probed steps
# 3-6 of a GIFT run: 3 follows the refresh of step 2, 4 is one, 5 follows it, 6 is steady.
REFRESH_WAITS = {3: 2, 4: 1, 5: 2, 6: 0}


@pytest.mark.cpu_harness
@pytest.mark.parametrize("world,ranks_per_node", [(2, None), (4, 2)], ids=["flat-2", "two-level-2x2"])
def test_steady_steps_never_synchronise_the_host(world, ranks_per_node):
    """A ``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``, ``t.new_tensor(x)``, data-dependent shape
    or host copy anywhere in an iteration (forward, backward, ``finish_grad_sync``, optimizer step)
    stops the host on a GPU every step (the backward's queue runs dry): none in a steady step of any
    mode, with the distributed optimizer or the all-reduce, flat or two-level; around a GIFT refresh
    only the refresh's own host waits (``REFRESH_WAITS``), each listed here when it fails."""
    results = run_on_ranks(_sync_worker, world, _configs(ranks_per_node), cpu_harness=True, timeout=600)
    for rank, res in enumerate(results):
        for name, steps in res.items():
            for step, events in steps.items():
                waits = REFRESH_WAITS[step] if name.startswith("gift") else 0
                refresh = all(
                    k.startswith("megatron_gift/refresh_sync.py:") and k.endswith("(HostCopy.wait)") for k in events
                )
                assert refresh, (rank, name, step, events)
                assert sum(events.values()) == waits, (rank, name, step, events)


class _Launches(TorchDispatchMode):
    """Counts the ATen ops dispatched that would launch a kernel on a GPU (``testing.meter.launches``:
    views and allocations are host work only, and vary with which of a rank's sections are empty)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from megatron_gift.testing.dispatch import launches

        self.total += launches(func)
        return func(*args, **(kwargs or {}))


def _stage_ops(reduction):
    """Kernel launches of each stage of ``reduction`` (run eagerly, collectives waited between stages)."""
    counts, step = [], StageResult()
    for stage in reduction.stages():
        with _Launches() as c:
            step = stage(step)
        counts.append(c.total)
        for work in step.works:
            work.wait()
    return counts


def _replicated(world):
    """Every shard (512 elements) holds the same parameters at the same offsets, rows inside it."""
    from megatron_gift.comm.layout import Segment

    pattern = [(0, 2, 128, Mode.GIFT), (256, 1, 100, Mode.OFF), (384, 1, 64, Mode.EUCLIDEAN), (448, 1, 48, Mode.BF16)]
    segs = [Segment(j * 512 + a, r, c, m, f"{m.value}{j}") for j in range(world) for a, r, c, m in pattern]
    return world * 512, segs


def _op_worker(rank, world, ranks_per_node):
    from megatron_gift.comm.hierarchical import TwoLevelReduce
    from megatron_gift.comm.layout import BucketLayout
    from megatron_gift.comm.quantized import QuantizedReduce
    from megatron_gift.comm.topology import build_groups
    from megatron_gift.numerics import CodecConfig
    from tests.dist.test_comm import _bucket_grads, _transforms
    from tests.dist.test_two_level import LAYOUTS

    (placed,) = build_groups([torch.distributed.group.WORLD], ranks_per_node)
    out = {}
    for name, (numel, segs) in {"fixed": LAYOUTS["mixed"], "replicated": _replicated(world)}.items():
        layout = BucketLayout(numel, world, segs, CodecConfig(), torch.float32)
        for all_reduce in (False, True):
            ts = _transforms(segs)
            for _ in range(2):  # the first run builds the layout's plans (kept with it): count the second
                flat = _bucket_grads(numel, segs, rank)
                if ranks_per_node is None:
                    reduction = QuantizedReduce(flat, layout, placed.group, ts, all_reduce=all_reduce, average=True)
                else:
                    reduction = TwoLevelReduce(flat, layout, placed, ts, all_reduce=all_reduce, average=True)
                out[(name, all_reduce)] = _stage_ops(reduction)
    return out


@pytest.mark.parametrize("ranks_per_node", [None, 2], ids=["flat", "two-level"])
def test_ops_per_bucket_do_not_grow_with_the_data_parallel_size(ranks_per_node):
    """A Python loop over peers in packing or decoding (about 23 ops per peer per bucket before)
    makes the host the bottleneck at scale. A stage whose work is the whole bucket (the senders',
    the two-level node sums of 1/g of it, the all-reduce's decode of every shard) launches the
    same kernels for one bucket at every group size and on every rank; a stage whose work is the own
    shard (decode, sum, ``T⁻¹``, the cut rows) the same at every group size and on every rank
    when every shard holds the same parameters: the work follows the parameters, not the peers."""
    sizes = (2, 4) if ranks_per_node is None else (4, 8)  # a per-peer loop shows between any two sizes
    # per stage: does its work follow the whole bucket (counted on one fixed bucket) or the own shard
    # (counted on the replicated buckets)?
    whole = {(None, False): "BSS", (None, True): "BSB", (2, False): "BBSS", (2, True): "BBSBB"}
    ops = {world: run_on_ranks(_op_worker, world, ranks_per_node, timeout=600) for world in sizes}
    for all_reduce in (False, True):
        for k, kind in enumerate(whole[(ranks_per_node, all_reduce)]):
            layout = "fixed" if kind == "B" else "replicated"
            counts = {(w, r): res[(layout, all_reduce)][k] for w, per in ops.items() for r, res in enumerate(per)}
            assert len(set(counts.values())) == 1, (all_reduce, k, layout, counts)
