"""Layouts with empty parts reduce correctly on 2, 4 and 8 gloo ranks (one spawn each).

The bug caught: with the distributed optimizer and tiny buckets, a rank whose shard holds no coded
value raised inside a reduction stage (an empty message's rows could not be viewed) while its
peers waited in their next collective, a hang. Each case (``tests/layout_cases.py``) is the
three-layer MLP of 16-32-32-8 with biases, or odd shapes (weights [7, 13], [13, 7], [5, 13],
biases 7, 13, 5), one parameter per bucket (at 8 ranks more ranks than most buckets have scaling
blocks), in every mode, with the reduce-scatter and the all-reduce, the eager schedule (and the
lagged one at 2 ranks), flat and (4 and 8 ranks) two-level; plus a mixed bucket (coded weights, ``off`` biases)
and one of BF16 (plain) segments only. Every parameter part a rank holds is within its bound of
the FP64 reduction by hand; with the all-reduce every rank holds the same bits.
"""

import itertools

import pytest

from megatron_gift.testing import run_on_ranks
from tests.layout_cases import Case, check_case, reduce_case

pytestmark = pytest.mark.cpu_harness

MODELS = {"mlp": ((16, 32, 32, 8), (True, True, True)), "odd": ((13, 7, 13, 5), (True, True, True))}


def cases(world: int) -> list[Case]:
    exchanges = [None] + ([2] if world >= 4 else [])
    # the lagged schedule at 2 ranks only (the suite's time): the bug is in the layouts, which the
    # schedule does not change; eager = lagged is tests/megatron/test_schedules.py's
    schedules = ("eager", "lagged") if world == 2 else ("eager",)
    out = [
        Case(widths, biases, 1, mode, rs, schedule, rpn)
        for (widths, biases), mode, rs, schedule, rpn in itertools.product(
            MODELS.values(), ("euclidean", "gift", "bf16"), (True, False), schedules, exchanges
        )
    ]
    for rs in (True, False):  # one bucket: coded weights next to off biases; several: BF16 ones only
        out.append(Case(*MODELS["odd"], 10**6, "gift", rs, layers="weight"))
        out.append(Case(*MODELS["odd"], 40, "bf16", rs))
    return out


def _worker(rank, world):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    out = [reduce_case(case, rank) for case in cases(world)]
    ps.destroy_model_parallel()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4, 8])
def test_empty_parts_reduce_within_bound(world):
    results = run_on_ranks(_worker, world, cpu_harness=True, timeout=900)
    for k, case in enumerate(cases(world)):
        check_case(case, [res[k] for res in results])


def test_uneven_reduce_scatter_shards_refused_when_planned():
    """A bucket the distributed optimizer could not shard evenly is refused where it is planned (on
    every rank alike), not in a stage where the plugin's shards would differ from Megatron's; the
    all-reduce takes it (its last shard is short)."""
    import torch

    from megatron_gift.comm.layout import BucketLayout, Segment
    from megatron_gift.config import Mode
    from megatron_gift.numerics import CodecConfig

    layout = BucketLayout(130, 4, [Segment(0, 10, 13, Mode.EUCLIDEAN, "w")], CodecConfig(), torch.float32)
    layout.check(reduce_scatter=False)
    with pytest.raises(ValueError, match="does not split into 4 equal shards"):
        layout.check(reduce_scatter=True)
    BucketLayout(132, 4, [Segment(0, 10, 13, Mode.EUCLIDEAN, "w")], CodecConfig(), torch.float32).check(True)
