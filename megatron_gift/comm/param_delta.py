"""The distributed optimizer's parameter all-gather as coded changes: one byte per element plus scales.

With Megatron's distributed optimizer each rank owns one shard (``S = N/p`` elements) of every
bucket's BF16 parameter buffer ``param_data [p·S]``; after the optimizer writes the new values
of its own shard, an all-gather sends every shard to every rank. Here a rank keeps ``prev``, its
own shard as every replica last reconstructed it (the other shards' last reconstruction is the
rest of ``param_data``), and sends the change ``Δ = new - prev`` coded in about one byte per
element. Every rank, the owner included, then sets ``param_data = dtype(prev + decode(Δ))`` for
every shard and the owner sets ``prev`` to its shard of that: all replicas hold the same bits
(the same elementwise IEEE operations on the same bytes), and the optimizer's FP32 main
parameters are never touched, so the next ``Δ`` carries this step's residual: the weights stay
within one step's quantization error of ``dtype(main)``, without accumulation.

Codec: int8 codes in units of the element's own step, or of a power-of-two scale per 32
elements where that is coarser (MXINT8-like; chosen over plain MXINT8-like int8 and over E4M3
with FP32 1x128 scales by ``megatron-gift bench param-gather``, docs/param-gather.md). Per
element ``i`` with base ``b_i`` (``prev``, BF16 or FP16): ``g_i``, half the dtype's spacing at
``b_i`` (from ``b_i``'s exponent bits; at least ``2^-126``), and ``Δ_i`` (FP32: the difference of
two BF16 values is exact in FP32 unless their exponents differ by more than 16). Blocks of
``BLOCK = 32`` (the last padded with zeros); block ``b``: ``a_b``, the largest ``|Δ_i|`` among
the elements that move by more than ``127 g_i`` (0 if none); ``s_b = 2^k_b``, the smallest power
of two with ``a_b <= 127 s_b`` (``k_b`` in ``[-126, 127]``: FP32 normals). Unit ``u_i = max(g_i,
s_b)``, code ``q_i = round_half_even(Δ_i / u_i)`` in ``[-127, 127]`` (no clipping by
construction), decode ``q_i u_i``, exact in FP32 (a power of two times an integer: a fused
multiply-add gives the same bits as a multiply and an add). A block whose ``Δ`` has a NaN or
Inf gets the scale code 255 and decodes to NaN in every element on every replica.

Exactness: an element that moves by at most ``127 g_i`` (63.5 steps of its base) in a block
with ``s_b <= g_i`` is reconstructed exactly (``Δ_i`` is a multiple of ``g_i``: the new value is
at most one binade below ``b_i``); ``s_b`` is set only by the elements that move further, which
8 bits cannot carry exactly (a weight smaller than about twice its change). Units of the
element's own step keep the large weights of a block exact where one block scale (plain
MXINT8-like int8, ``u_i = s_b`` from the block's largest ``|Δ|``) rounds them to the small ones'.

Message of one shard (``blocks = ceil(S/32)``): ``[32·blocks int8 codes | blocks uint8 scale
codes (k_b + 127)]``: ``1 + 1/32`` byte per element (``message_bytes``), 0.516x BF16's 2 bytes.

Bound (per element, ``h_i = u_i / 2``, ``half_steps``): ``|decode(Δ_i) - Δ_i| <= h_i``. The sum
``b_i + decode(Δ_i)`` is rounded to FP32 (relative ``2^-24``) and then to the parameter dtype;
``new_i`` is a value of that dtype within ``h_i + 2^-24 (|new_i| + h_i)`` of the FP32 sum, and
rounding to the nearest value moves at most that far, so
``|param_i - new_i| <= 2 h_i + 2^-23 (|new_i| + h_i)``.

Work per bucket, independent of ``p`` (memory-bound elementwise passes): encode reads ``2·2S``
bytes (``new``, ``prev``), writes ``~1.03 S``; one ``all_gather_into_tensor`` of uint8 messages;
decode reads ``~1.03 N`` codes and ``2N`` parameters, writes ``2N`` parameters (one FP32
temporary of ``N`` elements in this torch implementation); ``prev`` holds ``2S`` bytes per bucket.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed import _coalescing_manager

BLOCK = 32
CODE_MAX = 127
_SCALE_MIN, _SCALE_MAX, SCALE_NONFINITE = 1, 254, 255  # FP32 exponent fields of the normals; 255: a NaN/Inf block
CODED_DTYPES = (torch.bfloat16, torch.float16)
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_FIELDS = {torch.bfloat16: (7, 127), torch.float16: (10, 15)}  # stored mantissa bits, exponent bias


def blocks(numel: int) -> int:
    return math.ceil(numel / BLOCK)


def message_bytes(numel: int) -> int:
    """Bytes of the coded change of a ``numel``-element shard: int8 codes plus one scale byte per 32."""
    n = blocks(numel)
    return n * BLOCK + n


def _pow2_(field: torch.Tensor) -> torch.Tensor:
    """FP32 ``2^(field - 127)`` from an int32 tensor of exponent fields in ``[1, 255]`` (255: ``+Inf``),
    built in place from its bits: exact on every device."""
    return field.bitwise_left_shift_(23).view(torch.float32)


def _half_spacing(base: torch.Tensor, width: int) -> torch.Tensor:
    """FP32 ``g [rows, width]``: half the spacing of ``base [rows, S]``'s dtype (BF16 or FP16) at each
    element, at least ``2^-126``; the columns past ``S`` (padding) hold some positive value."""
    mant, bias = _FIELDS[base.dtype]
    e = torch.zeros(base.shape[0], width, dtype=torch.int32, device=base.device)
    e[:, : base.shape[1]] = base.view(torch.int16)
    e.bitwise_and_(0x7FFF).bitwise_right_shift_(mant)  # exponent field; 0: zero or subnormal
    # spacing 2^(max(e, 1) - bias - mant); its half as an FP32 exponent field: that exponent - 1 + 127
    return _pow2_(e.clamp_(min=1).add_(126 - bias - mant).clamp_(min=_SCALE_MIN))


def encode(new: torch.Tensor, prev: torch.Tensor, out: torch.Tensor) -> None:
    """Code ``new - prev`` (two ``[S]`` tensors of the parameter dtype) into ``out`` (uint8 ``[message_bytes(S)]``)."""
    numel, n = new.numel(), blocks(new.numel())
    delta = torch.zeros(n * BLOCK, dtype=torch.float32, device=new.device)
    delta[:numel].copy_(new).sub_(prev)  # FP32: exact for BF16 operands within 2^16 of each other
    d, g = delta.view(n, BLOCK), _half_spacing(prev.view(1, -1), n * BLOCK).view(n, BLOCK)
    far = torch.where(d.abs() <= CODE_MAX * g, 0.0, d.abs()).amax(dim=1)  # NaN and Inf count as far
    mant, expo = torch.frexp(far)  # far = mant * 2^expo, mant in [0.5, 1)
    # smallest k with far <= 127 * 2^k: expo - 7 while mant <= 127/128, else expo - 6; the least for far = 0
    k = expo + (mant > CODE_MAX / 128).to(expo.dtype) - 7
    code = torch.where(far > 0, k + 127, _SCALE_MIN).clamp_(_SCALE_MIN, _SCALE_MAX)
    code = torch.where(torch.isfinite(far), code, SCALE_NONFINITE)
    q = d.div_(g.clamp_(min=_pow2_(code.clone())[:, None])).round_()
    q.nan_to_num_(0.0, posinf=0.0, neginf=0.0)  # a non-finite block: all codes 0, its scale says NaN
    out[: n * BLOCK].view(torch.int8).view(n, BLOCK).copy_(q)  # exact integers in [-127, 127]
    out[n * BLOCK :].copy_(code)


def _units(messages: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes int8 ``[p, blocks, 32]`` and FP32 units ``u = max(g, s_b)`` ``[p, blocks, 32]`` (``+Inf``
    in a block with scale code 255) of ``messages [p, message_bytes(S)]`` against ``base [p, S]``."""
    p, n = base.shape[0], blocks(base.shape[1])
    codes = messages[:, : n * BLOCK].view(torch.int8).view(p, n, BLOCK)
    u = _half_spacing(base, n * BLOCK).view(p, n, BLOCK)
    return codes, u.clamp_(min=_pow2_(messages[:, n * BLOCK :].to(torch.int32))[..., None])


def decode_into(messages: torch.Tensor, base: torch.Tensor) -> None:
    """``base = dtype(base + decode(messages))`` for ``p`` shards at once: ``messages`` uint8
    ``[p, message_bytes(S)]``, ``base`` ``[p, S]`` of the parameter dtype (each shard's ``prev``).
    A block with scale code 255 has all codes 0: ``0 · Inf`` makes it NaN."""
    codes, u = _units(messages, base)
    x = u.mul_(codes).view(base.shape[0], -1)[:, : base.shape[1]]
    base.copy_(x.add_(base))


def half_steps(messages: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The bound ``h = u / 2`` of every element of ``p`` coded shards against their bases ``base [p, S]``
    (FP32 ``[p, S]``; tests and benchmarks)."""
    _, u = _units(messages, base)
    return u.mul_(0.5).view(base.shape[0], -1)[:, : base.shape[1]]


class _Gathered:
    """The in-flight coded all-gathers of one bucket group; ``wait()`` decodes them into the buckets, once."""

    def __init__(self, work, apply):
        self.work, self.apply = work, apply

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.apply is not None:
            apply, self.apply = self.apply, None
            apply()


class DeltaGather:
    """``prev`` and the coded all-gather of the buckets of one bucket group over ``group``.

    ``buffers``: each bucket's parameter buffer (flat ``[p·S]``), shard ``r`` owned by group rank
    ``r``. The 16-bit ones are coded; others (FP32 buffers, where the optimizer updates the buffer
    itself) are all-gathered as they are, in the same coalesced launch. ``prev`` (one entry per
    coded buffer) is None until the first full gather. ``ledger`` (a ``comm.quantized.CommLedger``)
    counts the bytes sent (ring all-gather: ``(p-1)`` shards or messages)."""

    def __init__(self, buffers: list[torch.Tensor], group, ledger=None):
        self.group, self.size, self.rank = group, group.size(), group.rank()
        for b in buffers:
            if b.numel() % self.size:
                raise ValueError(f"a buffer of {b.numel()} elements cannot be split into {self.size} shards")
        self.buffers, self.ledger = buffers, ledger
        self.coded = [i for i, b in enumerate(buffers) if b.dtype in CODED_DTYPES]
        self.prev: list[torch.Tensor] | None = None

    def own(self, i: int) -> torch.Tensor:
        s = self.buffers[i].numel() // self.size
        return self.buffers[i][self.rank * s : (self.rank + 1) * s]

    def _count(self, dtype: str, shard_bytes: int) -> None:
        if self.ledger is not None:
            self.ledger.add("all_gather", dtype, (self.size - 1) * shard_bytes)

    def start(self, async_op: bool, full: bool = False) -> _Gathered:
        """All-gather every bucket: its coded change (16-bit buckets, unless ``full``), else its shard
        as it is (``full`` sets ``prev`` to the shards sent). One collective per bucket, coalesced as
        Megatron's own gather and all of uint8 (gloo coalesces one dtype only). Decoding happens in
        the returned handle's ``wait()`` (already done when not ``async_op``); until then each coded
        own shard holds ``prev`` again."""
        assert full or self.prev is not None, "a delta gather needs prev: do a full gather first"
        if full:
            self.prev = [self.own(i).clone() for i in self.coded]
        prev = {} if full else dict(zip(self.coded, self.prev))
        received = []
        with _coalescing_manager(self.group, async_ops=async_op) as cm:
            for i, buf in enumerate(self.buffers):
                own = self.own(i)
                if i not in prev:
                    dist.all_gather_into_tensor(buf.view(torch.uint8), own.view(torch.uint8), group=self.group, async_op=async_op)
                    self._count(_DTYPE_NAMES.get(buf.dtype, str(buf.dtype)), own.numel() * own.element_size())
                    continue
                m = message_bytes(own.numel())
                send = torch.empty(m, dtype=torch.uint8, device=own.device)
                encode(own, prev[i], send)
                own.copy_(prev[i])  # every shard of the buffer now holds what all replicas last reconstructed
                recv = torch.empty(self.size * m, dtype=torch.uint8, device=own.device)
                dist.all_gather_into_tensor(recv, send, group=self.group, async_op=async_op)
                received.append(recv)
                self._count("int8+scales", m)
        handle = _Gathered(cm if async_op else None, None if full else lambda: self._apply(received))
        if not async_op:
            handle.wait()
        return handle

    def _apply(self, received: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for prev, i, recv in zip(self.prev, self.coded, received):
                buf = self.buffers[i]
                decode_into(recv.view(self.size, -1), buf.view(self.size, -1))
                prev.copy_(self.own(i))
