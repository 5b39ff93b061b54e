"""The wire formats of coded gradient values: one ``WireFormat`` per format, the table everything reads.

The codec (``numerics.fp8``), the bucket layouts and message packing (``comm``), the kernel gate
(``kernels``), the ledger's labels and the planner's byte counts take a format's properties from its
entry here and nowhere else. Adding a format is one entry (and, where no torch dtype holds its
codes, a subclass overriding ``to_codes`` / ``from_codes``); the Triton kernels run only for the
formats whose entry names them in ``kernels``.

A format's element is a whole number of bytes (``bits`` a multiple of 8): the messages address
coded values element by element (``comm.packing``), and a shard or chunk may start at any element,
so a sub-byte format (two 4-bit codes per byte) would need every boundary aligned to its packing.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

_CODE_DTYPES = {1: torch.uint8, 2: torch.int16}  # payload dtype by bytes per element

KERNELS = frozenset({"whiten_encode", "decode_sum_unwhiten"})
"""The fused kernels (``kernels``) a format can name as supporting it."""


@dataclass(frozen=True, repr=False)
class WireFormat:
    """One wire format: ``bits`` per element, an IEEE-like layout (sign, exponent with
    ``exponent_bias``, ``mantissa_bits``), its largest finite value ``max``, the code of its NaN,
    whether it encodes ±Inf (else Inf is sent as the NaN), the torch dtype whose bits its codes are,
    the fused kernels that implement it, and ``label``, its name in the byte ledger."""

    name: str
    bits: int
    exponent_bias: int
    mantissa_bits: int
    max: float
    nan_code: int
    has_inf: bool
    dtype: torch.dtype
    kernels: frozenset = frozenset()
    label: str = "fp8"

    def __post_init__(self):
        if self.bits <= 0 or self.bits % 8 or self.bits // 8 not in _CODE_DTYPES:
            raise ValueError(f"{self.name}: bits must be 8 or 16 (whole bytes, module doc), got {self.bits}")
        if not self.kernels <= KERNELS:
            raise ValueError(f"{self.name}: unknown kernels {sorted(self.kernels - KERNELS)}; known: {sorted(KERNELS)}")

    def __repr__(self) -> str:
        return f"WireFormat({self.name!r}, {self.bits} bits)"

    # -- derived from the entry -------------------------------------------------------------------
    @property
    def code_dtype(self) -> torch.dtype:
        """Dtype of the payload: one code per element (uint8 for 8 bits, int16 for 16)."""
        return _CODE_DTYPES[self.bits // 8]

    def payload_bytes(self, n: int) -> int:
        """Bytes of the codes of ``n`` elements."""
        return n * self.bits // 8

    @property
    def magnitude_mask(self) -> int:
        """The code bits below the sign bit."""
        return (1 << (self.bits - 1)) - 1

    @property
    def min_subnormal(self) -> float:
        """Smallest positive subnormal, ``2^(1 - bias - mantissa_bits)``: 2^-9 for E4M3, 2^-16 for E5M2."""
        return 2.0 ** (1 - self.exponent_bias - self.mantissa_bits)

    @property
    def ulp_at_max(self) -> float:
        """Spacing of the top binade, ``2^(floor(log2 max) - mantissa_bits)``: 32 for E4M3, 8192 for E5M2."""
        return 2.0 ** (math.floor(math.log2(self.max)) - self.mantissa_bits)

    @property
    def max_code(self) -> int:
        """Code of ``+max`` (sign bit clear): 0x7E for E4M3, 0x7B for E5M2."""
        e = math.floor(math.log2(self.max))
        mantissa = round((self.max / 2.0**e - 1) * 2**self.mantissa_bits)
        return ((e + self.exponent_bias) << self.mantissa_bits) | mantissa

    # -- the codec ----------------------------------------------------------------------------------
    def to_codes(self, y: torch.Tensor, scratch: bool = False) -> torch.Tensor:
        """Codes (``code_dtype``) of the FP32 ``y``, finite values clamped to ``±max`` and rounded to
        nearest even by torch's cast; NaN stays NaN, Inf is ±Inf or, without Inf, the NaN. ``scratch``:
        ``y`` is the caller's temporary, clamped in place (no FP32 copy of its size)."""
        inf = torch.isinf(y)
        wide = y.to(self.dtype).view(self.code_dtype) if self.has_inf else None  # read where ±Inf only
        q = (y.clamp_ if scratch else y.clamp)(-self.max, self.max).to(self.dtype).view(self.code_dtype)
        if self.has_inf:  # NaN stays NaN; ±Inf, clamped to ±max above, is ±Inf again
            return torch.where(inf, wide, q)
        # torch saturates ±Inf to ±max when casting to a format without Inf: force its NaN (a
        # scalar fill: no tensor made from Python data, no host-to-device copy).
        return q.masked_fill(inf, self.nan_code)

    def from_codes(self, q: torch.Tensor) -> torch.Tensor:
        """FP32 values of codes ``q`` (``code_dtype``, any shape)."""
        return q.view(self.dtype).float()

    def scaled(self, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``from_codes(q) * scales`` into ``scales`` (FP32, ``q``'s shape): the FP32 products bit for
        bit, the codes' values made in BF16 where it holds every one exactly (at most 8 exponent and
        7 mantissa bits, as E4M3 and E5M2: the product is still taken in FP32), half the temporary;
        a subclass's own ``from_codes`` is used as it is."""
        exact = self.bits - 1 - self.mantissa_bits <= 8 and self.mantissa_bits <= 7
        exact = exact and type(self).from_codes is WireFormat.from_codes
        return scales.mul_(q.view(self.dtype).to(torch.bfloat16) if exact else self.from_codes(q))


E4M3 = WireFormat("e4m3", 8, 7, 3, 448.0, 0x7F, False, torch.float8_e4m3fn, KERNELS)
E5M2 = WireFormat("e5m2", 8, 15, 2, 57344.0, 0x7E, True, torch.float8_e5m2, KERNELS)


class FP8Format(enum.Enum):
    """The shipped formats by name (``--gift-fp8-format``); ``wire`` is the table's entry."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def wire(self) -> WireFormat:
        return _SHIPPED[self.value]


_SHIPPED = {f.name: f for f in (E4M3, E5M2)}
