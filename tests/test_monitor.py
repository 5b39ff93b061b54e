"""``--gift-layers auto`` and telemetry inside GiftDistributedDataParallel (real Megatron DDP, 2 gloo ranks).

Every step profiles and logs. Checked against quantities computed independently of the plugin:
each record's per-layer RelL2 and cosine equal those of the reduced gradients against a hand-made
FP32 average; every rank writes the same records and takes the same decisions; parameters the
policy moves to GIFT or BF16 still reduce correctly (BF16 to BF16 accuracy); the decisions and
modes survive ``gift_state_dict`` / ``load_gift_state_dict`` into a fresh model.
"""

import json
import math

import pytest
import torch
import torch.distributed as dist

from megatron_gift.config import GiftConfig, Mode, PolicyConfig
from megatron_gift.numerics import CodecConfig
from megatron_gift.telemetry import jsonable
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.gpt import build_tiny_gpt, hand_average, lm_loss, random_tokens
from tests.bounds import GIFT_REL_L2, reduced_rel_l2_bound

pytestmark = pytest.mark.cpu_harness
STEPS = 4


def _ddp(policy: PolicyConfig):
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    model = build_tiny_gpt(hidden_size=72, ffn_hidden_size=136)
    cfg = GiftConfig(mode=Mode.GIFT, codec=CodecConfig("e4m3", "block"), rank=8, refresh_interval=1, error_feedback=True,
                     policy=policy, log_interval=1)  # fmt: skip
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=6000)
    return model, GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=cfg)


def _run(policy: PolicyConfig):
    from megatron.core import parallel_state

    model, ddp = _ddp(policy)
    ref = build_tiny_gpt(hidden_size=72, ffn_hidden_size=136)
    records = []
    ddp.monitor.sink = lambda step, record: records.append(json.dumps(jsonable(record), sort_keys=True))
    group = parallel_state.get_data_parallel_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    checks = []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        tokens = random_tokens(step, rank)
        lm_loss(ddp, tokens).backward()
        ddp.finish_grad_sync()
        expected = hand_average(ref, model, tokens, group)
        # RelL2 / cosine of each parameter's reduced gradient (this rank's shard, summed over ranks)
        names = {p: g.name for p, g in ddp.gift_params.items()}
        sums = {}
        for bg in ddp.bucket_groups:
            for bucket in bg.buckets:
                n = bucket.grad_data.numel()
                lo, hi = rank * n // world, (rank + 1) * n // world
                for p, (a, b) in bucket.param_to_index.items():
                    if p not in names or max(a, lo) >= min(b, hi):
                        continue
                    got = bucket.grad_data[max(a, lo) : min(b, hi)].double()
                    want = expected[p][max(a, lo) - a : min(b, hi) - a].double()
                    sums[names[p]] = torch.stack([((got - want) ** 2).sum(), (want**2).sum(), (got * want).sum(), (got**2).sum()])
        keys = sorted(names.values())
        total = torch.stack([sums.get(k, torch.zeros(4, dtype=torch.float64)) for k in keys])
        dist.all_reduce(total, group=group)
        checks.append({k: (math.sqrt(e / r), d / math.sqrt(g * r)) for k, (e, r, d, g) in zip(keys, total.tolist())})
        with torch.no_grad():  # a plain SGD step keeps the reference model in step
            for p, q in zip(model.parameters(), ref.parameters()):
                p -= 1e-2 * expected[p].view_as(p).to(p.dtype)
                q.copy_(p)
    state = ddp.gift_state_dict()  # closes the last step: its record goes out
    _, fresh = _ddp(policy)
    fresh.load_gift_state_dict(state)
    return dict(
        records=records,
        checks=checks,
        modes={g.name: g.mode.value for g in ddp.gift_params.values()},
        fresh_modes={g.name: g.mode.value for g in fresh.gift_params.values()},
        layouts_equal=[
            [s.mode for s in a.segments] == [s.mode for s in b.segments]
            for bg, fbg in zip(ddp.bucket_groups, fresh.bucket_groups)
            for a, b in zip(getattr(bg, "gift_layouts", []), getattr(fbg, "gift_layouts", []))
        ],
    )


def _worker(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    out = {
        "auto": _run(PolicyConfig(hysteresis=1, profile_steps=STEPS, margin=0.0)),
        "bf16": _run(PolicyConfig(hysteresis=2, profile_steps=STEPS, bf16_bound=1e-4)),
    }
    parallel_state.destroy_model_parallel()
    return out


def test_policy_and_telemetry_in_real_ddp():
    results = run_on_ranks(_worker, 2, cpu_harness=True, timeout=400)
    for name, res in results[0].items():
        other = results[1][name]
        records = [json.loads(r) for r in res["records"]]
        mine = [{k: v for k, v in r.items() if k != "bytes"} for r in records]  # bytes: what each rank sent
        assert mine == [{k: v for k, v in json.loads(r).items() if k != "bytes"} for r in other["records"]], name
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        for r, check in zip(records, res["checks"]):
            assert set(r["layers"]) == set(check)
            for layer, (rel, cos) in check.items():
                got = r["layers"][layer]
                assert math.isclose(got["rel_l2"], rel, rel_tol=1e-4, abs_tol=1e-7), (name, r["step"], layer, got["rel_l2"], rel)
                assert math.isclose(got["cos"], cos, rel_tol=1e-6), (name, layer)
                # tests/bounds.py: E4M3 0.054, BF16 0.0034, GIFT 0.1
                bound = {"euclidean": reduced_rel_l2_bound(3), "bf16": reduced_rel_l2_bound(7)}.get(got["mode"], GIFT_REL_L2)
                assert rel < bound, (name, r["step"], layer, got["mode"], rel)
                assert got["profile"]["ranks"] == 2 and got["bytes"] > 0
        decisions = [d for r in records for d in r["decisions"]]
        assert res["fresh_modes"] == res["modes"] and all(res["layouts_equal"])
        if name == "auto":  # margin 0, one profile: whichever FP8 mode measured better
            assert set(res["modes"].values()) <= {"euclidean", "gift"}
            assert all(d["to"] in ("euclidean", "gift") for d in decisions)
        else:  # an unreachable FP8 bound: every candidate falls back to BF16 after two profiles
            assert {d["step"] for d in decisions} == {2} and {d["to"] for d in decisions} == {"bf16"}
            assert set(res["modes"].values()) == {"bf16"} and len(decisions) == len(res["modes"])
            assert all(v["mode"] == "bf16" for r in records[1:] for v in r["layers"].values())
            assert all("all_to_all/fp8+scales" in r["bytes"] for r in records)  # BF16 values travel in the same messages
