"""A data-parallel group of one rank: GiftDistributedDataParallel leaves the gradient bit-identical
to stock Megatron DDP (nothing is sent, so nothing is quantized), unless ``loopback`` forces the
codec on; then every gradient is exactly one FP8 round trip of Megatron's (``÷ 1`` of the sum of
one message), the codec's error and nothing else.
"""

import argparse

import pytest
import torch

from megatron_gift.arguments import add_gift_args, gift_config_from_args, validate_gift_args
from megatron_gift.config import GiftConfig, Mode
from megatron_gift.numerics import CodecConfig
from megatron_gift.numerics.fp8 import roundtrip
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens

CODEC = CodecConfig("e4m3", "block")
STEPS = 2


def _grads(gift: GiftConfig | None, dist_opt: bool) -> list[dict]:
    """Per step, ``{name: main_grad after finish_grad_sync}`` of a 1-rank run (stock DDP when ``gift`` is None)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    model = build_tiny_gpt()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=dist_opt, overlap_grad_reduce=True, bucket_size=6000
    )
    if gift is None:
        ddp = DistributedDataParallel(model.config, ddp_config, model)
    else:
        ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=gift)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=dist_opt), [ddp])
    steps = []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        lm_loss(ddp, random_tokens(step, 0)).backward()
        ddp.finish_grad_sync()
        steps.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
        ok, _, _ = opt.step()
        assert ok
    converted = sum(type(bg).__name__ == "GiftBucketGroup" for bg in ddp.bucket_groups)
    return steps, converted


def _without_cold_start(run):
    """``run()`` with the cold-start rule off (every refresh's choice sent as made), so that step 1
    whitens with step 0's factor: these tests are about the codec path, the rule is test_refresh's."""
    import megatron_gift.numerics.refresh as refresh

    real, refresh.held_out_gate = refresh.held_out_gate, lambda chosen, euclidean_err, held_out_err: chosen
    try:
        return run()
    finally:
        refresh.held_out_gate = real


def _worker(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    every = dict(codec=CODEC, rank=8, refresh_interval=1, euclidean_layers=(".*",))  # every parameter in FP8
    out = {}
    for dist_opt in (True, False):
        out[dist_opt] = dict(
            stock=_grads(None, dist_opt),
            gift=_grads(GiftConfig.build(mode=Mode.GIFT, **every), dist_opt),
            euclidean=_grads(GiftConfig.build(mode=Mode.EUCLIDEAN, **every), dist_opt),
            loopback=_grads(GiftConfig.build(mode=Mode.EUCLIDEAN, loopback=True, **every), dist_opt),
            loopback_gift=_without_cold_start(
                lambda: _grads(GiftConfig.build(mode=Mode.GIFT, loopback=True, **every), dist_opt)
            ),
        )
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(_worker, 1, cpu_harness=True, timeout=600)[0]


@pytest.mark.cpu_harness
@pytest.mark.parametrize("dist_opt", [True, False])
@pytest.mark.parametrize("mode", ["gift", "euclidean"])
def test_dp1_is_bit_identical_to_stock_megatron(runs, dist_opt, mode):
    (stock, _), (got, converted) = runs[dist_opt]["stock"], runs[dist_opt][mode]
    assert converted == 0  # Megatron's bucket groups, untouched
    for want_step, got_step in zip(stock, got):
        for name, want in want_step.items():
            assert torch.equal(got_step[name], want), name


@pytest.mark.cpu_harness
@pytest.mark.parametrize("dist_opt", [True, False])
def test_loopback_is_one_fp8_round_trip_of_megatrons_gradient(runs, dist_opt):
    (stock, _), (got, converted) = runs[dist_opt]["stock"], runs[dist_opt]["loopback"]
    assert converted > 0
    # Step 0 only: from step 1 on the weights differ (the optimizer saw rounded gradients).
    for name, want in stock[0].items():
        rows = want.shape[0] if want.dim() > 1 else 1
        expected = roundtrip(want.reshape(rows, -1), CODEC).reshape(want.shape)
        assert torch.equal(got[0][name], expected), name
    diff = torch.cat([(got[0][n] - w).flatten() for n, w in stock[0].items()])
    assert diff.abs().max() > 0  # the codec did run


@pytest.mark.cpu_harness
@pytest.mark.parametrize("dist_opt", [True, False])
def test_loopback_gift_runs_the_whitened_codec(runs, dist_opt):
    """GIFT in loopback: the gradient is no longer Megatron's, and (after ``T⁻¹``) differs from the
    plain FP8 round trip too: the whitening took part. Step 0 has no ``T`` yet (step 0's factor is
    installed at step 1), so it is the plain round trip exactly; step 1 starts from the same weights."""
    (stock, _), (gift, converted) = runs[dist_opt]["stock"], runs[dist_opt]["loopback_gift"]
    euclidean = runs[dist_opt]["loopback"][0]
    assert converted > 0
    linear = [n for n in stock[0] if n.endswith(("linear_fc1.weight", "linear_qkv.weight"))]
    assert linear
    for name in linear:
        assert torch.equal(gift[0][name], euclidean[0][name]), name
        assert not torch.equal(gift[1][name], stock[1][name]), name
        assert not torch.equal(gift[1][name], euclidean[1][name]), name
        assert torch.isfinite(gift[1][name]).all()


def test_loopback_flag():
    parser = add_gift_args(argparse.ArgumentParser())
    assert gift_config_from_args(parser.parse_args(["--gift-mode", "euclidean", "--gift-loopback"])).exchange.loopback
    assert not gift_config_from_args(parser.parse_args(["--gift-mode", "euclidean"])).exchange.loopback
    with pytest.raises(ValueError, match="--gift-loopback has no effect with --gift-mode off"):
        validate_gift_args(parser.parse_args(["--gift-loopback"]))


MOE = dict(
    num_moe_experts=2,
    moe_router_topk=1,
    moe_router_pre_softmax=True,
    moe_token_dispatcher_type="allgather",
    expert_model_parallel_size=2,
)


def _expert_grads(gift: GiftConfig | None, rank: int) -> dict:
    """``{name: main_grad}`` of the expert weights after one backward and reduction (2 ranks, EP 2)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    model = build_tiny_gpt(**MOE)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True)
    if gift is None:
        ddp = DistributedDataParallel(model.config, ddp_config, model)
    else:
        ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=gift)
    ddp.zero_grad_buffer()
    lm_loss(ddp, random_tokens(0, rank)).backward()
    ddp.finish_grad_sync()
    return {n: p.main_grad.clone() for n, p in model.named_parameters() if not getattr(p, "allreduce", True)}


def _ep_worker(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)  # expert data-parallel size 1, dense 2
    every = dict(codec=CODEC, euclidean_layers=(".*",))
    out = dict(
        stock=_expert_grads(None, rank),
        plugin=_expert_grads(GiftConfig.build(mode=Mode.EUCLIDEAN, **every), rank),
        loopback=_expert_grads(GiftConfig.build(mode=Mode.EUCLIDEAN, loopback=True, **every), rank),
    )
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.cpu_harness
def test_expert_data_parallel_group_of_one_keeps_megatrons_expert_gradients():
    """Expert parallelism over both ranks: each expert's gradient has a reduction group of one rank
    (the dense weights still reduce over two, quantized)."""
    for res in run_on_ranks(_ep_worker, 2, cpu_harness=True, timeout=600):
        stock = res["stock"]
        assert len(stock) == 4  # fc1 and fc2 of this rank's expert, 2 layers
        for name, want in stock.items():
            assert torch.equal(res["plugin"][name], want), name
            assert not torch.equal(res["loopback"][name], want), name
