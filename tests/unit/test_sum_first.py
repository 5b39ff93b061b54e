"""``comm.sum_first``'s gather of the held sums (one index per granule of up to 16 elements), and of what
remains of its runs once the whole GIFT rows (read in place) are taken out."""

import pytest
import torch

from megatron_gift.comm.sum_first import _gather, _without


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


def test_placed_gather_writes_each_run_at_its_position():
    """The gather with positions (the coded values but for the whole GIFT rows): each run's elements land at
    its position of the FP32 sequence, in the bucket's dtype converted, and nothing else is written (the
    caller fills the rest). Bugs caught: positions taken as the sums' starts, granules placed out of order,
    a BF16 bucket's values not converted."""
    sums = torch.randn(384).to(torch.bfloat16)
    runs = [(16, 32, 96), (200, 8, 0), (352, 24, 40)]  # (start, length, position), positions out of order
    g = _gather(runs, 384, "cpu", size=128)
    assert g.granule == 8
    got = g(sums)
    assert got.dtype == torch.float32 and got.numel() == 128
    for a, n, b in runs:
        assert torch.equal(got[b : b + n], sums[a : a + n].float())


@pytest.mark.parametrize(
    "runs, cut, want",
    [
        ([(0, 100, 0)], [(20, 30)], [(0, 20, 0), (50, 50, 50)]),  # a cut inside a run
        ([(0, 40, 0), (100, 40, 40)], [(100, 40), (0, 10)], [(10, 30, 10)]),  # cuts given out of order, a whole run
        ([(8, 16, 64)], [(8, 4), (12, 4)], [(16, 8, 72)]),  # adjacent cuts at the run's start
        ([(0, 16, 0)], [], [(0, 16, 0)]),  # nothing cut
    ],
)
def test_without_removes_exactly_the_cut_intervals(runs, cut, want):
    """Bug caught: a remaining piece's position not shifted with its start (values of the rows before it
    written over a whole row's), a piece after the last cut dropped, or a whole run left in."""
    assert _without(runs, cut) == want
