"""The output side's steady step under the launch meter (``bench launches``' cases, moved from
tests/dist/test_output_side.py): no host synchronisation, and launches independent of the sizes."""

import pytest

from megatron_gift.comm.schedule import reduce_now


# -- a steady step: no host synchronisation, launches independent of the sizes ---------------------
@pytest.mark.parametrize("path", ["flat-rs", "flat-ar", "two-level/bf16-rs", "two-level/fp8-ar"])
def test_steady_step_never_synchronises_the_host(path):
    """A steady two-sided reduction (rank 0 of a simulated group of 4, real CPU tensors, the PyTorch
    path) dispatches none of the ops that would stop the host on a GPU (``SyncSanitizer``). Bug
    caught: a ``.item()``/``.tolist()`` or a data-dependent shape in the output side's maps."""
    from megatron_gift.testing.dispatch import SyncSanitizer
    from megatron_gift.testing.simulate import recorded_collectives
    from megatron_gift_tools.bench import launches

    case = launches.Case(path, "gift+out", 4 * launches.COLS * 8 + 96, 4, "pytorch", device="cpu")
    with recorded_collectives() as calls:
        reduce_now(case.reduction(), "cpu")  # first: the layout's plans are built
        with SyncSanitizer() as sync:
            reduce_now(case.reduction(), "cpu")
    assert not sync.events, sync.counts()
    assert ("all_reduce" in [c[0] for c in calls]) == path.endswith("-rs")


@pytest.mark.parametrize("path", ["flat-rs", "flat-ar", "two-level/bf16-rs", "two-level/fp8-ar"])
def test_launches_per_stage_do_not_grow(path):
    """On the fused path (kernels stubbed on meta tensors, ``bench launches``' ``gift+out`` bucket:
    four two-sided parameters) every stage issues the same launches at 1M and 10M elements and at 8
    and 64 ranks (up to 2: the segment parts a shard holds move with the sizes), the output side adds
    at most 4 launches per segment to the send and a few to the last inner stage, and its own stage
    is one fused launch per segment at most (``kernels.output_inverse``: its head piece, whole rows
    and tail piece together). A loop over rows, chunks or peers in the output side fails, and so does
    an output stage that leaves the fused path or splits a segment's pieces into launches."""
    from megatron_gift_tools.bench import launches

    def counts(bucket, n, dp):
        stages, _ = launches.counted(launches.Case(path, bucket, n, dp, "fused"))
        return {s.name: s.gpu_launches for s in stages}

    cases = [(n, dp) for n in (1 << 20, 10 << 20) for dp in (8, 64)]
    two_sided = {c: counts("gift+out", *c) for c in cases}
    for stage in two_sided[cases[0]]:
        per_case = [two_sided[c][stage] for c in cases]
        assert max(per_case) - min(per_case) <= 2, (stage, two_sided)
    segments = len(launches.BUCKETS["gift+out"])
    for c in cases:
        base = counts("gift", *c)
        got = two_sided[c]
        first, *middle, last = list(base)
        assert got[first] - base[first] <= 4 * segments, (c, got, base)
        assert all(got[s] == base[s] for s in middle), (c, got, base)
        assert got[last] - base[last] <= 4 + 3 * segments, (c, got, base)
        assert got["output"] <= segments, (c, got)
