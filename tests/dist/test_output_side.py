"""Two-sided whitening in the reduction (``comm/output_side.py``, ``numerics/two_sided.py``'s row-block
maps): ``Σ_i T_out⁻ᵀ dec(q(T_outᵀ G_i T_in)) T_in⁻¹`` on gloo ranks, flat and two-level, reduce-scatter
and all-reduce, against a hand reference built from dense FP64 ``T`` matrices and tests/reference.py's
FP8 round trips; the row-block maps against the dense FP64 ``TwoSidedWhitening``; error feedback. The
launches and host synchronisations of a steady step (under the tools' launch meter) are
tests/tools/test_output_side_launches.py's."""

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_gift.comm.hierarchical import TwoLevelReduce
from megatron_gift.comm.layout import BucketLayout
from megatron_gift.comm.ledger import CommLedger
from megatron_gift.comm.output_side import OutputSide
from megatron_gift.comm.quantized import QuantizedReduce, _all_gather
from megatron_gift.comm.schedule import StageFlags, reduce_now
from megatron_gift.comm.topology import build_groups
from megatron_gift.numerics import CodecConfig, ErrorFeedback, LowRankWhitening, approximate_factor
from megatron_gift.numerics.two_sided import (
    OutputRows,
    TwoSidedWhitening,
    output_inverse,
    output_projection,
    row_blocks,
)
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.dispatch import Lifetimes
from tests.dist import test_two_level
from tests.dist.test_comm import _bucket_grads, checked_transforms
from tests.reference import dense_whitening

WORLD = 4
# test_two_level's "mixed" layout (2304 elements: 4 shards of 576): GIFT "a" [20, 40] (the boundary at
# 576 cuts row 14), Euclidean "b" [9, 33], GIFT "c" [10, 100] (the boundary at 1728 cuts row 5), off, bf16.
NUMEL, SEGS = test_two_level.LAYOUTS["mixed"]
# segment index -> r_out of its T_out: three P's packed in one buffer; "b" has an output side and no
# input side (T_in = I: its cut-free part reduced whole into the target)
OUT_RANK = {0: 4, 2: 2, 3: 3}


def _spd(d: int, decades: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return (basis * torch.logspace(0, -decades, d, dtype=torch.float64)) @ basis.T


def _outputs():
    """Per segment ``(T_out, dense FP64 T_out, dense T_out⁻¹)`` or None: ``B`` spanning two decades, rank
    ``OUT_RANK``."""
    out = []
    for k, s in enumerate(SEGS):
        if k not in OUT_RANK:
            out.append(None)
            continue
        b = _spd(s.rows, 2.0, 50 + k)
        _, t, t_inv = dense_whitening(b.float(), OUT_RANK[k])
        out.append((LowRankWhitening.from_statistics(b.float(), rank=OUT_RANK[k]), t, t_inv))
    return out


def _grads(rank: int) -> torch.Tensor:
    """test_comm's bucket (GIFT rows anisotropic on the input side), the two-sided weights' rows mixed
    by an SPD map so that the output side matters too (FP32)."""
    g = _bucket_grads(NUMEL, SEGS, rank)
    for k in OUT_RANK:
        s = SEGS[k]
        g[s.start : s.end] = (
            (_spd(s.rows, 1.0, 70 + k) @ g[s.start : s.end].view(s.rows, s.cols).double()).flatten().float()
        )
    return g


# -- the row-block maps against the dense FP64 reference -----------------------------------------
def _dense_sides(d_out, d_in, r_out):
    """The FP64 ``TwoSidedWhitening`` with ``T_in = I`` and ``T_out`` from a ``B`` spanning two decades; the FP32
    ``T_out``."""
    factor = approximate_factor(_spd(d_out, 2.0, 1), r_out, 1e-3)
    w_out = LowRankWhitening(factor, torch.float64)
    return TwoSidedWhitening(LowRankWhitening.identity(d_in, torch.float64), w_out), LowRankWhitening(factor)


@pytest.mark.parametrize("e0, e1", [(0, 12 * 20), (7, 12 * 20 - 3), (45, 52), (20, 100), (33, 40), (3, 20)])
def test_row_block_maps_against_the_dense_reference(e0, e1):
    """``OutputRows`` (``Pre`` from all rows, then ``X``) is ``T_outᵀ G`` and, over any contiguous element
    range (cut at both ends, one piece inside a row, whole rows only), ``output_projection`` summed over a
    split of the parameter into ranges gives ``Qᵀ W`` and ``output_inverse`` the range of ``T_out⁻ᵀ W``: held
    to the dense FP64 ``TwoSidedWhitening`` with ``T_in = I`` (``inverse`` of the whole matrix). Bugs caught:
    a head or tail piece dropped or put in the wrong columns, ``Q`` rows misaligned with the range, ``c`` for
    ``c'``, the rows scaled by ``D^{-1/2}`` where ``D^{1/2}`` belongs, the range's offset off by a row.

    Tolerance: FP32 products of at most ``d_out + d_in`` terms (``γ = 32·2^-24``), componentwise
    ``|δ| ≤ γ (|Tᵀ| |X|)``-type sums, amplified at most by ``κ(T_out)`` (B spans 2 decades: κ ≤ 10,
    ``sqrt`` of B̂'s condition); asserted normwise at ``4 γ κ ‖·‖`` (test_two_sided's FP32 bound)."""
    d_out, d_in, r_out = 12, 20, 3
    dense, w = _dense_sides(d_out, d_in, r_out)
    w_out = dense.output_side
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(d_out, d_in, generator=gen)
    kappa = float(torch.linalg.cond(w_out.dense()[0]))
    bound = 4 * (d_out + d_in) * 2.0**-24 * kappa
    want = dense.apply(g.double())
    got = OutputRows.of(w).with_pre(g).apply(g)
    assert ((got.double() - want).norm() / want.norm()).item() <= bound
    # the receiver: W split into [0, e0), [e0, e1), [e1, n): the partials of P summed, each range finished
    wmat = torch.randn(d_out, d_in, generator=gen)
    flat = wmat.flatten()
    proj = torch.zeros(r_out, d_in)
    ranges = [(a, b) for a, b in [(0, e0), (e0, e1), (e1, d_out * d_in)] if b > a]
    for a, b in ranges:
        output_projection(w, flat[a:b], d_in, a, proj)
    assert ((proj.double() - w_out.q.T @ wmat.double()).norm() / (w_out.q.T @ wmat.double()).norm()).item() <= bound
    out = torch.full((d_out * d_in,), float("nan"))
    for a, b in ranges:
        output_inverse(w, flat[a:b], d_in, a, proj, out[a:b])
    want = dense.inverse(wmat.double()).flatten()
    assert ((out.double() - want).norm() / want.norm()).item() <= bound
    blocks = row_blocks(d_in, e0, e1)
    assert len(blocks) <= 3 and sum(n * (c1 - c0) for _, _, n, c0, c1 in blocks) == e1 - e0


# -- the reduction on gloo ranks ------------------------------------------------------------------
CASES = [  # (path, all_reduce, average, bucket dtype)
    *itertools.product(["flat"], [False, True], [False, True], ["fp32"]),
    ("flat", False, True, "bf16"),
    ("flat", True, True, "bf16"),
    *itertools.product(["two-level-bf16", "two-level-fp8"], [False, True], [True], ["fp32"]),
    ("two-level-fp8", False, False, "bf16"),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _reference(grads, outputs, checked, path, average, all_reduce, dtype):
    """What the two-sided reduction must give, full bucket (FP64): the senders' ``X_i = T_outᵀ G_i``
    from the dense FP64 ``T_out`` (rounded to FP32, as the runtime's source is), then test_two_level's
    independent simulation of the inner reduction (tests/reference.py's FP8 round trips, the FP32
    sums in order, its ``T_in`` / ``T_in⁻¹`` held to dense FP64 ones), then the dense ``T_out⁻ᵀ`` of the
    two-sided segments; and the exact ``Σ_i G_i`` (÷ p)."""
    xs = []
    for g in grads:
        x = g.float().clone()
        for s, o in zip(SEGS, outputs):
            if o is not None:
                x[s.start : s.end] = (o[1].T @ g[s.start : s.end].view(s.rows, s.cols).double()).flatten().float()
        xs.append(x)
    nodes = WORLD if path == "flat" else WORLD // 2
    intra = "fp32" if path == "flat" else path.rsplit("-", 1)[1]
    layout = BucketLayout(NUMEL, WORLD, SEGS, CodecConfig("e4m3", "block"), dtype)
    sim = test_two_level.simulate(layout, checked, xs, nodes, intra, average, all_reduce).double()
    for s, o in zip(SEGS, outputs):
        if o is not None:
            sim[s.start : s.end] = (o[2].T @ sim[s.start : s.end].view(s.rows, s.cols)).flatten()
    exact = torch.stack([g.double() for g in grads]).sum(0) / (WORLD if average else 1)
    return sim, exact


def _reduction_worker(rank, world):
    (placed,) = build_groups([dist.group.WORLD], 2)
    outputs = _outputs()
    checked = checked_transforms(SEGS)
    ts = [c.w if c is not None else None for c in checked]
    grads_all = [_grads(r) for r in range(world)]
    res = {}
    for path, all_reduce, average, dt in CASES:
        dtype = DTYPES[dt]
        layout = BucketLayout(NUMEL, world, SEGS, CodecConfig("e4m3", "block"), dtype)
        grads = [g.to(dtype) for g in grads_all]
        runs = []
        for _ in range(2):  # the second run is the steady one: the same bits
            flat, ledger = grads[rank].clone(), CommLedger()
            flag = StageFlags("cpu")
            common = dict(average=average, all_reduce=all_reduce, nonfinite=flag, ledger=ledger)
            if path == "flat":
                inner = QuantizedReduce(flat, layout, dist.group.WORLD, ts, **common)
            else:
                inner = TwoLevelReduce(flat, layout, placed, ts, intra=path.rsplit("-", 1)[1], **common)
            reduce_now(
                OutputSide(inner, [o[0] if o is not None else None for o in outputs], ledger), "cpu", watch=Lifetimes()
            )
            runs.append(flat)
        want, exact = _reference(grads, outputs, checked, path, average, all_reduce, dtype)
        lo, hi = (0, NUMEL) if all_reduce else (layout.shards[rank].lo, layout.shards[rank].hi)
        two_sided = torch.zeros(NUMEL, dtype=torch.bool)
        for k in OUT_RANK:
            two_sided[SEGS[k].start : SEGS[k].end] = True
        mine = torch.zeros(NUMEL, dtype=torch.bool)
        mine[lo:hi] = True
        flat = runs[1]
        sel = mine & two_sided
        res[(path, all_reduce, average, dt)] = dict(
            result=flat.clone(),
            steady_same=torch.equal(runs[0], runs[1]),
            err=(flat[sel].double() - want[sel]).norm().item(),
            quant=(want[sel] - exact[sel]).norm().item(),
            norm=exact[sel].norm().item(),
            others_same=torch.equal(flat[mine & ~two_sided], want[mine & ~two_sided].to(dtype)),
            untouched=torch.equal(flat[~mine], grads[rank][~mine]),
            nonfinite=bool(flag.any()),
            p_bytes=ledger.bytes.get(("all_reduce", "fp32-out"), 0),
            ledger_keys=set(ledger.bytes),
        )
    return res


@pytest.mark.slow
def test_two_sided_reduction_against_the_hand_reference():
    """Every rank's two-sided elements are those of ``T_out⁻ᵀ Σ_i dec(q(T_outᵀ G_i T_in)) T_in⁻¹`` (÷ p),
    the other segments' bit for bit those of the input-side reduction, nothing outside the shard
    written (reduce-scatter), every rank the same bits (all-reduce), P's all-reduce in the ledger
    under its own key (reduce-scatter: ``2(p-1)/p · 4 Σ r_out·d_in`` bytes; none with all-reduce;
    not the refresh's ``all_reduce/fp32``, which ``bench refresh`` reads), the steady run the
    same bits as the first. Bugs caught: ``T_out`` applied on the wrong side or not inverted, a
    partial of ``P`` lost (a cut row's piece, a rank's rows) or summed twice, ``P`` of one segment
    applied to another, a bucket element outside the shard written, the BF16 bucket rounded twice.

    Tolerance: the reference and the runtime differ by (a) FP32 rounding of ``T_outᵀ G``, ``G T_in``
    and the inverses (relative ``~(d_in + d_out)·2^-24`` per map, times ``κ(T_in)κ(T_out) ≤ 32·10``:
    below 1e-3), and (b) FP8 codes flipped where that rounding straddles a rounding boundary (about
    ``n·1e-3·2^4`` elements of ``n``: a few per case), each one step, of the size of the element's
    own quantization error. The quantization error ``‖ref − exact‖`` of the case sums such errors over
    all ``n`` elements: (a) + (b) stay below a quarter of it, while any bug above adds an error at
    least of its size (a misplaced or missing map: O(‖G‖); quantization in other coordinates: an
    independent error of the same size). BF16 buckets add one rounding, ``2^-9 ‖G‖``."""
    results = run_on_ranks(_reduction_worker, WORLD, timeout=900)
    p_numel = sum(r * SEGS[k].cols for k, r in OUT_RANK.items())
    for key in results[0]:
        path, all_reduce, average, dt = key
        for rank, res in enumerate(results):
            r = res[key]
            tol = 0.25 * r["quant"] + (2.0**-9 * r["norm"] if dt == "bf16" else 0.0)
            assert r["err"] <= tol, (key, rank, r["err"], r["quant"])
            assert r["quant"] > 1e-3 * r["norm"], (key, rank)  # the FP8 round trips happened
            assert r["others_same"] and r["untouched"] and r["steady_same"], (key, rank, r)
            assert not r["nonfinite"], (key, rank)
            assert r["p_bytes"] == (0 if all_reduce else 2 * (WORLD - 1) * 4 * p_numel // WORLD), (
                key,
                rank,
                r["p_bytes"],
            )
            assert ("all_reduce", "fp32") not in r["ledger_keys"], (key, rank)  # the refresh's key: not P's
            if all_reduce:
                assert torch.equal(r["result"], results[0][key]["result"]), (key, rank)


# -- error feedback: the residual in U's coordinates -----------------------------------------------
def _ef_worker(rank, world):
    """Two steps of the flat reduce-scatter with error feedback (averaging); per step every rank's
    gradient, residual before and after, and the whole reduced bucket (the shards all-gathered)."""
    outputs = _outputs()
    ts = [c.w if c is not None else None for c in checked_transforms(SEGS)]
    layout = BucketLayout(NUMEL, world, SEGS, CodecConfig("e4m3", "block"), torch.float32)
    ef = ErrorFeedback(layout.n_coded)
    lo, hi = layout.shards[rank].lo, layout.shards[rank].hi
    steps = []
    for step in range(2):
        flat = _grads(rank + world * step)
        given, before = flat.clone(), ef.residual.clone()
        inner = QuantizedReduce(flat, layout, dist.group.WORLD, ts, error_feedback=ef, average=True)
        reduce_now(OutputSide(inner, [o[0] if o is not None else None for o in outputs], CommLedger()), "cpu")
        ef.commit()

        def gather(t):
            out = torch.empty(world * t.numel())
            _all_gather(out, t.contiguous(), group=dist.group.WORLD)
            return out.view(world, -1)

        steps.append(
            dict(
                reduced=gather(flat[lo:hi]).flatten(), grads=gather(given), e=gather(before), e_new=gather(ef.residual)
            )
        )
    return steps


@pytest.mark.slow
def test_error_feedback_residual_in_whitened_coordinates():
    """With error feedback each rank sends ``dec(q(Ũ_i))``, ``Ũ_i = T_outᵀ G_i T_in + e_i``, and keeps
    ``e'_i = Ũ_i − dec(q(Ũ_i))``, so whatever codes were chosen ``T_outᵀ Ĝ T_in · p = Σ_i (T_outᵀ G_i T_in
    + e_i − e'_i)`` for the reduced (averaged) ``Ĝ``, with dense FP64 ``T``s, on both steps (the second
    carrying the first's residual). Bugs caught: the residual taken in ``G``'s or ``G T_in``'s
    coordinates, not added, or added on the wrong elements; the output side skipped where feedback runs.

    Tolerance (test_two_sided's FP32 bound): each FP32 map chains sums of at most ``d_in + d_out``
    terms, ``γ = (d_in + d_out)·2^-24``, amplified by ``κ(T_in)κ(T_out)`` normwise; the sum over ranks
    adds ``p·2^-24``; factor 8 for the sender's and the receiver's maps and the residual's subtraction,
    relative to ``Σ_i ‖Ũ_i‖``. The test also asserts that the residuals' sum exceeds 4x the bound
    (a wrong residual would not hide in it)."""
    results = run_on_ranks(_ef_worker, WORLD, timeout=600)
    outputs, checked = _outputs(), checked_transforms(SEGS)
    layout = BucketLayout(NUMEL, WORLD, SEGS, CodecConfig("e4m3", "block"), torch.float32)
    for step, r in enumerate(results[0]):
        assert all(torch.equal(res[step]["reduced"], r["reduced"]) for res in results)
        if step:
            assert torch.equal(r["e"], results[0][step - 1]["e_new"])
        for k in OUT_RANK:
            s = SEGS[k]
            c = layout.seg_at[k]
            t_in = checked[k].t if checked[k] is not None else torch.eye(s.cols, dtype=torch.float64)  # "b": T_in = I
            t_out = outputs[k][1]
            coded = lambda e: e[:, c : c + s.rows * s.cols].double().view(WORLD, s.rows, s.cols)  # noqa: E731
            u = t_out.T @ r["grads"][:, s.start : s.end].double().view(WORLD, s.rows, s.cols) @ t_in + coded(r["e"])
            want = (u - coded(r["e_new"])).sum(0)
            got = WORLD * t_out.T @ r["reduced"][s.start : s.end].double().view(s.rows, s.cols) @ t_in
            kappa = float(torch.linalg.cond(t_in) * torch.linalg.cond(t_out))
            bound = 8 * (s.rows + s.cols + WORLD) * 2.0**-24 * kappa * u.norm(dim=(1, 2)).sum().item()
            assert (got - want).norm().item() <= bound, (step, s.name, (got - want).norm().item(), bound)
            assert coded(r["e_new"]).sum(0).norm().item() > 4 * bound, (step, s.name)


# -- the fused kernels (Triton's interpreter on the CPU) ------------------------------------------
def _kernel_worker(rank, world):
    (placed,) = build_groups([dist.group.WORLD], 2)
    outputs = [o[0] if o is not None else None for o in _outputs()]
    ts = [c.w if c is not None else None for c in checked_transforms(SEGS)]
    out = {}
    for (path, all_reduce), use in itertools.product([("flat", False), ("two-level-bf16", True)], (False, True)):
        layout = BucketLayout(NUMEL, world, SEGS, CodecConfig("e4m3", "block"), torch.bfloat16)
        flat = _grads(rank).bfloat16()
        common = dict(average=True, all_reduce=all_reduce, kernels=use)
        if path == "flat":
            inner = QuantizedReduce(flat, layout, dist.group.WORLD, ts, **common)
        else:
            inner = TwoLevelReduce(flat, layout, placed, ts, intra="bf16", **common)
        assert inner.ops.fused == use
        reduce_now(OutputSide(inner, outputs, CommLedger()), "cpu")
        out[(path, all_reduce, use)] = flat
    return out


@pytest.mark.slow
def test_two_sided_with_kernels(monkeypatch):
    """The fused path (Triton's interpreter; BF16 bucket) against the PyTorch path, both wrapped in the
    output side: its ``T_outᵀ`` reaches the kernels' encode and cast, the targets their decode.
    Non-two-sided values bit for bit; two-sided ones within one E4M3 step (2^-4 relative: where FP32
    rounding of ``U`` flips a code) in norm. Bugs caught: a fused kernel mishandling ``T_outᵀ`` on a
    BF16 bucket (rows or ``Pre`` misplaced, ``X`` rounded to the bucket's dtype) or the FP32 targets
    (written in the bucket's dtype, then rounded twice)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the ranks' processes inherit it
    results = run_on_ranks(_kernel_worker, WORLD, timeout=900)
    layout = BucketLayout(NUMEL, WORLD, SEGS, CodecConfig("e4m3", "block"), torch.bfloat16)
    two_sided = torch.zeros(NUMEL, dtype=torch.bool)
    for k in OUT_RANK:
        two_sided[SEGS[k].start : SEGS[k].end] = True
    for rank, res in enumerate(results):
        for path, all_reduce in [("flat", False), ("two-level-bf16", True)]:
            lo, hi = (0, NUMEL) if all_reduce else (layout.shards[rank].lo, layout.shards[rank].hi)
            a, b, mask = res[(path, all_reduce, False)][lo:hi], res[(path, all_reduce, True)][lo:hi], two_sided[lo:hi]
            assert torch.equal(a[~mask], b[~mask]), (rank, path)
            diff = ((a[mask].float() - b[mask].float()).norm() / a[mask].float().norm()).item()
            assert diff < 2**-4, (rank, path, diff)


def test_output_side_refuses_what_it_cannot_whiten():
    """A transform of other than ``d_out`` rows, one on a plain (``off``/``bf16``) parameter, or a
    list not one per segment is refused at construction (start-up), never inside a stage."""
    layout = BucketLayout(NUMEL, 1, SEGS, CodecConfig("e4m3", "block"), torch.float32)
    from megatron_gift.testing.simulate import FakeGroup

    inner = QuantizedReduce(torch.zeros(NUMEL), layout, FakeGroup(1), [None] * len(SEGS))
    ok = [o[0] if o is not None else None for o in _outputs()]
    OutputSide(inner, ok, CommLedger())
    for bad in (
        [*ok[:1], LowRankWhitening.identity(1), *ok[2:]],  # "norm" [1, 7] is off: not FP8-coded
        [LowRankWhitening.identity(40), *ok[1:]],  # "a" has 20 rows
        ok[:-1],
    ):
        with pytest.raises(ValueError):
            OutputSide(inner, bad, CommLedger())


def _nan_worker(rank, world):
    outputs = [o[0] if o is not None else None for o in _outputs()]
    ts = [c.w if c is not None else None for c in checked_transforms(SEGS)]
    layout = BucketLayout(NUMEL, world, SEGS, CodecConfig("e4m3", "block"), torch.float32)
    out = {}
    for all_reduce, poison in itertools.product((False, True), (False, True)):
        flat = _grads(rank)
        if poison and rank == 1:
            flat[SEGS[3].start + 5 * 100 + 7] = float("nan")  # "c", row 5 (cut by the boundary at 1728)
        flag = StageFlags("cpu")
        inner = QuantizedReduce(flat, layout, dist.group.WORLD, ts, all_reduce=all_reduce, nonfinite=flag)
        reduce_now(OutputSide(inner, outputs, CommLedger()), "cpu")
        out[(all_reduce, poison)] = (flat, flag)
    return out


def test_nan_in_a_two_sided_weight():
    """A NaN in one element of a two-sided weight on one rank: ``T_outᵀ G T_in`` mixes it into every
    element of that weight, so every rank's elements of it are NaN and every rank holding some of it
    flags it; the other segments keep the bits of the clean run, although their ``P`` travel in the
    same buffer. Bugs caught: ``P`` of one segment read from another's place, a flag missing or
    raised by a rank that wrote no NaN, the output stage's flag never set."""
    results = run_on_ranks(_nan_worker, WORLD, timeout=300)
    layout = BucketLayout(NUMEL, WORLD, SEGS, CodecConfig("e4m3", "block"), torch.float32)
    c = torch.zeros(NUMEL, dtype=torch.bool)
    c[SEGS[3].start : SEGS[3].end] = True
    for all_reduce in (False, True):
        for rank, res in enumerate(results):
            (clean, clean_flag), (got, flag) = res[(all_reduce, False)], res[(all_reduce, True)]
            lo, hi = (0, NUMEL) if all_reduce else (layout.shards[rank].lo, layout.shards[rank].hi)
            mine = torch.zeros(NUMEL, dtype=torch.bool)
            mine[lo:hi] = True
            assert torch.isnan(got[mine & c]).all() and torch.equal(got[mine & ~c], clean[mine & ~c]), (
                all_reduce,
                rank,
            )
            assert not clean_flag.any() and bool(flag.any()) == bool((mine & c).any()), (all_reduce, rank)
