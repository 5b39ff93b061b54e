"""GiftDistributedDataParallel with ``--gift-inter-node-format nvfp4`` inside real Megatron-Core
training (CPU/gloo, 4 ranks as 2 simulated nodes x 2, the distributed optimizer, overlap): a few
steps train with finite losses, the replicas stay bit-identical, and the inter-node bytes are FP4's."""

import pytest
import torch

from megatron_gift.config import GiftConfig, Mode
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens

pytestmark = pytest.mark.cpu_harness
STEPS = 3


def _worker(rank, world):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    parallel_state.initialize_model_parallel(1, 1)
    model = build_tiny_gpt()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True)
    gift = GiftConfig(
        mode=Mode.GIFT,
        rank=8,
        refresh_interval=1,
        euclidean_layers=(r"embedding",),
        ranks_per_node=2,
        inter_node_format="nvfp4",
    )
    ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=gift)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [ddp])
    dp_rank = parallel_state.get_data_parallel_group().rank()
    losses, links = [], {}
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = lm_loss(ddp, random_tokens(step, dp_rank))
        loss.backward()
        ddp.finish_grad_sync()
        links = dict(ddp.ledger.links)
        ok, _, _ = opt.step()
        assert ok
        losses.append(float(loss))
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    whitened = sum(g.whitening is not None for g in ddp.gift_params.values())
    parallel_state.destroy_model_parallel()
    return dict(losses=losses, params=params, links=links, whitened=whitened)


def test_nvfp4_between_nodes_trains():
    """Bug caught: the FP4 exchange wired into the DDP wrongly (a NaN or Inf gradient, a rank whose
    weights drift from the others', FP8 sent where NVFP4 was asked, no GIFT layer ever whitened)."""
    results = run_on_ranks(_worker, 4, cpu_harness=True, timeout=600)
    for res in results:
        assert all(torch.isfinite(torch.tensor(res["losses"]))), res["losses"]
        assert res["links"].get(("inter", "nvfp4+scales"), 0) > 0, res["links"]
        assert not any(dtype.startswith("fp8") and link == "inter" for link, dtype in res["links"]), res["links"]
        assert res["whitened"] > 0
    assert all(torch.equal(r["params"], results[0]["params"]) for r in results)


@pytest.mark.parametrize("kernels, available, warned", [(None, True, False), (True, True, True), (True, False, False)])
def test_fp4_warns_once_where_the_kernels_would_run(monkeypatch, caplog, kernels, available, warned):
    """Bug caught: a run that asked for the fused kernels (``kernels=True``, or CUDA by default) not told
    that the four-bit exchange takes the PyTorch path; or told where the kernels would not run anyway
    (a CPU with ``kernels`` unset, or no Triton)."""
    from types import SimpleNamespace

    from megatron_gift import kernels as runtime_kernels
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    monkeypatch.setattr(runtime_kernels, "available", lambda device: available)
    fake = SimpleNamespace(
        gift_config=GiftConfig(mode=Mode.GIFT, inter_node_format="mxfp4", kernels=kernels),
        _device=lambda: torch.device("cpu"),
    )
    with caplog.at_level("WARNING"):
        GiftDistributedDataParallel._warn_fp4_kernels(fake)
    lines = [r.getMessage() for r in caplog.records if "PyTorch path" in r.getMessage()]
    assert len(lines) == int(warned) and all("--gift-inter-node-format mxfp4" in line for line in lines)
