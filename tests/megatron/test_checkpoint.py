"""GIFT state in Megatron's distributed checkpoints, through the real launcher (2 gloo ranks; the
runs are tests/launches.py's, shared with test_launcher and test_faults).

An uninterrupted run saves every 2 iterations up to 6; a run resumed from an iteration-2
checkpoint (test_faults: written by a run killed in iteration 3) saves at 4 and 6: both runs'
iteration-6 checkpoints (parameters, optimizer state, GIFT statistics, transforms and every rank's
error-feedback residual) must be bit-identical. The GIFT runs gather parameters as coded changes
(``--gift-param-gather delta``, overlapped with the forward), so their weights are the
reconstructed ones, which a resume must continue from. The iteration-4 checkpoint is loaded with
one rank (another data-parallel size), and a checkpoint written with ``--gift-mode off`` is
loaded by a GIFT run: both train and say in the log what they did. A 4-rank run's iteration-4
checkpoint is loaded with 2 ranks (the delta gather's replicas checked at every logged iteration).
With ``--gift-side both`` a run resumed from iteration 4 is bit-identical to the uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_gift.testing.launch import run_launcher
from tests.launches import GIFT, ITERS, _args, checkpoint_at, losses

pytestmark = [pytest.mark.slow, pytest.mark.cpu_harness]


def _contents(ckpt: Path, tmp: Path) -> dict:
    """Every entry of a torch_dist checkpoint directory, ShardedObjects unpickled."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    entries = torch.load(out, weights_only=False)
    # torch_dist stores each ShardedObject as a one-element list
    return {k: v[0] if k.startswith("gift.") else v for k, v in entries.items()}


def _bitwise_equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def test_resumed_run_is_bitwise_identical_to_the_uninterrupted_one(launcher_runs):
    tmp, logs = launcher_runs["tmp"], launcher_runs["logs"]
    assert "megatron-gift: GIFT state restored (step 1)" in logs["resumed"]
    whole = _contents(tmp / "whole" / "iter_0000006", tmp)
    resumed = _contents(tmp / "killed" / "iter_0000006", tmp)
    gift = sorted(k for k in whole if k.startswith("gift."))
    # dense state (replicated over the 2 data-parallel ranks: one copy), both ranks' local
    # statistics (per-step EMAs, summed only at refreshes) and both ranks' residuals
    assert [k.split("/")[0] for k in gift] == [
        "gift.chunk0.dense",
        *["gift.chunk0.local"] * 2,
        *["gift.chunk0.residuals"] * 2,
    ]
    state = whole[gift[0]]
    assert state["step"] == ITERS - 1 and len(state["params"]) == 8
    assert "decoder.layers.0.mlp.linear_fc2.weight" in state["params"]  # names without wrapper prefixes
    assert all(
        p["mode"] == "gift"
        and p["sides"].keys() == {"input"}
        and {"whitening", "damping", "rotate"} == p["sides"]["input"].keys()  # rotate: --gift-rotation auto's
        for p in state["params"].values()
    )
    local = [{n: e["input"] for n, e in whole[k].items()} for k in gift[1:3]]
    # each rank's statistics, and the held-out T (the cold-start rule) and the factors of the layers it
    # builds (only it holds them): every layer on one rank
    held = [{n for n, e in s.items() if "held_out" in e} for s in local]
    factors = [{n for n, e in s.items() if "factor" in e} for s in local]
    assert sorted(n for h in held for n in h) == sorted(state["params"]) and all(held)
    assert factors == held and all("d" in e["factor"] for s in local for e in s.values() if "factor" in e)
    assert all(len(s) == 8 and all(e["stats"]["folds"] == ITERS for e in s.values()) for s in local)
    assert not _bitwise_equal(local[0], local[1])  # each rank keeps its own EMA
    residuals = [whole[k] for k in gift[3:]]
    assert all(len(r) == 8 for r in residuals) and any(bool(t.abs().sum() > 0) for r in residuals for t in r.values())
    assert not _bitwise_equal(residuals[0], residuals[1])  # each rank keeps its own
    assert whole.keys() == resumed.keys()
    # Bit for bit, except: common_state (the run's arguments: --load differs) and the CPU torch
    # generator in rng_state, which differs the same way with Megatron's own DDP (the data
    # loader draws its seed from it after the checkpoint is loaded).
    differ = [
        k for k in whole if not k.startswith(("common_state", "rng_state")) and not _bitwise_equal(whole[k], resumed[k])
    ]
    assert differ == []
    rng = [k for k in whole if k.startswith("rng_state")]
    strip = lambda states: [
        [{k: v for k, v in s.items() if k != "torch_rng_state"} for s in per_rank] for per_rank in states
    ]  # noqa: E731
    assert rng and all(_bitwise_equal(strip(whole[k]), strip(resumed[k])) for k in rng)
    # the logged losses after the resume are the uninterrupted run's, but for iteration 4: Megatron's
    # log averages a run's first two iterations (3 and 4 here, test_launcher)
    whole_loss, resumed_loss = losses(logs["whole"]), losses(logs["resumed"])
    assert sorted(resumed_loss) == [3, 4, 5, 6] and all(resumed_loss[i] == whole_loss[i] for i in (3, 5, 6))


def test_another_data_parallel_size_restores_all_but_the_residuals(launcher_runs):
    log = launcher_runs["logs"]["one_rank"]
    assert "written by 2 ranks (data-parallel 2), this run has 1 (data-parallel 1)" in log
    assert "K-FAC statistics and error-feedback residuals (per rank) start afresh" in log
    assert "GIFT state restored (step 3)" in log
    assert sorted(losses(log)) == [5, 6]


def test_a_checkpoint_without_gift_state_starts_gift_fresh(launcher_runs):
    logs = launcher_runs["logs"]
    assert "megatron-gift: the checkpoint has no GIFT state" in logs["from_off"]
    assert "GIFT state restored" not in logs["from_off"]
    assert sorted(losses(logs["from_off"])) == [5, 6]
    assert "gradient reduction sent" not in logs["off"]


@pytest.fixture(scope="module")
def four_to_two(tmp_path_factory):
    """A 4-rank GIFT run (micro-batch 1, the same global batch) to iteration 6, and 2 ranks resumed
    from its iteration-4 checkpoint: both logs."""
    tmp = tmp_path_factory.mktemp("four-to-two")
    four = run_launcher(4, *_args(tmp, "four", *GIFT, "--micro-batch-size", "1", "--save", str(tmp / "four")))
    two = run_launcher(2, *_args(tmp, "two", *GIFT, "--load", str(checkpoint_at(tmp / "four", 4, tmp / "four-at-4"))))
    return four, two


def test_a_resume_from_4_to_2_ranks_keeps_the_replicas_and_the_weights(four_to_two):
    """Catches a resume at a smaller data-parallel size whose delta gather starts from replicas
    that disagree (no full first gather, or ``prev`` from the old shards): the replica check of
    every logged iteration would warn; and weights that are not the checkpoint's (the first loss
    after the resume is the 4-rank run's on the same samples: 7 printed digits, the FP32 sums of the
    losses in another order differ by ~1e-7 relative)."""
    four, two = four_to_two
    assert "written by 4 ranks (data-parallel 4), this run has 2 (data-parallel 2)" in two
    assert "replicas of a bucket group differ" not in four + two
    assert sorted(losses(two)) == [5, 6]
    assert abs(losses(two)[5] - losses(four)[5]) <= 1e-5 * abs(losses(four)[5])


@pytest.fixture(scope="module")
def two_sided_runs(tmp_path_factory):
    """``--gift-side both`` through the launcher: 6 iterations uninterrupted, and resumed from the
    iteration-4 checkpoint; the tmp directory."""
    tmp = tmp_path_factory.mktemp("two-sided")
    both = [*GIFT, "--gift-side", "both"]
    run_launcher(2, *_args(tmp, "whole", *both, "--save", str(tmp / "whole")))
    start = checkpoint_at(tmp / "whole", 4, tmp / "resumed")
    log = run_launcher(2, *_args(tmp, "resumed", *both, "--save", str(start), "--load", str(start)))
    return tmp, start, log


def test_two_sided_resume_is_bitwise_identical(two_sided_runs):
    """With ``--gift-side both`` the checkpoints carry each layer's ``T_out`` (replicated) and each rank's
    output statistics ``B`` (per rank, beside ``A``), and a run resumed from iteration 4 writes an
    iteration-6 checkpoint bit-identical to the uninterrupted run's. Bugs caught: ``B`` lost or
    replaced by another rank's at a resume (the next refresh builds another ``T_out``), its step's
    accumulators folded twice or never (a checkpoint closes the step), ``T_out`` not restored."""
    tmp, start, log = two_sided_runs
    assert "megatron-gift: GIFT state restored (step 3)" in log
    whole, resumed = _contents(tmp / "whole" / "iter_0000006", tmp), _contents(start / "iter_0000006", tmp)
    dense = whole[next(k for k in whole if k.startswith("gift.chunk0.dense"))]["params"]
    # output sides chosen by then (all 8 when written)
    assert any("whitening" in p["sides"].get("output", {}) for p in dense.values())
    local = [whole[k] for k in sorted(whole) if k.startswith("gift.chunk0.local")]
    out = [{n: s["output"]["stats"] for n, s in rank.items()} for rank in local]
    assert all(len(b) == len(dense) and all(s["folds"] == ITERS for s in b.values()) for b in out)
    assert not _bitwise_equal(out[0], out[1])  # each rank keeps its own B
    differ = [
        k for k in whole if not k.startswith(("common_state", "rng_state")) and not _bitwise_equal(whole[k], resumed[k])
    ]
    assert whole.keys() == resumed.keys() and differ == []
