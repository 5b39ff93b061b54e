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
``b_i`` (from ``b_i``'s exponent bits; 0 for zeros), and ``Δ_i`` (FP32: the difference of
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
at most one binade below ``b_i``); ``s_b`` is set only by the elements that move further (by
more than a quarter to a half of their own magnitude), which 8 bits cannot carry exactly. Units
of the element's own step keep the large weights of a block exact where one block scale (plain
MXINT8-like int8, ``u_i = s_b`` from the block's largest ``|Δ|``) puts every weight of the block
on the grid of its largest change.

Message of one shard (``blocks = ceil(S/32)``): ``[32·blocks int8 codes | blocks uint8 scale
codes (k_b + 127)]``: ``1 + 1/32`` byte per element (``message_bytes``), 0.516x BF16's 2 bytes.

Bound (per element, ``h_i = u_i / 2``, ``half_steps``): ``|decode(Δ_i) - Δ_i| <= h_i``. The sum
``b_i + decode(Δ_i)`` is rounded to FP32 (relative ``2^-24``) and then to the parameter dtype;
``new_i`` is a value of that dtype within ``h_i + 2^-24 (|new_i| + h_i)`` of the FP32 sum, and
rounding to the nearest value moves at most that far, so
``|param_i - new_i| <= 2 h_i + 2^-23 (|new_i| + h_i)``.

Work per bucket, independent of ``p`` (memory-bound elementwise passes): encode reads ``2·2S``
bytes (``new``, ``prev``), writes ``~1.03 S``; one uint8 all-gather of the messages;
decode reads ``~1.03 N`` codes and ``2N`` parameters, writes ``2N`` parameters (about 49 bytes
of HBM traffic per element and two FP32 temporaries of ``N`` elements in this unfused torch
implementation); ``prev`` holds ``2S`` bytes per bucket.
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
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.10
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}  # stored mantissa bits


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


def _widened(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [rows, S]`` in FP32, padded with zeros to ``width`` columns."""
    out = torch.empty(x.shape[0], width, dtype=torch.float32, device=x.device)
    out[:, : x.shape[1]] = x
    out[:, x.shape[1] :] = 0
    return out


def _half_spacing(base32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 ``g``: half the spacing of ``dtype`` (BF16 or FP16) at each normal value of ``base32``
    (FP32 values of that dtype): its leading power of two (the exponent bits alone) times
    ``2^-(m+1)``, ``m`` the stored mantissa bits. Finer for FP16's subnormals; 0 for zeros and
    BF16's subnormals (below ``2^-126``, where every unit is at least the block scale's ``2^-126``).
    Exact: powers of two."""
    lead = (base32.view(torch.int32) & 0x7F800000).view(torch.float32)
    return lead.mul_(2.0 ** -(_MANTISSA_BITS[dtype] + 1))


def encode(new: torch.Tensor, prev: torch.Tensor, out: torch.Tensor) -> None:
    """Code ``new - prev`` (two ``[S]`` tensors of the parameter dtype) into ``out`` (uint8 ``[message_bytes(S)]``)."""
    numel, n = new.numel(), blocks(new.numel())
    d = _widened(new.view(1, -1), n * BLOCK).view(n, BLOCK)
    d.view(-1)[:numel].sub_(prev)  # FP32: exact for BF16 operands within 2^16 of each other
    g = _half_spacing(_widened(prev.view(1, -1), n * BLOCK), prev.dtype).view(n, BLOCK)
    far = torch.where(d.abs() <= CODE_MAX * g, 0.0, d.abs()).amax(dim=1)  # NaN and Inf count as far
    mant, expo = torch.frexp(far)  # far = mant * 2^expo, mant in [0.5, 1)
    # smallest k with far <= 127 * 2^k: expo - 7 while mant <= 127/128, else expo - 6; the least for far = 0
    k = expo + (mant > CODE_MAX / 128).to(expo.dtype) - 7
    code = torch.where(far > 0, k + 127, _SCALE_MIN).clamp_(_SCALE_MIN, _SCALE_MAX)
    code = torch.where(torch.isfinite(far), code, SCALE_NONFINITE)
    q = d.div_(g.clamp_(min=_pow2_(code.clone())[:, None])).round_()  # g is now the unit max(g, s_b)
    q.nan_to_num_(0.0, posinf=0.0, neginf=0.0)  # a non-finite block: all codes 0, its scale says NaN
    out[: n * BLOCK].view(torch.int8).view(n, BLOCK).copy_(q)  # exact integers in [-127, 127]
    out[n * BLOCK :].copy_(code)


def _decoded(messages: torch.Tensor, base: torch.Tensor, plus_base: bool) -> torch.Tensor:
    """FP32 ``[p, 32·blocks]``: ``base + q u`` (``plus_base``) or the units ``u = max(g, s_b)`` of
    ``messages [p, message_bytes(S)]`` against ``base [p, S]``; ``u = +Inf`` in a block with scale
    code 255, whose codes are all 0, so that ``0 · Inf`` makes it NaN."""
    p, n = base.shape[0], blocks(base.shape[1])
    base32 = _widened(base, n * BLOCK)
    u = _half_spacing(base32, base.dtype).view(p, n, BLOCK)
    u.clamp_(min=_pow2_(messages[:, n * BLOCK :].to(torch.int32))[..., None])
    if not plus_base:
        return u.view(p, -1)
    codes = messages[:, : n * BLOCK].view(torch.int8).view(p, n, BLOCK)
    return base32.view(p, n, BLOCK).addcmul_(u, codes).view(p, -1)  # q u is exact: its rounding is the sum's


def decode_into(messages: torch.Tensor, base: torch.Tensor) -> None:
    """``base = dtype(base + decode(messages))`` for ``p`` shards at once: ``messages`` uint8
    ``[p, message_bytes(S)]``, ``base`` ``[p, S]`` of the parameter dtype (each shard's ``prev``)."""
    base.copy_(_decoded(messages, base, plus_base=True)[:, : base.shape[1]])


def half_steps(messages: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The bound ``h = u / 2`` of every element of ``p`` coded shards against their bases ``base [p, S]``
    (FP32 ``[p, S]``; tests and benchmarks)."""
    return _decoded(messages, base, plus_base=False)[:, : base.shape[1]].mul(0.5)


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
                    _all_gather(buf.view(torch.uint8), own.view(torch.uint8), group=self.group, async_op=async_op)
                    self._count(_DTYPE_NAMES.get(buf.dtype, str(buf.dtype)), own.numel() * own.element_size())
                    continue
                m = message_bytes(own.numel())
                send = torch.empty(m, dtype=torch.uint8, device=own.device)
                encode(own, prev[i], send)
                own.copy_(prev[i])  # every shard of the buffer now holds what all replicas last reconstructed
                recv = torch.empty(self.size * m, dtype=torch.uint8, device=own.device)
                _all_gather(recv, send, group=self.group, async_op=async_op)
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
