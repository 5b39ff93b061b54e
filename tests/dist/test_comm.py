"""Quantized reduce-scatter / all-reduce over gloo against an independently computed FP32 reference."""

import functools
import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_gift.comm.layout import BucketLayout, Segment
from megatron_gift.comm.ledger import CommLedger
from megatron_gift.comm.quantized import QuantizedReduce
from megatron_gift.comm.schedule import reduce_now
from megatron_gift.config import Mode
from megatron_gift.numerics import CodecConfig, ErrorFeedback, LowRankWhitening
from megatron_gift.testing import run_on_ranks
from tests.reference import CheckedWhitening, dense_whitening, fp8_roundtrip_groups, ordered_sum, scaling_groups
from tests.unit.test_whitening import fp32_bound

# Shard boundaries cut GIFT rows (4 ranks: at 352 inside row 8 of the first weight, at 1056
# inside row 1 of the last); one layout has a row that spans all four shards.
LAYOUTS = {
    "mixed": (
        1408,
        [
            Segment(0, 12, 40, Mode.GIFT, "a"),
            Segment(512, 1, 7, Mode.OFF, "norm"),
            Segment(576, 9, 33, Mode.EUCLIDEAN, "b"),
            Segment(896, 5, 100, Mode.GIFT, "c"),
            Segment(1400, 1, 6, Mode.BF16, "bias"),
        ],
    ),
    "long_row": (1200, [Segment(0, 1, 1100, Mode.GIFT, "wide")]),
}
CODECS = ["e4m3-block", "e5m2-tensor", "e4m3-mx", "e4m3-row"]


@functools.cache
def _factor(cols, seed):
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(cols, cols, generator=gen, dtype=torch.float64))
    evals = torch.logspace(0, -3, cols, dtype=torch.float64)
    return basis, evals


def _bucket_grads(numel, segments, rank):
    """Rank ``rank``'s gradient bucket; GIFT rows drawn from N(0, A²) so whitening matters."""
    gen = torch.Generator().manual_seed(1000 + rank)
    flat = torch.zeros(numel)
    for k, s in enumerate(segments):
        g = torch.randn(s.rows, s.cols, generator=gen, dtype=torch.float64)
        if s.mode is Mode.GIFT:
            basis, evals = _factor(s.cols, k)
            g = g @ (basis * evals) @ basis.T
        flat[s.start : s.end] = g.flatten().float()
    return flat


def _transforms(segments):
    out = []
    for k, s in enumerate(segments):
        if s.mode is not Mode.GIFT:
            out.append(None)
            continue
        basis, evals = _factor(s.cols, k)
        out.append(LowRankWhitening.from_statistics(((basis * evals) @ basis.T).float(), rank=min(8, s.cols)))
    return out


def checked_transforms(segments):
    """``_transforms``, each wrapped in ``CheckedWhitening`` with its dense FP64 reference (the
    same factor ``A`` and rank), after checking the reference's ``Tᵀ Â T = I`` in FP64."""
    out = []
    for k, (s, w) in enumerate(zip(segments, _transforms(segments))):
        if w is None:
            out.append(None)
            continue
        basis, evals = _factor(s.cols, k)
        a_hat, t, t_inv = dense_whitening(((basis * evals) @ basis.T).float(), w.rank)
        # FP64 work of d-term products: |Tᵀ Â T − I| ≲ d·eps64·‖T‖²‖Â‖ = d·eps64·κ(T)² (as ‖Â‖ = σ_min(T)⁻²
        # when Tᵀ Â T = I), |T T⁻¹ − I| ≲ d·eps64·κ(T); a wrong T misses by O(1)
        eye, kappa = torch.eye(s.cols, dtype=torch.float64), float(torch.linalg.cond(t))
        tol = 8 * s.cols * torch.finfo(torch.float64).eps * kappa
        assert float((t.T @ a_hat @ t - eye).abs().max()) < tol * kappa and float((t @ t_inv - eye).abs().max()) < tol
        out.append(CheckedWhitening(w, t, t_inv))
    return out


def _codec_args(codec: str) -> tuple[torch.dtype, str, bool]:
    """``(torch FP8 dtype, scaling, power-of-two scales)`` of a codec spelled ``"e4m3-block"``."""
    fmt, scaling = codec.split("-")
    return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt], scaling, scaling == "mx"


def _coded_groups(numel, world, segments, codec):
    """Per coded segment (bucket order): ``(segment, its scaling groups cut at shard boundaries)``,
    by tests/reference.py's ``scaling_groups`` (not the layout's)."""
    _, scaling, _ = _codec_args(codec)
    size = -(-numel // world)
    return [
        (s, scaling_groups(s.rows, s.cols, s.start, size, scaling))
        for s in sorted(segments, key=lambda s: s.start)
        if s.mode in (Mode.EUCLIDEAN, Mode.GIFT)
    ]


def _whitened(g, segments, transforms):
    """``G T`` of every GIFT weight (whole rows, as the sender whitens), the other values as they are."""
    x = g.clone()
    for s, t in zip(segments, transforms):
        if t is not None:
            x[s.start : s.end] = t.apply(x[s.start : s.end].view(s.rows, s.cols)).flatten()
    return x


def _roundtrip_coded(x, groups, codec):
    """Every coded value of the bucket ``x`` (FP32) rounded through FP8 by tests/reference.py, group by group."""
    dtype, _, pow2 = _codec_args(codec)
    y = x.clone()
    for s, lengths in groups:
        y[s.start : s.end] = fp8_roundtrip_groups(x[s.start : s.end], lengths, dtype, pow2)
    return y


def _emulate(layout, transforms, grads):
    """The reduce-scatter the math promises, computed locally without any collective (FP32): every
    rank's ``Q(G_r T)`` (tests/reference.py's codec) summed in FP32 in rank order, ``T⁻¹`` of whole
    GIFT rows (the runtime cuts rows at shard boundaries and sums their projections: other FP32
    orders, see test_whitening.fp32_bound); plain values summed in FP32 as sent (BF16: rounded first)."""
    segments, world = layout.segments, layout.num_shards
    groups = _coded_groups(layout.numel, world, segments, layout.codec.name)
    total = ordered_sum(
        [_roundtrip_coded(_whitened(g, segments, transforms), groups, layout.codec.name) for g in grads]
    )
    for s, t in zip(segments, transforms):
        if t is not None:
            total[s.start : s.end] = t.inverse(total[s.start : s.end].view(s.rows, s.cols)).flatten()
        if s.mode in (Mode.OFF, Mode.BF16):
            wire = torch.float32 if s.mode is Mode.OFF else torch.bfloat16
            total[s.start : s.end] = ordered_sum([g[s.start : s.end].to(wire) for g in grads])
    return total


def all_reduce_reference(numel, world, segments, codec, transforms, grads, average):
    """The flat quantized all-reduce bit for bit, with both of its roundings, from tests/reference.py's
    FP8 cast (not the runtime codec), ``T`` and ``T⁻¹`` checked against dense FP64 ones
    (``checked_transforms``), and the layout rules written out here: per rank ``Q(G_r T)``
    (groups cut at shard boundaries); per shard the FP32 sum of the decoded messages in rank order,
    ÷ p when averaging (before the re-encode, as the flat path divides); that sum ``Q``-rounded again
    in the same groups (the all-gathered message); ``T⁻¹`` of whole GIFT rows. Plain values: ``off``
    summed in FP32, ``bf16`` as BF16 values summed in FP32, ÷ p, rounded to BF16 once more. Padding
    between parameters is neither sent nor written: zero in these buckets, zero here."""
    groups = _coded_groups(numel, world, segments, codec)
    coded = ordered_sum([_roundtrip_coded(_whitened(g, segments, transforms), groups, codec) for g in grads])
    coded = _roundtrip_coded(coded / world if average else coded, groups, codec)
    out = torch.zeros(numel)
    for s, t in zip(segments, transforms):
        if s.mode in (Mode.EUCLIDEAN, Mode.GIFT):
            values = coded[s.start : s.end]
            out[s.start : s.end] = values if t is None else t.inverse(values.view(s.rows, s.cols)).flatten()
        else:
            wire = torch.float32 if s.mode is Mode.OFF else torch.bfloat16
            total = ordered_sum([g[s.start : s.end].to(wire) for g in grads])
            out[s.start : s.end] = (total / world if average else total).to(wire).float()
    return out


def _worker(rank, world):
    out = {}
    # the references' T, held to dense FP64 ones where that is cheap: "long_row"'s 1100-wide dense
    # build would cost every rank as much as the runtime's own build again
    checked_of = {
        name: checked_transforms(segs) if name == "mixed" else _transforms(segs) for name, (_, segs) in LAYOUTS.items()
    }
    _transforms_of = {
        name: [c.w if isinstance(c, CheckedWhitening) else c for c in ts] for name, ts in checked_of.items()
    }
    all_grads = {name: [_bucket_grads(numel, segs, r) for r in range(world)] for name, (numel, segs) in LAYOUTS.items()}
    for (name, (numel, segs)), codec, all_reduce, average in itertools.product(
        LAYOUTS.items(), CODECS, [False, True], [False, True]
    ):
        layout = BucketLayout(numel, world, segs, CodecConfig(*codec.split("-")), torch.float32)
        grads = all_grads[name]
        transforms = _transforms_of[name]
        reference = torch.stack(grads).double().sum(0)
        emulated = _emulate(layout, checked_of[name], grads)
        if average:
            reference /= world
            emulated /= world
        flat = grads[rank].clone()
        ledger = CommLedger()
        reduce_now(
            QuantizedReduce(
                flat, layout, dist.group.WORLD, transforms, average=average, all_reduce=all_reduce, ledger=ledger
            ),
            "cpu",
        )
        lo, hi = (0, numel) if all_reduce else (layout.shards[rank].lo, layout.shards[rank].hi)
        got, ref = flat[lo:hi].double(), reference[lo:hi]
        key = (name, codec, all_reduce, average)
        rel = ((got - ref).norm() / ref.norm()).item()
        # The reduce-scatter must equal the unsplit math (FP32 orders aside); the all-reduce, which
        # quantizes the sum once more, must equal its bitwise reference.
        emu_err = ((got - emulated[lo:hi].double()).norm() / ref.norm()).item()
        bitwise = all_reduce and torch.equal(
            flat, all_reduce_reference(numel, world, segs, codec, checked_of[name], grads, average)
        )
        # off values are summed exactly in FP32, bf16 ones to BF16 precision
        plain_ok = all(
            torch.allclose(
                flat[max(a, lo) : min(b, hi)].double(), reference[max(a, lo) : min(b, hi)], rtol=tol, atol=1e-7
            )
            for runs, tol in zip(layout.plain_runs, (1e-6, 2**-7))
            for a, b in runs
            if a < hi and b > lo
        )
        out[key] = dict(
            result=flat[lo:hi].clone(),
            rel=rel,
            emu_err=emu_err,
            bitwise=bitwise,
            plain_ok=plain_ok,
            bytes=ledger.total(),
        )
    # Error feedback over repeated steps keeps the running sum close to the FP32 running sum.
    numel, segs = LAYOUTS["mixed"]
    layout = BucketLayout(numel, world, segs, CodecConfig("e5m2", "tensor"), torch.float32)
    transforms = _transforms_of["mixed"]
    for use_ef in (False, True):
        ef = ErrorFeedback(layout.n_coded) if use_ef else None
        acc, ref = torch.zeros(numel), torch.zeros(numel, dtype=torch.float64)
        for _ in range(8):
            grads = all_grads["mixed"]
            flat = grads[rank].clone()
            reduce_now(
                QuantizedReduce(flat, layout, dist.group.WORLD, transforms, error_feedback=ef, all_reduce=True), "cpu"
            )
            if ef is not None:
                ef.commit()
            acc += flat
            ref += torch.stack(grads).double().sum(0)
        out[("ef", use_ef)] = ((acc.double() - ref).norm() / ref.norm()).item()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_quantized_reduce(world):
    """Within FP8's tolerance of the FP32 sum; the reduce-scatter equal to the unsplit emulation up to
    FP32 orders; the all-reduce bit for bit its reference with both roundings (``all_reduce_reference``),
    on every rank. Bugs caught: a rounding dropped, doubled or in other groups (scales of the re-encode
    spanning a shard's groups), a sum in another order or divided after the re-encode, a plain value
    not rounded as sent, ranks holding different bits."""
    results = run_on_ranks(_worker, world, timeout=300)
    # split rows transform their pieces in other FP32 orders than whole rows: test_whitening.fp32_bound
    fp32_tol = {
        name: 2 * max(fp32_bound(t.dense()[0], 2) for t in _transforms(segs) if t is not None)
        for name, (_, segs) in LAYOUTS.items()
    }
    for key, r0 in results[0].items():
        if key[0] == "ef":
            continue
        name, codec, all_reduce, average = key
        tol = 0.08 if codec.startswith("e4m3") else 0.16
        for rank, res in enumerate(results):
            r = res[key]
            assert r["rel"] < tol, (key, rank, r["rel"])
            assert r["plain_ok"], (key, rank)
            if not all_reduce:
                assert r["emu_err"] < fp32_tol[name], (key, rank, r["emu_err"])  # split rows exactly as unsplit
            else:
                assert r["bitwise"], (key, rank, r["emu_err"])  # both roundings, bit for bit
                assert torch.equal(r["result"], r0["result"]), (key, rank)  # bit-identical on every rank
        if not all_reduce:  # the shards tile the bucket
            assert sum(res[key]["result"].numel() for res in results) == LAYOUTS[name][0]
    # error feedback: over 8 steps the accumulated sum is much closer to the FP32 one
    assert results[0][("ef", True)] < 0.5 * results[0][("ef", False)]
