"""The matrix FP8 encode/decode (scaling groups as views, the refresh's and profiles' round trips)
against the flat one with explicit group lengths (the reduction path's): the same bits."""

import pytest
import torch

from megatron_gift.numerics import CodecConfig, fp8
from megatron_gift.numerics.fp8 import CodecStats, decode_flat, encode_flat, group_lengths

SHAPES = [(3, 300), (2, 256), (1, 5), (7, 33), (5, 129), (1, 1), (0, 8)]


@pytest.mark.parametrize("codec", ["e4m3-tensor", "e4m3-row", "e4m3-block", "e4m3-mx", "e5m2-block", "e5m2-tensor"])
def test_matrix_codec_matches_the_flat_one_bit_for_bit(codec):
    """Groups reduced and scaled along views (whole blocks, then each row's cut block) instead of a
    per-element index: a mixed-up group order, a cut block scaled with its neighbour's scale or a
    lost NaN/Inf would change codes, scales, decoded values or the counts."""
    cfg = CodecConfig(*codec.split("-"))
    gen = torch.Generator().manual_seed(0)
    for rows, cols in SHAPES:
        x = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, cols)
        if x.numel() > 2:
            x.view(-1)[0], x.view(-1)[-1], x.view(-1)[1] = float("nan"), float("inf"), -float("inf")
        lengths = group_lengths(rows, cols, cfg)
        for xin in (x, x.bfloat16()):
            s_flat, s_mat = CodecStats(), CodecStats()
            want = encode_flat(xin.reshape(-1), lengths, cfg, stats=s_flat)
            got = fp8.encode(xin, cfg, stats=s_mat)
            assert got.payload.shape == (rows, cols) and got.scales.shape == cfg.groups(rows, cols)
            assert torch.equal(got.payload.reshape(-1), want.payload) and torch.equal(
                got.scales.reshape(-1), want.scales.reshape(-1)
            )
            assert all(int(getattr(s_flat, k)) == int(getattr(s_mat, k)) for k in s_flat.__dataclass_fields__)
            dec_flat, dec = decode_flat(want, lengths, cfg), fp8.decode(got, cfg)
            assert torch.equal(dec.reshape(-1).nan_to_num(nan=7.0), dec_flat.nan_to_num(nan=7.0))
        amax = torch.rand(cfg.groups(rows, cols), generator=gen) * 4  # a shared maximum: values beyond it saturate
        assert torch.equal(
            fp8.encode(x, cfg, amax=amax).payload.reshape(-1),
            encode_flat(x.reshape(-1), lengths, cfg, amax=amax.reshape(-1)).payload,
        )
