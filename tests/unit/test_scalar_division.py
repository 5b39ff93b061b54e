"""The PyTorch reference divides as the kernels do (issue 35 item 6): on CUDA ``t / python_scalar``
is ``t * (1/s)``, one ulp off IEEE division for about half the FP8 scales, so the reference must
divide by a 0-dim tensor on the tensor's device (``numerics.fp8.divisor``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megatron_gift.kernels.reference import reference_sum_rows
from megatron_gift.numerics.fp8 import CodecConfig, Scaling, divisor, scales_from_amax

ROOT = Path(__file__).resolve().parents[2] / "megatron_gift"
GUARDED = [ROOT / "numerics" / "fp8.py", ROOT / "kernels" / "reference.py"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _numeric_names(tree: ast.AST) -> set[str]:
    """Names bound anywhere in the module to a numeric constant (``N = 3``, ``X = -1.5``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            v = node.value.operand if isinstance(node.value, ast.UnaryOp) else node.value
            if isinstance(v, ast.Constant) and isinstance(v.value, (int, float)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _is_divisor_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "divisor"


def scalar_divisions(source: str) -> list[int]:
    """Lines of ``source`` that divide by something other than a tensor: every ``/`` and ``/=`` must
    divide by ``divisor(...)`` (an attribute such as ``cfg.fmt.max`` or a ``sum(...)`` is a Python
    number too); ``div``/``div_``/``torch.div`` must not take a constant, a name bound to one, or a
    call other than ``divisor``."""
    tree = ast.parse(source)
    numeric = _numeric_names(tree)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            if not _is_divisor_call(node.right):
                bad.append(node.lineno)
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
            if not _is_divisor_call(node.value):
                bad.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("div", "div_"):
            args = (
                node.args[1:] if isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" else node.args
            )
            d = args[0] if args else None
            if d is None:
                continue
            if (
                isinstance(d, (ast.Constant, ast.Attribute, ast.UnaryOp))
                or (isinstance(d, ast.Name) and d.id in numeric)
                or (isinstance(d, ast.Call) and not _is_divisor_call(d))
            ):
                bad.append(node.lineno)
    return sorted(bad)


@pytest.mark.parametrize("path", GUARDED, ids=lambda p: p.name)
def test_no_python_scalar_division_left(path):
    """Catches a ``t / python_scalar`` (or ``div_`` by one) added to the reference: a GPU's bitwise
    kernel tests would fail on one ulp for PyTorch's reasons."""
    assert scalar_divisions(path.read_text()) == [], f"{path}: divide by divisor(value, device)"


def test_the_guard_sees_each_form():
    """Catches a guard that misses a form of scalar division (it would pass vacuously)."""
    src = "N = 3\nt / 2\nt / N\nt / cfg.fmt.max\nt /= sum(x)\nt.div_(len(x))\ntorch.div(t, N)\nt.div(2.0)\n"
    assert scalar_divisions(src) == [2, 3, 4, 5, 6, 7, 8]
    ok = "t / divisor(2, t.device)\nt /= divisor(n, t.device)\nt.div_(s)\ntorch.div(x, s[:, 1], out=s)\n"
    assert scalar_divisions(ok) == []


def _reciprocal_differs(a: torch.Tensor, b: float) -> torch.Tensor:
    """Where FP32 ``a * fp32(1/b)`` differs from the correctly rounded ``a / b`` (FP64 then FP32: exact,
    53 >= 2 * 24 + 2 bits)."""
    recip = torch.tensor(1.0 / b, dtype=torch.float64).float()
    return (a * recip) != (a.double() / b).float()


def _values_where_reciprocal_differs(b: float, n: int = 64) -> torch.Tensor:
    """``n`` FP32 values over many binades for which ``a * (1/b) != a / b``."""
    g = torch.Generator().manual_seed(35)
    a = torch.ldexp(1 + torch.rand(4096, generator=g), torch.randint(-30, 30, (4096,), generator=g)).float()
    a = a[_reciprocal_differs(a, b)][:n]
    assert a.numel() == n  # about half of all values differ: the construction holds
    return a


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_scales_are_ieee_divisions(device, fmt):
    """Catches ``amax / fp8_max`` computed as ``amax * (1/fp8_max)`` (CUDA's scalar division): the
    scales would be one ulp off the kernels' on these constructed maxima."""
    cfg = CodecConfig(fmt=fmt, scaling=Scaling.BLOCK)
    amax = _values_where_reciprocal_differs(cfg.fmt.max)
    want = (amax.double() / cfg.fmt.max).float()
    got = scales_from_amax(amax.to(device), cfg).cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_average_is_an_ieee_division(device):
    """Catches the reference's ``÷ R`` done as ``* (1/R)``: for R = 3 the average is one ulp off on
    these constructed sums."""
    s = _values_where_reciprocal_differs(3.0)
    parts = torch.stack([s, torch.zeros_like(s), torch.zeros_like(s)])  # the sum is s, exactly
    want = (s.double() / 3).float()
    assert torch.equal(reference_sum_rows([parts.to(device)], average=True).cpu(), want)


def test_divisor_is_cached_on_the_device_and_refuses_inexact_values():
    """Catches a divisor made per call (a fill per division) or one FP32 rounds (other bits)."""
    assert divisor(448.0, torch.device("cpu")) is divisor(448.0, torch.device("cpu"))
    assert divisor(3, torch.device("cpu")).dim() == 0 and divisor(3, torch.device("cpu")).dtype == torch.float32
    with pytest.raises(ValueError):
        divisor(0.1, torch.device("cpu"))
