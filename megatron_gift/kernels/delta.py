"""Triton kernels of the delta parameter all-gather (``comm.param_delta``'s codec, bit for bit).

Shapes: a bucket's parameter buffer ``param [p, S]`` (BF16 or FP16, flat, shard ``r`` owned by
group rank ``r``), the owner's ``prev [S]`` (what every replica last reconstructed of its shard),
``nb = ceil(S / 32)`` blocks of 32 per shard, a message ``[32·nb int8 codes | nb uint8 scale
codes]`` (``m = 33·nb`` bytes) per shard, ``messages [p, m]`` after the all-gather.

Per element (``comm.param_delta``'s module doc has the analysis): base ``b`` (``prev``, or ``0``
where ``prev`` is NaN or Inf: the repair), ``Δ = new - b`` and the half spacing ``g`` of ``b``
in FP32; block scale code ``c = clamp(E - 6 + [mantissa(a) > 0x7E0000], 1, 254)`` from the FP32
bits (``E`` the exponent field) of ``a``, the largest ``|Δ|`` over ``127 g``, i.e. the smallest
``k = c - 127`` with ``a <= 127·2^k`` (``c = 255`` where a ``Δ`` of the block is not finite);
``u = max(g, 2^k)``, ``q = rne(Δ / u)`` (``|q| <= 127``, exact division by a power of two, then
the round-to-nearest-even of ``x + 1.5·2^23 - 1.5·2^23``, exact for ``|x| < 2^22``), 0 in a
non-finite block. Decode: ``param = dtype(b + q·u)``, ``q·u`` exact so that a fused multiply-add
rounds the same as the reference's ``addcmul`` (the launches turn contraction off all the same);
``u = 2^128 = +Inf`` for ``c = 255``, so the block
decodes to NaN.

``_encode_kernel``: one program per ``BB`` blocks of the owner's shard, reads ``new`` and
``prev`` and writes the message (essential bytes: reads ``2·e·S``, ``e`` the element size,
writes ``33·nb``; nothing else is touched). ``_decode_kernel``: one program per ``BB`` blocks
of one shard row, all ``p`` rows in one launch; reads the row's message and its base (the row
of ``param``, the owner's from ``prev``: masked loads, one of the two per element), writes the
row of ``param`` and, on the owner's row, ``prev`` (essential bytes: reads ``p·m + p·e·S``,
writes ``(p + 1)·e·S``). One launch each per bucket whatever ``S`` and ``p``; no temporaries;
no host synchronisation (launches depend on shapes only). ``TRAFFIC`` gives each launch's
``(bytes read, bytes written)`` from its bound arguments (the kernels' bytes convention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BB = 64  # blocks of 32 per program: 2048 elements
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


@triton.jit
def _base_and_half_spacing(b, MANT: tl.constexpr):
    """FP32 base (0 where ``b`` is NaN or Inf) and ``g``, half the 16-bit spacing at it (0 for
    zeros and BF16's subnormals): the exponent bits alone times ``2^-(MANT+1)``, exact."""
    bits = b.to(tl.int32, bitcast=True)
    finite = (bits & 0x7F800000) != 0x7F800000
    b = tl.where(finite, b, 0.0)
    lead = (b.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return b, lead * (2.0 ** -(MANT + 1))


@triton.jit
def _rounded(x, dtype: tl.constexpr, MANT: tl.constexpr):
    """``x`` (FP32) rounded to nearest even in ``dtype``; BF16 by integer arithmetic on the bits
    (Triton's interpreter does not round its cast to nearest even), NaN as torch's ``0x7FC0``."""
    if MANT == 7:
        bits = x.to(tl.int32, bitcast=True)
        rne = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        return tl.where(nan, 0x7FC0, rne).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _encode_kernel(new_ptr, prev_ptr, codes_ptr, scales_ptr, numel, nblocks, BB: tl.constexpr, MANT: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB)
    offs = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    mask = offs < numel
    new = tl.load(new_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    base, g = _base_and_half_spacing(tl.load(prev_ptr + offs, mask=mask, other=0.0).to(tl.float32), MANT)
    d = new - base
    a = tl.abs(d)
    nonfinite = tl.max(((a.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000).to(tl.int32), axis=1) > 0
    far = tl.max(tl.where(a <= 127.0 * g, 0.0, a), axis=1)  # finite blocks: no NaN among them
    fbits = far.to(tl.int32, bitcast=True)
    code = (fbits >> 23) - 6 + ((fbits & 0x7FFFFF) > 0x7E0000).to(tl.int32)
    code = tl.minimum(tl.maximum(code, 1), 254)
    code = tl.where(nonfinite, 255, code)
    u = tl.maximum(g, (code << 23).to(tl.float32, bitcast=True)[:, None])
    q = tl.math.div_rn(d, u)
    q = (q + 12582912.0) - 12582912.0  # round half to even: |q| <= 127
    q = tl.where(nonfinite[:, None], 0.0, q)
    bmask = blk < nblocks
    tl.store(codes_ptr + offs, q.to(tl.int8), mask=offs < nblocks.to(tl.int64) * 32)  # 64-bit: a shard of 2^31
    tl.store(scales_ptr + blk, code.to(tl.uint8), mask=bmask)


@triton.jit
def _decode_kernel(
    msg_ptr,
    param_ptr,
    prev_ptr,
    numel,
    nblocks,
    msg_bytes,
    rank,
    programs_per_row,
    BB: tl.constexpr,
    MANT: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // programs_per_row
    blk = (pid - row * programs_per_row) * BB + tl.arange(0, BB)
    offs = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    bmask = blk < nblocks
    mask = offs < numel
    own = (tl.zeros([BB, 32], tl.int64) + row) == rank  # a tensor: the interpreter takes no scalar masks
    msg = msg_ptr + row * msg_bytes
    codes_end = nblocks.to(tl.int64) * 32  # the scales' offset: 64-bit, a shard may hold 2^31 elements
    q = tl.load(msg + offs, mask=offs < codes_end, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    code = tl.load(msg + codes_end + blk, mask=bmask, other=1).to(tl.int32)
    dst = param_ptr + row * numel + offs
    theirs = tl.load(dst, mask=mask & ~own, other=0.0).to(tl.float32)
    mine = tl.load(prev_ptr + offs, mask=mask & own, other=0.0).to(tl.float32)
    base, g = _base_and_half_spacing(tl.where(own, mine, theirs), MANT)
    u = tl.maximum(g, (code << 23).to(tl.float32, bitcast=True)[:, None])
    value = _rounded(base + q * u, param_ptr.dtype.element_ty, MANT)
    tl.store(dst, value, mask=mask)
    tl.store(prev_ptr + offs, value, mask=mask & own)


def _blocks(numel: int) -> int:
    return triton.cdiv(numel, 32)


TRAFFIC = {
    "_encode_kernel": lambda a: (2 * a["numel"] * a["new_ptr"].element_size(), 33 * a["nblocks"]),
    "_decode_kernel": lambda a: (
        (a["grid"][0] // a["programs_per_row"]) * (a["msg_bytes"] + a["numel"] * a["param_ptr"].element_size()),
        (a["grid"][0] // a["programs_per_row"] + 1) * a["numel"] * a["param_ptr"].element_size(),
    ),
}


def encode(new: torch.Tensor, prev: torch.Tensor, out: torch.Tensor) -> None:
    """``comm.param_delta.encode`` in one launch: ``out`` uint8 ``[33·nb]`` from ``new``, ``prev`` ``[S]``."""
    numel = new.numel()
    nb = _blocks(numel)
    _encode_kernel[(triton.cdiv(nb, BB),)](
        new,
        prev,
        out[: 32 * nb].view(torch.int8),
        out[32 * nb :],
        numel,
        nb,
        BB=BB,
        MANT=_MANTISSA_BITS[new.dtype],
        enable_fp_fusion=False,
    )


def decode(messages: torch.Tensor, param: torch.Tensor, prev: torch.Tensor, rank: int) -> None:
    """``comm.param_delta.decode_into`` with the owner's row read from and written to ``prev`` too,
    in one launch: ``messages`` uint8 ``[p, m]``, ``param`` ``[p, S]``, ``prev`` ``[S]``."""
    p, numel = param.shape
    nb = _blocks(numel)
    per_row = triton.cdiv(nb, BB)
    _decode_kernel[(p * per_row,)](
        messages,
        param,
        prev,
        numel,
        nb,
        messages.shape[1],
        rank,
        per_row,
        BB=BB,
        MANT=_MANTISSA_BITS[param.dtype],
        enable_fp_fusion=False,
    )
