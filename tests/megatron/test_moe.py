"""Four gloo ranks, one spawn: Megatron's MoE layer (local spec) with expert parallelism, and
several distributed-optimizer instances; each checked against a hand-made FP64 reduction.

* MoE (defect 4), TP 2 with sequence parallelism, EP 2, expert TP 1 (expert data-parallel 2),
  and TP 4, EP 2, expert TP 2 (the dense and expert tensor-parallel groups differ). Each expert
  linear's K-FAC statistics must be the sum of its own inputs over its expert data-parallel
  replicas and, when it is sequence-parallel, its expert tensor-parallel peers (not the dense
  TP group, whose ranks hold other experts); the reference is ``XᵀX`` of the inputs a test hook
  recorded, summed over those groups in FP64, within the BF16 wire rounding of the statistics
  (2**-8 relative). Euclidean and GIFT gradients of dense and expert weights are within the bound
  of ``tests/bounds.py`` (GIFT with each layer's own ``T``); expert replicas hold the same bits.
* virtual pipeline parallelism 2 on PP 2 x DP 2 (Megatron's interleaved schedule): ``off`` is
  bitwise stock Megatron's, Euclidean and GIFT within their bounds, DP peers bit-identical.
* num_distributed_optimizer_instances 2 (defect 10) on DP 4: ``off`` is bitwise Megatron's; the
  quantized intra-instance reduce-scatter plus the FP32 inter-instance all-reduce is within the
  bound of the 4-rank average (4 rounded messages, FP32 sums), and ranks holding the same shard
  hold the same bits.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_gift.config import GiftConfig, Mode
from megatron_gift.numerics import CodecConfig
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens
from megatron_gift.testing.reference import all_gather_rows, gathered_local_gradients
from tests.bounds import ReductionPath, reduction_errors

pytestmark = pytest.mark.cpu_harness
HIDDEN, TOKENS = 64, 32  # tokens per tensor-parallel rank (sequence parallelism)
# FP32 statistics: XᵀX accumulated over a rank's TOKENS rows (worst-case relative error γ_K ≈ K·u,
# u = 2⁻²⁴), then the EMA's scale-and-add and the sum over a few ranks (a few u more)
STATS_FP32 = (TOKENS + 8) * 2.0**-24


LAYOUTS = {"tp2-ep2-etp1": (2, 2, 1), "tp4-ep2-etp2": (4, 2, 2)}  # (TP, EP, expert TP) on 4 ranks


def build_moe_layer(tp: int, ep: int, etp: int, seed: int = 1234):
    """Megatron's MoELayer from the local GPT layer spec: 4 experts (SwiGLU), top-2 router, all-gather
    dispatch, sequence parallelism (Megatron requires it with EP and TP). The whole GPTModel cannot
    run these layouts on CPU: torch's norms refuse sequence parallelism."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=128,
        moe_ffn_hidden_size=128,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="allgather",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        params_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        sequence_parallel=True,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        use_cpu_initialization=True,
    )
    spec = get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm").submodules.mlp
    return spec(config=config)  # an MlpBuilder, as TransformerLayer calls it


def moe_loss(layer, x):
    return layer(x)[0].square().mean()


def _gift(mode, **kw):
    return GiftConfig.build(
        mode=mode, codec=CodecConfig("e4m3", "block"), rank=8, sketch=0, refresh_interval=1, error_feedback=False, **kw
    )


def _moe_case(mode, layout):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    model, ref = build_moe_layer(*layout), build_moe_layer(*layout)
    # TP 4 x EP 2 leaves data-parallel groups of one: loopback keeps GIFT (and its statistics) on there
    gift = _gift(mode, layers=(r"linear_fc\d\.weight$", r"router\.weight$"), loopback=layout[2] > 1)
    ddp = GiftDistributedDataParallel(model.config, DistributedDataParallelConfig(), model, gift_config=gift)
    inputs = {}  # expert fc1 name -> inputs seen on this rank
    names = {m: n for n, m in model.named_modules()}
    hooks = [
        m.register_forward_pre_hook(lambda m, a: inputs.setdefault(names[m], []).append(a[0].detach().double()))
        for n, m in model.named_modules()
        if n.endswith("linear_fc1") and "experts" in n
    ]
    ddp.zero_grad_buffer()
    x = torch.randn(TOKENS, 1, HIDDEN, generator=torch.Generator().manual_seed(dist.get_rank()))
    moe_loss(ddp, x).backward()
    ddp.finish_grad_sync()  # refresh step: statistics folded (warm-up: the EMA is the latest step)
    for h in hooks:
        h.remove()
    edp = ps.get_expert_data_parallel_group()
    stats_err = {}
    for name, xs in inputs.items() if mode is Mode.GIFT else ():
        seen = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs])
        xtx, count = seen.T @ seen, torch.tensor([float(seen.shape[0])], dtype=torch.float64)
        sequence_parallel = model.get_submodule(name).sequence_parallel  # it sees s/etp of the tokens
        for group in [edp] + ([ps.get_expert_tensor_parallel_group()] if sequence_parallel else []):
            dist.all_reduce(xtx, group=group)
            dist.all_reduce(count, group=group)
        g = ddp.gift_params[model.get_submodule(name).weight]
        # the plugin sums each rank's local EMA over the layer's statistics groups at a refresh
        # (RefreshSync.sum_statistics); the ratio of summed sums to summed tokens is the global average
        sums, tokens = g.input.stats.ema_sums["xtx"].double(), g.input.stats.ema_tokens.double().reshape(1)
        for group in g.input.groups:
            dist.all_reduce(sums, group=group)
            dist.all_reduce(tokens, group=group)
        got = sums / tokens
        want = xtx / count
        stats_err[name] = float((got - want).norm() / want.norm())
    dense_dp = ps.get_data_parallel_group(with_context_parallel=True)
    local = gathered_local_gradients(
        ref, model, lambda m: moe_loss(m, x), lambda p: edp if not getattr(p, "allreduce", True) else dense_dp
    )
    scale = 1.0 / dense_dp.size()  # Megatron scales experts by 1/dp too, then sums over expert-dp
    errors = reduction_errors(ddp, local, lambda p: scale, ReductionPath(all_reduce=True))
    expert_grads = torch.cat([p.main_grad.flatten() for p in model.parameters() if not getattr(p, "allreduce", True)])
    return dict(
        stats_err=stats_err,
        errors=errors,
        expert_grads=expert_grads,
        edp_rank=ps.get_expert_data_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        modes={g.name: g.mode.value for g in ddp.gift_params.values()},
    )


def _instances_case(mode, stock=False):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    model, ref = build_tiny_gpt(), build_tiny_gpt()
    cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        num_distributed_optimizer_instances=2,
        overlap_grad_reduce=True,
        bucket_size=6000,
    )
    if stock:
        ddp = DistributedDataParallel(model.config, cfg, model)
    else:
        ddp = GiftDistributedDataParallel(model.config, cfg, model, gift_config=_gift(mode))
    ddp.zero_grad_buffer()
    tokens = random_tokens(0, ps.get_data_parallel_rank())
    lm_loss(ddp, tokens).backward()
    ddp.finish_grad_sync()
    dp = ps.get_data_parallel_group()
    local = gathered_local_gradients(ref, model, lambda m: lm_loss(m, tokens), lambda p: dp)

    def owned(bg, bucket):
        size = bucket.grad_data.numel() // bg.intra_distributed_optimizer_instance_size
        r = bg.intra_distributed_optimizer_instance_rank
        return slice(r * size, (r + 1) * size)

    shards = [bucket.grad_data[owned(bg, bucket)].clone() for bg in ddp.bucket_groups for bucket in bg.buckets]
    return dict(
        errors=reduction_errors(ddp, local, lambda p: 1.0 / dp.size(), ReductionPath(), owned=owned),
        shards=shards,
        intra_rank=ddp.bucket_groups[0].intra_distributed_optimizer_instance_rank,
    )


def _vpp_case(mode):
    """Virtual pipeline 2 on PP 2 x DP 2 (4 layers, one per chunk), Megatron's interleaved schedule:
    ``off`` bitwise stock Megatron, Euclidean within the FP8 bound of the local gradients' sum."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    def chunks():
        return [
            build_tiny_gpt(
                num_layers=4,
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
                pipeline_dtype=torch.float32,
                vp_stage=i,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
            )
            for i in range(2)
        ]

    dp_rank = ps.get_data_parallel_rank()
    batches = [random_tokens(m, dp_rank) for m in range(2)]

    def forward_step(data, model):
        tokens = next(data)
        out = model(tokens[:, :-1], torch.arange(32).expand(2, 32), None, labels=tokens[:, 1:])
        return out, lambda output: (output.float().mean(), {})

    def run(ddps):
        for d in ddps:
            d.zero_grad_buffer()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in ddps],
            model=ddps,
            num_microbatches=2,
            seq_length=32,
            micro_batch_size=2,
            forward_only=False,
        )

    model, ref_model = chunks(), chunks()
    cfg = dict(use_distributed_optimizer=False, overlap_grad_reduce=True, bucket_size=6000)
    gift = [
        GiftDistributedDataParallel(
            c.config, DistributedDataParallelConfig(**cfg), c, disable_bucketing=i > 0, gift_config=_gift(mode)
        )
        for i, c in enumerate(model)
    ]
    ref = [
        DistributedDataParallel(c.config, DistributedDataParallelConfig(overlap_grad_reduce=False), c)
        for c in ref_model
    ]
    run(gift)
    for d in gift:
        d.finish_grad_sync()
    run(ref)  # without overlap, main_grad holds the local gradients until finish_grad_sync
    dp = ps.get_data_parallel_group()
    local = {}
    for c, r in zip(model, ref_model):
        for p, p_ref in zip(c.parameters(), r.parameters()):
            local[p] = all_gather_rows(p_ref.main_grad.double().flatten(), dp)
    for d in ref:
        d.finish_grad_sync()
    exact = all(
        torch.equal(p.main_grad, q.main_grad)
        for c, r in zip(model, ref_model)
        for p, q in zip(c.parameters(), r.parameters())
    )
    errors = [
        e for d in gift for e in reduction_errors(d, local, lambda p: 1.0 / dp.size(), ReductionPath(all_reduce=True))
    ]
    grads = torch.cat([p.main_grad.flatten() for c in model for p in c.parameters()])
    return dict(
        exact=exact,
        errors=errors,
        grads=grads,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        modes=[g.mode.value for d in gift for g in d.gift_params.values()],
    )


def _worker(rank, world):
    from megatron.core import parallel_state as ps

    out = {}
    for name, (tp, ep, etp) in LAYOUTS.items():
        ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        for mode in (Mode.EUCLIDEAN, Mode.GIFT) if etp == 1 else (Mode.GIFT,):
            out[name, mode.value] = _moe_case(mode, (tp, ep, etp))
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, num_distributed_optimizer_instances=2)
    out["instances", "stock"] = _instances_case(Mode.OFF, stock=True)
    for mode in (Mode.OFF, Mode.EUCLIDEAN, Mode.GIFT):
        out["instances", mode.value] = _instances_case(mode)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=2)
    for mode in (Mode.OFF, Mode.EUCLIDEAN, Mode.GIFT):
        out["vpp", mode.value] = _vpp_case(mode)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_worker, 4, cpu_harness=True, timeout=600)


@pytest.mark.slow
def test_expert_statistics_sum_over_expert_data_parallel_only(results):
    for res in results:
        for layout in LAYOUTS:
            errs = res[layout, "gift"]["stats_err"]
            assert errs and max(errs.values()) <= STATS_FP32, (layout, errs)


@pytest.mark.slow
def test_moe_gradients_against_fp64_reduction(results):
    """Dense and expert weights, Euclidean and GIFT, every layout. Bugs caught: an expert's T from
    another expert's statistics, the wrong scaling of expert gradients, a GIFT reduction only
    consistent across replicas but not right."""
    for res in results:
        for key in [k for k in res if k[0] in LAYOUTS]:
            over = [e for e in res[key]["errors"] if not e[2] <= e[3]]
            assert res[key]["errors"] and not over, (key, over)
        assert any("experts" in n and m == "gift" for n, m in res["tp2-ep2-etp1", "gift"]["modes"].items())
        assert any("experts" in n and m == "gift" for n, m, _, _ in res["tp2-ep2-etp1", "gift"]["errors"])
    for mode in ("euclidean", "gift"):  # replicas of an expert (same EP and TP rank) hold the same bits
        by_replica = {}
        for res in results:
            by_replica.setdefault(
                (res["tp2-ep2-etp1", mode]["ep_rank"], res["tp2-ep2-etp1", mode]["tp_rank"]), []
            ).append(res["tp2-ep2-etp1", mode])
        for group in by_replica.values():
            assert all(torch.equal(r["expert_grads"], group[0]["expert_grads"]) for r in group), mode


@pytest.mark.slow
def test_several_distributed_optimizer_instances(results):
    for res in results:
        assert all(
            torch.equal(a, b) for a, b in zip(res["instances", "off"]["shards"], res["instances", "stock"]["shards"])
        )
        for mode in ("euclidean", "gift"):
            over = [e for e in res["instances", mode]["errors"] if not e[2] <= e[3]]
            assert res["instances", mode]["errors"] and not over, (mode, over)
    for mode in ("off", "euclidean", "gift"):  # the same shard in both instances: the same bits
        by_shard = {}
        for res in results:
            by_shard.setdefault(res["instances", mode]["intra_rank"], []).append(res["instances", mode]["shards"])
        for group in by_shard.values():
            assert len(group) == 2 and all(all(torch.equal(a, b) for a, b in zip(s, group[0])) for s in group), mode


@pytest.mark.slow
def test_virtual_pipeline_parallelism(results):
    for res in results:
        assert res["vpp", "off"]["exact"]
        for mode in ("euclidean", "gift"):
            over = [e for e in res["vpp", mode]["errors"] if not e[2] <= e[3]]
            assert res["vpp", mode]["errors"] and not over, (mode, over)
        assert "gift" in res["vpp", "gift"]["modes"]
    for mode in ("euclidean", "gift"):  # data-parallel peers of a stage hold the same bits
        stages = {}
        for res in results:
            stages.setdefault(res["vpp", mode]["pp_rank"], []).append(res["vpp", mode]["grads"])
        assert all(len(g) == 2 and torch.equal(g[0], g[1]) for g in stages.values()), mode
