"""Fused Triton kernels vs the pure-PyTorch reference: codes, scales and the rank sum bit for bit,
the whitening ``T`` and ``T⁻¹`` to FP32 rounding.

On the CPU the kernels run under Triton's interpreter, which has to be on (``TRITON_INTERPRET=1``)
when the kernels are defined (``kernels.fused`` is imported at their first use, or by
``test_kernels_compile_for_sm90``): ``test_kernels_under_interpreter`` runs this file again in a
fresh process with it set, where the kernel tests below run on the CPU. Without the variable they
run on CUDA (``gpu``-marked: skipped on machines without it). The interpreter run also checks
``QuantizedReduce`` with the kernels forced on against its PyTorch path, on two gloo ranks."""

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from megatron_gift import kernels
from megatron_gift.comm import quantized
from megatron_gift.comm.layout import BucketLayout, Segment
from megatron_gift.comm.packing import packing
from megatron_gift.comm.quantized import decode_gathered
from megatron_gift.comm.schedule import reduce_now
from megatron_gift.config import Mode
from megatron_gift.kernels import reference_decode_sum_unwhiten, reference_whiten_encode
from megatron_gift.kernels.placement import Placement
from megatron_gift.kernels.reference import reference_sum_rows, reference_take
from megatron_gift.numerics.error_feedback import ErrorFeedback
from megatron_gift.numerics.fp8 import CodecConfig, Encoded, FP8Format, Scaling, encode, encode_flat, group_lengths
from megatron_gift.numerics.two_sided import OutputRows
from megatron_gift.numerics.whitening import LowRankWhitening
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.dispatch import OpCounter, SyncSanitizer
from megatron_gift.testing.kernel_log import assert_passes_under_interpreter, kernel_signature
from megatron_gift.testing.limits import wall_limit
from tests.unit.test_whitening import fp32_bound

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ["cpu"] if INTERPRET else [pytest.param("cuda", marks=pytest.mark.gpu)]
CONFIGS = [CodecConfig(fmt=f, scaling=s) for f in FP8Format for s in Scaling]
SHAPES = [(1, 1), (1, 300), (20, 257)]
KERNELS = {
    "fused": ["_encode_kernel", "_decode_sum_kernel", "_project_kernel", "_unwhiten_kernel"],
    "receive": ["_decode_placed_kernel", "_sum_kernel"],
}
CUDA_GRID = (2**31 - 1, 65535, 65535)  # the most programs a CUDA grid holds per dimension


class Launches:
    """Records each Triton launch of ``fused``'s kernels as ``(kernel, grid)``."""

    def __init__(self, monkeypatch):
        import importlib

        self.log: list[tuple[str, tuple]] = []
        for module, names in KERNELS.items():
            module = importlib.import_module(f"megatron_gift.kernels.{module}")
            for name in names:
                monkeypatch.setattr(module, name, _Recorded(getattr(module, name), name, self.log))

    def since(self, mark: int) -> list[str]:
        return [name for name, _ in self.log[mark:]]


class _Recorded:
    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append((self.name, tuple(grid)))
        return self.kernel[grid]


@pytest.fixture
def kernels_only(monkeypatch):
    """Fails any call that would fall back to the reference, records the Triton launches (the
    test must launch one) and holds every grid to CUDA's limits (65,535 programs on dimensions 1
    and 2: a 1-D parameter of ~8M elements once failed there)."""

    def fallback(*args, **kwargs):
        raise AssertionError("fell back to the PyTorch reference")

    for name in ("whiten_encode", "decode_sum_unwhiten", "decode_placed", "sum_rows", "take"):
        monkeypatch.setattr(kernels, f"reference_{name}", fallback)
    launches = Launches(monkeypatch)
    yield launches
    assert launches.log, "no Triton kernel ran"
    for name, grid in launches.log:
        assert all(0 < n <= limit for n, limit in zip(grid, CUDA_GRID)), (name, grid)


def _gradient(rows, cols, seed, device, special=True):
    """Magnitudes over many binades; with ``special``: NaN (both signs), ±Inf, a zero block, FP32
    subnormals and -0."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(rows, cols, generator=gen) * torch.exp(3 * torch.randn(rows, cols, generator=gen))
    if special and rows * cols > 1:
        flat = g.view(-1)
        n = flat.numel()
        odd = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-40, -3e-42, -0.0])
        flat[torch.randperm(n, generator=gen)[: len(odd)]] = odd[:n]
        g[-1, : min(cols, 130)] = 0.0
    return g.to(device)


def _whitening(cols, rank, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * cols + 8, cols, generator=gen) * torch.linspace(0.1, 3.0, cols)
    return LowRankWhitening.from_statistics(x.T @ x / x.shape[0], rank, device=device)


def _assert_same_encoding(enc, ref):
    assert enc.payload.dtype == torch.uint8 and enc.payload.shape == ref.payload.shape
    assert enc.scales.dtype == ref.scales.dtype and enc.scales.shape == ref.scales.shape
    assert torch.equal(enc.payload, ref.payload)
    assert torch.equal(enc.scales.view(-1).view(torch.uint8), ref.scales.view(-1).view(torch.uint8))


def _assert_same_bits(x, ref):
    """Bitwise equal FP32 tensors, any NaN counting as equal to any NaN."""
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(x), nan)
    assert torch.equal(torch.where(nan, 0.0, x).view(torch.int32), torch.where(nan, 0.0, ref).view(torch.int32))


def _assert_fp32_close(x, ref, w):
    """Two FP32 evaluations of ``X T`` or ``X T⁻¹`` (other summation orders): each row is a
    vector-matrix product, off by at most ``d · eps · κ(T)`` of its norm (test_whitening.fp32_bound)."""
    assert torch.isfinite(x).all()
    bound = fp32_bound(w.dense()[0], 2)
    assert ((x - ref).norm(dim=1) <= bound * ref.norm(dim=1)).all(), float(
        ((x - ref).norm(dim=1) / ref.norm(dim=1)).max()
    )


def _messages(world, rows, cols, cfg, device, special):
    encs = [encode(_gradient(rows, cols, seed, device, special), cfg) for seed in range(world)]
    return torch.stack([e.payload.reshape(-1) for e in encs]), torch.stack([e.scales.reshape(-1) for e in encs])


@pytest.mark.parametrize("device", DEVICES)
def test_available(device):
    assert kernels.available(torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_encode_is_bitwise_the_codec(device, shape, cfg, kernels_only):
    g = _gradient(*shape, seed=1, device=device)
    _assert_same_encoding(kernels.whiten_encode(g, None, cfg), encode(g, cfg))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", [f.wire for f in FP8Format], ids=lambda f: f.name)
def test_encode_rounds_every_fp8_value_and_tie(device, fmt, kernels_only):
    """Rows of one 1x128 block that start with fp8_max (scale 1): every FP8 value, the midpoints
    between neighbours (ties to even) and the FP32 numbers on either side, both signs."""
    values = torch.arange(fmt.max_code + 1, dtype=torch.uint8).view(fmt.dtype).float()
    mid = (values[1:] + values[:-1]) / 2
    inf = torch.full_like(mid, float("inf"))
    x = torch.cat([values, mid, torch.nextafter(mid, inf), torch.nextafter(mid, -inf), torch.tensor([1e-45, 2e-39])])
    x = torch.cat([x, -x])
    per_row = 127
    x = torch.cat([x, x.new_zeros(-x.numel() % per_row)]).view(-1, per_row)
    g = torch.cat([torch.full((x.shape[0], 1), fmt.max), x], dim=1).to(device)
    cfg = CodecConfig(fmt=fmt)
    ref = encode(g, cfg)
    assert (ref.scales == 1).all()
    _assert_same_encoding(kernels.whiten_encode(g, None, cfg), ref)


WHITEN_CASES = [(CodecConfig(scaling=s), (20, 257), 4) for s in Scaling] + [
    (CodecConfig(fmt=FP8Format.E5M2), (20, 257), 4),
    (CodecConfig(), (1, 200), 4),
    (CodecConfig(), (20, 257), 0),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg,shape,rank", WHITEN_CASES, ids=lambda v: getattr(v, "name", None))
def test_whiten_encode(device, cfg, shape, rank, kernels_only):
    """``U = G T`` to FP32 rounding, and its encoding bit for bit the codec's encoding of that ``U``."""
    g = _gradient(*shape, seed=2, device=device, special=False)
    w = _whitening(shape[1], rank, device)
    u, u_ref = torch.empty_like(g), torch.empty_like(g)
    enc = kernels.whiten_encode(g, w, cfg, out=u)
    reference_whiten_encode(g, w, cfg, out=u_ref)
    _assert_fp32_close(u, u_ref, w)
    _assert_same_encoding(enc, encode(u, cfg))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg,shape,rank", WHITEN_CASES, ids=lambda v: getattr(v, "name", None))
def test_whiten_encode_writes_the_residual_in_place(device, cfg, shape, rank, kernels_only):
    """Error feedback with ``e'`` the residual ``e`` itself, as ``ErrorFeedback.feedback`` hands it: the
    codes and the new residual bit for bit those with ``e'`` a buffer of its own. Bug caught: a pass
    that reads ``e`` where the kernel already wrote ``e'`` (a maxima pass after the encode, a chunk
    read again after its store; on CUDA a load moved past a store to what it took for another address)."""
    g = _gradient(*shape, seed=3, device=device, special=False)
    w = _whitening(shape[1], rank, device)
    e = (torch.randn(g.numel(), generator=torch.Generator().manual_seed(5)) * 0.01).to(device)
    apart = torch.full_like(e, float("nan"))
    ref = kernels.whiten_encode(g, w, cfg, feedback=(e, apart))
    in_place = e.clone()
    _assert_same_encoding(kernels.whiten_encode(g, w, cfg, feedback=(in_place, in_place)), ref)
    assert torch.isfinite(apart).all() and torch.equal(in_place.view(torch.int32), apart.view(torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (9, 300)])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_decode_sum_is_bitwise(device, average, shape, cfg, kernels_only):
    payloads, scales = _messages(3, *shape, cfg, device, special=True)
    out = kernels.decode_sum_unwhiten(payloads, scales, *shape, None, cfg, average)
    _assert_same_bits(out, reference_decode_sum_unwhiten(payloads, scales, *shape, None, cfg, average))


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_wider_than_a_chunk(device, kernels_only):
    """1 x 5000 blocks, wider than ``fused.MAX_TILE`` (read in two chunks): the encoding and the
    rank sum bit for bit the codec's and the reference's; a block scaled by one chunk's maximum fails."""
    cfg, shape = CodecConfig(block=5000), (2, 6000)
    g = _gradient(*shape, seed=12, device=device)
    g[0, 4500:5000] *= 1e3  # the first block's maximum in its second chunk
    _assert_same_encoding(kernels.whiten_encode(g, None, cfg), encode(g, cfg))
    payloads, scales = _messages(3, *shape, cfg, device, special=True)
    out = kernels.decode_sum_unwhiten(payloads, scales, *shape, None, cfg, True)
    _assert_same_bits(out, reference_decode_sum_unwhiten(payloads, scales, *shape, None, cfg, True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("rank", [0, 4])
@pytest.mark.parametrize("cfg", [CodecConfig(), CodecConfig(scaling=Scaling.ROW)], ids=lambda c: c.name)
def test_decode_sum_unwhiten(device, average, rank, cfg, kernels_only):
    rows, cols = 9, 300
    payloads, scales = _messages(3, rows, cols, cfg, device, special=False)
    w = _whitening(cols, rank, device)
    out = kernels.decode_sum_unwhiten(payloads, scales, rows, cols, w, cfg, average)
    _assert_fp32_close(out, reference_decode_sum_unwhiten(payloads, scales, rows, cols, w, cfg, average), w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank", [0, 4])
def test_unwhiten_is_t_inverse_rounded_once(device, rank, kernels_only):
    """``kernels.unwhiten`` (the FP4 owner's ``T⁻¹`` of whole rows): within two FP32 evaluations' bound of
    ``LowRankWhitening.inverse`` in FP64, into BF16 the FP32 result rounded once (bit for bit), one launch
    for the projection (none at rank 0) and one for the pass. Bugs caught: ``Qᵀ`` applied with ``c`` for
    ``c⁻¹``, ``D^{-1/2}`` for ``D^{1/2}``, a BF16 output rounded from a BF16 intermediate."""
    rows, cols = 9, 300
    s = _gradient(rows, cols, seed=5, device=device, special=False)
    w = _whitening(cols, rank, device)
    mark = len(kernels_only.log)
    fp32 = kernels.unwhiten(s, w, torch.empty_like(s))
    assert kernels_only.since(mark) == ["_project_kernel"] * (rank > 0) + ["_unwhiten_kernel"]
    w64 = LowRankWhitening.from_tensors({k: t.double() for k, t in w.tensors().items()})
    _assert_fp32_close(fp32.double(), w64.inverse(s.double()), w)
    bf16 = kernels.unwhiten(s, w, torch.empty(rows, cols, dtype=torch.bfloat16, device=device))
    assert torch.equal(bf16.view(torch.int16), fp32.bfloat16().view(torch.int16))


# Groups other than the matrix codec's, as kernels.whiten_encode takes them with ``lengths``:
# "cut": a [7, 300] weight's groups cut at shard boundaries (mid-row and mid-group, at a row's
# start, leaving groups of one element); "long": one row of three groups, one longer than a
# BLOCK/MX chunk (as padding sent as one group is); "wide": rows wider than fused.MAX_TILE, one cut;
# "rows": one group per row, coarser than a BLOCK/MX codec's (a row's groups not where its blocks are).
LENGTHS = {
    "cut": ((7, 300), [1, 450, 600, 1000, 1001, 2099]),
    "long": ((1, 400), None),
    "wide": ((2, 4500), [100]),
    "rows": ((3, 400), "rows"),
}


def _lengths(layout, cfg, device, dtype=torch.int64):
    """``((rows, cols), lengths)`` of a ``LENGTHS`` layout."""
    (rows, cols), cuts = LENGTHS[layout]
    if cuts is None:
        lengths = torch.tensor([3, 300, 97])
    elif cuts == "rows":
        lengths = torch.full((rows,), cols)
    else:
        ends = torch.cumsum(group_lengths(rows, cols, cfg), 0)
        lengths = torch.diff(torch.unique(torch.cat([torch.zeros(1, dtype=torch.int64), ends, torch.tensor(cuts)])))
    assert int(lengths.sum()) == rows * cols
    return (rows, cols), lengths.to(device, dtype)


def _flat_encoding(x, lengths, cfg):
    """``fp8.encode_flat`` of ``x [rows, cols]``, its payload in the shape of ``x``."""
    enc = encode_flat(x.reshape(-1), lengths.long(), cfg)
    return Encoded(payload=enc.payload.view(x.shape), scales=enc.scales)


ENCODE_LENGTHS_CASES = (
    [(cfg, "cut", torch.int64) for cfg in CONFIGS]  # TENSOR's groups many rows long (kernels.TensorUnits)
    + [(CodecConfig(), "cut", torch.int32), (CodecConfig(), "long", torch.int64)]
    + [(CodecConfig(scaling=Scaling.MX), "long", torch.int64), (CodecConfig(scaling=Scaling.ROW), "wide", torch.int64)]
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg,layout,dtype", ENCODE_LENGTHS_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_encode_with_lengths_is_bitwise_the_codec(device, cfg, layout, dtype, kernels_only):
    """Groups cut mid-row, of one element, or longer than a chunk (int64 or int32 lengths): codes
    and flat scales bit for bit ``encode_flat``'s, special values included. A unit that finds its
    group's start, length or scale wrongly, or a long group scaled by a partial maximum, fails."""
    (rows, cols), lengths = _lengths(layout, cfg, device, dtype)
    g = _gradient(rows, cols, seed=3, device=device)
    _assert_same_encoding(kernels.whiten_encode(g, None, cfg, lengths=lengths), _flat_encoding(g, lengths, cfg))


GROUPED_WHITEN_CASES = [(CodecConfig(scaling=s), "cut", 4) for s in Scaling] + [
    (CodecConfig(), "cut", 0),
    (CodecConfig(fmt=FP8Format.E5M2), "cut", 4),
    (CodecConfig(), "long", 4),
    (CodecConfig(scaling=Scaling.MX), "long", 4),
    (CodecConfig(), "rows", 4),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg,layout,rank", GROUPED_WHITEN_CASES, ids=lambda v: getattr(v, "name", v))
def test_whiten_encode_with_lengths(device, cfg, layout, rank, kernels_only):
    """With ``lengths``: ``U = G T`` to FP32 rounding (into a non-contiguous ``out``), and its
    encoding bit for bit ``encode_flat``'s of that ``U``; a unit with the wrong row or columns of
    ``T``, a long group whose ``U`` differs between the amax and the encoding pass, or groups coarser
    than the codec's found by the window search alone (``_ROW_GROUPS`` unchecked), fails."""
    (rows, cols), lengths = _lengths(layout, cfg, device)
    g = _gradient(rows, cols, seed=4, device=device, special=False)
    w = _whitening(cols, rank, device)
    u, u_ref = torch.empty(cols, rows, device=device).T, torch.empty_like(g)
    enc = kernels.whiten_encode(g, w, cfg, out=u, lengths=lengths)
    reference_whiten_encode(g, w, cfg, out=u_ref, lengths=lengths)
    _assert_fp32_close(u, u_ref, w)
    _assert_same_encoding(enc, _flat_encoding(u, lengths, cfg))


# A taller weight whose groups are cut at shard boundaries: two cuts in one block, one at a row's
# second element, one at a row's start, one before a row's last element.
TALL = ((37, 300), [301, 302, 5 * 300 + 77, 5 * 300 + 90, 20 * 300, 33 * 300 + 299])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", list(Scaling), ids=lambda s: s.name.lower())
@pytest.mark.parametrize("groups", [None, "layout", "cut"])
def test_row_layouts_over_several_row_blocks(device, scaling, groups, kernels_only, monkeypatch):
    """The sender with whitening when each program takes several blocks of rows (``ROW_PROGRAMS``
    lowered: one program per column slot over three blocks of 16 rows, the last partial), without
    ``lengths`` (``_ROW_BLOCKS``), with the codec's groups or with them cut at shard boundaries
    (``_ROW_GROUPS``): ``U = G T`` to FP32 rounding and codes and scales bit for bit the codec's of
    that ``U``. Bugs caught: a program that skips or repeats a block of rows, a unit after a cut
    taken by no column slot or by two, a masked row's unit written."""
    from megatron_gift.kernels import fused

    monkeypatch.setattr(fused, "ROW_PROGRAMS", 1)
    cfg = CodecConfig(scaling=scaling)
    (rows, cols), cuts = TALL
    lengths = None
    if groups is not None:
        ends = torch.cumsum(group_lengths(rows, cols, cfg), 0)
        cuts = torch.tensor(cuts if groups == "cut" else [], dtype=torch.int64)
        lengths = torch.diff(torch.unique(torch.cat([torch.zeros(1, dtype=torch.int64), ends, cuts]))).to(device)
    tiling = fused._Tiling.of(cfg, rows, cols, None if lengths is None else lengths.numel(), row_blocks=True)
    assert (tiling.row_steps, tiling.n_row_blocks) == (3, 1)
    g = _gradient(rows, cols, seed=5, device=device, special=False)
    w = _whitening(cols, 4, device)
    u, u_ref = torch.empty_like(g), torch.empty_like(g)
    enc = kernels.whiten_encode(g, w, cfg, out=u, lengths=lengths)
    reference_whiten_encode(g, w, cfg, out=u_ref, lengths=lengths)
    _assert_fp32_close(u, u_ref, w)
    _assert_same_encoding(enc, encode(u, cfg) if lengths is None else _flat_encoding(u, lengths, cfg))


@pytest.mark.parametrize("device", DEVICES)
def test_placed_cast_over_several_row_blocks(device, kernels_only, monkeypatch):
    """``whiten_place`` (the two-level sender's BF16 wire) with each program taking several blocks of rows
    (``place.ROW_PROGRAMS`` lowered) writes the same bits as with one block per program, which the
    placed-cast tests check against the reference. Bugs caught: a block of rows skipped, repeated or
    written at another block's positions."""
    from megatron_gift.kernels import place

    rows, cols = 37, 300
    g = _gradient(rows, cols, seed=6, device=device, special=False)
    w = _whitening(cols, 4, device)
    table = Placement([rows * cols - 5, 5], [3, 7], device)
    outs = []
    for programs in (place.ROW_PROGRAMS, 1):
        monkeypatch.setattr(place, "ROW_PROGRAMS", programs)
        out = torch.full((rows * cols + 10,), 7.0, dtype=torch.bfloat16, device=device)
        kernels.whiten_place(g, w, table.at(out, 0))
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert (outs[0][:3] == 7.0).all()  # the gap before the first shard untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_placed_cast_reads_rows_where_they_lie(device, dtype, kernels_only):
    """``whiten_place`` of a ``RowsAt`` (the summed-first sender's whole GIFT rows, read in the node's sums
    by their starts, ``G Q`` included) writes the bits it writes for the same rows gathered into a matrix.
    Rows out of order, with gaps between them and the buffer's last row among them. Bugs caught: a row read
    at ``i·cols`` or at another row's start, the projection reading other rows than the pass, the last
    row's mask."""
    rows, cols = 21, 96
    buffer = _gradient(1, 40 * cols + 7, seed=9, device=device, special=False).view(-1).to(dtype)
    starts = torch.randperm(40, generator=torch.Generator().manual_seed(3))[:rows] * cols + 7
    starts[0] = buffer.numel() - cols  # the buffer's last row
    starts = starts.to(device)
    at = kernels.RowsAt.of_one(buffer, starts, cols)
    dense = torch.stack([buffer[a : a + cols] for a in starts.tolist()])
    w = _whitening(cols, 4, device)
    table = Placement([rows * cols - 40, 40], [5, rows * cols], device)
    outs = []
    for x, ws in ((at, [w]), (dense, w)):
        out = torch.full((2 * rows * cols,), 7.0, device=device)
        kernels.whiten_place(x, ws, table.at(out, 0))
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
    assert kernels_only.since(0).count("_project_kernel") == 2  # both through the kernels
    with pytest.raises(ValueError, match="RowsAt"):
        kernels.whiten_place(at, None, table.at(outs[0], 0))


@pytest.mark.parametrize("device", DEVICES)
def test_placed_cast_of_several_matrices_in_one_launch(device, kernels_only):
    """``whiten_place`` of a ``RowsAt`` holding three matrices of one width (the summed-first sender's whole rows
    of every GIFT parameter of a shape: one ``G Q`` and one pass for them all): each matrix's rows whitened
    with its own ``T`` (to FP32 rounding of the reference's per-matrix ``G T``) at its place, the padding
    between spans neither read nor written. Bugs caught: every row whitened with the first matrix's ``D`` or
    ``Q`` (a block's matrix misread), a span's rows placed at another's positions, padding written."""
    cols, counts = 96, (21, 140, 5)  # spans at rows 0, 128 and 384 (ROW_ALIGN), padding between
    pads, matrix, spans = kernels.placement.aligned_rows(list(counts), device)
    total = sum(counts) + sum(pads)
    buffer = _gradient(1, 200 * cols, seed=4, device=device, special=False).view(-1)
    perm = torch.randperm(200, generator=torch.Generator().manual_seed(5))
    starts, k = [], 0
    for n, pad in zip(counts, pads):
        starts += (perm[k : k + n] * cols).tolist() + [-1] * pad
        k += n
    starts = torch.tensor(starts, dtype=torch.int64, device=device)
    at = kernels.RowsAt(buffer, starts, cols, matrix, spans)
    ws = [_whitening(cols, 4, device, seed=s) for s in range(3)]
    table = Placement([total * cols], [3], device)  # the sequence at 3 on
    out = torch.full((total * cols + 10,), 7.0, device=device)
    kernels.whiten_place(at, ws, table.at(out, 0))
    assert kernels_only.since(0).count("_project_kernel") == 1  # one G Q for the three matrices
    for (r0, n), w in zip(spans, ws):
        ref = kernels.reference.sender_values(at.gathered(r0, n), w, None)
        got = out[3 + r0 * cols : 3 + (r0 + n) * cols].view(n, cols)
        _assert_fp32_close(got, ref, w)
    written = torch.zeros(out.numel(), dtype=torch.bool)
    for r0, n in spans:
        written[3 + r0 * cols : 3 + (r0 + n) * cols] = True
    assert (out.cpu()[~written] == 7.0).all()  # padding rows and the gaps untouched


def _fp64(w, d):
    """Dense FP64 ``(T, |T|)`` of ``w`` (its own FP32 tensors, exactly converted; ``T = I`` of size ``d``
    for None): ``T = D^{-1/2} (I + Q diag(c) Qᵀ)`` and the magnitudes of its factors,
    ``|T| = D^{-1/2} (I + |Q| diag(|c|) |Q|ᵀ)``, that bound the FP32 evaluation's rounding."""
    if w is None:
        eye = torch.eye(d, dtype=torch.float64)
        return eye, eye
    d_inv, q, c = (v.double().cpu() for v in (w.d_inv_sqrt, w.q, w.c))
    eye = torch.eye(d, dtype=torch.float64)
    return d_inv[:, None] * (eye + (q * c) @ q.T), d_inv[:, None] * (eye + (q.abs() * c.abs()) @ q.abs().T)


# (cfg, r_in (None: no input side), r_out, groups): [150, 70] weights, more rows than a program of
# the two-sided projection takes (fused.OUTPUT_ROWS: its parts of Pre summed); "cut": the matrix
# codec's groups cut at shard-like boundaries (a row's start, mid-row, one-element groups).
TWO_SIDED_CASES = [
    (CodecConfig(), 4, 3, None),
    (CodecConfig(scaling=Scaling.ROW), 4, 3, None),
    (CodecConfig(FP8Format.E5M2, Scaling.MX), 4, 5, "cut"),
    (CodecConfig(), None, 3, "cut"),
    (CodecConfig(scaling=Scaling.TENSOR), None, 3, None),
    (CodecConfig(), 4, 0, None),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg,r_in,r_out,groups", TWO_SIDED_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_two_sided_encode_against_dense_fp64(device, cfg, r_in, r_out, groups, kernels_only):
    """``whiten_encode`` and ``whiten_place`` with an output side (``OutputRows``, ``Pre`` formed by the
    kernels in the read of ``G`` that gives ``G Q_in``): ``U = T_outᵀ G T_in`` against the dense FP64
    product, the kernels', the reference's and the FP32 cast's alike, and the codes and scales bit for
    bit the codec's of the kernels' ``U``. Bugs caught: a program's part of ``Pre`` dropped or summed
    twice, ``Q_out``/``D_out`` rows misaligned with a unit's row (groups cut mid-row), ``c_out`` or
    ``D_out`` applied twice or not at all in ``P = X Q_in'``, ``T_outᵀ`` skipped without an input side.

    Tolerance (componentwise, first order): every element of ``U`` is FP32 sums of at most
    ``n = d_out + d_in + r_out + r_in + 4`` products (``Pre``, ``P``, the rank-1 updates, the scalings),
    off by at most ``γ_n = n·2^-24`` times the same sums in magnitudes, ``|T_out|ᵀ |G| |T_in|``
    (``_fp64``); asserted normwise at ``2 γ_n`` of it (the factor for second-order terms)."""
    rows, cols = 150, 70
    g = _gradient(rows, cols, seed=21, device=device, special=False)
    w_in = _whitening(cols, r_in, device) if r_in is not None else None
    w_out = _whitening(rows, r_out, device, seed=1)
    (t_out, m_out), (t_in, m_in) = _fp64(w_out, rows), _fp64(w_in, cols)
    want = t_out.T @ g.double().cpu() @ t_in
    n = rows + cols + r_out + (r_in or 0) + 4
    bound = 2 * n * 2.0**-24 * (m_out.T @ g.double().cpu().abs() @ m_in).norm().item()
    lengths = None
    if groups == "cut":
        ends = torch.cumsum(group_lengths(rows, cols, cfg), 0)
        cuts = torch.tensor([0, 1, 70 * 40, 70 * 40 + 33, 70 * 99 + 1, 70 * 130 + 69])
        lengths = torch.diff(torch.unique(torch.cat([ends, cuts]))).to(device)
    u, u_ref = torch.empty_like(g), torch.empty_like(g)
    enc = kernels.whiten_encode(g, w_in, cfg, out=u, lengths=lengths, output=OutputRows.of(w_out))
    reference_whiten_encode(g, w_in, cfg, out=u_ref, lengths=lengths, output=OutputRows.of(w_out))
    for got in (u, u_ref):
        assert (got.double().cpu() - want).norm().item() <= bound, ((got.double().cpu() - want).norm().item(), bound)
    _assert_same_encoding(enc, encode(u, cfg) if lengths is None else _flat_encoding(u, lengths, cfg))
    placed = torch.full((rows * cols + 3,), 7.0, device=device)  # elements [2, n) placed after a gap of 3
    kernels.whiten_place(
        g, w_in, Placement([2, rows * cols - 2], [0, 5], device).at(placed, 0), output=OutputRows.of(w_out)
    )
    got = torch.cat([placed[:2], placed[5:]]).view(rows, cols)
    assert (got.double().cpu() - want).norm().item() <= bound and (placed[2:5] == 7.0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_encode_reads_half_precision(device, dtype, kernels_only):
    """A BF16/FP16 gradient is read as FP32 in the kernel: the codes and scales of ``encode(g.float())``."""
    g = _gradient(20, 257, seed=6, device=device).to(dtype)
    _assert_same_encoding(kernels.whiten_encode(g, None, CodecConfig()), encode(g.float(), CodecConfig()))


def _received(world, rows, cols, cfg, device, lengths=None, special=True):
    """``world`` ranks' messages as ``[world, ·]`` payloads and scales, and as views into one receive
    buffer laid out as on the wire (each row: the scales, then the payload; rows strided)."""
    encs = []
    for seed in range(world):
        g = _gradient(rows, cols, 10 + seed, device, special)
        encs.append(encode(g, cfg) if lengths is None else _flat_encoding(g, lengths, cfg))
    payloads = torch.stack([e.payload.reshape(-1) for e in encs])
    scales = torch.stack([e.scales.reshape(-1) for e in encs])
    scale_bytes = scales.shape[1] * scales.element_size()
    offset = -(-scale_bytes // 4) * 4
    buf = torch.zeros(world, offset + -(-payloads.shape[1] // 4) * 4 + 4, dtype=torch.uint8, device=device)
    buf[:, :scale_bytes] = scales.view(torch.uint8)
    buf[:, offset : offset + payloads.shape[1]] = payloads
    return (payloads, scales), (buf[:, offset : offset + payloads.shape[1]], buf[:, :scale_bytes].view(scales.dtype))


# Parts of the ranks' rows: one tensor, or (before the own rank, own, after) for 5 ranks.
SPLITS = {"tensor": None, "middle": (2, 1, 2), "first": (0, 1, 4), "last": (4, 1, 0)}


def _split(t, counts):
    """``t``'s rows as parts of ``counts`` rows each (``t`` itself for None)."""
    if counts is None:
        return t
    ends = list(itertools.accumulate(counts))
    return [t[a:b] for a, b in zip([0, *ends], ends)]


DECODE_CASES = (
    [(cfg, None, "middle") for cfg in CONFIGS]
    + [(cfg, "cut", "middle") for cfg in CONFIGS]  # TENSOR's groups many rows long (kernels.TensorUnits)
    + [
        (cfg, "cut", split)
        for cfg in (CodecConfig(), CodecConfig(FP8Format.E5M2, Scaling.MX))
        for split in ("tensor", "first", "last")
    ]
    + [(CodecConfig(), "long", "middle"), (CodecConfig(scaling=Scaling.ROW), "wide", "middle")]
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg,layout,split", DECODE_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_decode_parts_is_bitwise(device, cfg, layout, split, kernels_only):
    """The rank sum of 5 ranks given as parts of a receive buffer (strided rows, an empty part
    first or last), with groups cut mid-row or longer than a chunk: bit for bit the reference's
    from contiguous messages, summed and averaged; a part skipped, added out of order or read with
    the wrong row stride, or a group's scale misplaced, fails."""
    (rows, cols), lengths = _lengths(layout, cfg, device) if layout else ((7, 300), None)
    (payloads, scales), (recv_payloads, recv_scales) = _received(5, rows, cols, cfg, device, lengths)
    parts = (_split(recv_payloads, SPLITS[split]), _split(recv_scales, SPLITS[split]))
    for average in (False, True):
        out = kernels.decode_sum_unwhiten(*parts, rows, cols, None, cfg, average, lengths=lengths)
        ref = reference_decode_sum_unwhiten(payloads, scales, rows, cols, None, cfg, average, lengths=lengths)
        _assert_same_bits(out, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "cfg,layout",
    [(c, "cut") for c in CONFIGS]
    + [
        (CodecConfig(), None),
        (CodecConfig(FP8Format.E5M2, Scaling.MX), None),
        (CodecConfig(scaling=Scaling.TENSOR), None),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
@pytest.mark.filterwarnings(
    "ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning"
)  # numpy, interpreted
def test_decode_every_code_and_scale(device, cfg, layout, kernels_only):
    """Every FP8 code (NaN and Inf codes, subnormals, -0) times FP32 scales from subnormal to
    huge, or every E8M0 scale (2^-127, a subnormal, to +Inf): the rank sum bit for bit the
    reference's (NaN as NaN). A wrong code table, a flushed subnormal or an E8M0 decode other
    than ``fp8.scale_values`` fails."""
    (rows, cols), lengths = _lengths(layout, cfg, device) if layout else ((7, 300), None)
    world, n = 3, rows * cols
    n_groups = lengths.numel() if layout else cfg.groups(rows, cols)[0] * cfg.groups(rows, cols)[1]
    payloads = (torch.arange(world * n) * 7 % 256).to(torch.uint8).view(world, n)
    gen = torch.Generator().manual_seed(7)
    if cfg.scaling is Scaling.MX:
        scales = torch.randint(0, 256, (world, n_groups), generator=gen, dtype=torch.uint8)
        scales.view(-1)[: min(256, scales.numel())] = torch.arange(min(256, scales.numel()), dtype=torch.uint8)
    else:
        pool = torch.tensor([2.0**-126, 1e-40, 0.1, 1.0, 7.5, 3e35])
        scales = pool[torch.randint(0, len(pool), (world, n_groups), generator=gen)]
    payloads, scales = payloads.to(device), scales.to(device)
    for average in (False, True):
        out = kernels.decode_sum_unwhiten(payloads, scales, rows, cols, None, cfg, average, lengths=lengths)
        ref = reference_decode_sum_unwhiten(payloads, scales, rows, cols, None, cfg, average, lengths=lengths)
        _assert_same_bits(out, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank", [0, 4])
@pytest.mark.parametrize("cfg", [CodecConfig(), CodecConfig(scaling=Scaling.MX)], ids=lambda c: c.name)
def test_decode_sum_unwhiten_parts_with_lengths(device, rank, cfg, kernels_only):
    """Parts of a receive buffer and groups cut mid-row, then ``T⁻¹``: the reference's to FP32 rounding."""
    (rows, cols), lengths = _lengths("cut", cfg, device)
    (payloads, scales), (recv_payloads, recv_scales) = _received(5, rows, cols, cfg, device, lengths, special=False)
    w = _whitening(cols, rank, device)
    parts = (_split(recv_payloads, SPLITS["middle"]), _split(recv_scales, SPLITS["middle"]))
    out = kernels.decode_sum_unwhiten(*parts, rows, cols, w, cfg, True, lengths=lengths)
    _assert_fp32_close(
        out, reference_decode_sum_unwhiten(payloads, scales, rows, cols, w, cfg, True, lengths=lengths), w
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank", [None, 4])
def test_launches_do_not_grow_with_ranks(device, rank, kernels_only):
    """Decode: one launch for the rank sum of any number of ranks in three parts (+ ``P'`` and
    ``T⁻¹`` with whitening), the same ATen ops at 2, 5 and 9 ranks; encode: fixed launches; none of
    them synchronises the host (``SyncSanitizer``). A loop over ranks or parts on the host, or a
    ``.item()``, fails."""
    cfg = CodecConfig()
    (rows, cols), cut = _lengths("cut", cfg, device)
    w = None if rank is None else _whitening(cols, rank, device)
    whitening = [] if w is None else ["_project_kernel"]
    g = _gradient(rows, cols, seed=8, device=device, special=False)
    for lengths in (None, cut):
        mark = len(kernels_only.log)
        with SyncSanitizer() as sync:
            kernels.whiten_encode(g, w, cfg, lengths=lengths)
        assert kernels_only.since(mark) == [*whitening, "_encode_kernel"] and not sync.events, sync.counts()
        ops = {}
        for world in (2, 5, 9):
            _, (recv_payloads, recv_scales) = _received(world, rows, cols, cfg, device, lengths, special=False)
            split = (1, 1, world - 2)
            mark = len(kernels_only.log)
            with SyncSanitizer() as sync, OpCounter() as count:
                kernels.decode_sum_unwhiten(
                    _split(recv_payloads, split), _split(recv_scales, split), rows, cols, w, cfg, True, lengths=lengths
                )
            assert not sync.events, sync.counts()
            unwhiten = [] if w is None else ["_project_kernel", "_unwhiten_kernel"]
            assert kernels_only.since(mark) == ["_decode_sum_kernel", *unwhiten]
            ops[world] = count.by_op
        assert ops[2] == ops[5] == ops[9], ops


class _Allocated(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the new storages the ATen ops under it return (what they allocate)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        given = {a.untyped_storage().data_ptr() for a in leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.bytes += t.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank", [None, 4])
def test_tensor_scaling_with_lengths_runs_in_units(device, rank, kernels_only):
    """Per-tensor groups cut by shards (each many rows long), as ``--gift-scaling tensor`` sends a weight
    across shards: encode in two ``_encode_kernel`` passes (into a tensor, and placed into two shards'
    messages as the bucket's sender does), decode in one ``_decode_sum_kernel``, no host
    sync, codes and scales bit for bit ``encode_flat``'s and the sum the reference's, and ATen allocations
    beyond the codes under 1 B per element (the units' index arrays: ~12 int64 per 512 elements) where the
    reference's unchunked temporaries take over 10. A fallback to the reference, a group's scale taken from
    part of its rows, or an FP32 temporary of the gradient's size (4 B/element) fails."""
    cfg = CodecConfig(FP8Format.E4M3, Scaling.TENSOR)
    rows, cols = 48, 1100  # a row of three units, the last partial
    n = rows * cols
    lengths = torch.tensor([1000, n - 3100, 2100], device=device)  # cut mid-row: groups of 1 to 45 rows
    g = _gradient(rows, cols, seed=12, device=device, special=False)
    w = None if rank is None else _whitening(cols, rank, device)
    u = torch.empty_like(g)
    mark = len(kernels_only.log)
    with SyncSanitizer() as sync, _Allocated() as alloc:
        enc = kernels.whiten_encode(g, w, cfg, out=u, lengths=lengths)
    assert not sync.events, sync.counts()
    assert kernels_only.since(mark) == ["_project_kernel"] * (w is not None) + ["_encode_kernel"] * 2
    assert (alloc.bytes - enc.payload.numel()) / n < 1.0, alloc.bytes / n
    _assert_same_encoding(enc, _flat_encoding(u, lengths, cfg))
    # placed, as the bucket's sender writes a segment into its messages: the codes at two shards' places
    # (split where a shard cuts the weight, mid-row: a group boundary), the group scales beside them
    buf = torch.zeros(n + 64, dtype=enc.payload.dtype, device=device)
    sbuf = torch.zeros(8, dtype=enc.scales.dtype, device=device)
    into = kernels.Placed(
        Placement([1000, n - 1000], [0, 1000 + 64], device).at(buf, 0), Placement([3], [2], device).at(sbuf, 0)
    )
    with SyncSanitizer() as sync, _Allocated() as alloc:
        kernels.whiten_encode(g, w, cfg, out=u, lengths=lengths, into=into)
    assert not sync.events, sync.counts()
    assert alloc.bytes / n < 1.0, alloc.bytes / n
    codes = enc.payload.reshape(-1)
    assert torch.equal(buf[:1000].view(torch.uint8), codes[:1000].view(torch.uint8))
    assert torch.equal(buf[1064:].view(torch.uint8), codes[1000:].view(torch.uint8))
    assert torch.equal(sbuf[2:5], enc.scales.reshape(-1))
    with _Allocated() as alloc:
        reference_whiten_encode(g, w, cfg, lengths=lengths)
    assert alloc.bytes / n > 10, alloc.bytes / n  # what the count sees on the reference's path
    payloads = torch.stack([enc.payload.view(-1), enc.payload.view(-1).flip(0), enc.payload.view(-1)])
    scales = torch.stack([enc.scales, enc.scales.flip(0) * 3, enc.scales / 2])
    out = torch.empty(rows, cols, device=device)
    mark = len(kernels_only.log)
    with SyncSanitizer() as sync, _Allocated() as alloc:
        kernels.decode_sum_unwhiten(payloads, scales, rows, cols, None, cfg, False, lengths=lengths, out=out)
    assert not sync.events, sync.counts()
    assert kernels_only.since(mark) == ["_decode_sum_kernel"] and alloc.bytes / n < 1.0, alloc.bytes / n
    ref = reference_decode_sum_unwhiten(payloads, scales, rows, cols, None, cfg, False, lengths=lengths)
    _assert_same_bits(out, ref)


def _bits(x):
    """``x`` as FP32 (exact from BF16/FP16) for ``_assert_same_bits``."""
    return x.float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [None, 4])
def test_decode_into_a_bucket_slice(device, dtype, rank, kernels_only):
    """The rank sum written straight into a slice of a bucket in the bucket's dtype (nothing else of
    the bucket touched): without ``T`` bit for bit the reference's FP32 result rounded once to that
    dtype; with ``T⁻¹`` bit for bit the kernels' own FP32 result rounded once (the FP32 sum kept for
    ``P' = S Q``). A sum rounded before ``T⁻¹``, a second rounding, or a write beside the slice fails."""
    cfg = CodecConfig()
    (rows, cols), lengths = _lengths("cut", cfg, device)
    w = None if rank is None else _whitening(cols, rank, device)
    (payloads, scales), (recv_payloads, recv_scales) = _received(5, rows, cols, cfg, device, lengths, special=w is None)
    parts = (_split(recv_payloads, SPLITS["middle"]), _split(recv_scales, SPLITS["middle"]))
    bucket = torch.full((rows * cols + 10,), 7.0, dtype=dtype, device=device)
    got = kernels.decode_sum_unwhiten(*parts, rows, cols, w, cfg, True, lengths=lengths, out=bucket[5:-5])
    assert got.data_ptr() == bucket[5:].data_ptr() and got.shape == (rows, cols)
    assert (bucket[:5] == 7).all() and (bucket[-5:] == 7).all()
    if w is None:
        want = reference_decode_sum_unwhiten(payloads, scales, rows, cols, None, cfg, True, lengths=lengths)
    else:
        want = kernels.decode_sum_unwhiten(*parts, rows, cols, w, cfg, True, lengths=lengths)
    _assert_same_bits(_bits(got), _bits(want.to(dtype)))


# Five shards of 241: "a" (GIFT) has a row cut by the first boundary; shard 2 holds plain values
# only and shard 4 nothing (zero-size entries of every table, in the middle and at the end).
PLACED_LAYOUT = (
    1205,
    [
        Segment(0, 8, 40, Mode.GIFT, "a"),
        Segment(330, 1, 30, Mode.OFF, "norm"),
        Segment(360, 3, 40, Mode.EUCLIDEAN, "b"),
        Segment(482, 1, 241, Mode.OFF, "big"),
        Segment(730, 1, 30, Mode.BF16, "bias"),
        Segment(760, 2, 102, Mode.EUCLIDEAN, "d"),
    ],
)
PLACED_CONFIGS = [
    CodecConfig(),
    CodecConfig(scaling=Scaling.ROW),
    CodecConfig(FP8Format.E5M2, Scaling.MX),
    CodecConfig(FP8Format.E5M2, Scaling.TENSOR),
]


def _gathered(layout, slots, device):
    """An all-gathered buffer of one message per shard (shard ``j`` in slot ``slots[j]``): random
    finite codes of either sign, scales from subnormal to large, plain values N(0, 1); its packing."""
    order = sorted(range(layout.num_shards), key=lambda j: slots[j])
    width = layout.max_message_bytes
    gp = packing(layout, list(range(layout.num_shards)), [[j] for j in order], None, device, width)
    gen = torch.Generator().manual_seed(21)
    size = layout.num_shards * width
    codes = torch.randint(0, 0x70, (size,), generator=gen) | torch.randint(0, 2, (size,), generator=gen) << 7
    buf = codes.to(device, torch.uint8)
    views = quantized.views(buf, layout)
    n_groups = layout.n_groups
    if layout.codec.scaling is Scaling.MX:
        scales = torch.randint(100, 150, (n_groups,), generator=gen, dtype=torch.uint8)
    else:
        scales = torch.tensor([2.0**-126, 1e-3, 0.1, 1.0, 7.5, 3e4])[torch.randint(0, 6, (n_groups,), generator=gen)]
    views["groups"].index_copy_(0, gp.place["groups"].index(0, n_groups).long(), scales.to(device))
    for c, name in enumerate(("off", "bf16")):
        n = layout.n_plain[c]
        values = torch.randn(n, generator=gen).to(device, views[name].dtype)
        views[name].index_copy_(0, gp.place[name].index(0, n).long(), values)
    return buf, gp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", PLACED_CONFIGS, ids=lambda c: c.name)
def test_gathered_decode_reads_at_table_positions(device, dtype, cfg, monkeypatch):
    """``decode_gathered`` on the kernels (codes, scales and plain values read at the packing's table
    positions in the kernel; slots out of shard order; a cut row, a shard of plain values only, an
    empty shard) against its PyTorch path (``index_select`` of a per-element index): Euclidean and
    plain values bit for bit, GIFT ones to FP32 rounding of ``T⁻¹``; one placed decode per coded
    segment, one placed read per plain one. A wrong shard lookup (an empty shard not skipped), a
    scale of the wrong shard or a slot order ignored fails."""
    numel, segments = PLACED_LAYOUT
    layout = BucketLayout(numel, 5, segments, cfg, dtype)
    transforms = [
        _whitening(s.cols, 4, device, seed=k) if s.mode is Mode.GIFT else None for k, s in enumerate(segments)
    ]
    slots = [1, 3, 0, 4, 2]
    gathered, _ = _gathered(layout, slots, device)
    want = torch.full((numel,), 3.0, dtype=dtype, device=device)
    decode_gathered(gathered, layout, transforms, want, slots, kernels.CodecOps(False))
    launches = Launches(monkeypatch)
    got = torch.full((numel,), 3.0, dtype=dtype, device=device)
    decode_gathered(gathered, layout, transforms, got, slots, kernels.CodecOps(True))
    placed = [name for name, _ in launches.log if name in KERNELS["receive"]]
    # TENSOR scaling first reads the group scales of "a", the weight cut by a shard (one placed read).
    reads = ["_sum_kernel"] if cfg.scaling is Scaling.TENSOR else []
    assert placed == reads + ["_decode_placed_kernel"] * 3 + ["_sum_kernel"] * 3, placed
    for k, s in enumerate(segments):
        a, b = got[s.start : s.end], want[s.start : s.end]
        if transforms[k] is None:
            _assert_same_bits(_bits(a), _bits(b))
        else:
            _assert_fp32_close(a.float().view(s.rows, s.cols), b.float().view(s.rows, s.cols), transforms[k])
    gaps = torch.ones(numel, dtype=torch.bool)
    for s in segments:
        gaps[s.start : s.end] = False
    assert (got[gaps] == 3).all()


# Sizes of a table's source shards (zero-size ones included) and where each starts in a buffer of 1000.
TABLE = ([3, 0, 700, 0, 5, 2], [10, 0, 100, 60, 20, 40])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", ["tensor", "middle", "first", "last"])
@pytest.mark.parametrize(
    "dtype,out_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
def test_sum_rows_is_bitwise(device, split, dtype, out_dtype, kernels_only):
    """The rank sum of 5 senders' float values (parts of strided rows, an empty part first or last)
    bit for bit ``reference_sum_rows`` (``ordered_sum`` in FP32, ``÷ R``, one rounding to the
    output's dtype), into a tensor and at a table's positions (zero-size shards between); one
    placed read likewise. A row skipped or added out of order, a division before the sum, or a
    lookup that lands an element in the wrong shard fails."""
    sizes, starts = TABLE
    n = sum(sizes)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, n + 6, generator=gen) * torch.exp(4 * torch.randn(5, n + 6, generator=gen))
    x[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    x[:, 3] = -0.0
    rows = x.to(dtype).to(device)[:, 2 : n + 2]  # strided rows
    parts = _split(rows, SPLITS[split])
    table = Placement(sizes, starts, device)
    for average in (False, True):
        got = kernels.sum_rows(parts, average, out=torch.empty(n, dtype=out_dtype, device=device))
        _assert_same_bits(
            _bits(got), _bits(reference_sum_rows(parts, average, torch.empty(n, dtype=out_dtype, device=device)))
        )
        buf, ref = (torch.full((1000,), 9.0, dtype=out_dtype, device=device) for _ in range(2))
        kernels.sum_rows(parts, average, out=table.at(buf, 0))
        reference_sum_rows(parts, average, table.at(ref, 0))
        _assert_same_bits(_bits(buf), _bits(ref))
    src = torch.randn(1000, generator=gen).to(dtype).to(device)
    for at, m in ((0, n), (3, 703)):
        got = kernels.take(table.at(src, at), torch.empty(m, dtype=out_dtype, device=device))
        _assert_same_bits(
            _bits(got), _bits(reference_take(table.at(src, at), torch.empty(m, dtype=out_dtype, device=device)))
        )


# A 1-D parameter of more groups than CUDA grids hold on dimension 1 (where the old grid put
# cdiv(cols, block)): one-element groups keep it cheap in the interpreter; CUDA also runs ~8.4M
# elements of 1x128 blocks.
GRID_CASES = [(CodecConfig(block=1), 70_000)] + ([] if INTERPRET else [(CodecConfig(), 65_600 * 128)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg,cols", GRID_CASES, ids=lambda v: getattr(v, "name", v))
def test_one_row_of_more_than_65535_tiles(device, cfg, cols, kernels_only):
    """Encode and decode of a ``[1, cols]`` parameter with more than 65,535 groups, with and
    without lengths, bit for bit the codec's and the reference's; ``kernels_only`` holds the grids
    to CUDA's limits."""
    assert cols // cfg.block > 65_535
    g = _gradient(1, cols, seed=9, device=device)
    ref = encode(g, cfg)
    for lengths in (None, group_lengths(1, cols, cfg, device=device)):
        enc = kernels.whiten_encode(g, None, cfg, lengths=lengths)
        _assert_same_encoding(enc, ref if lengths is None else Encoded(ref.payload, ref.scales.reshape(-1)))
        payloads, scales = enc.payload.view(1, -1).expand(2, -1), enc.scales.reshape(1, -1).expand(2, -1)
        out = kernels.decode_sum_unwhiten(payloads, scales, 1, cols, None, cfg, True, lengths=lengths)
        _assert_same_bits(
            out, reference_decode_sum_unwhiten(payloads, scales, 1, cols, None, cfg, True, lengths=lengths)
        )


# Two shards of 800: "c" has a row cut by the boundary (row 0: 20 columns in shard 0) and whole
# rows 1-4 in shard 1; "b" lies in shard 0 and "d" in shard 1, whole.
COMM_LAYOUT = (
    1600,
    [
        Segment(0, 12, 40, Mode.GIFT, "a"),
        Segment(480, 1, 7, Mode.OFF, "norm"),
        Segment(512, 5, 50, Mode.EUCLIDEAN, "b"),
        Segment(780, 5, 100, Mode.GIFT, "c"),
        Segment(1300, 1, 6, Mode.BF16, "bias"),
        Segment(1320, 3, 90, Mode.EUCLIDEAN, "d"),
    ],
)
# (codec, all_reduce, average); "e5m2-tensor" has no block in "c" (its group spans the cut row).
COMM_CASES = [
    (codec, all_reduce, not all_reduce)
    for codec in ("e4m3-block", "e5m2-tensor", "e4m3-row", "e4m3-mx")
    for all_reduce in (False, True)
]


def _comm_inputs(world):
    numel, segments = COMM_LAYOUT
    grads = [torch.zeros(numel) for _ in range(world)]
    for k, s in enumerate(segments):
        for rank, g in enumerate(grads):
            g[s.start : s.end] = _gradient(s.rows, s.cols, 100 * rank + k, "cpu", special=False).view(-1)
    transforms = [_whitening(s.cols, 4, "cpu", seed=k) if s.mode is Mode.GIFT else None for k, s in enumerate(segments)]
    return grads, transforms


def _comm_worker(rank, world):
    """Each case through ``QuantizedReduce`` twice, the PyTorch path then the kernels forced on,
    counting the kernels' launches; a fallback to the kernels' reference with them forced on fails."""
    from megatron_gift.kernels import fused

    forced = [False]

    def fallback(reference):
        def call(*args, **kwargs):
            assert not forced[0], "fell back to the PyTorch reference"
            return reference(*args, **kwargs)

        return call

    kernels.reference_whiten_encode = fallback(kernels.reference_whiten_encode)
    kernels.reference_decode_sum_unwhiten = fallback(kernels.reference_decode_sum_unwhiten)
    calls = {"whiten_encode": 0, "decode_sum_unwhiten": 0}
    for name in calls:

        def counted(*args, _f=getattr(fused, name), _name=name, **kwargs):
            calls[_name] += 1
            return _f(*args, **kwargs)

        setattr(fused, name, counted)
    numel, segments = COMM_LAYOUT
    grads, transforms = _comm_inputs(world)
    out = {}
    for codec, all_reduce, average in COMM_CASES:
        layout = BucketLayout(numel, world, segments, CodecConfig(*codec.split("-")), torch.float32)
        for use in (False, True):
            before, forced[0] = dict(calls), use
            flat = grads[rank].clone()
            group = dist.group.WORLD
            reduce_now(
                quantized.QuantizedReduce(
                    flat, layout, group, transforms, average=average, all_reduce=all_reduce, kernels=use
                ),
                "cpu",
            )
            out[(codec, all_reduce, average, use)] = (flat, {k: calls[k] - before[k] for k in calls})
    # Error feedback on the kernels too: every coded element's residual written (to a buffer of its own,
    # NaN before); in place, the same bits.
    from tests.staged_residual import StagedResidual

    layout = BucketLayout(numel, world, segments, CodecConfig(), torch.float32)
    for use in (False, True):
        forced[0] = use
        efs = (ErrorFeedback(layout.n_coded), StagedResidual(torch.zeros(layout.n_coded)))
        for ef in efs:
            reduce_now(
                quantized.QuantizedReduce(
                    grads[rank].clone(), layout, dist.group.WORLD, transforms, error_feedback=ef, kernels=use
                ),
                "cpu",
            )
        out[("ef", use)] = efs[1].staged
        out[("ef in place", use)] = efs[0].residual
    return out


def _run(args, **env):
    env = {**os.environ, **env}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=wall_limit(900))


if INTERPRET:

    def test_quantized_reduce_with_kernels():
        """Kernel path vs PyTorch path of ``QuantizedReduce``: Euclidean and plain values bit for
        bit, GIFT ones to FP32 rounding; the result within FP8 error of the FP32 reduction and, for
        the all-reduce, bit-identical on both ranks; the kernels actually ran."""
        world = 2
        results = run_on_ranks(_comm_worker, world, timeout=300)
        numel, segments = COMM_LAYOUT
        grads, transforms = _comm_inputs(world)
        # G T before the codes, S T⁻¹ after the sum: FP32 in other orders (test_whitening.fp32_bound)
        fp32_tol = 2 * max(fp32_bound(t.dense()[0], 2) for t in transforms if t is not None)
        gift = torch.zeros(numel, dtype=torch.bool)
        for s in segments:
            gift[s.start : s.end] = s.mode is Mode.GIFT
        for codec, all_reduce, average in COMM_CASES:
            reference = torch.stack(grads).double().sum(0) / (world if average else 1)
            for rank, res in enumerate(results):
                torch_path, _ = res[(codec, all_reduce, average, False)]
                kernel_path, calls = res[(codec, all_reduce, average, True)]
                key = (codec, all_reduce, average, rank)
                assert calls["whiten_encode"] > 0 and calls["decode_sum_unwhiten"] > 0, (key, calls)
                lo, hi = (0, numel) if all_reduce else (rank * numel // world, (rank + 1) * numel // world)
                got, want, g = kernel_path[lo:hi], torch_path[lo:hi], gift[lo:hi]
                assert torch.equal(got[~g], want[~g]), key
                assert float((got[g] - want[g]).norm()) <= fp32_tol * float(want[g].norm()), key
                ref = reference[lo:hi]
                tol = 0.08 if codec.startswith("e4m3") else 0.16
                assert float((got.double() - ref).norm()) < tol * float(ref.norm()), key
                if all_reduce:
                    assert torch.equal(kernel_path, results[0][(codec, all_reduce, average, True)][0]), key
        # Residuals: Euclidean ones bit for bit; GIFT ones are of U = G T computed in another FP32
        # order (bitwise against the reference of the kernel's own U: tests/unit/test_send.py).
        layout = BucketLayout(numel, world, segments, CodecConfig(), torch.float32)
        euclidean = torch.zeros(layout.n_coded, dtype=torch.bool)
        for i in layout.coded_segments:
            s = layout.segments[i]
            euclidean[layout.seg_at[i] : layout.seg_at[i] + s.rows * s.cols] = s.mode is Mode.EUCLIDEAN
        for res in results:
            assert torch.isfinite(res[("ef", True)]).all() and torch.isfinite(res[("ef", False)]).all()
            assert torch.equal(res[("ef", True)][euclidean], res[("ef", False)][euclidean])
            for use in (False, True):
                assert torch.equal(res[("ef in place", use)].view(torch.int32), res[("ef", use)].view(torch.int32))

else:  # the outer run only, so that the interpreter run's summary has no skips

    def test_kernels_under_interpreter():
        """The kernel tests of this file on the CPU, in Triton's interpreter, in a fresh process."""
        assert_passes_under_interpreter(__file__)

    from megatron_gift.testing.kernel_log import (
        E4M3,
        E5M2_MX,
        GROUPS,
        IN_ORDER,
        ORDERED,
        ROW_BLOCKS,
        ROW_GROUPS,
        ROWS_AT,
        UNPLACED,
    )

    PROJECT_16, PROJECT_64 = dict(BM=16, BK=64, BR=32, BO=16), dict(BM=64, BK=16, BR=32, BO=32)

    # (kernel, its constexprs, FMA contraction as the launcher sets it, whether it divides)
    SM90_CASES = [
        (
            "_encode_kernel",
            dict(PASS=2, WHITEN=True, STORE_U=True, FMAX=448.0, **ROW_BLOCKS, **E4M3, **UNPLACED),
            True,
            True,
        ),
        (
            "_encode_kernel",
            dict(PASS=2, WHITEN=True, STORE_U=True, FMAX=448.0, **ROW_GROUPS, **E4M3, **UNPLACED),
            False,
            True,
        ),
        (
            "_encode_kernel",
            dict(PASS=0, WHITEN=True, STORE_U=False, FMAX=57344.0, **ROW_GROUPS, **E5M2_MX, **UNPLACED),
            False,
            False,
        ),
        (
            "_encode_kernel",
            dict(PASS=1, WHITEN=True, STORE_U=True, FMAX=57344.0, **ROW_GROUPS, **E5M2_MX, **UNPLACED),
            False,
            True,
        ),
        (
            "_encode_kernel",
            dict(PASS=1, WHITEN=False, STORE_U=False, FMAX=448.0, **ORDERED, **E4M3, **UNPLACED),
            False,
            True,
        ),
        # the sender's: placed into the messages, with error feedback
        (
            "_encode_kernel",
            dict(
                PASS=2,
                WHITEN=True,
                STORE_U=False,
                FMAX=448.0,
                PLACE=True,
                FEEDBACK=True,
                OUTPUT=False,
                **ROW_GROUPS,
                **E4M3,
            ),
            False,
            True,
        ),
        (
            "_encode_kernel",
            dict(
                PASS=1,
                WHITEN=False,
                STORE_U=False,
                FMAX=57344.0,
                PLACE=True,
                FEEDBACK=False,
                OUTPUT=False,
                **GROUPS,
                **E5M2_MX,
            ),
            False,
            True,
        ),
        # two-sided (T_outᵀ in the pass), placed
        (
            "_encode_kernel",
            dict(
                PASS=2,
                WHITEN=True,
                STORE_U=False,
                FMAX=448.0,
                PLACE=True,
                FEEDBACK=False,
                OUTPUT=True,
                **ROW_GROUPS,
                **E4M3,
            ),
            False,
            True,
        ),
        ("_project_kernel", dict(SCALE_D=True, PROJECT=True, OUTPUT=False, **PROJECT_16, **IN_ORDER), True, False),
        ("_project_kernel", dict(SCALE_D=True, PROJECT=True, OUTPUT=False, **PROJECT_16, **ROWS_AT), True, False),
        ("_project_kernel", dict(SCALE_D=True, PROJECT=True, OUTPUT=True, **PROJECT_64, **IN_ORDER), True, False),
        ("_place_kernel", dict(WHITEN=True, OUTPUT=False, CAST=2, **IN_ORDER), True, False),
        ("_place_kernel", dict(WHITEN=True, OUTPUT=False, CAST=0, **ROWS_AT), True, False),
        ("_place_kernel", dict(WHITEN=True, OUTPUT=True, CAST=2, **IN_ORDER), True, False),
        ("_place_kernel", dict(WHITEN=False, OUTPUT=False, CAST=0, BLOCK_R=1, BLOCK_C=1024, **IN_ORDER), True, False),
        ("_decode_sum_kernel", dict(AVERAGE=True, BF16=False, **GROUPS, **E4M3), False, True),
        ("_decode_sum_kernel", dict(AVERAGE=False, BF16=True, **ORDERED, **E5M2_MX), False, False),
        ("_unwhiten_kernel", dict(BF16=False), True, False),
        ("_unwhiten_kernel", dict(BF16=True), True, False),
        ("_decode_placed_kernel", dict(BF16=True, **GROUPS, **E4M3), False, False),
        ("_decode_placed_kernel", dict(BF16=False, **ORDERED, **E5M2_MX), False, False),
        ("_sum_kernel", dict(AVERAGE=True, PLACE=2, BLOCK=1024, BF16=True), False, True),
        ("_sum_kernel", dict(AVERAGE=False, PLACE=1, BLOCK=1024, BF16=False), False, False),
        ("_output_inverse_kernel", dict(BF16=True), True, False),
        ("_output_inverse_kernel", dict(BF16=False), True, False),
    ]

    @pytest.mark.parametrize("name,constexprs,fusion,divides", SM90_CASES)
    def test_kernels_compile_for_sm90(name, constexprs, fusion, divides):
        """Without a GPU: each kernel compiles to an sm_90 cubin, divides with IEEE rounding, never
        flushes subnormals, leaves products unfused where the launcher turns FMA off, and never
        multiplies in TF32 (the whitening products are true FP32)."""
        from triton import compile as triton_compile
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from megatron_gift.kernels import fused, output, place, receive

        kernel = next(getattr(m, name) for m in (fused, place, receive, output) if hasattr(m, name))
        tile = {"UNIT_W": 128, "W": 128, "BU": 16, "BLOCK_R": 16, "BLOCK_C": 128}
        constexprs = {**{k: v for k, v in tile.items() if k in kernel.arg_names}, **constexprs}
        signature = kernel_signature(kernel, constexprs)
        src = ASTSource(kernel, signature, {(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
        asm = triton_compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": fusion}).asm
        assert asm["cubin"]
        ptx = asm["ptx"]
        assert ".ftz" not in ptx and "tf32" not in ptx
        assert ("div.rn.f32" in ptx) == divides and "div.full" not in ptx and "div.approx" not in ptx
        assert fusion or "fma." not in ptx

    @pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
    @pytest.mark.parametrize(
        "shape,split",
        [
            ((2, 1), (1, 1)),
            ((7, 300), (7,)),
            ((7, 300), (2, 1, 4)),
            ((7, 300), (0, 1, 6)),
            ((64, 1000), (31, 1, 32)),
            ((64, 1000), (63, 1, 0)),
        ],
    )
    @pytest.mark.parametrize(
        "block_rows", [None, 2, "4-blocks"], ids=["whole-parts", "blocks-of-2-rows", "at-least-4-blocks"]
    )
    def test_ordered_sum_is_sequential(device, shape, split, block_rows):
        """``ordered_sum`` over any split into parts, each taken whole, in blocks of rows (a ``budget``
        of two rows' values) or in at least 4 blocks (``blocks``: most of them empty for parts of a row or
        two; on CUDA an empty block skips the scan), is bit for bit ``acc = x_0.clone(); acc += x_i``
        in row order, the receivers' summation order on every rank. On the CPU it relies on
        ``index_add_`` adding its source's rows one after another in index order (ATen's
        ``index_add_cpu_`` loops over the index, each step an elementwise ``add_`` of one source row
        into the selected row, so no reassociation across rows); a pairwise or parallel reduction
        over the rows fails here, as the data is order-sensitive (the reversed loop differs)."""
        gen = torch.Generator().manual_seed(11)
        x = (torch.randn(shape, generator=gen) * torch.exp(4 * torch.randn(shape, generator=gen))).to(device)
        acc = x[0].clone()
        for row in x[1:]:
            acc += row
        if block_rows == "4-blocks":
            got = kernels.ordered_sum(_split(x, split), blocks=4)
        else:
            got = kernels.ordered_sum(_split(x, split), budget=block_rows and block_rows * shape[1])
        assert torch.equal(got.view(torch.int32), acc.view(torch.int32))
        if shape[0] > 2:
            backwards = x[-1].clone()
            for row in x.flip(0)[1:]:
                backwards += row
            assert not torch.equal(backwards, acc)

    def test_ordered_sum_in_blocks_runs_the_same_ops_on_every_rank():
        """Bug caught: blocks counted per part (a rank with its 6 senders in one part and one with 3 and 3
        would enqueue different ops: the GPU rules' same work on every rank) or a budget ignored (the ops of
        whole parts). With a budget of 2 rows' values, 7 rows take 4 blocks per part, however split."""
        x = torch.randn(7, 300)
        counts = []
        for split in [(0, 1, 6), (3, 1, 3), (6, 1, 0)]:
            with OpCounter() as ops:
                kernels.ordered_sum(_split(x, split), budget=2 * 300)
            counts.append(ops.by_op["index_add_"])
        with OpCounter() as whole:
            kernels.ordered_sum(_split(x, (3, 1, 3)))
        assert counts == [12, 12, 12] and whole.by_op["index_add_"] == 3

    def test_imports_and_falls_back_without_triton():
        code = textwrap.dedent(
            """
            import sys, torch
            sys.modules["triton"] = None  # makes `import triton` raise ImportError
            from megatron_gift import kernels
            from megatron_gift.numerics.fp8 import CodecConfig, encode
            assert not kernels.available(torch.device("cpu"))
            g = torch.randn(3, 200)
            assert torch.equal(kernels.whiten_encode(g, None, CodecConfig()).payload, encode(g, CodecConfig()).payload)
            """
        )
        proc = _run(["-c", code], TRITON_INTERPRET="1")
        assert proc.returncode == 0, proc.stderr[-5000:]
