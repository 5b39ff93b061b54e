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

Repair by construction: a base that is NaN or Inf counts as 0 (encoder and decoders alike: every
replica holds the same base), so the next change of a block that decoded to NaN is the owner's
new value itself, coded against 0: every replica comes back within the bound below of
``dtype(main)`` at the next gather, without a full one (the closed loop then refines it step by
step). Still NaN where the owner's new value is (a NaN main parameter, as stock Megatron would
hold it); a change beyond FP32's range (weights above ``2^127``) decodes to NaN.

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

Work per bucket, independent of ``p``, one fused launch each (``kernels.delta``, on CUDA): encode
reads ``2·2S`` bytes (``new``, ``prev``), writes ``33/32 S``; one uint8 all-gather of the
messages; decode reads ``33/32 N`` codes and scales and ``2N`` bases (the owner's from
``prev``), writes ``2N`` parameters and ``2S`` of ``prev``: ``5.03 + 2/p`` bytes per element of
the bucket, no temporaries. The PyTorch path (CPUs, no triton) makes about 49 bytes per element
in element-wise passes, with FP32 temporaries of at most ``CHUNK`` elements (longer buckets in
chunks of it, a fixed number of ops each). ``prev`` holds ``2S`` bytes per bucket.

Streams: the encode and the collective are issued on the current stream; the decode on the
decode stream after the collective (``_Gathered``), so that the next bucket group's gather
overlaps it; the current stream waits for its event only before the weights are read.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch.distributed import _coalescing_manager

from .. import kernels
from .._compat import all_gather as _all_gather
from .ledger import dtype_label
from .schedule import StageStreams

BLOCK = 32
CODE_MAX = 127
_SCALE_MIN, _SCALE_MAX, SCALE_NONFINITE = 1, 254, 255  # FP32 exponent fields of the normals; 255: a NaN/Inf block
CODED_DTYPES = (torch.bfloat16, torch.float16)
CHUNK = 1 << 24  # elements of each FP32 temporary of the PyTorch path (64 MiB): longer inputs go in chunks of it
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}  # stored mantissa bits


def blocks(numel: int) -> int:
    return math.ceil(numel / BLOCK)


def message_bytes(numel: int) -> int:
    """Bytes of the coded change of a ``numel``-element shard: int8 codes plus one scale byte per 32."""
    n = blocks(numel)
    return n * BLOCK + n


@functools.cache
def _kernel_module():
    """``kernels.delta`` (the fused codec), or None where triton does not import."""
    try:
        from ..kernels import delta
    except ImportError:
        return None
    return delta


def _fused(t: torch.Tensor, fused: bool):
    """The kernel module where the fused codec runs on ``t`` (CUDA, or the CPU under Triton's interpreter), else
    None."""
    return _kernel_module() if fused and t.numel() > 0 and kernels.available(t.device) else None


def _chunks(numel: int, rows: int = 1):
    """``(first block, end block, first element, end element)`` of the column chunks of ``rows``
    rows of ``numel`` elements, each at most ``CHUNK`` elements over all rows (whole blocks)."""
    n, step = blocks(numel), max(1, CHUNK // (BLOCK * rows))
    for b0 in range(0, n, step):
        b1 = min(n, b0 + step)
        yield b0, b1, b0 * BLOCK, min(numel, b1 * BLOCK)


def _pow2_(field: torch.Tensor) -> torch.Tensor:
    """FP32 ``2^(field - 127)`` from an int32 tensor of exponent fields in ``[1, 255]`` (255: ``+Inf``),
    built in place from its bits: exact on every device."""
    return field.bitwise_left_shift_(23).view(torch.float32)


def _base32(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [rows, S]`` in FP32, padded with zeros to ``width`` columns, NaN and Inf replaced by 0
    (the repair: a block that decoded to NaN is coded against 0 next time, on every replica)."""
    out = torch.empty(x.shape[0], width, dtype=torch.float32, device=x.device)
    out[:, : x.shape[1]] = x
    out[:, x.shape[1] :] = 0
    return out.nan_to_num_(0.0, posinf=0.0, neginf=0.0)


def _half_spacing(base32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 ``g``: half the spacing of ``dtype`` (BF16 or FP16) at each normal value of ``base32``
    (FP32 values of that dtype): its leading power of two (the exponent bits alone) times
    ``2^-(m+1)``, ``m`` the stored mantissa bits. Finer for FP16's subnormals; 0 for zeros and
    BF16's subnormals (below ``2^-126``, where every unit is at least the block scale's ``2^-126``).
    Exact: powers of two."""
    lead = (base32.view(torch.int32) & 0x7F800000).view(torch.float32)
    return lead.mul_(2.0 ** -(_MANTISSA_BITS[dtype] + 1))


def encode(new: torch.Tensor, prev: torch.Tensor, out: torch.Tensor, fused: bool = True) -> None:
    """Code ``new - prev`` (two ``[S]`` tensors of the parameter dtype) into ``out`` (uint8
    ``[message_bytes(S)]``): the fused kernel where it runs (``kernels.delta``), else in chunks
    of ``CHUNK`` elements (a fixed number of torch ops per chunk)."""
    if (k := _fused(new, fused)) is not None:
        return k.encode(new, prev, out)
    n = blocks(new.numel())
    for b0, b1, e0, e1 in _chunks(new.numel()):
        _encode_chunk(new[e0:e1], prev[e0:e1], out[b0 * BLOCK : b1 * BLOCK], out[n * BLOCK + b0 : n * BLOCK + b1])


def _encode_chunk(new: torch.Tensor, prev: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    n = scales.numel()
    base = _base32(prev.view(1, -1), n * BLOCK).view(n, BLOCK)
    d = base.neg().view(-1)
    d[: new.numel()].add_(new)  # FP32 new - base: exact for BF16 operands within 2^16 of each other
    d = d.view(n, BLOCK)
    g = _half_spacing(base, prev.dtype)
    a = d.abs()
    far = a.masked_fill_(a <= g * CODE_MAX, 0.0).amax(dim=1)  # NaN and Inf count as far
    mant, expo = torch.frexp(far)  # far = mant * 2^expo, mant in [0.5, 1)
    # smallest k with far <= 127 * 2^k: expo - 7 while mant <= 127/128, else expo - 6; the least for far = 0
    k = expo + (mant > CODE_MAX / 128).to(expo.dtype) - 7
    code = torch.where(far > 0, k + 127, _SCALE_MIN).clamp_(_SCALE_MIN, _SCALE_MAX)
    code = torch.where(torch.isfinite(far), code, SCALE_NONFINITE)
    q = d.div_(g.clamp_(min=_pow2_(code.clone())[:, None])).round_()  # g is now the unit max(g, s_b)
    q.nan_to_num_(0.0, posinf=0.0, neginf=0.0)  # a non-finite block: all codes 0, its scale says NaN
    codes.view(torch.int8).view(n, BLOCK).copy_(q)  # exact integers in [-127, 127]
    scales.copy_(code)


def _decoded(codes: torch.Tensor, scales: torch.Tensor, base: torch.Tensor, plus_base: bool) -> torch.Tensor:
    """FP32 ``[p, 32·n]``: ``base + q u`` (``plus_base``) or the units ``u = max(g, s_b)`` of
    ``n`` blocks of codes ``[p, 32·n]`` and scale codes ``[p, n]`` against ``base [p, <= 32·n]``;
    ``u = +Inf`` in a block with scale code 255, whose codes are all 0, so that ``0 · Inf`` makes it NaN."""
    p, n = base.shape[0], scales.shape[1]
    base32 = _base32(base, n * BLOCK)
    u = _half_spacing(base32, base.dtype).view(p, n, BLOCK)
    u.clamp_(min=_pow2_(scales.to(torch.int32))[..., None])
    if not plus_base:
        return u.view(p, -1)
    codes = codes.view(torch.int8).view(p, n, BLOCK)
    return base32.view(p, n, BLOCK).addcmul_(u, codes).view(p, -1)  # q u is exact: its rounding is the sum's


def decode_into(
    messages: torch.Tensor, base: torch.Tensor, prev: torch.Tensor | None = None, rank: int = -1, fused: bool = True
) -> None:
    """``base = dtype(base + decode(messages))`` for ``p`` shards at once: ``messages`` uint8
    ``[p, message_bytes(S)]``, ``base`` ``[p, S]`` of the parameter dtype (each shard's ``prev``).
    With ``prev [S]``, row ``rank``'s base is read from ``prev`` and its result written to both.
    The fused kernel where it runs, else in chunks of ``CHUNK`` elements over the ``p`` rows."""
    if prev is not None and rank < 0:
        raise ValueError("decode_into: prev needs the rank whose row it is")
    if (k := _fused(base, fused)) is not None:
        return k.decode(messages, base, base[0] if prev is None else prev, rank)
    if prev is not None:
        base[rank].copy_(prev)
    n = blocks(base.shape[1])
    for b0, b1, e0, e1 in _chunks(base.shape[1], base.shape[0]):
        codes, scales = messages[:, b0 * BLOCK : b1 * BLOCK], messages[:, n * BLOCK + b0 : n * BLOCK + b1]
        base[:, e0:e1].copy_(_decoded(codes, scales, base[:, e0:e1], plus_base=True)[:, : e1 - e0])
    if prev is not None:
        prev.copy_(base[rank])


def half_steps(messages: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The bound ``h = u / 2`` of every element of ``p`` coded shards against their bases ``base [p, S]``
    (FP32 ``[p, S]``; tests and benchmarks)."""
    n = blocks(base.shape[1])
    u = _decoded(messages[:, : n * BLOCK], messages[:, n * BLOCK :], base, plus_base=False)
    return u[:, : base.shape[1]].mul(0.5)


class _Gathered:
    """The in-flight coded all-gathers of one bucket group. ``wait()`` (what Megatron's
    ``finish_param_sync`` calls) enqueues the decode on the decode stream behind the collective
    (on CUDA; inline elsewhere) and returns: the next bucket group's gather, which Megatron
    dispatches right after it, overlaps the decode. ``ready()`` makes the current stream wait for
    the decode's event (the forward pre-hook), and drops the messages then (the current stream
    allocated them: once it has waited, no later use of their memory can overtake the decode)."""

    def __init__(self, work, decode, streams, keep):
        self.work, self.decode, self.streams, self.keep = work, decode, streams, keep
        self.event = None

    def wait(self) -> None:
        if self.work is None and self.decode is None:
            return
        with self.streams.context(0):
            if self.work is not None:
                self.work.wait()
                self.work = None
            if self.decode is not None:
                decode, self.decode = self.decode, None
                decode()
        self.event = self.streams.record(0)

    def ready(self) -> None:
        self.wait()
        self.streams.wait_event(None, self.event)
        self.event, self.keep = None, None


class DeltaGather:
    """``prev`` and the coded all-gather of the buckets of one bucket group over ``group``.

    ``buffers``: each bucket's parameter buffer (flat ``[p·S]``), shard ``r`` owned by group rank
    ``r``. The 16-bit ones are coded; others (FP32 buffers, where the optimizer updates the buffer
    itself) are all-gathered as they are, in the same coalesced launch. ``prev`` (one entry per
    coded buffer) is None until the first full gather. ``ledger`` (a ``comm.quantized.CommLedger``)
    counts the bytes sent (ring all-gather: ``(p-1)`` shards or messages). ``streams`` (a
    ``comm.schedule.StageStreams``): stream 0 decodes. ``fused``: whether the codec may take the
    fused kernels (``kernels.delta``), as ``GiftConfig.exchange.kernels``: None on CUDA, True wherever they run
    (the CPU too under Triton's interpreter), False never."""

    def __init__(self, buffers: list[torch.Tensor], group, ledger=None, streams=None, fused: bool | None = None):
        self.group, self.size, self.rank = group, group.size(), group.rank()
        for b in buffers:
            if b.numel() % self.size:
                raise ValueError(f"a buffer of {b.numel()} elements cannot be split into {self.size} shards")
        self.buffers, self.ledger = buffers, ledger
        self.fused = fused is True or (fused is None and buffers[0].device.type == "cuda")
        self.streams = streams or StageStreams(buffers[0].device)
        self.coded = [i for i, b in enumerate(buffers) if b.dtype in CODED_DTYPES]
        self.prev: list[torch.Tensor] | None = None
        self.pending: _Gathered | None = None  # the last gather, until the current stream has waited for its decode

    def own(self, i: int) -> torch.Tensor:
        s = self.buffers[i].numel() // self.size
        return self.buffers[i][self.rank * s : (self.rank + 1) * s]

    def _count(self, dtype: str, shard_bytes: int) -> None:
        if self.ledger is not None:
            self.ledger.add("all_gather", dtype, (self.size - 1) * shard_bytes)

    def start(self, async_op: bool, full: bool = False) -> _Gathered:
        """All-gather every bucket: its coded change (16-bit buckets, unless ``full``), else its shard
        as it is (``full`` sets ``prev`` to the shards sent). One collective per bucket, coalesced as
        Megatron's own gather and all of uint8 (gloo coalesces one dtype only). The returned handle
        decodes in ``wait()`` (already called when not ``async_op``); ``ready()`` ends the gather.
        Until the decode the coded own shards hold the new values: the decode reads ``prev``."""
        assert full or self.prev is not None, "a delta gather needs prev: do a full gather first"
        self.ready()
        if full:
            self.prev = [self.own(i).clone() for i in self.coded]
        prev = {} if full else dict(zip(self.coded, self.prev))
        sent, received = [], []
        with _coalescing_manager(self.group, async_ops=async_op) as cm:
            for i, buf in enumerate(self.buffers):
                own = self.own(i)
                if i not in prev:
                    _all_gather(buf.view(torch.uint8), own.view(torch.uint8), group=self.group, async_op=async_op)
                    self._count(dtype_label(buf.dtype), own.numel() * own.element_size())
                    continue
                m = message_bytes(own.numel())
                send = torch.empty(m, dtype=torch.uint8, device=own.device)
                encode(own, prev[i], send, fused=self.fused)
                recv = torch.empty(self.size * m, dtype=torch.uint8, device=own.device)
                _all_gather(recv, send, group=self.group, async_op=async_op)
                sent.append(send)
                received.append(recv)
                self._count("int8+scales", m)
        decode = None if full else lambda: self._decode(received)
        self.pending = _Gathered(cm if async_op else None, decode, self.streams, (sent, received))
        if not async_op:  # the current stream holds the gathered messages: the decode stream waits for it
            self.streams.wait_current(0)
            self.pending.wait()
        return self.pending

    def ready(self) -> None:
        """The current stream waits for the last gather's decode (enqueued first if it was not yet)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.ready()

    def _decode(self, received: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for prev, i, recv in zip(self.prev, self.coded, received):
                rows = self.buffers[i].view(self.size, -1)
                decode_into(recv.view(self.size, -1), rows, prev, self.rank, fused=self.fused)

    def checksum(self) -> torch.Tensor:
        """int64 ``[1]``: the sum of the bit patterns (as int16) of every coded shard as this replica
        holds its last reconstruction (the other shards in the buffers, its own in ``prev``): the
        same on every replica that agrees; a difference in one element always changes it."""
        self.ready()
        total = torch.zeros(1, dtype=torch.int64, device=self.buffers[0].device)
        for prev, i in zip(self.prev, self.coded):
            total += self.buffers[i].view(torch.int16).sum(dtype=torch.int64)
            total -= self.own(i).view(torch.int16).sum(dtype=torch.int64)
            total += prev.view(torch.int16).sum(dtype=torch.int64)
        return total

    def replicas_differ(self) -> bool:
        """Whether the replicas' ``checksum`` differ over the group: one all-reduce of two integers
        and a host synchronisation (call it on logging steps only)."""
        c = self.checksum()
        both = torch.cat([c, -c])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        return bool(both[0] != -both[1])
