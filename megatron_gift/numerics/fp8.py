"""FP8 codec: encode FP32 tensors to a payload of codes plus scales, decode back to FP32.

Pure tensor code (no torch.distributed): the payload and scales are plain integer/float32
tensors, so they travel over any collective, gloo included. The format of the codes (E4M3, E5M2,
or any other entry of ``numerics.wire``'s table) is ``CodecConfig.fmt``; "fp8" below stands for it.

A tensor is viewed as a matrix ``x`` of shape ``[rows, cols]`` (a weight gradient
``[d_out, d_in]``; a 1-D tensor is one row). Scales are chosen per *scaling group*:

===========  =====================================  ======================================
granularity  group                                  scale stored as
===========  =====================================  ======================================
TENSOR       the whole tensor                       1 x float32
ROW          one row                                rows x float32
BLOCK        1 x ``block`` (128) along cols         rows x ceil(cols/block) x float32
MX           1 x 32 along cols                      rows x ceil(cols/32) x uint8 (E8M0)
===========  =====================================  ======================================

Encode: ``q = fp8(x / s)`` with ``s = amax / fp8_max`` (``amax`` over the group's finite
values; ``s = 1`` for an all-zero group). Decode: ``x̂ = float(q) * s``.

Tensor, row and block scales are FP32 (block: 4/128 byte per element): a group's maximum
encodes to ``±fp8_max`` and decodes to ``amax`` within two FP32 roundings (relative 2^-23, no
bias; unless ``amax < fp8_max · 2^-126``, where ``s`` is clamped to FP32's smallest normal). A
BF16 scale (2/128 byte) would have to be rounded up so that the maximum never clips, and the
maximum would then decode up to 2^-7 too large, always upwards (docs/codec.md measures this).
MX scales are powers of two rounded up (OCP MX E8M0, 1/32 byte per element): the maximum never
clips and carries the format's own rounding error, like every other element. Every element
other than a group's maximum carries the format's relative rounding error, at most
``2^-(mantissa_bits+1)``, or half a subnormal step times ``s``. Non-finite inputs are encoded as
the format's NaN (E4M3) or Inf/NaN (E5M2) so they survive decode: a NaN check after the
reduction still fires.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

from .wire import FP8Format, WireFormat

MX_BLOCK = 32
_E8M0_BIAS = 127


@functools.lru_cache(maxsize=256)
def divisor(value: float, device: torch.device | str | None) -> torch.Tensor:
    """``value`` as a cached FP32 0-dim tensor on ``device``, to divide by: on CUDA ``t / python_scalar``
    is ``t * (1/s)``, not the IEEE division the kernels do (issue 35 item 6). Filled on the device (no
    copy, no sync); shared, so never written."""
    if float(torch.tensor(value, dtype=torch.float32)) != value:  # checked on the host: FP32 must hold it
        raise ValueError(f"divisor {value!r} is not exact in FP32")
    return torch.full((), value, dtype=torch.float32, device=device)


class Scaling(enum.Enum):
    """Scaling granularity; see the module docstring for the group each one scales."""

    TENSOR = "tensor"
    ROW = "row"
    BLOCK = "block"
    MX = "mx"


@dataclass(frozen=True)
class CodecConfig:
    """Format and scaling granularity of one FP8 encoding; ``fmt`` may be given as an ``FP8Format``
    or its name."""

    fmt: WireFormat = FP8Format.E4M3.wire
    scaling: Scaling = Scaling.BLOCK
    block: int = 128

    def __post_init__(self):
        if not isinstance(self.fmt, WireFormat):  # a shipped format by name
            object.__setattr__(self, "fmt", FP8Format(self.fmt).wire)
        if not isinstance(self.scaling, Scaling):
            object.__setattr__(self, "scaling", Scaling(self.scaling))
        if self.scaling is Scaling.MX:
            object.__setattr__(self, "block", MX_BLOCK)
        if self.block <= 0:
            raise ValueError(f"block size must be positive, got {self.block}")

    @property
    def name(self) -> str:
        return f"{self.fmt.name}-{self.scaling.value}"

    def groups(self, rows: int, cols: int) -> tuple[int, int]:
        """Shape ``[rows', groups per row]`` of the scale tensor for an ``[rows, cols]`` input."""
        if self.scaling is Scaling.TENSOR:
            return (1, 1)
        if self.scaling is Scaling.ROW:
            return (rows, 1)
        return (rows, -(-cols // self.block))

    def scale_dtype(self) -> torch.dtype:
        """MX scales travel as E8M0 bytes, all others as FP32 (see the module docstring for why)."""
        return torch.uint8 if self.scaling is Scaling.MX else torch.float32

    def scale_bytes(self, rows: int, cols: int) -> int:
        r, g = self.groups(rows, cols)
        return r * g * self.scale_dtype().itemsize

    def encoded_bytes(self, rows: int, cols: int) -> int:
        """Bytes on the wire for one encoded ``[rows, cols]`` tensor: payload plus scales."""
        return self.fmt.payload_bytes(rows * cols) + self.scale_bytes(rows, cols)


@dataclass
class Encoded:
    """An encoded tensor: ``payload`` ``[rows, cols]`` codes (``fmt.code_dtype``); ``scales`` as
    ``CodecConfig.groups``."""

    payload: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.payload.numel() * self.payload.element_size() + self.scales.numel() * self.scales.element_size()


@dataclass
class CodecStats:
    """Counts for encodes: non-zero inputs that decode to zero (``flushed``), inputs beyond the
    format's range that saturated (``clipped``: only possible with an external ``amax``), codes
    at the largest magnitude (``at_max``) and at the smallest subnormal (``at_min_subnormal``),
    the paper's vulnerability signals, and non-finite inputs. An encode adds its counts as 0-d
    tensors on the encoded data's device (so that profiling never waits for the device);
    ``int(stats.at_max)`` reads one on the host."""

    numel: int = 0
    flushed: int = 0
    clipped: int = 0
    at_max: int = 0
    at_min_subnormal: int = 0
    nonfinite: int = 0

    def __iadd__(self, other: CodecStats) -> CodecStats:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))
        return self


def _as_matrix(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2:
        return x
    if x.dim() == 1:
        return x.view(1, -1)
    return x.reshape(x.shape[0], -1)


def group_lengths(rows: int, cols: int, cfg: CodecConfig, device=None) -> torch.Tensor:
    """Lengths of the scaling groups of a row-major ``[rows, cols]`` matrix, in memory order, filled
    on ``device`` (no copy from host memory: on a GPU a pageable one waits for the device)."""
    if cfg.scaling is Scaling.TENSOR:
        return torch.full((1,), rows * cols, device=device)
    if cfg.scaling is Scaling.ROW:
        return torch.full((rows,), cols, device=device)
    lengths = torch.full((rows, -(-cols // cfg.block)), cfg.block, device=device)
    if cols % cfg.block:
        lengths[:, -1].fill_(cols % cfg.block)
    return lengths.view(-1)


def segment_amax(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Max |x| over the finite values of each contiguous segment of the flat ``x``."""
    a = x.float().abs().nan_to_num_(nan=0.0, posinf=0.0)  # in place: no temporary beyond |x|
    return torch.segment_reduce(a, "max", lengths=lengths, unsafe=True)


def scales_from_amax(amax: torch.Tensor, cfg: CodecConfig) -> torch.Tensor:
    """Dequantization scales ``s = amax / fp8_max`` (1 where amax is 0) in the wire format."""
    # Clamped to FP32's smallest normal so that a group of tiny values never divides by zero.
    s = torch.where(
        amax > 0,
        (amax / divisor(cfg.fmt.max, amax.device)).clamp_min(torch.finfo(torch.float32).tiny),
        torch.ones_like(amax),
    )
    if cfg.scaling is Scaling.MX:
        # OCP MX: a power of two, rounded up so that amax / s <= fp8_max (the maximum never clips).
        e = torch.ceil(torch.log2(s)).clamp(-_E8M0_BIAS, _E8M0_BIAS)
        return (e + _E8M0_BIAS).to(torch.uint8)
    return s.float()


def scale_values(scales: torch.Tensor, cfg: CodecConfig) -> torch.Tensor:
    """FP32 dequantization scales from stored scales (decodes E8M0 codes)."""
    if cfg.scaling is Scaling.MX:
        return torch.exp2(scales.float() - _E8M0_BIAS)
    return scales.float()


def repeat_groups(values: torch.Tensor, lengths: torch.Tensor, n: int, dim: int = -1) -> torch.Tensor:
    """``values`` (one per group along ``dim``) repeated over their groups' ``lengths`` (summing to
    ``n``), as ``repeat_interleave`` does, by an int32 index where ``n`` fits: 4 B per element beside
    the result, not int64's 8 (``output_size`` given: no host read of the total on CUDA)."""
    idx = torch.repeat_interleave(lengths.to(torch.int32) if n < 2**31 else lengths, output_size=n)
    return values.index_select(dim, idx)


def encode_flat(
    x: torch.Tensor,
    lengths: torch.Tensor,
    cfg: CodecConfig,
    amax: torch.Tensor | None = None,
    stats: CodecStats | None = None,
) -> Encoded:
    """Encode the flat ``x [n]`` with one scale per contiguous group (``lengths`` sum to n).

    ``amax`` overrides the per-group maxima (e.g. a maximum shared by all ranks); values
    beyond it saturate to ±fp8_max and are counted. When ``stats`` is given, it is
    incremented with this encode's counts (extra passes; leave it None on hot paths).
    """
    x = x.float()
    if amax is None:
        amax = segment_amax(x, lengths)
    scales = scales_from_amax(amax, cfg)
    s = repeat_groups(scale_values(scales, cfg), lengths, x.numel())
    y = torch.div(x, s, out=s)  # into the repeated scales: one temporary of x's size, not two
    q = cfg.fmt.to_codes(y, scratch=stats is None)  # y is this encode's own: the counts read it unclamped
    if stats is not None:
        stats += _count(x, y, q, cfg)
    return Encoded(payload=q, scales=scales)


def _count(x: torch.Tensor, y: torch.Tensor, q: torch.Tensor, cfg: CodecConfig) -> CodecStats:
    """The counts of one encode as 0-d tensors on ``x``'s device (no host synchronisation)."""
    fin = torch.isfinite(y)
    mag = q & cfg.fmt.magnitude_mask
    return CodecStats(
        numel=x.numel(),
        flushed=((x != 0) & fin & (mag == 0)).sum(),
        clipped=(fin & (y.abs() >= cfg.fmt.max + cfg.fmt.ulp_at_max * 0.5)).sum(),
        at_max=(fin & (mag == cfg.fmt.max_code)).sum(),
        at_min_subnormal=(fin & (mag == 1)).sum(),
        nonfinite=(~fin).sum(),
    )


def decode_flat(enc: Encoded, lengths: torch.Tensor, cfg: CodecConfig) -> torch.Tensor:
    """Decode a flat encoding to FP32 ``[n]``."""
    q = enc.payload.reshape(-1)
    return cfg.fmt.scaled(q, repeat_groups(scale_values(enc.scales.reshape(-1), cfg), lengths, q.numel()))


def _grouped(m: torch.Tensor, cfg: CodecConfig):
    """The scaling groups of the matrix ``m [rows, cols]`` (``[1, numel]`` for tensor scaling) as
    ``(view [rows, n, L], first group, n)`` per run of equal-length groups (whole blocks, then the
    cut last block of each row): the groups' values are reduced and scaled along the last dim,
    with no per-element index (``repeat_interleave``) or segment reduction, as ``encode_flat`` needs."""
    rows, cols = m.shape
    L = cols if cfg.scaling in (Scaling.TENSOR, Scaling.ROW) else cfg.block
    n, rem = divmod(cols, L)
    runs = [(0, n, L)] if n else []
    if rem:
        runs.append((n * L, 1, rem))
    return [(m[:, c0 : c0 + k * length].view(rows, k, length), g0, k) for g0, (c0, k, length) in zip((0, n), runs)]


def encode(
    x: torch.Tensor, cfg: CodecConfig, amax: torch.Tensor | None = None, stats: CodecStats | None = None
) -> Encoded:
    """Encode ``x`` viewed as ``[rows, cols]``: payload ``[rows, cols]``, scales ``cfg.groups(rows, cols)``;
    bit for bit ``encode_flat`` with ``group_lengths``, in at most one FP32 temporary of ``x``'s size at a time."""
    xm = _as_matrix(x)
    rows, cols = xm.shape
    if xm.numel() == 0:
        lengths = group_lengths(rows, cols, cfg, device=x.device)
        enc = encode_flat(xm.reshape(-1), lengths, cfg, amax=None if amax is None else amax.reshape(-1), stats=stats)
        return Encoded(payload=enc.payload.view(rows, cols), scales=enc.scales.view(cfg.groups(rows, cols)))
    m = xm.float().contiguous()
    m = m.view(1, -1) if cfg.scaling is Scaling.TENSOR else m
    groups = _grouped(m, cfg)
    if amax is None:  # max |x| over each group's finite values
        amax = torch.cat([v.abs().nan_to_num_(nan=0.0, posinf=0.0).amax(-1) for v, _, _ in groups], 1)
    scales = scales_from_amax(amax.reshape(m.shape[0], -1), cfg)
    s = scale_values(scales, cfg)
    y = torch.empty_like(m)
    for (v, g0, k), (out, _, _) in zip(groups, _grouped(y, cfg)):
        torch.div(v, s[:, g0 : g0 + k, None], out=out)
    q = cfg.fmt.to_codes(y, scratch=stats is None)  # y is this encode's own: the counts read it unclamped
    if stats is not None:
        stats += _count(m, y, q, cfg)
    return Encoded(payload=q.view(rows, cols), scales=scales.view(cfg.groups(rows, cols)))


def decode(enc: Encoded, cfg: CodecConfig, out_shape: torch.Size | tuple | None = None) -> torch.Tensor:
    """Decode to FP32, shape ``[rows, cols]`` or ``out_shape`` (``decode_flat``'s bits, scaled in place)."""
    rows, cols = enc.payload.shape
    x = cfg.fmt.from_codes(enc.payload).contiguous()  # a new FP32 tensor
    m = x.view(1, -1) if cfg.scaling is Scaling.TENSOR else x
    if m.numel():
        s = scale_values(enc.scales, cfg).reshape(m.shape[0], -1)
        for v, g0, k in _grouped(m, cfg):
            v.mul_(s[:, g0 : g0 + k, None])
    return x.view(out_shape if out_shape is not None else (rows, cols))


def roundtrip(x: torch.Tensor, cfg: CodecConfig, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``decode(encode(x))`` in the shape of ``x``."""
    return decode(encode(x, cfg, amax=amax), cfg, out_shape=x.shape)
