"""``bench param-gather``'s codecs and command line (moved from tests/megatron/test_param_gather.py)."""

import torch


def test_bench_codecs_keep_their_bounds_on_a_training_like_change():
    """Catches a benchmark that measures a codec against a wrong bound ``h`` (each codec's error
    must be within twice its ``h`` after the rounding to BF16) or counts other bytes than payload
    plus scales."""
    from megatron_gift_tools.bench import param_gather
    from megatron_gift_tools.cli import build_parser

    gen = torch.Generator().manual_seed(3)
    prev = (0.02 * torch.randn(128 * 40, generator=gen)).bfloat16()
    new = (prev.float() - 1e-3 * torch.randn(prev.numel(), generator=gen).clamp(-3, 3)).bfloat16()
    for codec in param_gather.CODECS:
        got, h, nbytes = param_gather._roundtrip(codec, new, prev)
        stats = param_gather._stats(got, new, h, prev)
        assert stats["max_over_h"] <= 2 and 0.5 < stats["identical"] / prev.numel() < 1, (codec, stats)
        assert nbytes == prev.numel() * (1 + 1 / 32), codec  # 1 B a code; 1 B per 32 or 4 B per 128 scales
    args = build_parser().parse_args(["bench", "param-gather", "--steps", "3", "--ranks", "4", "--json", "x.json"])
    assert (args.steps, args.ranks, args.json, args.func.__name__) == (3, 4, "x.json", "_bench_param_gather")
