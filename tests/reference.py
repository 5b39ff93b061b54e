"""Independent references for tests: an FP8 round trip written from the OCP definition with
torch's own FP8 cast (not ``megatron_gift.numerics.fp8``), for finite inputs."""

import torch


def fp8_roundtrip(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, width: int | None = 128) -> torch.Tensor:
    """``round(x / s) · s`` per group of ``width`` consecutive elements of each row of ``x [rows, cols]``
    (``None``: the whole tensor is one group), ``s = max|group| / fp8_max`` in FP32 (1 for a zero group)."""
    fmax = torch.finfo(dtype).max
    x = x.float()
    groups = [x.reshape(1, -1)] if width is None else list(x.split(width, dim=1))
    out = []
    for grp in groups:
        amax = grp.abs().amax(dim=1, keepdim=True)
        s = torch.where(amax > 0, (amax / fmax).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
        out.append((grp / s).clamp(-fmax, fmax).to(dtype).float() * s)
    return out[0].view_as(x) if width is None else torch.cat(out, dim=1)
