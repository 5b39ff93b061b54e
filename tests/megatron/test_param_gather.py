"""``--gift-param-gather delta``: the codec of ``comm.param_delta`` against bit-level references,
and real Megatron training (GPTModel, BF16 parameters, distributed optimizer, several buckets) on
2 and 4 gloo ranks against what stock Megatron's gather would have sent in the same run.

Bounds (docs/param-gather.md): a weight whose change is at most 63 of its own BF16 steps, in a
block of 32 where every weight's is, comes back exactly; every other weight is within
``2 max(g, a/127) + 2^-23 |new|`` of ``bf16(main)``, ``g`` half its step, ``a`` the largest change in
its block (the codec's unit is ``max(g, s_b)`` with the power of two ``s_b < 2 a / 127``; the final
rounding to BF16 at most doubles the distance).
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_gift.comm import param_delta
from megatron_gift.testing import run_on_ranks

STEPS = 6
FULL_EVERY = 3


# --------------------------------------------------------------------------- references


def step_up(x: torch.Tensor) -> torch.Tensor:
    """FP32 distance from each 16-bit value to the next one away from zero (the next bit pattern)."""
    nxt = (x.view(torch.int16) + 1).view(x.dtype)
    return (nxt.float() - x.float()).abs()


def reference_bound(new: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """The module doc's bound on ``|param - new|`` from ``new``, ``prev`` (flat shard) alone."""
    change = (new.float() - prev.float()).abs()
    blocks = torch.nn.functional.pad(change, (0, -change.numel() % 32)).view(-1, 32)
    a = blocks.amax(dim=1, keepdim=True).expand_as(blocks).reshape(-1)[: change.numel()]
    return 2 * torch.maximum(step_up(prev) / 2, a / 127) + 2.0**-23 * new.float().abs()


def near_blocks(new: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Whether each element's block of 32 has every change within 63 steps of its weight (exact there)."""
    near = (new.float() - prev.float()).abs() <= 63 * step_up(prev)
    near = torch.nn.functional.pad(near, (0, -near.numel() % 32), value=True).view(-1, 32).all(dim=1, keepdim=True)
    return near.expand(-1, 32).reshape(-1)[: new.numel()]


def roundtrip(new: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    msg = torch.empty(param_delta.message_bytes(new.numel()), dtype=torch.uint8)
    param_delta.encode(new, prev, msg)
    out = prev.clone().view(1, -1)
    param_delta.decode_into(msg.view(1, -1), out)
    return out.view(-1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bit-identical, but for the sign of a zero (IEEE sums ``x + (-x)`` to ``+0``; ``-0`` is ``+0``'s value)."""
    return (a.view(torch.int16) == b.view(torch.int16)) | ((a == 0) & (b == 0))


# --------------------------------------------------------------------------- the codec


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_changes_of_up_to_63_steps_come_back_exactly(dtype):
    """Catches a unit coarser than half the weight's own step, or a block scale set by weights
    that fit (exactness would then depend on the block's largest change, as in plain MXINT8)."""
    gen = torch.Generator().manual_seed(0)
    n = 4096
    # magnitudes from 2^-20 (FP16: subnormal) to 16, both signs, each moved by k bit patterns along its grid
    exps = torch.randint(-20, 4, (n,), generator=gen).float()
    prev = (
        (torch.rand(n, generator=gen) + 1).mul(torch.exp2(exps)).mul(torch.randint(0, 2, (n,), generator=gen) * 2 - 1)
    )
    prev = prev.to(dtype)
    k = torch.randint(-63, 64, (n,), generator=gen, dtype=torch.int16)
    new = (prev.view(torch.int16) + k).view(dtype)
    fits = (new.float() - prev.float()).abs() <= 63 * step_up(prev)
    new = torch.where(fits, new, prev)  # a step up the grid near a binade's top can double: keep those still
    assert fits.float().mean() > 0.9
    assert same_bits(roundtrip(new, prev), new).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_weight_within_the_bound_and_near_blocks_exact(dtype):
    """Catches clipping, a scale more than twice the ideal one, and a rounding that is not to the
    nearest code; the change mixes weights moved by a few of their steps and ones moved far."""
    gen = torch.Generator().manual_seed(1)
    n = 32 * 300 + 17  # a partial last block
    prev = (torch.randn(n, generator=gen) * torch.exp2(torch.randint(-12, 0, (n,), generator=gen).float())).to(dtype)
    finer = 3 if dtype is torch.float16 else 0  # FP16's steps are 2^3 finer than BF16's
    lr = torch.exp2(torch.randint(-16, -6, (n // 32 + 1,), generator=gen).float() - finer).repeat_interleave(32)[:n]
    new = (prev.float() + lr * torch.randn(n, generator=gen)).to(dtype)
    got = roundtrip(new, prev)
    diff = (got.float() - new.float()).abs()
    assert (diff <= reference_bound(new, prev)).all()
    near = near_blocks(new, prev)
    assert 0.05 < near.float().mean() < 0.95  # both kinds of block are exercised
    assert same_bits(got, new)[near].all()
    assert roundtrip(prev, prev).equal(prev)  # no change, nothing moves


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_change_just_below_a_power_of_two_stays_within_int8(dtype):
    """A block's scale is the least power of two ``s`` with ``a <= 127 s``: a largest change of 255/256
    of a power of two (more than 127/128 of it) needs the next power up. Catches a scale taken from
    the change's exponent alone: ``a / s`` then rounds to 128, which the int8 code wraps to -128."""
    c = 255 / 256 * 2.0**-3  # exact in BF16 and FP16
    prev = torch.zeros(2 * 32, dtype=dtype)  # zero weights: the unit is the block scale alone
    new = prev.clone()
    new[0], new[1], new[33], new[40] = c, 1e-3, -c, 2e-3
    got = roundtrip(new, prev)
    assert ((got.float() - new.float()).abs() <= reference_bound(new, prev)).all(), got[[0, 1, 33, 40]]


def test_a_non_finite_change_makes_its_block_nan():
    """Catches a NaN or Inf that is flushed to zero or clipped (it must reach every replica) and one
    that spills into other blocks."""
    prev = (torch.randn(5 * 32) * 0.02).bfloat16()
    clean = (prev.float() + 1e-3).bfloat16()
    new = clean.clone()
    for i, bad in ((3, float("nan")), (40, float("inf")), (70, -float("inf"))):
        new[i] = bad
    got = roundtrip(new, prev)
    assert got[:96].isnan().all()
    assert same_bits(got[96:], roundtrip(clean, prev)[96:]).all()


def test_a_nan_base_is_coded_against_zero():
    """Catches a NaN or Inf base (a block that decoded to NaN) that poisons every later change: the
    next change is coded against 0, so the block comes back finite within the bound of the new
    values against a base of 0 and, from there, exact where its changes fit."""
    gen = torch.Generator().manual_seed(4)
    new = (0.02 * torch.randn(3 * 32, generator=gen)).bfloat16()
    prev = (new.float() + 1e-4 * torch.randn(new.numel(), generator=gen)).bfloat16()
    prev[:32], prev[40] = float("nan"), float("inf")  # a NaN block and an Inf element in the next
    got = roundtrip(new, prev)
    base = torch.nan_to_num(prev, nan=0.0, posinf=0.0, neginf=0.0)
    assert got.isfinite().all()
    assert ((got.float() - new.float()).abs() <= reference_bound(new, base)).all()
    assert same_bits(got[64:], roundtrip(new[64:], prev[64:])).all()  # the clean block as alone
    again = roundtrip(new, got)
    assert same_bits(again, new)[near_blocks(new, got)].all() and near_blocks(new, got).any()


def test_wire_bytes_are_one_byte_per_element_plus_one_per_32():
    """Catches a message layout that grows the payload or the scales (<= 0.53x BF16's 2 bytes)."""
    for numel in (32, 4096, 40_000_000 // 8):
        assert param_delta.message_bytes(numel) == numel + numel // 32 <= 0.53 * 2 * numel
    assert param_delta.message_bytes(33) == 64 + 2  # a partial block is padded


def test_all_shards_decode_at_once_as_one_by_one():
    """Catches a decode whose result depends on how many shards it handles at once (every rank
    decodes all ``p`` shards in one pass; each must come out as its owner's would)."""
    gen = torch.Generator().manual_seed(2)
    p, numel = 4, 96 + 5
    prev = (torch.randn(p, numel, generator=gen) * 0.02).bfloat16()
    new = (prev.float() + 1e-3 * torch.randn(p, numel, generator=gen)).bfloat16()
    msgs = torch.empty(p, param_delta.message_bytes(numel), dtype=torch.uint8)
    for r in range(p):
        param_delta.encode(new[r], prev[r], msgs[r])
    together = prev.clone()
    param_delta.decode_into(msgs, together)
    for r in range(p):
        assert together[r].equal(roundtrip(new[r], prev[r]))


# --------------------------------------------------------------------------- Megatron training

CONFIGS = {  # name: (gather, overlap param gather, one bucket group, full every, seed); 4 ranks: the first two
    "delta": ("delta", False, False, 0, 1234),
    "delta-overlap": ("delta", True, False, 0, 1234),
    "delta-one-group": ("delta", False, True, 0, 1234),
    "delta-full": ("delta", False, False, FULL_EVERY, 1234),
    "stock": ("bf16", False, False, 0, 1234),
    "stock-seed2": ("bf16", False, False, 0, 99),
}


def _train(rank: int, world: int, names: list[str]) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gift.config import GiftConfig, ParamGather
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.megatron.param_gather import DeltaParamSync
    from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens
    from megatron_gift.testing.reference import replicas_identical, stock_param_shards

    parallel_state.initialize_model_parallel(1, 1)
    out = {}
    for name in names:
        gather, overlap, one_group, every, seed = CONFIGS[name]
        model = build_tiny_gpt(seed=seed, bf16=True, params_dtype=torch.bfloat16)
        cfg = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=overlap, bucket_size=20000
        )
        ddp = GiftDistributedDataParallel(
            model.config,
            cfg,
            model,
            disable_bucketing=one_group,
            gift_config=GiftConfig.build(param_gather=ParamGather(gather), param_gather_full_every=every),
        )
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True), [ddp]
        )
        buckets = [b for bg in ddp.bucket_groups for b in bg.buckets]
        rec = dict(
            losses=[],
            params=[],
            checks=[],
            identical=[],
            replicas=[],
            groups=[(type(bg).__name__, len(bg.buckets)) for bg in ddp.bucket_groups],
        )
        for step in range(STEPS):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            prev = {b: b.param_data.clone() for b in buckets}
            loss = lm_loss(ddp, random_tokens(step, 100 * seed + rank))
            if overlap and step:  # the forward's pre-hooks waited for the last update's gathers
                rec["params"].append(torch.cat([b.param_data.view(torch.int16) for b in buckets]))
            loss.backward()
            ddp.finish_grad_sync()
            opt.step()
            rec["losses"].append(float(loss))
            if overlap:
                continue
            rec["params"].append(torch.cat([b.param_data.view(torch.int16) for b in buckets]))
            rec["replicas"].append(replicas_identical(buckets))
            same = total = 0
            for b, want in stock_param_shards(opt).items():
                if b.param_data.dtype != torch.bfloat16:
                    continue
                s = b.param_data.numel() // world
                got, base = b.param_data[rank * s : (rank + 1) * s], prev[b][rank * s : (rank + 1) * s]
                ok = (got.float() - want.float()).abs() <= reference_bound(want, base)
                exact = same_bits(got, want)
                rec["checks"].append((bool(ok.all()), bool(exact[near_blocks(want, base)].all())))
                same, total = same + int(exact.sum()), total + exact.numel()
            rec["identical"].append(same / total)
        if overlap:
            ddp.start_param_sync(force_sync=True)  # as Megatron does before evaluation and checkpoints
            rec["params"].append(torch.cat([b.param_data.view(torch.int16) for b in buckets]))
        rec["delta_groups"] = sum(isinstance(bg, DeltaParamSync) for bg in ddp.bucket_groups)
        rec["ledger"] = ddp.param_gather_ledger.as_dict()
        rec["coded_numel"] = sum(b.param_data.numel() for b in buckets if b.param_data.dtype == torch.bfloat16)
        out[name] = rec
    model = build_tiny_gpt(bf16=True, params_dtype=torch.bfloat16)
    try:
        GiftDistributedDataParallel(
            model.config,
            DistributedDataParallelConfig(use_distributed_optimizer=False),
            model,
            gift_config=GiftConfig.build(param_gather=ParamGather.DELTA),
        )
    except ValueError as e:
        out["refused"] = str(e)
    parallel_state.destroy_model_parallel()
    return out


@functools.cache
def _trained(world: int) -> list[dict]:
    names = list(CONFIGS) if world == 2 else list(CONFIGS)[:2]  # 4 ranks share 2 cores: fewer runs
    return run_on_ranks(_train, world, names, cpu_harness=True, timeout=900)


@pytest.fixture(params=[2, 4], ids=["dp2", "dp4"])
def trained(request):
    return request.param, _trained(request.param)


@pytest.fixture
def trained_dp2():
    return 2, _trained(2)


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_every_replica_holds_the_same_bits_within_the_bound_of_stock(trained):
    """Catches replicas that drift apart (an owner applying its own ``new`` instead of the decoded
    change, a decode that differs by shard), weights outside the bound of what stock Megatron would
    have gathered (``bf16`` of the run's own FP32 main parameters), and an error that accumulates
    (the bound is per step, against the fresh main parameters)."""
    world, ranks = trained
    for r in ranks:
        assert r["delta"]["delta_groups"] == len(r["delta"]["groups"]) - 1 >= 4  # the FP32 group keeps Megatron's
        if "delta-one-group" in r:  # one group of a BF16 and an FP32 bucket (the latter gathered as it is)
            assert r["delta-one-group"]["groups"] == [("DeltaParamAndGradBucketGroup", 2)]
        for name in [n for n in ("delta", "delta-one-group", "delta-full") if n in r]:
            run = r[name]
            assert all(run["replicas"]) and len(run["replicas"]) == STEPS, name
            assert all(ok for ok, _ in run["checks"]), f"{name}: a weight outside the bound"
            assert all(exact for _, exact in run["checks"]), f"{name}: a weight in a near block that is not exact"
            assert all(0.5 < f <= 1 for f in run["identical"]), run["identical"]  # mostly exact
        assert all(f < 1 for f in r["delta"]["identical"])  # and really coded
    for t in range(STEPS):
        assert all(torch.equal(r["delta"]["params"][t], ranks[0]["delta"]["params"][t]) for r in ranks)


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_overlapping_the_gather_does_not_change_a_bit(trained):
    """Catches a delta gather whose result depends on when it runs: overlapped with the next forward
    (Megatron's pre-hooks wait for it) or inside the optimizer step."""
    _, ranks = trained
    for r in ranks:
        assert len(r["delta-overlap"]["params"]) == STEPS
        assert all(torch.equal(a, b) for a, b in zip(r["delta-overlap"]["params"], r["delta"]["params"]))
        assert r["delta-overlap"]["losses"] == r["delta"]["losses"]


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_wire_bytes_and_the_first_full_gather(trained):
    """Catches wire bytes above 1 + 1/32 per element and a first gather that is not full (replicas
    would keep whatever they started from)."""
    world, ranks = trained
    run = ranks[0]["delta"]
    shard = run["coded_numel"] // world
    assert run["ledger"]["all_gather/int8+scales"] == STEPS * (world - 1) * (
        shard + shard // 32
    )  # shards: multiples of 32
    assert run["ledger"]["all_gather/bf16"] == (world - 1) * shard * 2  # the first gather, before any update


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_every_nth_update_is_gathered_in_full(trained_dp2):
    """Catches --gift-param-gather-full-every not sending every N-th update in full: those steps
    must equal stock's gather bit for bit, the others not."""
    world, ranks = trained_dp2
    shard = ranks[0]["delta"]["coded_numel"] // world
    full = ranks[0]["delta-full"]
    assert [f == 1.0 for f in full["identical"]] == [t % FULL_EVERY == 0 for t in range(STEPS)]
    assert full["ledger"]["all_gather/bf16"] == (1 + len(range(0, STEPS, FULL_EVERY))) * (world - 1) * shard * 2


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_loss_follows_stock_within_the_seed_spread(trained_dp2):
    """Catches a delta gather that changes training beyond noise: against stock from the same seed the
    losses differ far less than stock from another seed does (the first loss is the same model)."""
    _, ranks = trained_dp2
    mean = lambda rs, name: [sum(r[name]["losses"][t] for r in rs) / len(rs) for t in range(STEPS)]  # noqa: E731
    delta, stock, other = mean(ranks, "delta"), mean(ranks, "stock"), mean(ranks, "stock-seed2")
    assert delta[0] == stock[0]
    gap = max(abs(a - b) for a, b in zip(delta, stock))
    spread = sum(abs(a - b) for a, b in zip(other, stock)) / STEPS
    assert gap < 0.1 * spread, (gap, spread)


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_the_ddp_refuses_a_run_without_the_distributed_optimizer(trained_dp2):
    _, ranks = trained_dp2
    assert "--gift-param-gather delta codes the distributed optimizer's parameter all-gather" in ranks[0]["refused"]
    assert "--use-distributed-optimizer" in ranks[0]["refused"]


# --------------------------------------------------------------------------- repair: skipped steps, NaN, replica check

REPAIR_STEPS, SKIP_AT, NAN_AT, CORRUPT_AT, CHECK_EVERY = 8, 2, 4, 6, 6


def _train_repair(rank: int, world: int) -> dict:
    """2 ranks, ``--gift-param-gather delta`` with a constant loss scale (so that Megatron checks
    the gradients): at ``SKIP_AT`` an Inf gradient (a skipped step); at ``NAN_AT``, after the
    backward, one weight's reconstruction NaN on every replica (what a non-finite change leaves)
    while its main parameter is finite; at ``CORRUPT_AT`` one bit of rank 1's replica of rank 0's
    shard flipped before the step's replica check."""
    import logging

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gift.config import GiftConfig, ParamGather
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.megatron.param_gather import DeltaParamSync
    from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens
    from megatron_gift.testing.reference import replicas_identical, stock_param_shards

    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("megatron_gift.megatron.param_gather").addHandler(handler)
    parallel_state.initialize_model_parallel(1, 1)
    model = build_tiny_gpt(seed=1234, bf16=True, params_dtype=torch.bfloat16)
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=20000)
    gift = GiftConfig.build(param_gather=ParamGather.DELTA, param_gather_check_every=CHECK_EVERY)
    ddp = GiftDistributedDataParallel(model.config, cfg, model, gift_config=gift)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, loss_scale=1.0, use_distributed_optimizer=True), [ddp]
    )
    groups = [bg for bg in ddp.bucket_groups if isinstance(bg, DeltaParamSync)]
    target = groups[0]  # its first coded buffer takes the NaN and the flipped bit
    buf = target.delta.buffers[target.delta.coded[0]]
    shard = buf.numel() // world
    buckets = [b for bg in ddp.bucket_groups for b in bg.buckets if b.param_data.dtype == torch.bfloat16]
    target_bucket = next(b for b in buckets if b.param_data is buf)
    in_target = [any(b.param_data is target.delta.buffers[i] for i in target.delta.coded) for b in buckets]
    rec = dict(steps=[], updated=[], in_target=in_target)
    for step in range(REPAIR_STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        if step == CORRUPT_AT and rank == 1:
            buf.view(torch.int16)[7] ^= 1  # rank 1's replica of rank 0's element 7
        before = {b: b.param_data.clone() for b in buckets}
        lm_loss(ddp, random_tokens(step, 100 + rank)).backward()
        ddp.finish_grad_sync()
        if step == NAN_AT:  # every replica's reconstruction of rank 0's element 3 NaN (rank 0's prev too)
            buf[3] = float("nan")
            if rank == 0:
                target.delta.prev[0][3] = float("nan")
        if step == SKIP_AT:
            for b in buckets:  # an Inf in every rank's own gradient shard
                b.grad_data[rank * (b.grad_data.numel() // world)] = float("inf")
        updated, _, _ = opt.step()
        want = stock_param_shards(opt)
        rec["updated"].append(bool(updated))
        own = [b.param_data.view(world, -1)[rank] for b in buckets]
        rec["steps"].append(
            dict(
                ddp_step=ddp.step,
                replicas=replicas_identical(buckets),
                unchanged=all(
                    torch.equal(b.param_data.view(torch.int16), before[b].view(torch.int16)) for b in buckets
                ),
                target=buf[:shard].clone(),
                target_prev=before[target_bucket][:shard].clone(),
                target_want=want[target_bucket].clone(),
                exact=[bool(same_bits(o, want[b]).all()) for o, b in zip(own, buckets)],
                ledger=ddp.param_gather_ledger.as_dict(),
            )
        )
    rec["warnings"] = [w for w in warnings if "replicas" in w]
    parallel_state.destroy_model_parallel()
    return rec


@functools.cache
def _repaired() -> list[dict]:
    return run_on_ranks(_train_repair, 2, cpu_harness=True, timeout=900)


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_a_skipped_step_sends_a_zero_change():
    """Catches a found_inf step (the optimizer skips its update) that moves a weight or lets the
    replicas drift (its gather must send nothing but zeros, or not run), and a skip that breaks
    the next steps' gathers."""
    ranks = _repaired()
    for r in ranks:
        assert r["updated"] == [t != SKIP_AT for t in range(REPAIR_STEPS)]
        assert r["steps"][SKIP_AT]["unchanged"]
        assert all(s["replicas"] for s in r["steps"])
        assert not r["steps"][SKIP_AT + 1]["unchanged"]  # training goes on


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_a_nan_reconstruction_is_repaired_by_the_next_gather():
    """Catches a NaN that stays in the weights once the main parameters are finite (the NaN base
    poisoning every later change until a full gather): the next gather codes the element against
    a base of 0, so that on every replica it is finite and within the bound of ``bf16(main)``, and
    so is every weight after every later step; no step is skipped for it."""
    ranks = _repaired()
    owner = ranks[0]["steps"]
    for t in range(NAN_AT, REPAIR_STEPS):
        got, want, base = owner[t]["target"], owner[t]["target_want"], owner[t]["target_prev"]
        if t == NAN_AT:
            base = base.clone()
            base[3] = 0.0  # the NaN base, coded against 0
        assert got.isfinite().all(), t
        assert ((got.float() - want.float()).abs() <= reference_bound(want, base)).all(), t
        assert all(r["steps"][t]["replicas"] for r in ranks), t
    assert all(r["updated"][NAN_AT:] == [True] * (REPAIR_STEPS - NAN_AT) for r in ranks)


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_the_replica_check_warns_and_gathers_in_full():
    """Catches a replica check that misses a flipped bit in one replica, warns on agreeing replicas,
    or does not repair: at the check after the flip both ranks warn once, the group's next update
    is gathered in full (every weight of it ``bf16(main)`` bit for bit, Megatron's bytes for it)
    and the replicas agree again; the other checks (step 0, and the NaN block, the same on every
    replica) pass silently."""
    ranks = _repaired()
    for r in ranks:
        assert len(r["warnings"]) == 1 and f"iteration {CORRUPT_AT}" in r["warnings"][0], r["warnings"]
        s = r["steps"][CORRUPT_AT]
        assert all(e for e, inside in zip(s["exact"], r["in_target"]) if inside)
        assert not all(e for e, inside in zip(r["steps"][CORRUPT_AT - 1]["exact"], r["in_target"]) if inside)
        full = lambda t: r["steps"][t]["ledger"].get("all_gather/bf16", 0)  # noqa: E731
        assert full(CORRUPT_AT) > full(CORRUPT_AT - 1) and full(CORRUPT_AT - 1) == full(0)
        assert all(x["replicas"] for x in r["steps"][CORRUPT_AT:])
        assert [x["ddp_step"] for x in r["steps"]] == list(range(REPAIR_STEPS))


# --------------------------------------------------------------------------- the decode stream's order


def _train_stream_order(rank: int, world: int) -> list[tuple]:
    """2 steps with --overlap-param-gather, the delta gather's streams replaced by a recorder (the
    CPU has no streams): the order in which gathers start, decodes run (inside the decode
    stream's context or not), events are recorded and the current stream waits on them."""
    import contextlib

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gift.comm import param_delta
    from megatron_gift.comm.schedule import StageStreams
    from megatron_gift.config import GiftConfig, ParamGather
    from megatron_gift.megatron import param_gather
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens

    log: list[tuple] = []
    inside = [False]

    class Recorder(StageStreams):
        @contextlib.contextmanager
        def context(self, s):
            inside[0] = True
            yield
            inside[0] = False

        def record(self, s):
            token = object()
            log.append(("record", id(token)))
            return token

        def wait_event(self, s, event):
            if event is not None:
                log.append(("wait", id(event)))

    param_gather.StageStreams = Recorder
    start, decode = param_delta.DeltaGather.start, param_delta.DeltaGather._decode
    param_delta.DeltaGather.start = lambda self, *a, **k: (log.append(("start", id(self))), start(self, *a, **k))[1]
    param_delta.DeltaGather._decode = lambda self, *a: (log.append(("decode", id(self), inside[0])), decode(self, *a))[
        1
    ]
    parallel_state.initialize_model_parallel(1, 1)
    model = build_tiny_gpt(seed=1234, bf16=True, params_dtype=torch.bfloat16)
    cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=20000
    )
    ddp = GiftDistributedDataParallel(
        model.config, cfg, model, gift_config=GiftConfig.build(param_gather=ParamGather.DELTA)
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True), [ddp]
    )
    for step in range(2):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        log.append(("forward",))
        lm_loss(ddp, random_tokens(step, 100 + rank)).backward()
        ddp.finish_grad_sync()
        opt.step()
    parallel_state.destroy_model_parallel()
    return log


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_the_decode_runs_on_its_stream_behind_the_next_gather():
    """Catches a decode on the compute stream, a next bucket group's gather issued only after the
    compute stream waited for this decode (no overlap), and a pre-hook that returns before the
    compute stream waits for the decode's event (the forward would read half-decoded weights):
    every decode runs in the decode stream's context and records an event; the next group's gather
    starts between that record and the compute stream's wait on it; every event is waited on."""
    for log in run_on_ranks(_train_stream_order, 2, cpu_harness=True, timeout=600):
        second = log[log.index(("forward",), log.index(("forward",)) + 1) :]  # the coded gathers of step 2
        decodes = [i for i, e in enumerate(second) if e[0] == "decode"]
        assert len(decodes) >= 4 and all(second[i][2] for i in decodes)  # one per group, on its stream
        for n, i in enumerate(decodes):
            event = second[i + 1]
            assert event[0] == "record"
            wait = second.index(("wait", event[1]), i)
            between = [e for e in second[i + 2 : wait] if e[0] == "start"]
            assert len(between) == (n < len(decodes) - 1), (n, second[i : wait + 1])  # the next group's gather
