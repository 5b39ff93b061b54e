"""A NaN or Inf inside a GIFT row that a shard boundary cuts (its pieces reduced on two ranks, ``T⁻¹``
finished from an exchange of partial projections, ``comm/pieces.py``), on the flat and the two-level
path, reduce-scatter and all-reduce.

The contract (``numerics/fp8.py``: non-finite values survive encode and decode; ``comm/quantized.py``:
the stage that writes a NaN/Inf sets its flag; docs/how-it-works.md: a NaN/Inf anywhere reaches the
reduced gradients): ``G T`` mixes a row, so the poisoned row is non-finite wherever it is written
(both pieces, on both owners; every rank after an all-reduce), the owners of its pieces flag it
and no other rank does, and every other element is bit for bit what the same reduction gives with
that row zero on the poisoning rank (group maxima are taken over finite values; the groups of these
block-scaled layouts never span two rows, a tensor-scaled group does): nothing else is poisoned.
All-reduce: the same bits, NaN positions included, on every rank."""

import itertools

import torch
import torch.distributed as dist

from megatron_gift.comm.hierarchical import TwoLevelReduce
from megatron_gift.comm.layout import BucketLayout
from megatron_gift.comm.quantized import QuantizedReduce
from megatron_gift.comm.schedule import StageFlags, reduce_now
from megatron_gift.comm.topology import build_groups
from megatron_gift.numerics import CodecConfig
from megatron_gift.testing import run_on_ranks
from tests.dist import test_comm, test_two_level
from tests.dist.test_comm import _bucket_grads, _transforms

WORLD, POISONED_RANK = 4, 1
# (layout, cut GIFT row [lo, hi), poisoned element): 4 shards of 352 cut row 8 of "a" (320..360) at
# 352; 4 shards of 576 cut row 14 of "a" (560..600) at 576; the element lies in the first piece.
FLAT = (test_comm.LAYOUTS["mixed"], (320, 360), 330)
TWO_LEVEL = (test_two_level.LAYOUTS["mixed"], (560, 600), 570)
CASES = [
    *itertools.product(["flat", "two-level-bf16", "two-level-fp8"], ["e4m3-block"], [False, True], ["nan", "inf"]),
    *itertools.product(["flat"], ["e5m2-block"], [False, True], ["inf"]),  # E5M2 carries Inf as Inf
    # one scale per shard's part of a weight: its maximum must skip the poisoned row (reduce-scatter
    # only: the all-reduce re-encodes a sum whose row is non-zero in the clean run)
    *itertools.product(["flat"], ["e4m3-tensor"], [False], ["nan", "inf"]),
]


def _same_bits(a, b):
    """Equal values and NaN positions (NaN payloads aside)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


def _worker(rank, world):
    (placed,) = build_groups([dist.group.WORLD], 2)
    out = {}
    for path, codec, all_reduce, bad in CASES:
        (numel, segs), (row_lo, row_hi), at = FLAT if path == "flat" else TWO_LEVEL
        layout = BucketLayout(numel, world, segs, CodecConfig(*codec.split("-")), torch.float32)
        ts = _transforms(segs)
        results = {}
        for poison in (False, True):
            flat = _bucket_grads(numel, segs, rank)
            if rank == POISONED_RANK:
                flat[row_lo:row_hi] = 0.0  # the clean reference: the row zero on the poisoning rank
                if poison:
                    flat[at] = float(bad)
            given = flat.clone()
            flag = StageFlags("cpu")
            if path == "flat":
                red = QuantizedReduce(flat, layout, dist.group.WORLD, ts, all_reduce=all_reduce, nonfinite=flag)
            else:
                red = TwoLevelReduce(
                    flat, layout, placed, ts, intra=path.rsplit("-", 1)[1], all_reduce=all_reduce, nonfinite=flag
                )
            reduce_now(red, "cpu")
            results[poison] = (flat, given, bool(flag.any()))
        lo, hi = (0, numel) if all_reduce else (layout.shards[rank].lo, layout.shards[rank].hi)
        (clean, _, clean_flag), (got, given, flagged) = results[False], results[True]
        row = torch.zeros(numel, dtype=torch.bool)
        row[row_lo:row_hi] = True
        written = torch.zeros(numel, dtype=torch.bool)
        written[lo:hi] = True
        out[(path, codec, all_reduce, bad)] = dict(
            result=got,
            row_nonfinite=bool((~torch.isfinite(got[row & written])).all()),
            others_same=torch.equal(got[written & ~row], clean[written & ~row]),
            untouched=_same_bits(got[~written], given[~written]),
            flagged=flagged,
            clean_flag=clean_flag,
            holds_row=layout.shards[rank].lo < row_hi and layout.shards[rank].hi > row_lo,  # owns a piece
        )
    return out


def test_non_finite_in_a_cut_row_piece():
    """Bugs caught: a piece's NaN lost in the exchange of partial projections (the other piece of the
    row finite) or spread to the other pieces a rank holds, a group scale taken over a NaN (the
    whole group NaN or zero), a flag missing on a piece's owner or raised on a rank that wrote no
    NaN, ranks that disagree after an all-reduce."""
    results = run_on_ranks(_worker, WORLD, timeout=600)
    for key in CASES:
        path, codec, all_reduce, bad = key
        for rank, res in enumerate(results):
            r = res[key]
            assert r["row_nonfinite"], (key, rank)  # the row's owned elements are all non-finite
            assert r["others_same"], (key, rank)  # nothing else poisoned, not a bit changed
            assert r["untouched"], (key, rank)  # reduce-scatter: nothing outside the shard written
            assert not r["clean_flag"], (key, rank)
            assert r["flagged"] == r["holds_row"], (key, rank)  # the pieces' owners flag it, no one else
        assert sum(res[key]["holds_row"] for res in results) == 2, key  # the row is cut: two owners
        if all_reduce:
            assert all(_same_bits(res[key]["result"], results[0][key]["result"]) for res in results), key
