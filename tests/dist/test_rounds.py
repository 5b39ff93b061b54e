"""A bucket reduced in sub-buckets (``comm.rounds``) through an arena smaller than its whole
reduction needs: the bucket's own reduction's results, every round within the bound."""

import pytest
import torch
import torch.distributed as dist

from megatron_gift.comm.rounds import split
from megatron_gift.comm.schedule import ALIGN, Arena, ReductionQueue, StageStreams, reduce_now
from megatron_gift.comm.topology import build_groups
from megatron_gift.config import Mode, Schedule
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.dispatch import Lifetimes
from tests.dist.test_arena import PER_NODE, WORLD, _cases, _make
from tests.dist.test_comm import _bucket_grads, _transforms

ROUNDS = 3


def _worker(rank, world):
    (placed,) = build_groups([dist.group.WORLD], PER_NODE)
    out = {}
    for name, kind, layout, numel, segs in _cases():
        if kind == "fp4sum":  # the sum-first exchange reduce-scatters equal shards: never split
            continue
        ts = _transforms(segs)
        rounds = split(layout, ROUNDS)
        if rounds is None:  # a shard inside one row (flat/long_row): the bucket stays whole
            continue
        grads = [_bucket_grads(numel, segs, r) for r in range(world)]
        plain, euclidean = torch.zeros(numel, dtype=torch.bool), torch.zeros(numel, dtype=torch.bool)
        for s in segs:
            plain[s.start : s.end] = s.mode in (Mode.OFF, Mode.BF16)
            euclidean[s.start : s.end] = s.mode is Mode.EUCLIDEAN
        for all_reduce in (False, True):
            whole = grads[rank].clone()
            reduction = _make(kind, whole, layout, placed, ts, all_reduce)
            need = reduction.footprint()
            reduce_now(reduction, "cpu")  # the bucket in one reduction, buffers of its own
            for schedule in (Schedule.EAGER, Schedule.LAGGED):
                flat = grads[rank].clone()
                parts = [_make(kind, flat, r.layout, placed, r.per_segment(ts), all_reduce) for r in rounds]
                needs = [p.footprint() for p in parts]
                arena = Arena(max(needs) + ALIGN, "cpu")  # about one round: each waits for the one before
                # the lifetime rule watched across rounds (``testing.dispatch.Lifetimes`` raises where broken)
                queue = ReductionQueue(StageStreams("cpu"), schedule, watch=Lifetimes(), arena=arena)
                for flight in [queue.start(p) for p in parts]:
                    queue.wait(flight)
                lo, hi = (0, numel) if all_reduce else layout.bounds[rank]
                exact = torch.stack(grads).double().mean(0)
                out[(name, all_reduce, schedule.value)] = dict(
                    rounds=len(rounds),
                    bounded=arena.over == 0 and arena.nbytes < need,
                    same_plain=torch.equal(flat[lo:hi][plain[lo:hi]], whole[lo:hi][plain[lo:hi]]),
                    same_euclidean=torch.equal(flat[lo:hi][euclidean[lo:hi]], whole[lo:hi][euclidean[lo:hi]]),
                    outside=torch.equal(flat[:lo], grads[rank][:lo]) and torch.equal(flat[hi:], grads[rank][hi:]),
                    rel=((flat.double() - exact)[lo:hi].norm() / exact[lo:hi].norm()).item(),
                    result=flat.clone() if all_reduce else None,
                )
    return out


@pytest.mark.slow
def test_a_bucket_in_rounds_is_its_own_reduction_within_a_bound():
    """Bug caught: rounds whose pieces leave an element of the own shard unreduced or reduce one twice,
    write outside the own shard (reduce-scatter), cut a GIFT row between rounds (its whitening would
    see half a row), or need more than the arena that holds one round. Flat and two-level FP8, flat
    and two-level NVFP4, reduce-scatter and all-reduce, eager and lagged, three rounds in an arena
    smaller than the whole reduction's footprint, the lifetime rule watched: the plain elements, and
    with FP8 the Euclidean ones (the same scaling groups: none crosses a row), bit for bit the whole
    reduction's, every element within the format's bound of the FP32 average, the bucket outside the
    own shard untouched, every rank the same after an all-reduce."""
    results = run_on_ranks(_worker, WORLD, timeout=900)
    assert {k[0] for k in results[0]} == {
        "flat/mixed",
        "two-level/mixed",
        "two-level/gift",
        "fp4-flat",
        "fp4-two-level",
    }
    for key, r0 in results[0].items():
        for rank, res in enumerate(results):
            r = res[key]
            assert r["rounds"] == ROUNDS and r["bounded"], (key, rank)
            assert r["same_plain"] and (key[1] or r["outside"]), (key, rank)
            # FP8's scaling groups never cross a row: a round's are the bucket's. NVFP4's second scale
            # is its part's maximum, of a round's rows alone: other codes, within the same bound
            assert r["same_euclidean"] or key[0].startswith("fp4"), (key, rank)
            # FP8 E4M3: 2^-4 relative per quantization, twice in the two-level path; NVFP4: E2M1's
            # half step of ~1/6 of a block's range, GIFT's T⁻¹ raising it by its condition number
            assert r["rel"] < (0.5 if key[0].startswith("fp4") else 0.16), (key, rank, r["rel"])
            if key[1]:
                assert torch.equal(r["result"], r0["result"]), (key, rank)


def _feedback_worker(rank, world):
    """The flat FP8 exchange with error feedback over two steps (the second compensated by the first's
    residual), the bucket whole and in rounds: each step's bucket and the residual after each."""
    from megatron_gift.comm.quantized import QuantizedReduce
    from megatron_gift.numerics import ErrorFeedback

    out = {}
    for name, kind, layout, numel, segs in _cases():
        if kind != "flat" or (rounds := split(layout, ROUNDS)) is None:
            continue
        ts = _transforms(segs)
        for all_reduce in (False, True):
            runs = {}
            for parts in (None, rounds):
                ef, seen = ErrorFeedback(layout.n_coded), []
                for step in range(2):
                    flat = _bucket_grads(numel, segs, rank + 10 * step)
                    todo = (
                        [QuantizedReduce(flat, layout, dist.group.WORLD, ts, ef, average=True, all_reduce=all_reduce)]
                        if parts is None
                        else [
                            QuantizedReduce(
                                flat,
                                r.layout,
                                dist.group.WORLD,
                                r.per_segment(ts),
                                r.feedback(ef, layout),
                                average=True,
                                all_reduce=all_reduce,
                            )
                            for r in parts
                        ]
                    )
                    for reduction in todo:
                        reduce_now(reduction, "cpu")
                    ef.commit()
                    seen.append((flat, ef.residual.clone()))
                runs[parts is None] = seen
            lo, hi = (0, numel) if all_reduce else layout.bounds[rank]
            euclidean = torch.zeros(numel, dtype=torch.bool)
            for s in segs:
                euclidean[s.start : s.end] = s.mode is Mode.EUCLIDEAN
            coded = torch.zeros(numel, dtype=torch.bool)
            for s in segs:
                coded[s.start : s.end] = s.mode in (Mode.EUCLIDEAN, Mode.GIFT)
            residual_euclidean = euclidean[coded]  # the residual's Euclidean elements (coded order: bucket order)
            out[(name, all_reduce)] = [
                dict(
                    bucket=torch.equal(a[lo:hi][euclidean[lo:hi]], b[lo:hi][euclidean[lo:hi]]),
                    residual=torch.equal(ea[residual_euclidean], eb[residual_euclidean]),
                    residual_norm=(ea.norm().item(), eb.norm().item()),
                )
                for (a, ea), (b, eb) in zip(runs[True], runs[False])
            ]
    return out


@pytest.mark.slow
def test_error_feedback_in_rounds_is_the_whole_buckets():
    """Bug caught: a round reading or writing the bucket's residual at its own coded positions instead of
    where its segments' values lie in the bucket's coded sequence (another parameter's rounding error
    fed back, or none). Flat FP8 with error feedback, two steps, reduce-scatter and all-reduce: the
    Euclidean gradients and their residuals bit for bit the whole bucket's after each step (the same
    codes), and the residual as large overall (GIFT's within a tenth: its rows whitened in other
    products)."""
    results = run_on_ranks(_feedback_worker, WORLD, timeout=600)
    assert {k[0] for k in results[0]} == {"flat/mixed"}
    for rank, res in enumerate(results):
        for key, steps in res.items():
            for step, r in enumerate(steps):
                assert r["bucket"] and r["residual"], (key, rank, step)
                whole, rounds = r["residual_norm"]
                assert whole > 0 and abs(rounds - whole) <= 0.1 * whole, (key, rank, step, r["residual_norm"])


def _kernel_worker(rank, world):
    """Flat and two-level NVFP4 in rounds, every coded parameter sent without a transform, with the fused
    kernels (under Triton's interpreter) and on the PyTorch path: each rank's bucket."""
    (placed,) = build_groups([dist.group.WORLD], PER_NODE)
    out = {}
    for name, kind, layout, numel, segs in _cases():
        if kind not in ("fp4", "fp4two"):
            continue
        ts, rounds = [None] * len(segs), split(layout, ROUNDS)  # unwhitened: FP32 products differ by path
        for all_reduce in (False, True):
            buckets = []
            for kernels in (True, False):
                flat = _bucket_grads(numel, segs, rank)
                for r in rounds:
                    reduce_now(_make(kind, flat, r.layout, placed, r.per_segment(ts), all_reduce, kernels), "cpu")
                buckets.append(flat)
            out[(name, all_reduce)] = buckets
    return out


@pytest.mark.slow
def test_rounds_with_the_kernels_are_their_pytorch_path(monkeypatch):
    """Bug caught: the fused kernels' placement tables or segment ends built for a layout of equal shards
    from the bucket's start (a round's shards are pieces, unequal, with gaps between them): codes
    placed at another element, a shard's values read from another. Flat and two-level NVFP4, three
    rounds, reduce-scatter and all-reduce, no transform (the kernels' FP32 products are not PyTorch's):
    each rank's bucket with the kernels (the ranks under Triton's interpreter) bit for bit the PyTorch
    path's, as for a whole bucket (tests/unit/test_fp4_kernels.py)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the ranks define the kernels under it
    results = run_on_ranks(_kernel_worker, WORLD, timeout=900)
    assert {k[0] for k in results[0]} == {"fp4-flat", "fp4-two-level"}
    for rank, res in enumerate(results):
        for key, (kernels, pytorch) in res.items():
            assert torch.equal(kernels, pytorch), (key, rank)
