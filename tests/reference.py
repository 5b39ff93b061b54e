"""Independent references for tests: FP8 group scales and round trips written from the OCP definition
with torch's own FP8 cast (not ``megatron_gift.numerics.fp8``), for finite inputs."""

import math

import torch


def fp8_scales(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, width: int | None = 128,
               power_of_two: bool = False) -> torch.Tensor:  # fmt: skip
    """Per-element dequantization scale of ``x [rows, cols]``: ``s = max|group| / fp8_max`` in FP32
    over each group of ``width`` consecutive elements of a row (``None``: the whole tensor; the row
    width: one group per row), clamped to FP32's smallest normal, 1 for a group of zeros;
    ``power_of_two`` (MX): ``2^ceil(log2 s)`` by ``math.frexp`` (the maximum never exceeds ``fp8_max``)."""
    fmax = torch.finfo(dtype).max
    x = x.float()
    groups = [x.reshape(1, -1)] if width is None else list(x.split(width, dim=1))
    out = []
    for grp in groups:
        amax = grp.abs().amax(dim=1, keepdim=True)
        s = torch.where(amax > 0, (amax / fmax).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
        if power_of_two:  # the FP32 s rounded up to a power of two: 2^ceil(log2 s) from frexp
            exps = [math.frexp(v)[1] - (math.frexp(v)[0] == 0.5) for v in s.double().flatten().tolist()]
            s = torch.tensor([2.0**e for e in exps], dtype=torch.float32).view_as(amax)
        out.append(s.expand_as(grp))
    return out[0].reshape(x.shape) if width is None else torch.cat(out, dim=1)


def fp8_roundtrip(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, width: int | None = 128,
                  power_of_two: bool = False) -> torch.Tensor:  # fmt: skip
    """``round(x / s) · s`` with :func:`fp8_scales`' ``s`` (saturating at ``fp8_max``)."""
    fmax = torch.finfo(dtype).max
    s = fp8_scales(x, dtype, width, power_of_two)
    return (x.float() / s).clamp(-fmax, fmax).to(dtype).float() * s
