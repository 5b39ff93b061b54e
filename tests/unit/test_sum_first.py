"""``comm.sum_first``'s gather of the held sums (one index per granule of up to 16 elements)."""

import pytest
import torch

from megatron_gift.comm.sum_first import _gather


@pytest.mark.parametrize(
    "runs, total, granule",
    [
        ([(0, 64), (128, 32), (320, 16)], 384, 16),  # FP4 blocks: whole granules of 16
        ([(0, 64), (136, 24)], 384, 8),  # a run starting 8 into a granule of 16
        ([(3, 5), (20, 1)], 40, 1),  # odd starts and lengths: one element at a time
        ([(0, 32)], 36, 4),  # a buffer whose size only 4 divides
    ],
)
def test_gather_is_the_elementwise_gather(runs, total, granule):
    """Bug caught: granules larger than a run's start or length allows (values of a neighbouring run, or
    padding, gathered into the sequence), or runs gathered out of order."""
    sums = torch.randn(total)
    want = torch.cat([sums[a : a + n] for a, n in runs])
    g = _gather(runs, total, "cpu")
    assert g.granule == granule and g.index.numel() == want.numel() // granule
    assert torch.equal(g(sums), want)
