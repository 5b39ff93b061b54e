"""The four-bit exchange's Triton kernels (``kernels/fp4.py``) bit for bit against ``numerics.fp4`` (whose
own tests hold it to a table-lookup reference on every code and tie) and the rotation bit for bit
``numerics.rotation.fwht``, their launches and ``TRAFFIC``
entries, and ``FP4Reduce`` / ``FP4TwoLevelReduce`` with the kernels against their PyTorch path on 4
gloo ranks.

As in tests/unit/test_kernels.py, the kernel tests run on the CPU in Triton's interpreter, which has to
be on when the kernels are defined: ``test_fp4_kernels_under_interpreter`` runs this file again in a
fresh process with ``TRITON_INTERPRET=1``; without it they run on CUDA (``gpu``)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_gift.comm.schedule import StageResult
from megatron_gift.kernels.placement import Placement
from megatron_gift.numerics.fp4 import FP4_FORMATS, decode_fp4, encode_fp4
from megatron_gift.testing.dispatch import OpCounter
from megatron_gift.testing.kernel_log import assert_passes_under_interpreter, launches_of
from tests.reference import ordered_sum

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ["cpu"] if INTERPRET else [pytest.param("cuda", marks=pytest.mark.gpu)]
# Segment lengths in blocks: one block, odd counts, a segment across programs (64 blocks each).
SEGMENT_BLOCKS = [1, 3, 70, 2, 130, 5]


if not INTERPRET:  # the outer run only

    def test_fp4_kernels_under_interpreter():
        """The kernel tests of this file on the CPU, in Triton's interpreter, in a fresh process."""
        assert_passes_under_interpreter(__file__)


def values(n: int, block: int, seed: int) -> torch.Tensor:
    """FP32 values over FP32's whole range (subnormals included), a zero block, a block of a
    subnormal, ties of the E2M1 grid at a scale of one, a NaN, an Inf and a negative zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-140, 120, (n,), generator=gen).float())
    x[:block] = 0
    x[block : 2 * block] = 1e-44
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[2 * block : 2 * block + 8] = ties
    x[2 * block + 8 : 2 * block + 16] = -ties
    x[5 * block + 3] = float("nan")
    x[9 * block] = float("inf")
    x[11 * block + 1] = -0.0
    return x


def buffer_of(fmt, lengths: list[int], shards: int, device):
    """A buffer of ``shards`` messages holding the sequence's codes, block scales and segment scales,
    the sequence cut into ``shards`` runs of whole segments and the messages in reverse order with
    gaps (as ``comm.fp4_reduce.fp4_packing`` places them): ``(buffer bytes, place)``."""
    cuts = [len(lengths) * j // shards for j in range(shards + 1)]
    runs = [lengths[cuts[j] : cuts[j + 1]] for j in range(shards)]
    at, starts = 0, [0] * shards
    for j in reversed(range(shards)):
        n = sum(runs[j])
        starts[j] = (at, at + n // 2 + 4, at + n // 2 + n // fmt.block + 8)  # codes, block scales, segments
        at = -(-(starts[j][2] + 4 * len(runs[j]) + 12) // 4) * 4
    place = {
        "coded": Placement([sum(r) // 2 for r in runs], [s[0] for s in starts], device),
        "groups": Placement([sum(r) // fmt.block for r in runs], [s[1] for s in starts], device),
        "segments": Placement([len(r) for r in runs], [-(-s[2] // 4) for s in starts], device),
    }
    return at, place


def reference_placed(x, fmt, lengths, out, place):
    """``encode_fp4`` of the whole sequence, each section copied to its table's positions."""
    enc = encode_fp4(x, fmt, lengths)
    for key, t in (("coded", enc.codes), ("groups", enc.block_scales)):
        out.index_copy_(0, place[key].index(0, t.numel()).long(), t)
    if fmt.segment_scale:
        seg = enc.segment_scales
        out.view(torch.float32).index_copy_(0, place["segments"].index(0, seg.numel()).long(), seg)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("fmt", sorted(FP4_FORMATS))
def test_encode_placed_is_the_reference(fmt, shards, device):
    """Every byte of the buffer (codes, block scales, segment scales, untouched padding) as
    ``encode_fp4`` and a placement by index give it, over many binades, zero and subnormal blocks,
    ties, NaN and Inf, and segments across programs. Bugs caught: a block scale rounded to nearest
    instead of up, a segment maximum taken over one program's blocks only (atomics missing), a nibble
    order swapped, a block or segment written to another shard's message."""
    from megatron_gift.kernels import fp4

    f = FP4_FORMATS[fmt]
    lengths = [b * f.block for b in SEGMENT_BLOCKS]
    x = values(sum(lengths), f.block, seed=shards).to(device)
    nbytes, place = buffer_of(f, lengths, shards, device)
    seg = torch.tensor(lengths, dtype=torch.int64, device=device)
    got = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device=device)
    want = got.clone()
    fp4.encode_placed(x, f, seg.cumsum(0), got, place)
    reference_placed(x, f, seg, want, place)
    assert torch.equal(got, want), (got != want).nonzero()[:10].flatten().tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", sorted(FP4_FORMATS))
def test_encode_placed_rotates_in_its_passes(fmt, device):
    """``encode_placed`` given a rotation table: every byte of the buffer as ``fwht(x ⊙ s)`` on the rotated
    64-element chunks (``numerics.rotation``, chunk by chunk; the others as they are) then ``encode_fp4``
    and a placement give it, ``x`` itself unchanged; the two passes of NVFP4 agree on the rotated values.
    Bugs caught: a chunk rotated with another's signs or not at all, the segment maxima taken over the
    unrotated values, the even and odd lanes of a block mixed up after the butterflies, ``x`` rotated in place."""
    from megatron_gift.kernels import fp4
    from megatron_gift.numerics.rotation import fwht

    f = FP4_FORMATS[fmt]
    lengths = [b * 64 for b in SEGMENT_BLOCKS]  # segments of whole rotation chunks, as the layout's are
    n = sum(lengths)
    x = values(n, f.block, seed=3).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0) * 1e-3
    gen = torch.Generator().manual_seed(11)
    signs = (torch.randint(0, 2, (7, 64), generator=gen) * 2 - 1).float()
    chunk_rows = torch.randint(-3, 7, (n // 64,), generator=gen).clamp(min=-1)  # about a third unrotated
    rotated = x.clone()
    for c in range(n // 64):
        if chunk_rows[c] >= 0:
            blk = rotated[64 * c : 64 * c + 64].view(1, 64)
            rotated[64 * c : 64 * c + 64] = fwht(blk * signs[chunk_rows[c]], 64).view(-1)
    nbytes, place = buffer_of(f, lengths, 3, device)
    seg = torch.tensor(lengths, dtype=torch.int64, device=device)
    got = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device=device)
    want = got.clone()
    xd = x.to(device)
    fp4.encode_placed(xd, f, seg.cumsum(0), got, place, rotation=(chunk_rows.to(device), signs.to(device)))
    reference_placed(rotated, f, seg.cpu(), want, place)
    assert torch.equal(xd.cpu(), x)
    assert torch.equal(got.cpu(), want.cpu()), (got.cpu() != want.cpu()).nonzero()[:10].flatten().tolist()


def _own_runs(runs: list[tuple[int, int, int]], n: int) -> list[tuple[int, int]]:
    """The ``(position, length)`` runs of ``[0, n)`` not in ``runs`` (a source's), by hand."""
    held = torch.zeros(n, dtype=torch.bool)
    for pos, length, _ in runs:
        held[pos : pos + length] = True
    out, at = [], 0
    while at < n:
        end = at
        while end < n and held[end] == held[at]:
            end += 1
        if not held[at]:
            out.append((at, end - at))
        at = end
    return out


def _split_source(x: torch.Tensor, block: int, dtype, seed: int):
    """``x`` with about half of its blocks (in runs of 1-9) moved into another tensor of ``dtype`` at shuffled
    places with gaps, the values there rounded to ``dtype`` in ``x`` too; what is left in the sequence's own
    buffer at the moved places NaN (never to be read). Returns ``(x as the encode must see it, own buffer,
    source tensor, runs)``."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks, runs, at = x.numel() // block, [], 0
    while at < n_blocks:
        length = int(torch.randint(1, 10, (1,), generator=gen))
        if torch.rand(1, generator=gen) < 0.5:
            runs.append((at * block, min(length, n_blocks - at) * block))
        at += length
    order = torch.randperm(len(runs), generator=gen).tolist()
    src = torch.full((sum(n for _, n in runs) + 7 * len(runs) + 5,), float("nan"), dtype=dtype)
    want, own, placed, start = x.clone(), x.clone(), [], 5
    for i in order:
        pos, n = runs[i]
        src[start : start + n] = x[pos : pos + n].to(dtype)
        want[pos : pos + n] = src[start : start + n].float()
        own[pos : pos + n] = float("nan")
        placed.append((pos, n, start))
        start += n + 7
    return want, own, src, placed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True], ids=["at-positions", "packed"])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", sorted(FP4_FORMATS))
def test_encode_placed_reads_its_source_in_place(fmt, dtype, rotate, packed, device):
    """``encode_placed`` given a ``Source`` (runs of blocks read from another tensor, FP32 or BF16, shuffled,
    with gaps): every byte of the buffer as the encode of the whole sequence gathered first gives it, with and
    without the rotation; the own buffer's elements at the source's runs are NaN and must not be read; the
    ``TRAFFIC`` entries count each value once, in the dtype it is read in; the own buffer given only up to the
    end of its last run, or ``packed`` (the flat FP4 sender's ``G T``) its runs alone, one after another.
    Bugs caught: a run read at another run's offset, a source element read as FP32 bits when it is BF16, the
    own buffer read where the source holds the values (NaN reaches the scales), a run boundary inside a block
    misplaced, the sequence's length taken from the own buffer, a packed own run read at its position in the
    sequence."""
    from megatron_gift.kernels import fp4
    from megatron_gift.kernels.placement import Source
    from megatron_gift.numerics.rotation import fwht

    f = FP4_FORMATS[fmt]
    lengths = [b * 64 for b in SEGMENT_BLOCKS]  # whole rotation chunks, as the layout's are
    n = sum(lengths)
    x = values(n, f.block, seed=5).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).clamp(-1e30, 1e30) * 1e-3
    whole, own, src, runs = _split_source(x, f.block, dtype, seed=int(rotate) + 2 * (dtype == torch.bfloat16))
    rotation, seen = None, whole.clone()
    if rotate:
        gen = torch.Generator().manual_seed(11)
        signs = (torch.randint(0, 2, (7, 64), generator=gen) * 2 - 1).float()
        chunk_rows = torch.randint(-3, 7, (n // 64,), generator=gen).clamp(min=-1)
        for c in range(n // 64):
            if chunk_rows[c] >= 0:
                seen[64 * c : 64 * c + 64] = fwht(
                    seen[64 * c : 64 * c + 64].view(1, 64) * signs[chunk_rows[c]], 64
                ).view(-1)
        rotation = (chunk_rows.to(device), signs.to(device))
    nbytes, place = buffer_of(f, lengths, 3, device)
    seg = torch.tensor(lengths, dtype=torch.int64, device=device)
    got = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device=device)
    want = got.clone()
    source = Source.runs(runs, n, device, packed=packed).on(src.to(device))
    own_runs = _own_runs(runs, n)
    if packed:
        assert source.own == sum(k for _, k in own_runs)
        mine = torch.cat([own[p : p + k] for p, k in own_runs] + [own[:1]])  # one spare value: never read
    else:
        assert source.own == (own_runs[-1][0] + own_runs[-1][1] if own_runs else 0)
        mine = own[: max(1, source.own)]
    with launches_of(fp4) as log:
        fp4.encode_placed(mine.to(device), f, seg.cumsum(0), got, place, rotation, source)
    reference_placed(seen, f, seg.cpu(), want, place)
    assert torch.equal(got.cpu(), want.cpu()), (got.cpu() != want.cpu()).nonzero()[:10].flatten().tolist()
    held = sum(length for _, length, _ in runs)
    values_read = held * src.element_size() + (n - held) * 4 + 24 * source.table.ends.numel()
    plain = dict(log)["_fp4_encode_kernel"]
    extra = fp4.TRAFFIC["_fp4_encode_kernel"](plain)[0] - values_read
    for name, args in log:  # the same tables and scales as without a source, the values once each
        bare = {**args, "SRC": 0}
        assert fp4.TRAFFIC[name](args)[0] - values_read == fp4.TRAFFIC[name](bare)[0] - 4 * n, name
    assert extra > 0


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, every NaN counted as the same NaN."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)))


def _messages(xs, f, lengths):
    """Each sender's ``encode_fp4`` of ``xs[i]`` as one row of a message ``[segment scales | block scales |
    codes]`` (uint8, sections 4-byte aligned), the rows stacked; each one's ``decode_fp4``; the sections'
    byte offsets ``(seg_at, scales_at, codes_at)``."""
    n, seg = sum(lengths), torch.tensor(lengths, dtype=torch.int64)
    seg_at, scales_at = 0, -(-4 * len(lengths) // 16) * 16
    codes_at = scales_at + -(-n // f.block // 4) * 4
    rows, decoded = [], []
    for x in xs:
        enc = encode_fp4(x, f, seg)
        row = torch.zeros(codes_at + n // 2, dtype=torch.uint8)
        row[codes_at:] = enc.codes
        row[scales_at : scales_at + n // f.block] = enc.block_scales
        row[: 4 * len(lengths)] = enc.segment_scales.view(torch.uint8) if f.segment_scale else 0
        rows.append(row)
        decoded.append(decode_fp4(enc, f, seg))
    return torch.stack(rows), decoded, (seg_at, scales_at, codes_at)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("senders", [1, 3])
@pytest.mark.parametrize("fmt", sorted(FP4_FORMATS))
def test_decode_sum_is_the_reference(fmt, senders, device):
    """The FP32 sum of every sender's decoded message, in sender order, bit for bit
    ``ordered_sum(decode_fp4(...))`` (NaN where a block held one). Bugs caught: the senders summed
    in another order, a sender's segment scale read from another's message, a block scale of
    another block."""
    from megatron_gift.kernels import fp4

    f = FP4_FORMATS[fmt]
    lengths = [b * f.block for b in SEGMENT_BLOCKS]
    n, seg = sum(lengths), torch.tensor(lengths, dtype=torch.int64)
    xs = [values(n, f.block, seed=10 + i) * (i + 1) for i in range(senders)]
    msgs, decoded, (seg_at, scales_at, codes_at) = _messages(xs, f, lengths)
    got = fp4.decode_sum(msgs.to(device), n, f, codes_at, scales_at, seg_at, seg.cumsum(0).to(device))
    assert same(got.cpu(), ordered_sum(decoded))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", sorted(FP4_FORMATS))
def test_decode_sum_rotates_back_in_its_pass(fmt, device):
    """``decode_sum`` given a rotation table: bit for bit the senders' ordered FP32 sum with each rotated
    64-element chunk then ``fwht(x) ⊙ s`` (``numerics.rotation``, chunk by chunk; the others as they are),
    one launch, its ``TRAFFIC`` the unrotated decode's plus the chunk table and the signs. Bugs caught: a
    chunk rotated back with another's signs, the signs applied before the butterflies (``H`` for ``Hᵀ``),
    the even and odd lanes interleaved wrongly before the butterflies."""
    from megatron_gift.kernels import fp4
    from megatron_gift.numerics.rotation import fwht

    f = FP4_FORMATS[fmt]
    lengths = [b * 64 for b in SEGMENT_BLOCKS]  # segments of whole rotation chunks, as the layout's are
    n, seg, senders = sum(lengths), torch.tensor(lengths, dtype=torch.int64), 3
    xs = [values(n, f.block, seed=20 + i).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0) * (i + 1) for i in range(senders)]
    msgs, decoded, (seg_at, scales_at, codes_at) = _messages(xs, f, lengths)
    gen = torch.Generator().manual_seed(12)
    signs = (torch.randint(0, 2, (5, 64), generator=gen) * 2 - 1).float()
    chunk_rows = torch.randint(-3, 5, (n // 64,), generator=gen).clamp(min=-1)  # about a third unrotated
    want = ordered_sum(decoded)
    for c in range(n // 64):
        if chunk_rows[c] >= 0:
            want[64 * c : 64 * c + 64] = (fwht(want[64 * c : 64 * c + 64].view(1, 64), 64) * signs[chunk_rows[c]])[0]
    with launches_of(fp4) as log:
        got = fp4.decode_sum(
            msgs.to(device),
            n,
            f,
            codes_at,
            scales_at,
            seg_at,
            seg.cumsum(0).to(device),
            (chunk_rows.to(device), signs.to(device)),
        )
    assert same(got.cpu(), want)
    assert [name for name, _ in log] == ["_fp4_decode_sum_kernel"]
    segs, codes = 4 * len(lengths) if f.segment_scale else 0, n // 2 + n // f.block
    read = senders * (codes + segs) + (8 * len(lengths) if f.segment_scale else 0) + 8 * (n // 64) + 4 * signs.numel()
    assert fp4.TRAFFIC["_fp4_decode_sum_kernel"](log[0][1]) == (read, 4 * n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", sorted(FP4_FORMATS))
def test_launches_and_traffic(fmt, device):
    """NVFP4's encode takes two launches (segment maxima, then the codes), MXFP4's one, the decode-sum
    one, whatever the elements and senders; each ``TRAFFIC`` entry is the bytes of what the launch
    addresses. Bugs caught: a launch per segment or per sender; a traffic formula missing the second
    read of NVFP4's values or the senders' scales."""
    from megatron_gift.kernels import fp4

    f = FP4_FORMATS[fmt]
    seen = set()
    for blocks, senders in ((SEGMENT_BLOCKS, 2), ([b * 3 for b in SEGMENT_BLOCKS], 4)):
        lengths = [b * f.block for b in blocks]
        n = sum(lengths)
        ends = torch.tensor(lengths, dtype=torch.int64, device=device).cumsum(0)
        nbytes, place = buffer_of(f, lengths, 2, device)
        x = values(n, f.block, 0).to(device)
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        scales_at = 4 * len(lengths)
        codes_at = scales_at + -(-n // f.block // 4) * 4
        msgs = torch.zeros(senders, codes_at + n // 2, dtype=torch.uint8, device=device)
        with launches_of(fp4) as log:
            fp4.encode_placed(x, f, ends, buf, place)
            fp4.decode_sum(msgs, n, f, codes_at, scales_at, 0, ends)
        seen.add(tuple(name for name, _ in log))
        traffic = {name: fp4.TRAFFIC[name](args) for name, args in log}
        segs, codes = 4 * len(lengths) if f.segment_scale else 0, n // 2 + n // f.block
        tables = 16 * 2 * 3  # the three placement tables of two shards (ends and delta)
        enc = traffic["_fp4_encode_kernel"]
        assert enc == (4 * n + tables + (8 * len(lengths) + segs if f.segment_scale else 0), codes + segs)
        dec = traffic["_fp4_decode_sum_kernel"]
        assert dec == (senders * (codes + segs) + (8 * len(lengths) if f.segment_scale else 0), 4 * n)
        if f.segment_scale:
            assert traffic["_fp4_amax_kernel"] == (4 * n + 8 * len(lengths), segs)
    amax = ("_fp4_amax_kernel",) if f.segment_scale else ()
    assert seen == {(*amax, "_fp4_encode_kernel", "_fp4_decode_sum_kernel")}, seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inverse", [False, True])
def test_rotate_blocks_is_the_reference(inverse, device):
    """``rotate_blocks`` in place, bit for bit ``numerics.rotation.fwht`` block by block (``fwht(x ⊙ s)``;
    inverse ``fwht(x) ⊙ s``) for blocks at scattered starts (16-element aligned, not 64) with sign rows in
    any order, every other element untouched; one launch for 3 or 300 blocks, its ``TRAFFIC`` the bytes
    it addresses. Bugs caught: a butterfly partner or sign taken from the wrong lane, the signs applied
    on the wrong side, elements outside the blocks written, a launch per block."""
    from megatron_gift.kernels import fp4
    from megatron_gift.numerics.rotation import fwht

    gen = torch.Generator().manual_seed(5)
    signs = (torch.randint(0, 2, (7, 64), generator=gen) * 2 - 1).float()
    for n_blocks in (3, 300):
        starts = torch.arange(n_blocks, dtype=torch.int64) * 96 + 16 * (torch.arange(n_blocks) % 3)
        rows = torch.randint(0, 7, (n_blocks,), generator=gen)
        x = torch.randn(int(starts[-1]) + 64 + 40, generator=gen) * 1e3
        want = x.clone()
        for b in range(n_blocks):
            a, s = int(starts[b]), signs[rows[b]]
            blk = want[a : a + 64].view(1, 64)
            want[a : a + 64] = (fwht(blk, 64) * s if inverse else fwht(blk * s, 64)).view(-1)
        got = x.to(device)
        with launches_of(fp4) as log:
            fp4.rotate_blocks(got, starts.to(device), rows.to(device), signs.to(device), inverse)
        assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))
        assert [name for name, _ in log] == ["_rotate_kernel"]
        assert fp4.TRAFFIC["_rotate_kernel"](log[0][1]) == (
            4 * 64 * n_blocks + 16 * n_blocks + 4 * 7 * 64,
            4 * 64 * n_blocks,
        )


# -- the reductions with the kernels against their PyTorch path, 4 gloo ranks as 2 nodes x 2 -------------


def _worker(rank, world):
    from megatron_gift import kernels as k
    from megatron_gift.comm.fp4_reduce import FP4Reduce, FP4TwoLevelReduce
    from megatron_gift.comm.schedule import reduce_now
    from megatron_gift.comm.sum_first import FP4SumFirstReduce
    from megatron_gift.comm.topology import build_groups
    from megatron_gift.config import IntraNode
    from megatron_gift.kernels import fp4
    from tests.dist.test_comm import _bucket_grads, _transforms
    from tests.dist.test_fp4_exchange import CASES, PER_NODE, ROTATION, _bucket, _layout

    # The two-level intra-node stage's G T of whitened parameters on the PyTorch path in both runs: its
    # kernels agree with it to FP32 rounding only (tests/dist/test_two_level.py), and one rounding can
    # move an FP4 code; this test is about the FP4 kernels, which must then give the same bits.
    # So is the owner's T⁻¹ (its own kernels, checked in tests/unit/test_kernels.py, and below: "t-inverse").
    encode, place, unwhiten = k.whiten_encode, k.whiten_place, k.unwhiten
    k.whiten_encode = lambda g, w, cfg, fused=True, **kw: encode(g, w, cfg, fused=fused and w is None, **kw)
    k.whiten_place = lambda x, w, into, fused=True, output=None, stacked=None: place(
        x, w, into, fused and w is None, output, stacked
    )
    (placed,) = build_groups([dist.group.WORLD], PER_NODE)
    out = {}
    for case in CASES + [(*c, "t-inverse") for c in CASES if c[3] and c[4] == "reduce-scatter"]:
        fmt, two_level, all_reduce, rotation, intra = case[:5]
        (numel, segments), layout = _bucket(rotation), _layout(rotation)
        layout.check_blocks(64 if rotation else FP4_FORMATS[fmt].block, "test")
        k.unwhiten = unwhiten if len(case) > 5 else (lambda s, w, out, fused=True: unwhiten(s, w, out, False))
        for kernels in (False, True) if len(case) == 5 else (True,):
            flat = _bucket_grads(numel, segments, rank)
            common = dict(average=True, all_reduce=all_reduce, rotation=ROTATION if rotation else None, kernels=kernels)
            ts = _transforms(segments)
            if intra == "reduce-scatter":
                red = FP4SumFirstReduce(flat, layout, placed, ts, FP4_FORMATS[fmt], **common)
            elif two_level:
                red = FP4TwoLevelReduce(flat, layout, placed, ts, FP4_FORMATS[fmt], IntraNode(intra), **common)
            else:
                red = FP4Reduce(
                    flat, layout, dist.group.WORLD, ts, FP4_FORMATS[fmt], topology=placed.topology, **common
                )
            assert red.ops.fused is kernels
            with launches_of(fp4) as log, launches_of(k._fused()) as t_log:
                reduce_now(red, "cpu")
            if len(case) > 5:  # the owner's whole GIFT rows through the T⁻¹ kernel
                assert "_unwhiten_kernel" in {name for name, _ in t_log}, case
            ran = {name for name, _ in log}  # the encode and the decode-sum ran where asked, and only there
            assert ran == ({"_fp4_encode_kernel", "_fp4_decode_sum_kernel"} if kernels else set()) | (
                {"_fp4_amax_kernel"} if kernels and fmt == "nvfp4" else set()
            ), (case, ran)  # the rotation inside the encode's and the decode's passes: no pass of its own
            out[(case, kernels)] = flat
    from megatron_gift.numerics import ErrorFeedback

    k.unwhiten = lambda s, w, out, fused=True: unwhiten(s, w, out, False)  # the owner's T⁻¹ as above
    for rotation in (False, True):  # error feedback: the sender's encode is the PyTorch path's on either
        (numel, segments), layout = _bucket(rotation), _layout(rotation)
        for kernels in (False, True):
            ef, ts = ErrorFeedback(layout.n_coded), _transforms(segments)
            common = dict(average=True, rotation=ROTATION if rotation else None, kernels=kernels, error_feedback=ef)
            for step in range(2):  # the second step adds the first's residual
                flat = _bucket_grads(numel, segments, rank + 4 * step)
                red = FP4Reduce(
                    flat, layout, dist.group.WORLD, ts, FP4_FORMATS["nvfp4"], topology=placed.topology, **common
                )
                with launches_of(fp4) as log:
                    reduce_now(red, "cpu")
                ef.commit()
                assert {name for name, _ in log} == ({"_fp4_decode_sum_kernel"} if kernels else set())
            out[("ef", rotation, kernels)] = (flat, ef.residual)
    return out


@pytest.mark.skipif(not INTERPRET, reason="gloo ranks on the CPU: the interpreter's run only")
def test_reductions_with_kernels_are_their_pytorch_path():
    """Flat and two-level, NVFP4 and MXFP4, reduce-scatter and all-reduce, with and without the rotation,
    FP32 and FP8 inside the node or a reduce-scatter first (``comm.sum_first``): each rank's reduced
    bucket with the kernels bit for bit the PyTorch path's (which tests/dist/test_fp4_exchange.py holds
    to a hand FP32 sum), and every rank's the same for all-reduce. Bugs caught: the kernels given another
    shard's segment ends, plain values placed in another class's section, the decode reading the own
    message from the wrong row. With the owner's ``T⁻¹`` in its kernel too (the rotated sum-first cases):
    within two FP32 evaluations' bound of the PyTorch path, ranks bit-identical for all-reduce (a kernel
    given another segment's factors, or rows written at another place, fails). With error feedback (flat
    NVFP4, with and without the rotation, two steps): the bucket and the residual bit for bit the PyTorch
    path's, the kernels running the decode-sum alone (the residual comes from the message's own encode;
    a kernel encode beside it would send other bits than the residual assumes)."""
    from megatron_gift.testing import run_on_ranks
    from tests.dist.test_comm import _transforms
    from tests.dist.test_fp4_exchange import CASES, ROT_SEGMENTS
    from tests.unit.test_whitening import fp32_bound

    results = run_on_ranks(_worker, 4)
    for rotation in (False, True):  # error feedback: the bucket and the residual the PyTorch path's
        for rank in range(4):
            (got, e_got), (want, e_want) = (results[rank][("ef", rotation, k)] for k in (True, False))
            assert same(got, want) and torch.equal(e_got, e_want), (rotation, rank)
    for case in CASES:
        for rank in range(4):
            assert same(results[rank][(case, True)], results[rank][(case, False)]), (case, rank)
        if case[2]:  # all-reduce: every rank holds the whole reduced bucket
            assert all(torch.equal(results[r][(case, True)], results[0][(case, True)]) for r in range(4)), case
    # rows T⁻¹ made by the kernel: each off by at most the bound of its own norm, every other value exact
    bound = max(fp32_bound(w.dense()[0], 2) for w in _transforms(ROT_SEGMENTS) if w is not None)
    for case in [c for c in CASES if c[3] and c[4] == "reduce-scatter"]:
        got = [results[rank][((*case, "t-inverse"), True)] for rank in range(4)]
        for rank in range(4):
            want = results[rank][(case, False)]
            assert torch.isfinite(got[rank]).all() and float((got[rank] - want).norm()) <= bound * float(want.norm())
        if case[2]:
            assert all(torch.equal(g, got[0]) for g in got), case


SUM_FIRST_SHAPES = [(1, 64, "euclidean"), (40, 256, "gift"), (30, 128, "gift"), (44, 256, "gift")]
SUM_FIRST_SHAPES += [(20, 256, "euclidean")]
"""Two GIFT parameters of 256 columns (padding between them in a ``RowsAt``), one of 128, two Euclidean ones; the
first one shifts the others so that shards of 3,840 elements cut GIFT rows (cut pieces: their projections)."""


def _sum_first_layout():
    from megatron_gift.comm.layout import BucketLayout, Segment
    from megatron_gift.config import Mode
    from megatron_gift.numerics.fp8 import CodecConfig

    segments, at = [], 0
    for i, (rows, cols, mode) in enumerate(SUM_FIRST_SHAPES):
        segments.append(Segment(at, rows, cols, Mode(mode), f"p{i}"))
        at += rows * cols
    return BucketLayout(-(-at // (64 * 8)) * 64 * 8, 8, segments, CodecConfig(), torch.float32)


def _sum_first_transforms(seed):
    from megatron_gift.numerics.whitening import LowRankWhitening

    gen, ts = torch.Generator().manual_seed(seed), []
    for _, cols, mode in SUM_FIRST_SHAPES:
        w = None
        if mode == "gift":
            w = LowRankWhitening.empty(cols, 4)
            for t in w.tensors().values():
                t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
        ts.append(w)
    return ts


def _sum_first_rows(layout, rank, ts, held, kernels, log_module=None):
    """``FP4SumFirstReduce._rows`` of rank ``rank`` (8 ranks, 2 nodes x 4) on the node's sums ``held``: the
    reduction, what the stage hands on (its ``coded`` values and cut pieces' projections ``own``) and the
    launches of ``log_module``."""
    from megatron_gift.comm.sum_first import FP4SumFirstReduce
    from megatron_gift.comm.topology import Topology, TwoLevelGroups
    from megatron_gift.testing.simulate import FakeGroup, recorded_collectives

    topo = Topology(2, 4)
    groups = TwoLevelGroups(FakeGroup(8, rank), topo, FakeGroup(4, topo.local(rank)), FakeGroup(2, topo.node(rank)))
    red = FP4SumFirstReduce(torch.zeros(layout.numel), layout, groups, ts, FP4_FORMATS["nvfp4"], kernels=kernels)
    assert red.ops.fused is kernels
    stages, log = red.stages(), []
    with recorded_collectives():  # the cut pieces' all-to-all recorded, not run
        sent = stages[0](StageResult())
        sent.held_sums.copy_(held)  # the node's reduce-scatter (a FakeGroup's leaves it unset)
        if log_module is None:
            step = stages[1](sent)
        else:
            with launches_of(log_module) as log:
                step = stages[1](sent)
    return red, step, log


def coded_sequence(red, step, held: torch.Tensor) -> torch.Tensor:
    """The held coded sequence after ``_rows`` (``step``: what it handed on) as the PyTorch path holds it: its
    ``coded`` values with the runs of its ``source`` (the Euclidean parts, read by the encode in the held sums
    ``held`` where the kernels run) taken from there, and the cut pieces (which ``_node_sums`` whitens into
    place) as the held sums hold them."""
    src = step.source
    seq = torch.full((step.coded.numel() if src is None else src.n,), float("nan"))
    seq[: step.coded.numel() if src is None else src.own] = step.coded[: len(seq) if src is None else src.own]
    for p in red._tables(held.device).pieces:
        seq[p.src] = held[p.held].float()
    if src is not None:
        start = 0
        for end, d, held in zip(src.table.ends.tolist(), src.table.delta.tolist(), src.held.tolist()):
            if held:
                seq[start:end] = src.tensor[start + d : end + d].float()
            start = end
    return seq


@pytest.mark.skipif(not INTERPRET, reason="the kernels on the CPU: the interpreter's run only")
@pytest.mark.parametrize("rank", [2, 7])
def test_sum_first_whole_rows_of_every_shape_through_the_kernels(rank):
    """The sum-first node sums' whitening stage (``FP4SumFirstReduce._rows``) with the kernels, every GIFT
    parameter of a shape in one ``RowsAt`` (two of 256 columns, padding between them; one of 128), against
    its PyTorch path on the same held sums: the whole rows' ``G T`` to FP32 rounding, every other coded value
    (cut pieces, the Euclidean parameter) exact, nothing left unset; one launch per width. Bugs caught: a
    parameter's rows whitened with another's ``T`` or placed at another's positions, the Euclidean values or
    cut pieces lost when the whole rows are left out of the gather, the Euclidean values (read by the encode
    in the held sums where the kernels run) looked up at another place there."""
    from megatron_gift.comm.topology import Topology
    from megatron_gift.kernels import place

    topo, layout, ts = Topology(2, 4), _sum_first_layout(), _sum_first_transforms(3)
    held = torch.randn(topo.nodes * layout.shard_size, generator=torch.Generator().manual_seed(4))
    coded = {}
    for kernels in (False, True):
        red, step, log = _sum_first_rows(layout, rank, ts, held, kernels, place)
        held_shards = [m * topo.ranks_per_node + topo.local(rank) for m in range(topo.nodes)]
        widths = {layout.segments[s].cols for j in held_shards for s, r0, r1 in layout.shards[j].gift_rows if r1 > r0}
        assert len([name for name, _ in log if name == "_place_kernel"]) == (len(widths) if kernels else 0)
        coded[kernels] = coded_sequence(red, step, held)
        assert (step.source is not None) == kernels  # the Euclidean parameter read where it lies, not gathered
    ref, got = coded[False], coded[True]
    assert torch.isfinite(got).all()
    close = (got - ref).abs() <= 1e-5 * ref.abs().max()
    assert close.all(), int((~close).sum())
    gift = sum(r * c for r, c, m in SUM_FIRST_SHAPES if m == "gift")
    assert (got == ref).sum() >= ref.numel() - gift // topo.ranks_per_node


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.skipif(not INTERPRET, reason="CPU"))])
@pytest.mark.parametrize("rank", [2, 7])
def test_sum_first_factor_stacks_follow_every_change_of_the_factors(rank, kernels):
    """The sum-first reduction keeps its whitenings' stacked factors with the layout, across steps: a step
    after a refresh (new transforms) and one after a transform written in place (a checkpoint's load) give
    bit for bit what a fresh layout gives (the whole rows' ``G T`` and the cut pieces' projections), and a
    steady step stacks nothing. Bugs caught: stacks kept from before a refresh or an in-place write."""
    from megatron_gift.comm.topology import Topology

    topo, layout = Topology(2, 4), _sum_first_layout()
    held = torch.randn(topo.nodes * layout.shard_size, generator=torch.Generator().manual_seed(4))
    ts = _sum_first_transforms(3)
    _sum_first_rows(layout, rank, ts, held, kernels)  # stacks built for ts
    refreshed = _sum_first_transforms(5)
    with OpCounter() as ops:  # a steady step: the stacks kept
        _sum_first_rows(layout, rank, ts, held, kernels)
    assert ops.by_op["stack"] == 0, ops.by_op
    for step, ws in (("refresh", refreshed), ("in place", refreshed)):
        if step == "in place":
            for w in refreshed:  # the same transforms written in place, as a checkpoint's load writes them
                if w is not None:
                    w.q.mul_(-1.5)
        red, got, _ = _sum_first_rows(layout, rank, ws, held, kernels)
        fresh, want, _ = _sum_first_rows(_sum_first_layout(), rank, ws, held, kernels)
        assert same(coded_sequence(red, got, held), coded_sequence(fresh, want, held)), step
        assert same(got.own, want.own), step
        assert got.own.abs().sum() > 0  # the shards cut rows: the pieces' stacks were read
