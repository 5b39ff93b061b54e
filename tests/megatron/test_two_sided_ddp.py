"""``--gift-side both`` in Megatron-Core training on 2 gloo ranks (one spawn): the tiny GPTModel
(rows of 72 and 136 columns: shard boundaries cut weight rows), DDP with the distributed optimizer
and overlap (reduce-scatter, several buckets) and without it (all-reduce), Adam steps, a refresh
every step. Once a refresh installs a ``T_out``, every reduced gradient is within the bound of
``tests/bounds.py`` (FP8 of ``T_outᵀ G_r T_in`` mapped back by ``T_out⁻ᵀ · T_in⁻¹``) around the FP64
sum of the ranks' local gradients; the ranks hold the same ``T_out`` bits and the same weights,
and without the distributed optimizer the same reduced gradients. With error feedback the
telescoping invariant of ``test_megatron_ddp`` holds through refreshes and mode switches.
"""

import pytest
import torch

from megatron_gift.config import GiftConfig, Mode, Side
from megatron_gift.numerics import CodecConfig
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens
from megatron_gift.testing.reference import gathered_local_gradients
from megatron_gift.testing.wire import WireRecord
from tests.bounds import ReductionPath, reduction_errors
from tests.megatron.test_megatron_ddp import _ef_invariant_worker, check_error_feedback_telescopes

pytestmark = pytest.mark.cpu_harness
STEPS = 8


def _train(dist_opt: bool):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    shape = dict(hidden_size=72, ffn_hidden_size=136)
    model, ref = build_tiny_gpt(**shape), build_tiny_gpt(**shape)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=dist_opt, overlap_grad_reduce=True, bucket_size=6000
    )
    gift = GiftConfig.build(
        mode=Mode.GIFT,
        codec=CodecConfig("e4m3", "block"),
        rank=8,
        sketch=16,
        damping=1.0,
        refresh_interval=1,
        side=Side.BOTH,
    )
    ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=gift)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=dist_opt), [ddp])
    group = parallel_state.get_data_parallel_group()
    rank, size = group.rank(), group.size()

    def owned(bg, bucket):
        n = bucket.grad_data.numel()
        return slice(rank * n // size, (rank + 1) * n // size)

    steps = []
    with WireRecord() as wire:
        for step in range(STEPS):
            wire.clear()
            ddp.zero_grad_buffer()  # closes the last step: its bytes move to last_step_bytes
            if steps:
                steps[-1]["bytes"] = dict(ddp.last_step_bytes)
            opt.zero_grad()
            tokens = random_tokens(step, rank)
            lm_loss(ddp, tokens).backward()
            ddp.finish_grad_sync()
            sent = {s.name: wire.mode(s.name) for b in ddp.gift_buckets() for s in b.layout.segments}
            local = gathered_local_gradients(ref, model, lambda m: lm_loss(m, tokens), lambda p: group)
            errors = reduction_errors(
                ddp,
                local,
                lambda p: 1.0 / size,
                ReductionPath(all_reduce=not dist_opt),
                owned=owned if dist_opt else None,
                sent=sent,
            )
            two_sided = sorted(
                gp.name
                for gp in ddp.gift_params.values()
                if gp.mode is Mode.GIFT
                and gp.output is not None
                and gp.output.whitening is not None
                and gp.output.whitening.rank > 0
            )
            t_out = torch.cat(
                [
                    t.flatten()
                    for gp in ddp.gift_params.values()
                    if gp.output is not None and gp.output.whitening is not None
                    for t in gp.output.whitening.tensors().values()
                ]
                or [torch.zeros(0)]
            )
            grads = torch.cat([b.grad.clone() for b in ddp.gift_buckets()])
            ok, _, _ = opt.step()
            assert ok
            params = torch.cat([p.detach().flatten() for p in model.parameters()])
            steps.append(
                dict(
                    errors=errors,
                    two_sided=two_sided,
                    t_out=t_out,
                    grads=grads,
                    params=params,
                    sent=sent,
                    pieces=sum(b.layout.max_pieces for b in ddp.gift_buckets()),
                )
            )
    ddp.zero_grad_buffer()
    steps[-1]["bytes"] = dict(ddp.last_step_bytes)
    return dict(steps=steps)


def _worker(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    out = {d: _train(d) for d in (True, False)}
    parallel_state.destroy_model_parallel()
    out["ef"] = _ef_invariant_worker(rank, world, Side.BOTH, steps=6)
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_worker, 2, cpu_harness=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("dist_opt", [True, False])
def test_two_sided_reduction_in_training(results, dist_opt):
    """Bugs caught: ``T_out`` installed but not sent (the wire record shows ``gift``, not ``gift+out``),
    applied at one end only or to the wrong rows (cut rows under the distributed optimizer: the
    ``P`` exchange; the error would be that of a wrong map, far above the bound), a rank-dependent
    ``T_out`` (ranks would differ), the output side never chosen or installed (``--gift-side`` not
    reaching the refresh's candidates)."""
    runs = [r[dist_opt] for r in results]
    for step in range(STEPS):
        per_rank = [r["steps"][step] for r in runs]
        for s in per_rank:
            over = [e for e in s["errors"] if not e[2] <= e[3]]
            assert s["errors"] and not over, (step, over)
        a, b = per_rank
        assert a["two_sided"] == b["two_sided"] and torch.equal(a["t_out"], b["t_out"]), step
        assert torch.equal(a["params"], b["params"]), step
        if not dist_opt:
            assert torch.equal(a["grads"], b["grads"]), step
        # what went on the wire (testing.wire): T_outᵀ G T_in exactly where an output side is installed
        assert {n for n, m in a["sent"].items() if m.endswith("+out")} == set(a["two_sided"]), step
        assert all(a["sent"][n] == "gift+out" for n in a["two_sided"])
    steps_seen = [bool(s["two_sided"]) for s in runs[0]["steps"]]
    assert sum(steps_seen) >= 2, f"output sides installed at {steps_seen}"  # (the choice may prefer Euclidean)
    for s in runs[0]["steps"]:  # P's all-reduce, counted, where cut rows need it: reduce-scatter with an output side
        assert (s["bytes"].get("all_reduce/fp32-out", 0) > 0) == (dist_opt and bool(s["two_sided"])), s["bytes"]
    if dist_opt:
        assert runs[0]["steps"][-1]["pieces"] > 0  # shard boundaries cut GIFT rows


@pytest.mark.slow
def test_error_feedback_telescopes_with_the_output_side(results):
    """Error feedback's invariant (``test_megatron_ddp``) with ``--gift-side both``: the residuals live in
    ``T_outᵀ G T_in``'s coordinates; a refresh carries them into the new pair's, a mode switch to
    Euclidean and back through both sides (``set_mode``). Bugs caught: a residual converted by
    ``T_in`` alone (left in the output side's coordinates), dropped, or committed twice."""
    check_error_feedback_telescopes([r["ef"] for r in results])
    assert all(sum(two_sided for *_, two_sided in r["ef"]) >= 4 for r in results)  # steps x layers with an output side
