"""GiftDistributedDataParallel inside real Megatron-Core training on CPU/gloo.

For every mode x {distributed optimizer on, off} x {overlap on, off} x {one, many buckets}:
``off`` is bitwise equal to stock Megatron DDP; every parameter's reduced gradient is within the
bound of ``tests/bounds.py`` for its mode (FP32 sums; BF16 roundings; FP8 of ``G_r T`` with each
GIFT layer's own ``T``, mapped back by its ``T⁻¹``) around the FP64 sum of the ranks' local
gradients; ranks hold bit-identical results.
"""

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_gift.config import GiftConfig, Mode, Side
from megatron_gift.numerics import CodecConfig
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens
from megatron_gift.testing.reference import gathered_local_gradients, shard_pieces
from megatron_gift.testing.wire import WireRecord
from tests.bounds import ReductionPath, reduction_errors

pytestmark = pytest.mark.cpu_harness
STEPS = 2
BUCKETS = [(False, None), (True, None), (True, 6000)]  # (overlap, bucket_size): no overlap = one bucket


def shard_of(dp_rank, dp_size):
    """``owned`` for :func:`tests.bounds.reduction_errors`: this rank's shard of each bucket (distributed optimizer)."""
    return lambda bg, bucket: slice(
        dp_rank * bucket.grad_data.numel() // dp_size, (dp_rank + 1) * bucket.grad_data.numel() // dp_size
    )


def _train(mode, dist_opt, overlap, bucket_size, tp, stock=False):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    # rows of 72 and 136 columns: shard boundaries (multiples of 64) cut weight rows
    extra = dict(tensor_model_parallel_size=tp, hidden_size=72, ffn_hidden_size=136)
    model, ref = build_tiny_gpt(**extra), build_tiny_gpt(**extra)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=dist_opt, overlap_grad_reduce=overlap, bucket_size=bucket_size
    )
    if stock:
        ddp = DistributedDataParallel(model.config, ddp_config, model)
    else:
        gift = GiftConfig.build(mode=mode, codec=CodecConfig("e4m3", "block"), rank=8, refresh_interval=1)
        ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=gift)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=dist_opt), [ddp])
    dp_group = parallel_state.get_data_parallel_group()
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    errors, grads, modes = [], [], {}
    with WireRecord() as wire:
        for step in range(STEPS):
            wire.clear()  # this step's
            ddp.zero_grad_buffer()
            opt.zero_grad()
            tokens = random_tokens(step, dp_rank)
            lm_loss(ddp, tokens).backward()
            ddp.finish_grad_sync()
            if not stock:  # each parameter's bound for the mode it was sent in (testing.wire)
                modes = {s.name: wire.mode(s.name) for b in ddp.gift_buckets() for s in b.layout.segments}
                local = gathered_local_gradients(ref, model, lambda m: lm_loss(m, tokens), lambda p: dp_group)
                errors += reduction_errors(
                    ddp,
                    local,
                    lambda p: 1.0 / dp_size,
                    ReductionPath(all_reduce=not dist_opt),
                    owned=shard_of(dp_rank, dp_size) if dist_opt else None,
                    sent=modes,
                )
            for bg in ddp.bucket_groups:
                for bucket in bg.buckets:
                    n = bucket.grad_data.numel()
                    grads.append(
                        bucket.grad_data[dp_rank * n // dp_size : (dp_rank + 1) * n // dp_size].clone()
                        if dist_opt
                        else bucket.grad_data.clone()
                    )
            ok, _, _ = opt.step()
            assert ok
    ddp.zero_grad_buffer()  # closes the last step: its byte count moves to last_step_bytes
    sent = dict(getattr(ddp, "last_step_bytes", {}))
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    pieces = (
        sum(b.layout.max_pieces for b in ddp.gift_buckets()) if hasattr(ddp, "gift_buckets") else 0
    )  # stock DDP: none
    n_buckets = sum(len(bg.buckets) for bg in ddp.bucket_groups)
    return dict(errors=errors, grads=grads, params=params, pieces=pieces, buckets=n_buckets, sent=sent, modes=modes)


def _worker(rank, world, tp_sizes):
    from megatron.core import parallel_state

    out = {}
    for tp in tp_sizes:
        parallel_state.initialize_model_parallel(tp, 1)
        for mode, dist_opt, (overlap, bucket_size) in itertools.product(list(Mode), [True, False], BUCKETS):
            key = (tp, mode.value, dist_opt, overlap, bucket_size)
            res = _train(mode, dist_opt, overlap, bucket_size, tp)
            if mode is Mode.OFF:
                stock = _train(mode, dist_opt, overlap, bucket_size, tp, stock=True)
                res["equal_to_stock"] = all(torch.equal(a, b) for a, b in zip(res["grads"], stock["grads"]))
            res["dp_rank"] = parallel_state.get_data_parallel_rank()
            res["tp_rank"] = parallel_state.get_tensor_model_parallel_rank()
            out[key] = res
        parallel_state.destroy_model_parallel()
    return out


def _check(results, dist_opt_split_rows_expected=True):
    split_rows_seen, used = False, {}
    for key in results[0]:
        tp, mode, dist_opt, overlap, bucket_size = key
        per_rank = [r[key] for r in results]
        for res in per_rank:
            if mode == "off":
                assert res["equal_to_stock"], key
            # every parameter within its mode's bound (tests/bounds.py), the modes the ones asked for
            over = [(n, m, e, b) for n, m, e, b in res["errors"] if not e <= b]
            assert not over, (key, over)
            for m in {m for _, m, _, _ in res["errors"]}:  # how tight the bounds are (pytest -s shows it)
                used.setdefault(m, []).extend(e / b for _, mm, e, b in res["errors"] if mm == m and b > 0)
            # the last step (GIFT with its T), as the wire record saw it: the mode asked for, the rest off
            assert set(res["modes"].values()) | {"off"} == {"off", mode}, (key, res["modes"])
            if mode != "off":  # bytes are reported per step, by collective and dtype
                labels = [k.split("/", 1)[1] for k in res["sent"] if k.startswith("all_to_all/")]
                # FP8 codes are fp8+scales; BF16 values travel in messages named by what they carry
                # (with the off parameters' own FP32: fp32+bf16), never fp8+scales
                label = "fp8+scales" if mode != "bf16" else next(k for k in labels if "bf16" in k)
                assert "fp8" not in label or mode != "bf16", (key, res["sent"])
                assert res["sent"].get(f"all_to_all/{label}", 0) > 0, (key, res["sent"])
                assert (res["sent"].get(f"all_gather/{label}", 0) > 0) == (not dist_opt), (key, res["sent"])
            if bucket_size is not None:
                assert res["buckets"] >= 3, key
        # Ranks holding the same model shard (same TP rank) end with bit-identical parameters,
        # and without the distributed optimizer with bit-identical reduced gradients.
        by_tp = {}
        for res in per_rank:
            by_tp.setdefault(res["tp_rank"], []).append(res)
        for group in by_tp.values():
            for res in group[1:]:
                assert torch.equal(res["params"], group[0]["params"]), key
                if not dist_opt:
                    assert all(torch.equal(a, b) for a, b in zip(res["grads"], group[0]["grads"])), key
        if mode == "gift" and dist_opt:
            split_rows_seen |= per_rank[0]["pieces"] > 0
    assert split_rows_seen or not dist_opt_split_rows_expected, "no shard boundary cut a GIFT row"
    print("error / bound (tests/bounds.py):", {m: f"{min(v):.2f}-{max(v):.2f}" for m, v in sorted(used.items())})


def _two_rank_worker(rank, world):
    """Every 2-rank case in one spawn (process start-up dominates)."""
    return dict(
        dp=_worker(rank, world, [1]),
        nan=_nan_worker(rank, world),
        owner=_owner_build_worker(rank, world),
        resume={d: _resume_worker(rank, world, d) for d in (False, True)},
        ef=_ef_invariant_worker(rank, world),
    )


def _four_rank_worker(rank, world):
    return dict(dp=_worker(rank, world, [1, 2]), sp=_sp_stats_worker(rank, world), pp=_pp_worker(rank, world))


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(_two_rank_worker, 2, cpu_harness=True, timeout=600)


@pytest.fixture(scope="module")
def four_ranks():
    return run_on_ranks(_four_rank_worker, 4, cpu_harness=True, timeout=900)


@pytest.mark.slow
def test_dp2(two_ranks):
    _check([r["dp"] for r in two_ranks])


@pytest.mark.slow
def test_dp4_and_tp2_dp2(four_ranks):
    _check([r["dp"] for r in four_ranks])


def _nan_worker(rank, world):
    """bf16 + loss scaler: a NaN on rank 1 at step 1 makes every rank skip that step only."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    parallel_state.initialize_model_parallel(1, 1)
    gpt = build_tiny_gpt(bf16=True, params_dtype=torch.bfloat16)
    model = Float16Module(gpt.config, gpt)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, grad_reduce_in_fp32=True
    )
    gift = GiftConfig.build(mode=Mode.GIFT, rank=8, refresh_interval=1, error_feedback=True)
    ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=gift)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, loss_scale=1.0, use_distributed_optimizer=True), [ddp]
    )
    embedding = model.module.embedding
    poison = embedding.register_forward_hook(
        lambda m, a, out: out * float("nan") if (ddp.step == 1 and rank == 1) else out
    )
    steps = []
    for step in range(3):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        before = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        lm_loss(ddp, random_tokens(step, rank)).backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        after = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        steps.append(dict(ok=ok, grad_norm=grad_norm, unchanged=torch.equal(before, after)))
    poison.remove()
    ddp.zero_grad_buffer()  # closes step 2: commits its residual
    state_finite = all(
        torch.isfinite(t).all()
        for g in ddp.gift_params.values()
        for t in [
            *(g.input.stats.ema_sums or {}).values(),
            *(g.input.whitening.tensors().values() if g.input.whitening else []),
        ]
    ) and all(torch.isfinite(b.error_feedback.residual).all() for b in ddp.gift_buckets())
    parallel_state.destroy_model_parallel()
    return dict(steps=steps, state_finite=bool(state_finite))


@pytest.mark.slow
def test_nan_on_one_rank_skips_the_step_everywhere(two_ranks):
    for res in (r["nan"] for r in two_ranks):
        ok = [s["ok"] for s in res["steps"]]
        assert ok == [True, False, True], ok
        assert res["steps"][1]["unchanged"] and not res["steps"][2]["unchanged"]
        assert res["steps"][2]["grad_norm"] is not None and res["steps"][2]["grad_norm"] > 0
        assert res["state_finite"], "a skipped step poisoned the factors or the error-feedback residual"


def _sp_stats_worker(rank, world):
    """TP=2 x DP=2, a column-parallel layer with sequence parallelism: A sums s/tp token chunks
    over TP and DP ranks, and every data-parallel rank holds the same transform."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    parallel_state.initialize_model_parallel(2, 1)
    hidden, seq, batch = 16, 8, 2
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=2,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )

    class Net(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.lin = ColumnParallelLinear(hidden, 24, config=config, init_method=torch.nn.init.normal_, bias=False)

        def forward(self, x):
            return self.lin(x)[0]

    torch.manual_seed(0)
    net = Net()
    ddp = GiftDistributedDataParallel(
        config,
        DistributedDataParallelConfig(),
        net,
        gift_config=GiftConfig.build(mode=Mode.GIFT, layers=(r"lin\.weight$",), rank=4, refresh_interval=1),
    )
    chunks = [torch.randn(seq // 2, batch, hidden, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    ddp.zero_grad_buffer()
    ddp(chunks[rank]).pow(2).sum().backward()
    ddp.finish_grad_sync()
    ddp.gift_state_dict()  # closes the step and installs its refresh (training installs it at the next step)
    g = next(iter(ddp.gift_params.values()))
    q = torch.cat([t.flatten() for t in g.input.whitening.tensors().values()])
    parallel_state.destroy_model_parallel()
    return dict(
        ema=g.input.stats.ema_sums["xtx"].double(), tokens=float(g.input.stats.ema_tokens), q=q, chunk=chunks[rank]
    )


@pytest.mark.slow
def test_kfac_statistics_tensor_and_sequence_parallel(four_ranks):
    res = [r["sp"] for r in four_ranks]
    # every rank keeps its own local EMA; their sum is the global A of all 4 token chunks
    x = torch.cat([r["chunk"].reshape(-1, r["chunk"].shape[-1]) for r in res]).double()
    expected = x.T @ x / x.shape[0]
    a = sum(r["ema"] for r in res) / sum(r["tokens"] for r in res)
    assert ((a - expected).abs().max() / expected.abs().max()).item() < 32 * 2**-24  # FP32 sums of 32 tokens
    # ranks 0/2 and 1/3 share a TP rank (data-parallel peers): identical transforms
    assert torch.equal(res[0]["q"], res[2]["q"]) and torch.equal(res[1]["q"], res[3]["q"])


def _owner_build_worker(rank, world):
    """Each refresh builds every GIFT layer's factor and T on its owner rank only; the others
    receive T: transforms and choices are bitwise identical everywhere, the factor only on its owner."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig

    import megatron_gift.refresh_sync as refresh_mod
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    parallel_state.initialize_model_parallel(1, 1)
    model = build_tiny_gpt(hidden_size=72, ffn_hidden_size=136)
    gift = GiftConfig.build(mode=Mode.GIFT, rank=8, refresh_interval=1, error_feedback=True)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=6000
    )
    ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=gift)
    built = []
    build = refresh_mod.FactorBuild
    refresh_mod.FactorBuild = lambda layers, *a, **k: (
        built.extend(layer.name for layer in layers) or build(layers, *a, **k)
    )
    try:
        steps = []
        for step in range(3):
            built.clear()
            ddp.zero_grad_buffer()  # closes the last step: its refresh is sent, its bytes move to last_step_bytes
            sent_before = dict(ddp.last_step_bytes)
            lm_loss(ddp, random_tokens(step, rank)).backward()
            ddp.finish_grad_sync()
            layers = [g for g in ddp.gift_params.values() if g.candidate]
            installed = all(
                g.input.whitening is not None for g in layers
            )  # a refresh is installed at the next step's first sync
            steps.append(
                dict(
                    built=sorted(built),
                    owned=sorted(g.name for g in layers if g.owner == rank),
                    state=torch.cat(
                        [
                            t.flatten().double()
                            for g in layers
                            for t in (
                                torch.tensor([-1.0 if g.input.damping is None else g.input.damping]),  # the choice
                                *g.input.whitening.tensors().values(),
                            )
                        ]
                    )
                    if installed
                    else None,
                    factors=sorted(g.name for g in layers if g.input.factor is not None),
                    sent_before=sent_before,
                )
            )
    finally:
        refresh_mod.FactorBuild = build
    parallel_state.destroy_model_parallel()
    return dict(steps=steps, layers=len(layers))


@pytest.mark.slow
def test_factors_are_built_by_their_owner_and_sent(two_ranks):
    res = [r["owner"] for r in two_ranks]
    n = res[0]["layers"]
    assert n >= 4
    for step in range(3):
        per_rank = [r["steps"][step] for r in res]
        for s in per_rank:
            assert s["built"] == s["owned"], s["built"]  # each rank built exactly the layers it owns
            assert abs(len(s["owned"]) - n / 2) <= 0.5  # balanced by bytes: two fc2 records, then half the rest each
        assert sorted(sum((s["built"] for s in per_rank), [])) == sorted(set(sum((s["owned"] for s in per_rank), [])))
        assert len(sum((s["built"] for s in per_rank), [])) == n
        if step == 0:
            assert all(s["state"] is None for s in per_rank)  # step 0's factors are installed at step 1
        else:
            sent = per_rank[0][
                "sent_before"
            ]  # the previous step's refresh: statistics reduce-scatter, record all-gather
            assert sent.get("all_gather/factors", 0) > 0 and not any(k.startswith("broadcast") for k in sent), sent
            assert sent.get("reduce_scatter/fp32", 0) > 0 and "all_reduce/fp32" not in sent, (
                sent
            )  # FP32 statistics, onto the owners
            assert torch.equal(per_rank[0]["state"], per_rank[1]["state"])
            for s in per_rank:  # the FP64 factor stays with the rank that built it
                assert s["factors"] == s["owned"], s["factors"]


def _pp_worker(rank, world):
    """PP=2 x DP=2 with Megatron's pipeline schedule: each stage's reduced gradients within the bound
    of tests/bounds.py around the FP64 sum of the local gradients (stock Megatron DDP without
    overlap on the same weights and data, read before its reduction), for every mode; ``off``
    bitwise equal to stock Megatron's reduction."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.testing.reference import all_gather_rows

    parallel_state.initialize_model_parallel(1, 2)
    stage = dict(
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        hidden_size=72,
        ffn_hidden_size=136,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    dp_group = parallel_state.get_data_parallel_group()
    dp_rank, dp_size = dp_group.rank(), dp_group.size()

    def forward_step(data, model):
        tokens = next(data)
        out = model(tokens[:, :-1], torch.arange(32).expand(2, 32), None, labels=tokens[:, 1:])
        return out, lambda output: (output.float().mean(), {})

    def run_step(ddp, step):
        ddp.zero_grad_buffer()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([random_tokens(10 * step + m, dp_rank) for m in range(2)]),
            model=[ddp],
            num_microbatches=2,
            seq_length=32,
            micro_batch_size=2,
            forward_only=False,
        )

    out = {}
    for mode, dist_opt in itertools.product(list(Mode), [True, False]):
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=dist_opt, overlap_grad_reduce=True, bucket_size=6000
        )
        model, ref_model = build_tiny_gpt(**stage), build_tiny_gpt(**stage)
        gift = GiftConfig.build(mode=mode, rank=8, refresh_interval=1)
        ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=gift)
        # off: stock DDP with the same buckets (bitwise); else without overlap, whose main_grad holds
        # the local gradients until finish_grad_sync
        ref_config = (
            ddp_config if mode is Mode.OFF else DistributedDataParallelConfig(use_distributed_optimizer=dist_opt)
        )
        ref = DistributedDataParallel(ref_model.config, ref_config, ref_model)
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=dist_opt), [ddp]
        )
        errors, exact = [], True
        for step in range(2):
            opt.zero_grad()  # as Megatron's train_step: the optimizer aliased .grad to main_grad
            run_step(ddp, step)
            ddp.finish_grad_sync()  # what Megatron's finalize_model_grads does after the schedule
            with torch.no_grad():
                for p_ref, p in zip(ref_model.parameters(), model.parameters()):
                    p_ref.copy_(p)
            run_step(ref, step)
            if mode is not Mode.OFF:
                local = {
                    p: all_gather_rows(q.main_grad.double().flatten(), dp_group)
                    for p, q in zip(model.parameters(), ref_model.parameters())
                }
                errors += reduction_errors(
                    ddp,
                    local,
                    lambda p: 1.0 / dp_size,
                    ReductionPath(all_reduce=not dist_opt),
                    owned=shard_of(dp_rank, dp_size) if dist_opt else None,
                )
            ref.finish_grad_sync()
            if mode is Mode.OFF:
                for g, w in zip(
                    (b.grad_data for bg in ddp.bucket_groups for b in bg.buckets),
                    (b.grad_data for bg in ref.bucket_groups for b in bg.buckets),
                ):
                    region = (
                        slice(dp_rank * g.numel() // 2, (dp_rank + 1) * g.numel() // 2) if dist_opt else slice(None)
                    )
                    exact &= torch.equal(g[region], w[region])
            opt.step()
        out[(mode.value, dist_opt)] = dict(
            errors=errors,
            exact=exact,
            params=torch.cat([p.detach().flatten() for p in model.parameters()]),
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        )
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_pipeline_parallel_pp2_dp2(four_ranks):
    res = [r["pp"] for r in four_ranks]
    for key in res[0]:
        mode, _ = key
        for r in res:
            if mode == "off":
                assert r[key]["exact"], key
            else:  # tests/bounds.py, per parameter and mode
                over = [e for e in r[key]["errors"] if not e[2] <= e[3]]
                assert r[key]["errors"] and not over, (key, over)
        stages = {}
        for r in res:  # data-parallel peers of one stage hold identical parameters
            stages.setdefault(r[key]["pp_rank"], []).append(r[key]["params"])
        assert all(torch.equal(ps[0], p) for ps in stages.values() for p in ps), key


@pytest.mark.parametrize(
    "field,value,match",
    [("reduce_scatter_with_fp32_accumulation", True, "reduce_scatter_with_fp32_accumulation")],
)
def test_unsupported_ddp_settings_are_refused(field, value, match):
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, **{field: value})
    with pytest.raises(ValueError, match=match):
        GiftDistributedDataParallel(None, ddp_config, torch.nn.Linear(2, 2))


def _resume_worker(rank, world, dist_opt, gift=None, ranks_per_node=None):
    """4 steps straight vs 2 steps, state saved, a fresh model/DDP/optimizer restored, 2 more:
    parameters and plugin state are bitwise identical (GIFT, error feedback, refresh every 2; with
    the distributed optimizer its parameter state travels by ``get_parameter_state_dp_reshardable``)."""
    import copy

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    parallel_state.initialize_model_parallel(1, 1)
    gift = gift or GiftConfig.build(mode=Mode.GIFT, rank=8, refresh_interval=2, error_feedback=True)
    dp_rank = parallel_state.get_data_parallel_rank()

    def build():
        model = build_tiny_gpt(hidden_size=72, ffn_hidden_size=136)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=dist_opt, overlap_grad_reduce=True, bucket_size=6000
        )
        ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=gift)
        return (
            model,
            ddp,
            get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=dist_opt), [ddp]
            ),
        )

    def train(model, ddp, opt, steps):
        for step in steps:
            ddp.zero_grad_buffer()
            opt.zero_grad()
            lm_loss(ddp, random_tokens(step, dp_rank)).backward()
            ddp.finish_grad_sync()
            opt.step()

    def snapshot(model, ddp):
        state = ddp.gift_state_dict()
        flat = [p.detach().flatten() for p in model.parameters()]
        for entry in state["params"].values():
            flat += [t.flatten().float() for t in entry.get("whitening", {}).values()]
            flat += [t.flatten().float() for t in (entry.get("stats", {}).get("ema_sums") or {}).values()]
            if "residual" in entry:
                flat.append(entry["residual"].flatten())
        return torch.cat(flat), state["step"]

    def optimizer_state(opt):
        params = [o.get_parameter_state_dp_reshardable() for o in opt.chained_optimizers] if dist_opt else None
        for state in params or ():  # Megatron's loader skips entries its sharded save marks as padding
            for buffers in (v for k, v in state.items() if isinstance(k, int)):
                for bucket in (b for buckets in buffers.values() for b in buckets):
                    for entry in bucket:
                        entry["padding"] = False
        return dict(opt=opt.state_dict(), params=params)

    def cloned(tree):  # deepcopy refuses the optimizer's non-leaf views
        if isinstance(tree, torch.Tensor):
            return tree.detach().clone()
        if isinstance(tree, dict):
            return {k: cloned(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(cloned(v) for v in tree)
        return copy.deepcopy(tree)

    straight = build()
    train(*straight, range(4))
    first = build()
    train(*first, range(2))
    saved = cloned(
        dict(
            gift=first[1].gift_state_dict(),
            opt=optimizer_state(first[2]),
            params=[p.detach() for p in first[0].parameters()],
        )
    )
    resumed = build()
    with torch.no_grad():
        for p, q in zip(resumed[0].parameters(), saved["params"]):
            p.copy_(q)
    resumed[2].load_state_dict(saved["opt"]["opt"])
    with torch.no_grad():  # as Megatron's checkpoint loading calls it
        for o, params in zip(resumed[2].chained_optimizers, saved["opt"]["params"] or ()):
            o.load_parameter_state_from_dp_reshardable(params)
            # torch's Adam under Megatron's fallback (no TE / apex): each parameter its own step
            # counter, the checkpoint's (as cpu_harness.install_for_training does for the launcher)
            for group in o.optimizer.param_groups:
                for q in group["params"]:
                    if "step" in o.optimizer.state.get(q, {}):
                        o.optimizer.state[q]["step"] = torch.tensor(float(group["step"]))
    missing = resumed[1].load_gift_state_dict(saved["gift"])
    train(*resumed, range(2, 4))
    a, b = snapshot(*straight[:2]), snapshot(*resumed[:2])
    parallel_state.destroy_model_parallel()
    return dict(equal=torch.equal(a[0], b[0]), steps=(a[1], b[1]), missing=missing)


@pytest.mark.slow
@pytest.mark.parametrize("dist_opt", [False, True])
def test_resume_from_gift_state_is_bitwise_identical(two_ranks, dist_opt):
    """Bugs caught: a piece of plugin state (statistics, T, damping choice, residual, step) or of the
    distributed optimizer's missing from the saved state, or restored into the wrong place."""
    for res in (r["resume"][dist_opt] for r in two_ranks):
        assert res["missing"] == [] and res["steps"][0] == res["steps"][1]
        assert res["equal"], "resumed run diverged from the uninterrupted one"


def _ef_invariant_worker(rank, world, side=Side.INPUT, steps=4):
    """Error feedback over ``steps`` steps, GIFT rebuilt every step (each rebuild carries the whitened
    residuals into the new ``T``'s coordinates), one layer sent Euclidean at step 2 and GIFT again
    at step 3 (``set_mode``: the residual to plain coordinates and back), distributed optimizer:
    the telescoping sum ``Σ_t reduced_t + Σ_r ε_r = Σ_t Σ_r x_{r,t}`` in the gradient's coordinates,
    ``x_{r,t}`` rank r's scaled local gradient (÷ R before the reduction, as Megatron scales the
    bucket) and ``ε_r`` its final residual. ``side``: ``--gift-side`` (``both``: the residuals in
    ``T_outᵀ G T_in``'s coordinates wherever an output side is in use)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_gift.megatron.bucket_group import sent_map
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.testing.reference import all_gather_rows

    parallel_state.initialize_model_parallel(1, 1)
    model, ref = (
        build_tiny_gpt(hidden_size=72, ffn_hidden_size=136),
        build_tiny_gpt(hidden_size=72, ffn_hidden_size=136),
    )
    gift = GiftConfig.build(mode=Mode.GIFT, rank=8, refresh_interval=1, error_feedback=True, damping=3.0, side=side)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=6000
    )
    ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=gift)
    group = parallel_state.get_data_parallel_group()
    switched = next(g for g in ddp.gift_params.values() if g.name.endswith("0.mlp.linear_fc1.weight"))
    owned, got, inputs, norms, spectra = {}, {}, {}, {}, {}

    def plain_residuals():
        state = ddp.gift_state_dict()  # closes the step: commits its residuals
        out = {}
        for p, g in ddp.gift_params.items():
            r = state["params"][g.name]["residual"]
            out[p] = all_gather_rows((sent_map(g).inverse(r) if g.mode is Mode.GIFT else r).double().flatten(), group)
        return out

    def kappa(w) -> float:  # κ(T) = σmax(T) / σmin(T) (= sqrt(λmax(Â) / λmin(Â)), Tᵀ Â T = I), from T itself: every
        # rank has it (the FP64 factor only its owner)
        sv = torch.linalg.svdvals(w.dense()[0].double())
        return float(sv.max() / sv.min())

    for step in range(steps):
        ddp.zero_grad_buffer()
        if step in (2, 3):
            ddp.set_mode(switched, Mode.EUCLIDEAN if step == 2 else Mode.GIFT)
        tokens = random_tokens(step, rank)
        lm_loss(ddp, tokens).backward()
        ddp.finish_grad_sync()
        local = gathered_local_gradients(ref, model, lambda m: lm_loss(m, tokens), lambda p: group)
        residuals = plain_residuals()
        for bucket, p, g, a, lo, hi in shard_pieces(ddp, rank, world):
            owned[p] = slice(lo - a, hi - a)
            got[p] = got.get(p, 0) + bucket.grad_data[lo:hi].double()
            inputs[p] = inputs.get(p, 0) + local[p][:, owned[p]].sum(0) / world
            norms[p] = (
                norms.get(p, 0) + float(local[p].norm(dim=1).sum()) / world + float(residuals[p].norm(dim=1).sum())
            )
            two_sided = g.mode is Mode.GIFT and g.output is not None and g.output.whitening is not None
            k = (kappa(g.input.whitening) if g.mode is Mode.GIFT else 1.0) * (
                kappa(g.output.whitening) if two_sided else 1.0
            )
            spectra.setdefault(p, []).append((k, p.shape[1] + (p.shape[0] + 8 if two_sided else 0)))
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-2 * (local[p].sum(0) / world).view_as(p).to(p.dtype)
    out = []
    for p, g in ddp.gift_params.items():
        if p not in owned:
            continue
        defect = float((got[p] + residuals[p][:, owned[p]].sum(0) - inputs[p]).norm())
        # κ of each step's map: κ(T_in) (1 for T = I), times κ(T_out) with an output side, whose terms it adds
        k, d = max(k for k, _ in spectra[p]), max(d for _, d in spectra[p])
        out.append(
            (g.name, defect, float(inputs[p].norm()), norms[p], k, d, sum(d > p.shape[1] for _, d in spectra[p]))
        )
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_error_feedback_telescopes_through_refreshes_and_mode_switches(two_ranks):
    """Error feedback's invariant, not a comparison with plain FP8. Tolerance: per step and rank the
    FP32 work on a coded element (``G T``, adding the residual, carrying it into a new ``T`` or out of
    a mode, the receiver's sum over R ranks and ``T⁻¹``) are sums of at most ``d + r + R + 2`` terms,
    each within ``γ = (d + r + R + 2) 2^-24`` of its operands' magnitude; an operation in whitened
    coordinates, seen in the gradient's, is amplified by at most ``κ(T)`` (``‖e T⁻¹‖ ≤ κ ‖e‖ / ‖T‖``):
    four operations per step on ``Σ_r (‖x_r‖ + ‖ε_r‖)``, ``K = max κ(T_t)``. (Measured: ~1e-7 of
    ``‖Σ x‖``, a dropped residual ~1e-2.) Bugs caught: a
    residual dropped or left in the old ``T``'s coordinates at a refresh (``remap_residual``) or a
    mode switch, a residual committed for a step it was not sent in."""
    check_error_feedback_telescopes([r["ef"] for r in two_ranks])


def check_error_feedback_telescopes(per_rank) -> None:
    """The tolerance of :func:`test_error_feedback_telescopes_through_refreshes_and_mode_switches` on
    :func:`_ef_invariant_worker`'s results; with an output side ``d`` counts both sides' terms
    (``d_in + d_out + r_out``) and ``κ = κ(T_in) κ(T_out)`` (``‖T_out⁻ᵀ e T_in⁻¹‖``)."""
    for res in per_rank:
        for name, defect, total, norms, k, d, _ in res:
            tol = 4 * (d + 8 + 2 + 2) * 2.0**-24 * k * norms
            assert defect <= tol, (name, defect, tol, total)
            assert tol < 0.1 * 2.0**-4 / 3**0.5 * total, (
                name,
                tol,
                total,
            )  # far below one FP8 rounding: the test can fail
