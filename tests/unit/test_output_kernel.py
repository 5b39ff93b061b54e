"""The output side's fused inverse (``kernels.output_inverse``, ``kernels/output.py``) against an
independent dense FP64 ``D^{1/2}(W + Q diag(c') P)`` and the PyTorch reference
(``numerics.two_sided.output_inverse``) on element ranges that cut rows, into FP32, BF16 and FP16
outputs; its one launch per call and its ``TRAFFIC`` entry.

As in tests/unit/test_kernels.py, the kernel tests run on the CPU in Triton's interpreter, which has to
be on when the kernels are defined: ``test_output_kernel_under_interpreter`` runs this file again
in a fresh process with ``TRITON_INTERPRET=1``; without it they run on CUDA (``gpu``).

Tolerance: per element the kernel computes ``a_k = fl(Q[i,k] c'_k)`` (one rounding), adds the ``r``
products ``fl(a_k P[k,j])`` to ``W`` one after the other (one rounding each, one per add; an FMA
only drops some) and multiplies by ``d_sqrt[i]`` (one), all in FP32: a product term passes through
at most ``r + 3`` roundings, so ``|Ĝ - G| ≤ γ_{r+3} M`` with ``γ_m = m u / (1 - m u)``, ``u = 2^-24``,
``M = |d| (|W| + |Q| |c'| |P|)`` (the componentwise bound of a sum of products, whatever the order
of the sum). The FP64 reference's own error, ``γ^{64}_{r+3} M``, is added. The PyTorch reference
(``c' ⊙ P``, an ``addmm`` in any order, a ``mul``: as many roundings) is held to twice that. A
narrower output rounds once more: ``|out - G| ≤ u_o |Ĝ| + η_o + γ M`` (``u_o``: 2^-8 for BF16,
2^-11 for FP16; ``η_o``, half the smallest subnormal: 2^-134, 2^-25), and it must be bit for bit
torch's cast of the kernel's own FP32 result (one rounding, to nearest even: not truncated, not
rounded twice).
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_gift import kernels
from megatron_gift.numerics.two_sided import output_inverse as reference_output_inverse
from megatron_gift.numerics.whitening import LowRankWhitening
from megatron_gift.testing.kernel_log import assert_passes_under_interpreter, launches_of

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ["cpu"] if INTERPRET else [pytest.param("cuda", marks=pytest.mark.gpu)]
D_OUT, COLS = 40, 300  # more rows than a program's 16, more columns than its 128
N = D_OUT * COLS
# [e0, e1): all; head piece + whole rows + tail piece; head and tail only (two rows); a piece inside one row
# across column tiles; one element; whole rows only; whole rows + tail; the last element
RANGES = [(0, N), (7, N - 3), (250, 420), (130, 290), (5, 6), (600, 6000), (300, 5017), (N - 1, N)]
# a narrower output's rounding: unit roundoff, half its smallest subnormal (module doc)
UNIT = {torch.bfloat16: (2.0**-8, 2.0**-134), torch.float16: (2.0**-11, 2.0**-25)}


def _gamma(m: int, u: float) -> float:
    return m * u / (1 - m * u)


def _inputs(rank: int, device):
    """``T_out`` of rank ``rank`` from a ``B`` spanning ~1.5 decades, ``W [N]`` and ``P [rank, COLS]``
    (magnitudes over a few binades; a NaN in ``W``)."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(4 * D_OUT, D_OUT, generator=gen) * torch.logspace(-1.5, 0, D_OUT)
    w = LowRankWhitening.from_statistics(x.T @ x / x.shape[0], rank, device=device)
    values = torch.randn(N, generator=gen) * torch.exp(torch.randn(N, generator=gen))
    values[N // 2 + 11] = float("nan")
    proj = torch.randn(rank, COLS, generator=gen) * 10
    return w, values.to(device), proj.to(device)


def _dense(w: LowRankWhitening, values: torch.Tensor, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, M)`` flat over the whole parameter in FP64: ``G = diag(d) (W + Q diag(c') P)`` as dense
    matrix products, and the magnitudes ``M = |d| (|W| + |Q| |c'| |P|)`` of the bound."""
    d, q, c = (t.double().cpu() for t in (w.d_sqrt, w.q, w.c_inv))
    wm, p = values.double().cpu().view(D_OUT, COLS), proj.double().cpu()
    g = d[:, None] * (wm + q @ torch.diag(c) @ p)  # row scaling elementwise: a NaN stays in its element
    m = d.abs()[:, None] * (wm.abs() + q.abs() @ torch.diag(c.abs()) @ p.abs())
    return g.flatten(), m.flatten()


@pytest.fixture
def launches(monkeypatch):
    def fallback(*args, **kwargs):
        raise AssertionError("fell back to the PyTorch reference")

    from megatron_gift.kernels import output

    monkeypatch.setattr(kernels, "reference_output_inverse", fallback)
    with launches_of(output) as log:
        yield log


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank", [0, 5])
@pytest.mark.parametrize("e0,e1", RANGES)
def test_output_inverse_against_dense_fp64(device, rank, e0, e1, launches):
    """Catches a head or tail piece dropped, written at the wrong offset or given another row's
    ``Q``/``d_sqrt``, ``P`` read at the wrong columns, ``c`` for ``c'`` or ``c'`` left out, ``D^{-1/2}``
    for ``D^{1/2}``, a write outside the rank's elements (the output is a slice of a sentinel
    buffer), a NaN not propagated or spread to other elements, a BF16/FP16 result truncated or
    rounded twice, and more than one launch for the three pieces (bound: module doc)."""
    w, values, proj = _inputs(rank, device)
    want, mag = _dense(w, values, proj)
    want, mag = want[e0:e1], mag[e0:e1]
    err = _gamma(rank + 3, 2.0**-24) + _gamma(rank + 3, 2.0**-53)
    results = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        buf = torch.full((e1 - e0 + 2,), 7.0, dtype=dtype, device=device)
        mark = len(launches)
        kernels.output_inverse(w, values[e0:e1], COLS, e0, proj, buf[1:-1])
        assert [name for name, _ in launches[mark:]] == ["_output_inverse_kernel"], dtype
        assert buf[0].item() == 7.0 and buf[-1].item() == 7.0, dtype
        results[dtype] = got = buf[1:-1].double().cpu()
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), dtype
        got, ref = got[~nan], want[~nan]
        if dtype is torch.float32:
            assert ((got - ref).abs() <= err * mag[~nan]).all(), float(((got - ref).abs() / mag[~nan]).max())
        else:
            fp32 = results[torch.float32][~nan]
            assert torch.equal(got.to(dtype), fp32.float().to(dtype)), dtype  # one rounding, to nearest even
            unit, eta = UNIT[dtype]
            assert ((got - ref).abs() <= unit * fp32.abs() + eta + err * mag[~nan]).all(), dtype
    # the PyTorch reference: the same roundings in another order (module doc)
    ref = torch.empty(e1 - e0, device=device)
    reference_output_inverse(w, values[e0:e1], COLS, e0, proj, ref)
    ref, got, nan = ref.double().cpu(), results[torch.float32], want.isnan()
    assert torch.equal(ref.isnan(), nan)
    assert ((got - ref)[~nan].abs() <= 2 * err * mag[~nan]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_traffic_entry_is_the_launch_bytes(device, launches):
    """Catches a ``TRAFFIC`` formula that is not the bytes the launch touches: ``W`` and the output
    once, and the distinct rows of ``d_sqrt``/``Q``, columns of ``P`` and entries of ``c'`` its
    elements use, counted here element by element."""
    from megatron_gift.kernels import output

    rank = 5
    w, values, proj = _inputs(rank, device)
    for e0, e1 in RANGES:
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(e1 - e0, dtype=dtype, device=device)
            kernels.output_inverse(w, values[e0:e1], COLS, e0, proj, out)
            name, args = launches[-1]
            e = torch.arange(e0, e1)
            rows, cols = e.div(COLS, rounding_mode="floor").unique().numel(), (e % COLS).unique().numel()
            read = 4 * (e1 - e0) + 4 * rows * (1 + rank) + 4 * cols * rank + 4 * rank
            assert output.TRAFFIC[name](args) == (read, (e1 - e0) * out.element_size()), (e0, e1, dtype)


if not INTERPRET:  # the outer run only

    def test_output_kernel_under_interpreter():
        """The kernel tests of this file on the CPU, in Triton's interpreter, in a fresh process."""
        pytest.importorskip("triton")
        assert_passes_under_interpreter(__file__)
