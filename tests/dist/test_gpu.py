"""The quantized reduction with CUDA tensors on one GPU (``gpu``-marked: skipped without CUDA).

One rank (NCCL on device 0; the same code on a gloo CPU rank, so that it cannot rot where no GPU
is lent) runs ``QuantizedReduce`` on every layout and codec of test_comm.py, reduce-scatter and
all-reduce, summed or averaged, through the Triton kernels wherever they run, and is compared with
the same reduction computed on the CPU (``test_comm._emulate``) and with the FP64 truth. NCCL does
not put two ranks on one GPU: the sum over ranks is covered on gloo ranks (test_comm.py) and by the
kernels' rank sum on CUDA (test_kernels.py).
"""

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_gift.comm.layout import BucketLayout
from megatron_gift.comm.quantized import QuantizedReduce
from megatron_gift.comm.schedule import reduce_now
from megatron_gift.config import Mode
from megatron_gift.numerics import CodecConfig, LowRankWhitening
from megatron_gift.testing import run_on_ranks
from tests.bounds import BF16_BITS, Rounding, error_bound, fp8_format, fp32_sum_bound
from tests.dist.test_comm import CODECS, LAYOUTS, _bucket_grads, _emulate, _factor


def _whitenings(segments, device):
    """test_comm._transforms on ``device``: the same FP64 factors, so the same FP32 bits."""
    return [
        LowRankWhitening.from_statistics(((b * e) @ b.T).float(), rank=min(8, s.cols), device=device)
        if s.mode is Mode.GIFT
        else None
        for s, (b, e) in ((s, _factor(s.cols, k)) for k, s in enumerate(segments))
    ]


def _one_rank(rank, world, device):
    out = {}
    whitenings = {name: (_whitenings(segs, device), _whitenings(segs, "cpu")) for name, (_, segs) in LAYOUTS.items()}
    for (name, (numel, segs)), codec, all_reduce, average in itertools.product(
        LAYOUTS.items(), CODECS, [False, True], [False, True]
    ):
        layout = BucketLayout(numel, world, segs, CodecConfig(*codec.split("-")), torch.float32)
        grads = [_bucket_grads(numel, segs, r) for r in range(world)]
        flat = grads[rank].to(device)
        on_device, on_cpu = whitenings[name]
        reduce_now(
            QuantizedReduce(flat, layout, dist.group.WORLD, on_device, average=average, all_reduce=all_reduce), device
        )
        assert flat.device.type == torch.device(device).type
        gift = torch.zeros(numel, dtype=torch.bool)
        for s in segs:
            gift[s.start : s.end] = s.mode is Mode.GIFT
        out[(name, codec, all_reduce, average)] = dict(
            got=flat.cpu(),
            emulated=_emulate(layout, on_cpu, grads) / (world if average else 1),
            grads=torch.stack(grads),
            gift=gift,
        )
    return out


def _segment_bounds(name, codec, all_reduce, grads):
    """``(segment, bound on ‖got − truth‖)`` per segment (tests/bounds.py): one rank's message, the
    all-reduce's second rounding, each GIFT segment through its own ``T``; plain segments in FP32
    (``off``) or BF16."""
    numel, segs = LAYOUTS[name]
    bits, sigma, fmax = fp8_format(CodecConfig(*codec.split("-")).fmt.dtype)
    mx = codec.endswith("mx")
    transforms = _whitenings(segs, "cpu")
    coded = {}
    for s, w in zip(segs, transforms):
        if s.mode in (Mode.EUCLIDEAN, Mode.GIFT):
            local = grads[:, s.start : s.end].double().view(-1, s.rows, s.cols)
            coded[s] = local if w is None else local @ w.dense()[0].double()
    spacing = (
        sigma * (2 if mx else 1) * torch.stack([c.abs().flatten(1).amax(1) for c in coded.values()]).amax(0) / fmax
    )
    out = []
    for s, w in zip(segs, transforms):
        local = grads[:, s.start : s.end].double().view(-1, s.rows, s.cols)
        if s.mode is Mode.OFF:
            out.append((s, fp32_sum_bound(local.flatten(1))))
        elif s.mode is Mode.BF16:
            rounds = [Rounding(local, BF16_BITS, whitened=False)] + (
                [Rounding(local.sum(0, keepdim=True), BF16_BITS, whitened=False)] if all_reduce else []
            )
            out.append((s, error_bound(local, rounds)))
        else:
            rounds = [Rounding(coded[s], bits, spacing)] + (
                [Rounding(coded[s].sum(0, keepdim=True), bits, spacing.sum())] if all_reduce else []
            )
            out.append((s, error_bound(local, rounds, *(w.dense() if w is not None else (None, None)))))
    return out


@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), pytest.param("cuda", "nccl", marks=pytest.mark.gpu)])
def test_quantized_reduce_on_one_device(device, backend):
    """Against the FP64 truth within each segment's bound of tests/bounds.py, and against the CPU
    emulation (test_comm._emulate): bitwise for Euclidean codes and plain values on the
    reduce-scatter (the kernels' codes, scales and FP32 rank sum are the CPU codec's, test_kernels.py);
    GIFT's ``G T`` on the device may differ from the CPU's in the last bit and move a code, and the
    all-reduce rounds once more: within twice the bound (both within it of the truth)."""
    (results,) = run_on_ranks(_one_rank, 1, device, backend=backend, timeout=600)
    for key, r in results.items():
        name, codec, all_reduce, average = key
        got, emulated, grads, gift = r["got"], r["emulated"], r["grads"], r["gift"]
        scale = 1.0 / grads.shape[0] if average else 1.0
        truth = grads.double().sum(0) * scale
        if not all_reduce:
            assert torch.equal(got[~gift], emulated[~gift]), key
        for s, bound in _segment_bounds(name, codec, all_reduce, grads):
            seg = slice(s.start, s.end)
            assert float((got[seg].double() - truth[seg]).norm()) <= scale * bound, (key, s.name)
            assert float((got[seg].double() - emulated[seg].double()).norm()) <= 2 * scale * bound, (key, s.name)
