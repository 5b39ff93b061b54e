"""Fused Triton kernels vs the pure-PyTorch reference: codes, scales and the rank sum bit for bit,
the whitening ``T`` and ``T⁻¹`` to FP32 rounding.

On the CPU the kernels run under Triton's interpreter, which has to be on (``TRITON_INTERPRET=1``)
when the kernels are defined (``kernels.fused`` is imported at their first use, or by
``test_kernels_compile_for_sm90``): ``test_kernels_under_interpreter`` runs this file again in a
fresh process with it set, where the kernel tests below run on the CPU. Without the variable they
run on CUDA (``gpu``-marked: skipped on machines without it). The interpreter run also checks
``QuantizedReduce`` with the kernels forced on against its PyTorch path, on two gloo ranks."""

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
from megatron_gift.config import Mode
from megatron_gift.kernels import reference_decode_sum_unwhiten, reference_whiten_encode
from megatron_gift.numerics.error_feedback import ErrorFeedback
from megatron_gift.numerics.fp8 import CodecConfig, FP8Format, Scaling, encode
from megatron_gift.numerics.whitening import LowRankWhitening
from megatron_gift.testing import run_on_ranks
from tests.test_whitening import fp32_bound

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ["cpu"] if INTERPRET else [pytest.param("cuda", marks=pytest.mark.gpu)]
CONFIGS = [CodecConfig(fmt=f, scaling=s) for f in FP8Format for s in Scaling]
SHAPES = [(1, 1), (1, 300), (20, 257)]


@pytest.fixture
def kernels_only(monkeypatch):
    """Fails any call that would fall back to the reference: the Triton path must be taken."""

    def fallback(*args, **kwargs):
        raise AssertionError("fell back to the PyTorch reference")

    monkeypatch.setattr(kernels, "reference_whiten_encode", fallback)
    monkeypatch.setattr(kernels, "reference_decode_sum_unwhiten", fallback)


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
    assert ((x - ref).norm(dim=1) <= bound * ref.norm(dim=1)).all(), float(((x - ref).norm(dim=1) / ref.norm(dim=1)).max())


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
@pytest.mark.parametrize("fmt", FP8Format)
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
@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (9, 300)])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_decode_sum_is_bitwise(device, average, shape, cfg, kernels_only):
    payloads, scales = _messages(3, *shape, cfg, device, special=True)
    out = kernels.decode_sum_unwhiten(payloads, scales, *shape, None, cfg, average)
    _assert_same_bits(out, reference_decode_sum_unwhiten(payloads, scales, *shape, None, cfg, average))


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
    counting the kernels' launches; a fallback to the kernels' reference fails."""
    from megatron_gift.kernels import fused

    def fallback(*args, **kwargs):
        raise AssertionError("fell back to the PyTorch reference")

    kernels.reference_whiten_encode = kernels.reference_decode_sum_unwhiten = fallback
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
            before = dict(calls)
            flat = grads[rank].clone()
            group = dist.group.WORLD
            quantized.QuantizedReduce(flat, layout, group, transforms, average=average, all_reduce=all_reduce, kernels=use).wait()
            out[(codec, all_reduce, average, use)] = (flat, {k: calls[k] - before[k] for k in calls})
    # Error feedback keeps the sender on the PyTorch path: the same residual either way.
    layout = BucketLayout(numel, world, segments, CodecConfig(), torch.float32)
    for use in (False, True):
        ef = ErrorFeedback(layout.n_coded)
        quantized.QuantizedReduce(grads[rank].clone(), layout, dist.group.WORLD, transforms, error_feedback=ef, kernels=use).wait()
        out[("ef", use)] = ef._pending
    return out


def _run(args, **env):
    env = {**os.environ, **env}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)


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
        for res in results:
            assert torch.equal(res[("ef", True)], res[("ef", False)])

else:  # the outer run only, so that the interpreter run's summary has no skips

    def test_kernels_under_interpreter():
        """The kernel tests of this file on the CPU, in Triton's interpreter, in a fresh process."""
        proc = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], TRITON_INTERPRET="1")
        assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
        summary = proc.stdout.strip().splitlines()[-1]
        assert "passed" in summary and "skipped" not in summary and "deselected" not in summary, summary

    E4M3 = dict(MANT=3, BIAS=7, E4M3=True)
    E5M2 = dict(MANT=2, BIAS=15, E4M3=False)
    # (kernel, its constexprs, FMA contraction as the launcher sets it, whether it divides)
    SM90_CASES = [
        ("_whiten_encode_kernel", dict(PASS=2, WHITEN=True, STORE_U=True, FMAX=448.0, **E4M3), True, True),
        ("_whiten_encode_kernel", dict(PASS=0, WHITEN=True, STORE_U=False, FMAX=57344.0, **E5M2), False, False),
        ("_whiten_encode_kernel", dict(PASS=1, WHITEN=True, STORE_U=True, FMAX=57344.0, **E5M2), False, True),
        ("_decode_sum_kernel", dict(AVERAGE=True, **E4M3), False, True),
        ("_decode_sum_kernel", dict(AVERAGE=False, **E5M2), False, False),
        ("_unwhiten_kernel", {}, True, False),
    ]

    @pytest.mark.parametrize("name,constexprs,fusion,divides", SM90_CASES)
    def test_kernels_compile_for_sm90(name, constexprs, fusion, divides):
        """Without a GPU: each kernel compiles to an sm_90 cubin, divides with IEEE rounding, never
        flushes subnormals, and leaves products unfused where the launcher turns FMA off."""
        from triton import compile as triton_compile
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from megatron_gift.kernels import fused

        kernel = getattr(fused, name)
        tile = {"WIDTH": 128, "BLOCK_R": 16, "BLOCK_C": 128}
        constexprs = {**{k: v for k, v in tile.items() if k in kernel.arg_names}, **constexprs}
        pointers = {"code_ptr": "*u8", "scale_ptr": "*i16" if constexprs.get("PASS") == 2 else "*fp32"}
        signature = {
            a: "constexpr" if a in constexprs else pointers.get(a, "*fp32") if a.endswith("_ptr") else "i32"
            for a in kernel.arg_names
        }
        src = ASTSource(kernel, signature, {(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
        asm = triton_compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": fusion}).asm
        assert asm["cubin"]
        ptx = asm["ptx"]
        assert ".ftz" not in ptx
        assert ("div.rn.f32" in ptx) == divides and "div.full" not in ptx and "div.approx" not in ptx
        assert fusion or "fma." not in ptx

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
