"""``numerics.fp8.roundtrip`` bit for bit, in FP32 arithmetic, for the CPU benchmarks that round-trip
thousands of gradients: torch's float<->float8 casts are the codec's slowest passes on the CPU (the
round trip here takes about half the codec's time at 1x128 blocks).

Per scaling group, ``s`` is the codec's scale (``scales_from_amax`` of the finite values' maximum)
and ``y = x / s`` the codec's quotient, so ``|y| <= max`` up to the division's rounding, which
rounds back to ``max``: the codec's clamp never acts. The code's value is ``y`` rounded to nearest
even on the format's grid, whose spacing at ``|y|`` is ``2^(e-m)`` (``m = mantissa_bits``, ``e`` the
binade of ``|y|``, at least the smallest normal's ``1 - bias``). With ``M = 2^(e+23-m)``, ``|y| + M``
lies in ``M``'s binade, whose FP32 spacing is that one, so the FP32 add rounds ``|y|`` onto the grid
(ties to the even multiple, as the cast) and subtracting ``M`` is exact; the sign is copied back.
Decoding multiplies that value by ``s`` as ``decode`` does, so every element equals ``roundtrip``'s.
Non-finite inputs decode as the codec's (NaN; ±Inf where the format has Inf).
"""

from __future__ import annotations

import torch

from megatron_gift.numerics.fp8 import CodecConfig, Scaling, _grouped, scale_values, scales_from_amax


def _grid(a: torch.Tensor, sign: torch.Tensor, finite: bool, cfg: CodecConfig) -> torch.Tensor:
    """The value of the code of ``y = copysign(a, sign)`` (FP32, module doc) for ``a = |y|`` (overwritten;
    ``a <= max`` up to FP32 rounding where finite); ``finite``: no Inf among them."""
    fmt = cfg.fmt
    # M = 2^(e+23-m): a's exponent bits, at least the smallest normal's (biased 127 + 1 - bias), plus 23 - m
    m = (a.view(torch.int32) & 0x7F800000).clamp_(min=(128 - fmt.exponent_bias) << 23)
    m = m.add_((23 - fmt.mantissa_bits) << 23).view(torch.float32)
    r = a.add_(m).sub_(m).copysign_(sign)  # NaN stays NaN, Inf stays Inf
    return r if finite or fmt.has_inf else r.masked_fill_(torch.isinf(r), float("nan"))


def roundtrip(x: torch.Tensor, cfg: CodecConfig) -> torch.Tensor:
    """``numerics.fp8.roundtrip(x, cfg)`` (FP32, ``x``'s shape) for ``x [..., cols]`` with row or block
    scales: the groups lie within a row, so any leading dims (e.g. ranks stacked) give each matrix's bits."""
    if cfg.scaling not in (Scaling.ROW, Scaling.BLOCK):
        raise ValueError(f"fp8_sim.roundtrip: row or block scales only, got {cfg.scaling}")
    m = x.float().reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(m)
    for (v, _, _), (o, _, _) in zip(_grouped(m, cfg), _grouped(out, cfg)):  # v, o: [rows, groups, group length]
        a = v.abs()
        amax = a.amax(-1)  # NaN where a group holds one
        finite = bool(torch.isfinite(amax).all())
        if not finite:  # the codec's maximum skips non-finite values
            amax = a.nan_to_num(nan=0.0, posinf=0.0).amax(-1)
        s = scale_values(scales_from_amax(amax, cfg), cfg)[..., None]
        torch.mul(_grid(a.div_(s), v, finite, cfg), s, out=o)  # |v| / s = |v / s|
    return out.view(x.shape)
