"""GiftDistributedDataParallel with four bits between nodes inside real Megatron-Core training
(CPU/gloo, 4 ranks as 2 simulated nodes x 2): NVFP4 with the distributed optimizer and overlap, MXFP4
with the Hadamard rotation and Megatron's all-reduce, NVFP4 with ``--gift-intra-node reduce-scatter``; a
few steps train with finite losses, the
replicas stay bit-identical, and the inter-node bytes are FP4's."""

import pytest
import torch

from megatron_gift.config import GiftConfig, Mode
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens

pytestmark = pytest.mark.cpu_harness
STEPS = 3


def _train(dist_opt, fmt, rotation, intra="bf16", ef=False):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    parallel_state.initialize_model_parallel(1, 1)
    model = build_tiny_gpt()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=dist_opt,
        overlap_grad_reduce=dist_opt,
        pad_buckets_for_high_nccl_busbw=dist_opt and rotation != "none",  # shards of whole 64-column blocks
    )
    gift = GiftConfig.build(
        mode=Mode.GIFT,
        rank=8,
        refresh_interval=1,
        euclidean_layers=(r"embedding",),
        ranks_per_node=2,
        inter_node_format=fmt,
        rotation=rotation,
        rotation_seed=1234,
        intra_node=intra,
        error_feedback=ef,
    )
    ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=gift)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=dist_opt), [ddp])
    dp_rank = parallel_state.get_data_parallel_group().rank()
    losses, links, collectives = [], {}, set()
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = lm_loss(ddp, random_tokens(step, dp_rank))
        loss.backward()
        ddp.finish_grad_sync()
        links, collectives = dict(ddp.ledger.links), set(ddp.ledger.bytes)
        ok, _, _ = opt.step()
        assert ok
        losses.append(float(loss))
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    whitened = sum(g.input.whitening is not None for g in ddp.gift_params.values())
    residual = sum(float(view.abs().sum()) for view, _ in ddp._residual_views())
    rotate = [g.input.rotate for g in ddp.gift_params.values()]
    parallel_state.destroy_model_parallel()
    return dict(
        losses=losses,
        params=params,
        links=links,
        collectives=collectives,
        whitened=whitened,
        residual=residual,
        rotate=rotate,
    )


# (distributed optimizer, format, rotation, intra-node stage): the reduce-scatter with NVFP4; the all-reduce
# (the plugin's own shards, aligned to whole 64-column blocks) with MXFP4 and the Hadamard rotation; NVFP4
# with the rotation after a plain reduce-scatter inside the node (``comm.sum_first``); NVFP4 with the rotation
# chosen per layer (``--gift-rotation auto``) and error feedback (one flat exchange)
RUNS = [
    (True, "nvfp4", "none"),
    (False, "mxfp4", "hadamard"),
    (True, "nvfp4", "hadamard", "reduce-scatter"),
    (True, "nvfp4", "auto", "bf16", True),
]


def _worker(rank, world):
    return [_train(*run) for run in RUNS]


@pytest.mark.parametrize("run", range(len(RUNS)))
def test_fp4_between_nodes_trains(results, run):
    """Bug caught: the FP4 exchange wired into the DDP wrongly (a NaN or Inf gradient, a rank whose
    weights drift from the others', FP8 sent where FP4 was asked, no GIFT layer ever whitened); the
    all-reduce's layout refused for want of aligned shards; ``--gift-intra-node reduce-scatter`` not
    reaching the bucket groups (the whitening-first BF16 stage run instead); error feedback with four bits
    not keeping the flat exchange (an intra-node stage) or its residual never staged; ``--gift-rotation
    auto``'s per-layer choice differing between ranks."""
    per_rank = [r[run] for r in results]
    fmt = RUNS[run][1]
    for res in per_rank:
        assert all(torch.isfinite(torch.tensor(res["losses"]))), res["losses"]
        assert res["links"].get(("inter", f"{fmt}+scales"), 0) > 0, res["links"]
        assert not any(dtype.startswith("fp8") and link == "inter" for link, dtype in res["links"]), res["links"]
        assert res["whitened"] > 0
        if RUNS[run][3:] == ("reduce-scatter",):  # the node's reduce-scatter in the bucket's FP32, no BF16 stage
            assert ("reduce_scatter", "fp32") in res["collectives"], res["collectives"]
            assert res["links"].get(("intra", "fp32"), 0) > 0 and ("intra", "bf16") not in res["links"], res["links"]
        if RUNS[run][4:] == (True,):  # error feedback: one flat exchange, FP4 inside the node too
            assert res["links"].get(("intra", f"{fmt}+scales"), 0) > 0 and ("intra", "bf16") not in res["links"]
            assert res["residual"] > 0
    assert all(torch.equal(r["params"], per_rank[0]["params"]) for r in per_rank)
    assert all(r["rotate"] == per_rank[0]["rotate"] for r in per_rank)


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_worker, 4, cpu_harness=True, timeout=600)


def _bucket_reduction(config, groups, layout, params, error_feedback=None):
    """``GiftBucketGroup._reduction`` of one bucket (zero gradient) for a bucket group of ``config`` over ``groups``."""
    from types import SimpleNamespace

    from megatron_gift.megatron.bucket_group import GiftBucketGroup

    owner = SimpleNamespace(
        gift_context=SimpleNamespace(config=config, state=SimpleNamespace(ledger=None, nonfinite=None)),
        gift_groups=groups,
        ddp_config=SimpleNamespace(average_in_collective=False),
    )
    grad = torch.zeros(layout.numel)
    bucket = SimpleNamespace(grad=grad, layout=layout, params=params, error_feedback=error_feedback)
    return GiftBucketGroup._reduction(owner, bucket, all_reduce=False)


@pytest.mark.parametrize("kernels, available, fused", [(None, True, False), (True, True, True), (False, True, False)])
def test_fp4_buckets_take_the_kernels_setting(monkeypatch, kernels, available, fused):
    """The bucket group's four-bit reduction runs its codec kernels exactly where ``--gift-kernels`` asks
    and they can run (a CPU with the setting unset: no). Bug caught: FP4 buckets forced onto the
    PyTorch path (the setting dropped), or given the kernels against ``--gift-kernels off``."""
    from types import SimpleNamespace

    from megatron_gift import kernels as runtime_kernels
    from megatron_gift.comm.fp4_reduce import FP4Reduce
    from megatron_gift.comm.layout import BucketLayout, Segment
    from megatron_gift.numerics import CodecConfig

    monkeypatch.setattr(runtime_kernels, "available", lambda device: available)
    group = SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    layout = BucketLayout(2048, 2, [Segment(0, 16, 128, Mode.EUCLIDEAN, "w")], CodecConfig(), torch.float32)
    config = GiftConfig.build(mode=Mode.GIFT, inter_node_format="nvfp4", kernels=kernels)
    red = _bucket_reduction(config, SimpleNamespace(intra=None, group=group, topology=None), layout, [None])
    assert isinstance(red, FP4Reduce) and red.ops.fused is fused


@pytest.mark.parametrize(
    "intra, ef", [("reduce-scatter", False), ("bf16", False), ("reduce-scatter", True), ("bf16", True)]
)
def test_intra_node_setting_picks_the_two_level_fp4_reduction(intra, ef):
    """Bug caught: ``--gift-intra-node reduce-scatter`` reaching the bucket group but its four-bit buckets
    built as the whitening-first two-level exchange (which then sends FP32 inside the node: the same bytes,
    so the ledger alone cannot tell), or the sum-first reduction built for another intra-node setting;
    with error feedback (a residual per rank and bucket) a two-level reduction built, or the flat one
    without the bucket's residual."""

    from megatron_gift.comm.fp4_reduce import FP4Reduce, FP4TwoLevelReduce
    from megatron_gift.comm.layout import BucketLayout, Segment
    from megatron_gift.comm.sum_first import FP4SumFirstReduce
    from megatron_gift.comm.topology import Topology, TwoLevelGroups
    from megatron_gift.numerics import CodecConfig
    from megatron_gift.testing.simulate import FakeGroup

    groups = TwoLevelGroups(FakeGroup(4, 0), Topology(2, 2), FakeGroup(2, 0), FakeGroup(2, 0))
    layout = BucketLayout(4096, 4, [Segment(0, 32, 128, Mode.EUCLIDEAN, "w")], CodecConfig(), torch.float32)
    from megatron_gift.numerics import ErrorFeedback

    config = GiftConfig.build(mode=Mode.GIFT, inter_node_format="nvfp4", intra_node=intra, error_feedback=ef)
    residual = ErrorFeedback(layout.n_coded) if ef else None
    red = _bucket_reduction(config, groups, layout, [None], residual)
    if ef:
        assert type(red) is FP4Reduce and red.error_feedback is residual
    else:
        assert type(red) is {"reduce-scatter": FP4SumFirstReduce, "bf16": FP4TwoLevelReduce}[intra]


def test_auto_rotation_reaches_the_bucket_reduction():
    """``--gift-rotation auto``: the bucket's four-bit reduction rotates the GIFT parameters whose
    refresh chose the rotation (``GiftParam.input.rotate``) and nothing else; ``hadamard``: every coded
    parameter (no subset). Bug caught: the per-layer choice never reaching the exchange (every GIFT
    layer rotated, or none), a Euclidean parameter rotated under ``auto``."""
    from types import SimpleNamespace

    from megatron_gift.comm.fp4_reduce import FP4Reduce
    from megatron_gift.comm.layout import BucketLayout, Segment
    from megatron_gift.numerics import CodecConfig
    from megatron_gift.state import GiftParam

    segments = [
        Segment(i * 1024, 8, 128, mode, name)
        for i, (mode, name) in enumerate([(Mode.GIFT, "on"), (Mode.GIFT, "off"), (Mode.EUCLIDEAN, "plain")])
    ]
    layout = BucketLayout(4096, 2, segments + [Segment(3072, 8, 128, Mode.GIFT, "on2")], CodecConfig(), torch.float32)
    params = [GiftParam(s.name, s.mode) for s in layout.segments]
    params[0].input.rotate = params[3].input.rotate = True
    params[2].input.rotate = True  # a stale flag on a parameter not sent GIFT: not rotated
    group = SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    for rotation, want in (("auto", (0, 3)), ("hadamard", (0, 1, 2, 3))):
        config = GiftConfig.build(mode=Mode.GIFT, inter_node_format="nvfp4", rotation=rotation)
        red = _bucket_reduction(config, SimpleNamespace(intra=None, group=group, topology=None), layout, params)
        assert isinstance(red, FP4Reduce) and red.rotated_segments == want, (rotation, red.rotated_segments)


def test_a_refresh_installs_the_rotation_choice():
    """The record's ``rotate`` becomes ``GiftParam.input.rotate`` on every rank that installs it, with
    the chosen ``T`` (Euclidean here: ``T = I``). Bug caught: the choice dropped at install (``auto``
    then never rotates), or kept from an earlier refresh."""
    from megatron_gift.numerics.kfac import KFACStatistics
    from megatron_gift.numerics.refresh import HEADER, RecordLayout
    from megatron_gift.refresh_sync import RefreshSync
    from megatron_gift.state import GiftParam

    d, r = 64, 4
    for flag in (1.0, 0.0):
        gp = GiftParam("w", Mode.GIFT, candidate=True)
        gp.input.stats, gp.input.rotate = KFACStatistics(d, ema=0.5), not flag
        lay = RecordLayout(d, r)
        rec = lay.views(torch.zeros(lay.nbytes, dtype=torch.uint8))
        rec["input"]["d_inv_sqrt"].fill_(1.0)
        rec["input"]["d_sqrt"].fill_(1.0)
        head = dict(zip(HEADER, (0.0, float(r), -1.0, 1.0, 1.0, 0.0, flag)))
        RefreshSync._install(gp, rec, head, None, lambda *a: None, None)
        assert gp.input.rotate is bool(flag) and gp.input.damping is None
