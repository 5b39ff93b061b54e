"""``bench.fp8_sim.roundtrip``: the FP8 round trip in FP32 arithmetic equals the codec's
(``numerics.fp8.roundtrip``, through torch's float8 casts) bit for bit."""

import pytest
import torch

from megatron_gift.numerics.fp8 import CodecConfig, FP8Format, Scaling, roundtrip
from megatron_gift_tools.bench import fp8_sim

CONFIGS = [CodecConfig(f, s) for f in FP8Format for s in (Scaling.BLOCK, Scaling.ROW)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN payloads aside (any NaN matches any NaN)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num(0.0).view(torch.int32), b.nan_to_num(0.0).view(torch.int32)
    )


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_grid_point_midpoint_and_neighbour_rounds_as_the_codec(cfg):
    """Scale 1 (each row holds ``max``), so the values are rounded as given: every code's value, every
    midpoint between neighbours (ties: to the even code) and the FP32 numbers either side of it, the
    smallest subnormal's half, zeros of both signs, above ``max``, NaN and ±Inf. Catches ties rounded
    away from zero, a subnormal grid off by a binade, a wrong normal/subnormal threshold, a lost sign
    of zero and non-finite values decoded as numbers."""
    grid = torch.arange(256, dtype=torch.uint8).view(cfg.fmt.dtype).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mid = (grid[:-1] + grid[1:]) / 2
    values = torch.cat(
        [
            grid,
            mid,
            mid.nextafter(torch.tensor(0.0)),
            mid.nextafter(torch.tensor(1e9)),
            torch.tensor([cfg.fmt.min_subnormal / 2, cfg.fmt.max * 1.0000001, 0.0]),
        ]
    )
    values = torch.cat([torch.tensor([float("nan"), float("inf"), -float("inf")]), values, -values])
    width = 127 if cfg.scaling is Scaling.BLOCK else 300
    rows = torch.cat([values, values.new_zeros(-values.numel() % width)]).view(-1, width)
    x = torch.cat([torch.full((rows.shape[0], 1), cfg.fmt.max), rows], 1)
    assert _same(fp8_sim.roundtrip(x, cfg), roundtrip(x, cfg))


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
@pytest.mark.parametrize("cols", [1, 100, 128, 576, 1000])
def test_random_gradients_round_trip_as_the_codec(cfg, cols):
    """Matrices over 40 binades with zeros, an outlier row and non-finite values, blocks cut at the row
    end (576 = 4.5 blocks), and a stack of them (a matrix each, as the codec on each): catches a scale of
    the wrong group, the cut last block scaled as a whole one, groups running across rows or stacked
    matrices, and a group's scale taken from a non-finite value (the codec's skips them)."""
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(3, 7, cols, generator=gen) * torch.exp2(torch.randint(-30, 10, (3, 7, cols), generator=gen).float())
    x[x.abs() < 1e-6] = 0.0  # exact zeros among the data (not a tolerance: both sides are compared bit for bit)
    x[1, 2] *= 1e6
    x[2, 3, 0], x[0, 4, -1], x[2, 6, cols // 2] = float("nan"), float("inf"), -float("inf")
    expected = torch.stack([roundtrip(m, cfg) for m in x])
    assert _same(fp8_sim.roundtrip(x, cfg), expected)
    assert _same(fp8_sim.roundtrip(x[0], cfg), expected[0])
