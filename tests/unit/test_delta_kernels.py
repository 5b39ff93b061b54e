"""The delta parameter gather's fused kernels (``kernels.delta``) bit for bit against the PyTorch
codec (``comm.param_delta`` with ``fused=False``), their launches and their ``TRAFFIC`` entries;
the PyTorch path's chunking.

As in tests/unit/test_kernels.py, the kernel tests run on the CPU in Triton's interpreter, which has
to be on when the kernels are defined: ``test_delta_kernels_under_interpreter`` runs this file
again in a fresh process with ``TRITON_INTERPRET=1``; without it they run on CUDA (``gpu``)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from megatron_gift.comm import param_delta
from megatron_gift.testing.dispatch import OpCounter
from megatron_gift.testing.kernel_log import assert_passes_under_interpreter, launches_of

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ["cpu"] if INTERPRET else [pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.bfloat16, torch.float16]
# (shard elements, shards): one element, a partial block, exact blocks, a partial program (2048 elements each)
SHAPES = [(1, 1), (33, 3), (64, 2), (2048 + 37, 2)]


def shards(p: int, numel: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prev, new)`` ``[p, numel]``: magnitudes over many binades (FP16's subnormals included),
    zeros, changes of a few steps and far ones, whole blocks of NaN / Inf bases (the repair), a
    NaN, an Inf and an FP32-overflowing change (``-max`` to ``+max``)."""
    gen = torch.Generator().manual_seed(seed)
    n = p * numel
    low = -24 if dtype is torch.float16 else -40
    prev = torch.randn(n, generator=gen) * torch.exp2(torch.randint(low, 4, (n,), generator=gen).float())
    prev[torch.rand(n, generator=gen) < 0.05] = 0
    step = torch.exp2(torch.randint(-14, -4, (n,), generator=gen).float())
    new = prev + step * torch.randn(n, generator=gen) * torch.where(torch.rand(n, generator=gen) < 0.1, 300.0, 1.0)
    prev, new = prev.to(dtype), new.to(dtype)
    if n > 96:
        prev[32:64] = float("nan")  # a block that decoded to NaN last time: coded against 0
        prev[64:70] = float("inf")
        new[5] = float("nan")
        new[100 % n] = -float("inf")
        big = torch.finfo(dtype).max
        prev[n - 1], new[n - 1] = -big, big
    return prev.view(p, numel), new.view(p, numel)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, every NaN counted as the same NaN (its bits are the cast's, not the codec's)."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16)))


@pytest.fixture
def launches():
    from megatron_gift.kernels import delta

    with launches_of(delta) as log:
        yield log


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel,p", SHAPES)
def test_fused_codec_is_bitwise_the_reference(device, dtype, numel, p, launches):
    """Catches a kernel whose codes, scale codes, decoded weights or ``prev`` differ by one bit from
    the PyTorch codec (rounding of the code, the scale's exponent arithmetic, the half spacing of
    subnormals, NaN/Inf blocks, the repair of a NaN base, the owner's row read from ``prev``), and a
    kernel that touches other rows or the padding's weights; one launch each whatever the sizes."""
    prev, new = (t.to(device) for t in shards(p, numel, dtype, seed=numel + p))
    m = param_delta.message_bytes(numel)
    got, want = torch.zeros(p, m, dtype=torch.uint8, device=device), torch.zeros(p, m, dtype=torch.uint8, device=device)
    for r in range(p):
        param_delta.encode(new[r], prev[r], got[r], fused=True)
        param_delta.encode(new[r], prev[r], want[r], fused=False)
    assert torch.equal(got, want)
    assert [name for name, _ in launches] == ["_encode_kernel"] * p
    for rank in range(p):
        param = prev.clone()
        param[rank] = new[rank]  # the owner's row holds the new values until the decode
        own = prev[rank].clone()
        ref_param, ref_own = param.clone(), own.clone()
        param_delta.decode_into(got, param, own, rank, fused=True)
        param_delta.decode_into(got, ref_param, ref_own, rank, fused=False)
        assert same(param, ref_param) and same(own, ref_own), rank
        assert same(param[rank], own)
    assert [name for name, _ in launches[p:]] == ["_decode_kernel"] * p
    # without prev: every row decoded against itself
    param, ref = prev.clone(), prev.clone()
    param_delta.decode_into(got, param, fused=True)
    param_delta.decode_into(got, ref, fused=False)
    assert same(param, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_traffic_entries_are_the_launch_bytes(device, launches):
    """Catches a ``TRAFFIC`` formula that is not the bytes of the tensors a launch reads and writes
    (encode: both shards in, the message out; decode: every message and every row's base in, every
    row and the owner's ``prev`` out), at two shard sizes and two group sizes."""
    from megatron_gift.kernels import delta

    for numel, p in ((2048 + 37, 2), (100, 3)):
        prev, new = (t.to(device) for t in shards(p, numel, torch.bfloat16, seed=7))
        msgs = torch.empty(p, param_delta.message_bytes(numel), dtype=torch.uint8, device=device)
        mark = len(launches)
        param_delta.encode(new[0], prev[0], msgs[0])
        param_delta.decode_into(msgs, prev.clone(), prev[1].clone(), 1)
        (enc_name, enc), (dec_name, dec) = launches[mark:]
        assert delta.TRAFFIC[enc_name](enc) == (new[0].nbytes + prev[0].nbytes, msgs[0].nbytes)
        assert delta.TRAFFIC[dec_name](dec) == (msgs.nbytes + prev.nbytes, prev.nbytes + prev[1].nbytes)


if not INTERPRET:  # the outer run only

    def test_delta_kernels_under_interpreter():
        """The kernel tests of this file on the CPU, in Triton's interpreter, in a fresh process."""
        assert_passes_under_interpreter(__file__)

    @pytest.mark.parametrize(
        "name,dtype", [("_encode_kernel", "bf16"), ("_decode_kernel", "bf16"), ("_decode_kernel", "fp16")]
    )
    def test_kernels_compile_for_sm90(name, dtype):
        """Without a GPU: each kernel compiles to an sm_90 cubin, never flushes subnormals (FP16's
        and BF16's small weights), the encode divides with IEEE rounding, and no offset is multiplied
        in 32 bits (issue 35 item 8: ``nblocks * 32`` in i32 wrapped for a shard of 2^31 - 31 elements
        or more, so the encode wrote no codes and the decode read scales ~2 GB before its message)."""
        from triton import compile as triton_compile
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from megatron_gift.kernels import delta

        kernel = getattr(delta, name)
        constexprs = {"BB": delta.BB, "MANT": 7 if dtype == "bf16" else 10}
        types = {
            "new_ptr": dtype,
            "prev_ptr": dtype,
            "param_ptr": dtype,
            "codes_ptr": "i8",
            "scales_ptr": "u8",
            "msg_ptr": "u8",
        }
        signature = {
            a: "constexpr" if a in constexprs else f"*{types[a]}" if a.endswith("_ptr") else "i32"
            for a in kernel.arg_names
        }
        src = ASTSource(kernel, signature, {(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
        asm = triton_compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm
        assert asm["cubin"] and ".ftz" not in asm["ptx"]
        assert ("div.rn.f32" in asm["ptx"]) == (name == "_encode_kernel") and "div.approx" not in asm["ptx"]
        muls = [line for line in asm["ttir"].splitlines() if "arith.muli" in line]
        assert muls and not [m for m in muls if re.search(r"[: x]i32\b", m)], muls  # every product 64-bit

    def test_reference_chunks_are_bitwise_one_pass_and_ops_do_not_grow(monkeypatch):
        """Catches a chunk boundary that shifts codes, scales or weights (chunks of 2 blocks against
        one pass over everything), and a PyTorch path whose op count grows with the elements inside
        a chunk (the same at 2 and 200 blocks a shard, 2 and 5 shards)."""
        prev, new = shards(3, 32 * 7 + 5, torch.bfloat16, seed=3)
        m = param_delta.message_bytes(prev.shape[1])
        one, chunked = torch.empty(3, m, dtype=torch.uint8), torch.empty(3, m, dtype=torch.uint8)
        for r in range(3):
            param_delta.encode(new[r], prev[r], one[r], fused=False)
        a, a_own = prev.clone(), prev[1].clone()
        param_delta.decode_into(one, a, a_own, 1, fused=False)
        monkeypatch.setattr(param_delta, "CHUNK", 64)
        for r in range(3):
            param_delta.encode(new[r], prev[r], chunked[r], fused=False)
        assert torch.equal(one, chunked)
        b, b_own = prev.clone(), prev[1].clone()
        param_delta.decode_into(one, b, b_own, 1, fused=False)
        assert same(a, b) and same(a_own, b_own)
        monkeypatch.setattr(param_delta, "CHUNK", 1 << 24)
        counts = set()
        for p, numel in ((2, 64), (2, 6400), (5, 64), (5, 6400)):
            prev, new = shards(p, numel, torch.bfloat16, seed=4)
            msgs = torch.empty(p, param_delta.message_bytes(numel), dtype=torch.uint8)
            with OpCounter() as enc:
                param_delta.encode(new[0], prev[0], msgs[0], fused=False)
            with OpCounter() as dec:
                param_delta.decode_into(msgs, prev, prev[0].clone(), 0, fused=False)
            counts.add((enc.total, dec.total))
        assert len(counts) == 1, counts
