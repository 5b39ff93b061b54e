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
from tests.bounds import reduced_rel_l2_bound
from tests.test_comm import CODECS, LAYOUTS, _bucket_grads, _emulate, _factor


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
    for (name, (numel, segs)), codec, all_reduce, average in itertools.product(
        LAYOUTS.items(), CODECS, [False, True], [False, True]
    ):
        layout = BucketLayout(numel, world, segs, CodecConfig(*codec.split("-")), torch.float32)
        grads = [_bucket_grads(numel, segs, r) for r in range(world)]
        flat = grads[rank].to(device)
        reduce_now(QuantizedReduce(flat, layout, dist.group.WORLD, _whitenings(segs, device), average=average,
                                   all_reduce=all_reduce), device)  # fmt: skip
        assert flat.device.type == torch.device(device).type
        gift = torch.zeros(numel, dtype=torch.bool)
        for s in segs:
            gift[s.start : s.end] = s.mode is Mode.GIFT
        out[(name, codec, all_reduce, average)] = dict(
            got=flat.cpu(), emulated=_emulate(layout, _whitenings(segs, "cpu"), grads) / (world if average else 1),
            truth=torch.stack(grads).double().sum(0) / (world if average else 1), gift=gift,
        )  # fmt: skip
    return out


@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), pytest.param("cuda", "nccl", marks=pytest.mark.gpu)])
def test_quantized_reduce_on_one_device(device, backend):
    (results,) = run_on_ranks(_one_rank, 1, device, backend=backend, timeout=600)
    for key, r in results.items():
        name, codec, all_reduce, average = key
        got, emulated, truth, gift = r["got"], r["emulated"], r["truth"], r["gift"]
        if not all_reduce:
            # Euclidean codes and plain values: the kernels' codes, scales and FP32 rank sum are
            # those of the CPU codec bit for bit (test_kernels.py)
            assert torch.equal(got[~gift], emulated[~gift]), key
        # GIFT: G T in FP32 on the device differs from the CPU's in the last bit, which may move a
        # code across a rounding boundary; the all-reduce quantizes the sum a second time (twice
        # the bound of one rounding). tests/bounds.py, one rank (c = 1).
        bound = 2 * reduced_rel_l2_bound(CodecConfig(*codec.split("-")).fmt.mantissa_bits, c=1.0)
        assert float((got.double() - truth).norm() / truth.norm()) < bound, key
        assert float((got.double() - emulated.double()).norm() / truth.norm()) < bound, key
