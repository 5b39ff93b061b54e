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


def fp8_roundtrip_groups(x: torch.Tensor, lengths, dtype: torch.dtype = torch.float8_e4m3fn,
                         power_of_two: bool = False) -> torch.Tensor:  # fmt: skip
    """:func:`fp8_roundtrip` of the flat ``x`` with one scale per run of ``lengths`` (a list of
    ints summing to ``x.numel()``): each run rounded on its own, as a one-row tensor-scaled matrix."""
    out, pos = [], 0
    for n in lengths:
        out.append(fp8_roundtrip(x[pos : pos + n].reshape(1, -1), dtype, None, power_of_two).reshape(-1))
        pos += n
    assert pos == x.numel(), (pos, x.numel())
    return torch.cat(out) if out else x.float().new_zeros(0)


def ordered_sum(values) -> torch.Tensor:
    """FP32 sum in the given (rank) order: ``acc = x_0``, then ``acc += x_i``, written out here so that
    a test's reference stays independent of ``kernels.ordered_sum``, the runtime's."""
    acc = values[0].float().clone()
    for t in values[1:]:
        acc += t.float()
    return acc


def scaling_groups(rows: int, cols: int, start: int, shard_size: int, scaling: str, block: int = 128) -> list[int]:
    """Lengths (row-major order) of the scaling groups of a ``[rows, cols]`` parameter at bucket offset
    ``start`` in a bucket cut into shards of ``shard_size``: per tensor, row, or ``block`` columns
    (``mx``: 32) of a row, each further cut where a shard boundary falls inside it."""
    pos = torch.arange(rows * cols)
    width = {"tensor": rows * cols, "row": cols}.get(scaling, 32 if scaling == "mx" else block)
    group = pos // cols * cols + (pos % cols) // width if scaling != "tensor" else torch.zeros_like(pos)
    shard = (start + pos) // shard_size
    key = group * (10**9) + shard  # a new group wherever the parameter's group or the shard changes
    change = torch.ones(rows * cols, dtype=torch.bool)
    change[1:] = key[1:] != key[:-1]
    firsts = torch.nonzero(change).flatten().tolist() + [rows * cols]
    return [b - a for a, b in zip(firsts[:-1], firsts[1:])]
