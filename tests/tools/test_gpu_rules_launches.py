"""Launch targets of the hot path, checked with the launch meter (``bench launches`` on simulated layouts up
to 64 ranks; moved from tests/megatron/test_gpu_rules.py): on the fused path the kernels a bucket's
reduction launches do not grow with the bucket's size or the data-parallel size."""

import pytest

# -- Launch targets of the hot path (the launch meter, on simulated layouts) ------------------------
# Four [rows, 1000] parameters per bucket at every size (``bench.launches.segments``).
_SEGMENTS = 4


def _launches(path, bucket, numel, dp, kernels):
    from megatron_gift_tools.bench import launches

    stages, _ = launches.counted(launches.Case(path, bucket, numel, dp, kernels))
    return {s.name: (s.gpu_launches if kernels == "fused" else s.aten_ops) for s in stages}


def _fused_counts(path, bucket, dps=(8, 64)):
    return {(n, dp): _launches(path, bucket, n, dp, "fused") for n in (1 << 20, 10 << 20) for dp in dps}


@pytest.mark.parametrize(
    "path",
    [
        "flat-rs",
        "flat-ar",
        "two-level/bf16-rs",
        "two-level/fp8-ar",
        "flat-nvfp4-rs",
        "two-level/bf16-nvfp4-rs",
        "two-level/reduce-scatter-nvfp4-rs",
    ],
)
def test_fused_launches_per_stage_do_not_grow(path):
    """On the fused path (the one CUDA takes; kernels stubbed on meta tensors) every stage of a
    bucket issues the same launches at 1M and 10M elements and at 8 and 64 ranks, up to one per
    plain class that the rank's shards hold or not (where shard boundaries fall moves with the
    sizes): a loop over element chunks, or over peers, makes the host launch-bound. FP4 paths
    (``gift`` buckets with the Hadamard rotation, ``euclidean`` ones without): the rotation of the held shards
    one call per shard part grew with the nodes; summing first, the node's reduce-scatter one call per
    node row, or the held rows whitened one call per held shard."""
    for bucket in ("gift", "euclidean") if "fp4" in path else ("gift", "plain"):
        # summing first, a rank whitens the rows its held shards have: at 8 ranks rank 0's miss two of the
        # four parameters (fewer launches); from 64 on they touch every parameter
        counts = _fused_counts(path, bucket, (64, 512) if "reduce-scatter" in path else (8, 64))
        for stage in next(iter(counts.values())):
            per_case = [c[stage] for c in counts.values()]
            assert max(per_case) - min(per_case) <= 2, (bucket, stage, counts)


# The stages above 4 + 3 x segments (GIFT bucket, 4 segments: 16), all in the all-reduce: its gather
# (the own message's re-encode; 27-35), the two-level inter-node gather (29) and GIFT's decode of
# every shard (20).
_OVER = "the all-reduce's re-encode and gathered decode launch more than 4 + 3 per segment"


@pytest.mark.parametrize(
    "path",
    [
        "flat-rs",
        "two-level/bf16-rs",
        pytest.param("flat-ar", marks=pytest.mark.xfail(strict=True, reason=_OVER)),
        pytest.param("two-level/fp8-ar", marks=pytest.mark.xfail(strict=True, reason=_OVER)),
    ],
)
def test_fused_launches_per_stage_stay_few(path):
    """At most 4 + 3 launches per parameter segment per stage on the fused path."""
    for bucket in ("gift", "plain"):
        counts = _fused_counts(path, bucket)
        assert all(k <= 4 + 3 * _SEGMENTS for c in counts.values() for k in c.values()), (bucket, counts)


@pytest.mark.parametrize("path", ["flat-rs", "two-level/fp8-rs"])
def test_pytorch_ops_per_stage_do_not_grow_with_the_data_parallel_size(path):
    """On the PyTorch reference path a stage whose work is the whole bucket (the sender's, the node
    sums) dispatches the same ATen ops at 8 and 64 ranks, at two bucket sizes, and one whose work is
    the own shard no more at 64 ranks than at 8 (the shard holds fewer segment parts): a receive
    budget divided by the senders cut the own shard finer as DP grew."""
    for n in (1 << 20, 2 << 20):
        counts = {dp: _launches(path, "gift", n, dp, "pytorch") for dp in (8, 64)}
        for stage, ops in counts[8].items():
            if stage in ("send", "intra", "node_sums"):
                assert counts[64][stage] == ops, (n, stage, counts)
            else:
                assert counts[64][stage] <= ops, (n, stage, counts)
