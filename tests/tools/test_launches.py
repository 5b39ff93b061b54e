"""The launch-and-traffic meter (``testing.meter``) and ``bench launches``: its counts against hand
counts, the kernels' ``TRAFFIC`` formulas against the tensors a launch is given, stubbed counts on
``meta`` tensors against a real run (CPU, and Triton's interpreter), and the benchmark's wiring."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_gift.numerics.fp8 import CodecConfig, Scaling
from megatron_gift.testing.simulate import kernels_on
from megatron_gift_tools.bench import launches
from megatron_gift_tools.meter import Meter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_aten_counts_match_a_hand_count():
    """An op the mode misses, a view counted as traffic, an in-place target counted as read or an
    indexed op counted by its whole destination would each change these hand-counted totals."""
    x = torch.arange(1000, dtype=torch.float32)
    y2 = torch.ones(200)
    meter = Meter()
    with meter, meter.stage("s") as c:
        y = x[100:300]  # slice: a view, 0 B
        z = y + y2  # add: reads 800 + 800, writes 800
        buf = torch.empty(50)  # empty: 0 B
        buf.copy_(z[:50])  # slice (0 B), copy_: reads 200, writes 200
        w = torch.zeros(10, dtype=torch.float64)  # writes 80
        w.index_copy_(
            0, torch.arange(3), torch.ones(3, dtype=torch.float64)
        )  # arange 24, ones 24; reads 24 + 24, writes 24
        x.index_select(0, torch.arange(4))  # arange 32; reads 16 of x + 32 of index, writes 16
    assert c.aten_ops == 11 and c.no_traffic_ops == 3
    assert c.aten_read == 1600 + 200 + 48 + 48
    assert c.aten_written == 800 + 200 + 80 + 24 + 24 + 24 + 32 + 16
    assert c.gpu_launches == 8


def _meta_launch(fn):
    meter = Meter(stub=True)
    with kernels_on("meta"), meter, meter.stage("k") as c:
        out = fn()
    return c, out


@pytest.mark.parametrize("scaling", [Scaling.BLOCK, Scaling.ROW])
def test_encode_traffic_is_the_bytes_of_its_tensors(scaling):
    """``TRAFFIC['_encode_kernel']`` against the tensors: one pass reads G and writes the codes and
    scales (BLOCK: one launch); ROW scaling's two passes read G twice, the first writing the unit
    maxima, the second reading the scales. A formula off by a dtype size or a term fails."""
    from megatron_gift import kernels

    cfg = CodecConfig(scaling=scaling)
    g = torch.empty(64, 256, device="meta")
    c, enc = _meta_launch(lambda: kernels.whiten_encode(g, None, cfg))
    names = [k.kernel for k in c.launches]
    if scaling is Scaling.BLOCK:
        assert names == ["_encode_kernel"]
        (k,) = c.launches
        assert (k.read, k.written) == (g.nbytes, enc.payload.nbytes + enc.scales.nbytes)
    else:
        assert names == ["_encode_kernel", "_encode_kernel"]
        amax_units = 64 * 2  # ROW: units of 128 columns
        assert (c.launches[0].read, c.launches[0].written) == (g.nbytes, 4 * amax_units)
        assert (c.launches[1].read, c.launches[1].written) == (g.nbytes + enc.scales.nbytes, enc.payload.nbytes)


def test_gift_decode_traffic_is_the_bytes_of_its_tensors():
    """The rank sum reads every part's codes and scales and writes the FP32 sum; ``S Q`` reads the
    sum and Q (four column splits of 64 of one 32-row block: each program its columns of ``Q`` and all
    the coefficients) and writes a part of ``P`` per split; ``T⁻¹`` reads and writes the sum in place
    (two programs of 16 rows per 128 columns: each its rows of ``P`` and its columns of ``D^½``, ``Qᵀ``)."""
    from megatron_gift import kernels
    from megatron_gift.numerics.whitening import LowRankWhitening

    cfg, rows, cols, r, ranks = CodecConfig(), 32, 256, 8, 3
    w = LowRankWhitening.empty(cols, r, device="meta")
    codes = torch.empty(ranks, rows * cols, dtype=torch.uint8, device="meta")
    scales = torch.empty(ranks, rows * cols // 128, device="meta")
    c, out = _meta_launch(lambda: kernels.decode_sum_unwhiten(codes, scales, rows, cols, w, cfg, True))
    assert [k.kernel for k in c.launches] == ["_decode_sum_kernel", "_project_kernel", "_unwhiten_kernel"]
    dec, proj, unw = c.launches
    assert (dec.read, dec.written) == (codes.nbytes + scales.nbytes, out.nbytes)
    assert proj.grid == (4,) and unw.grid == (4,)
    assert (proj.read, proj.written) == (out.nbytes + w.q.nbytes + 4 * w.c_inv.nbytes, 4 * (4 * rows * r))
    p_rows = 4 * rows * r
    assert (unw.read, unw.written) == (out.nbytes + 2 * (w.d_sqrt.nbytes + w.q.nbytes) + 2 * p_rows, out.nbytes)


def test_a_formula_claiming_more_than_its_tensors_is_refused(monkeypatch):
    """The meter's check of each ``TRAFFIC`` entry: bytes beyond what the launch's tensors address."""
    from megatron_gift import kernels
    from megatron_gift.kernels import fused

    monkeypatch.setitem(fused.TRAFFIC, "_encode_kernel", lambda a: (10**12, 0))
    with pytest.raises(AssertionError, match="more than"):
        _meta_launch(lambda: kernels.whiten_encode(torch.empty(4, 128, device="meta"), None, CodecConfig()))


def _stage_counts(case: launches.Case) -> list[tuple]:
    stages, _ = launches.counted(case)
    return [
        (
            s.name,
            s.aten_ops,
            s.no_traffic_ops,
            s.aten_read,
            s.aten_written,
            [(k.kernel, k.read, k.written) for k in s.launches],
        )
        for s in stages
    ]


@pytest.mark.parametrize("path", ["flat-rs", "flat-ar", "two-level/bf16-rs", "two-level/fp8-ar"])
def test_meta_counts_equal_real_cpu_counts(path):
    """Counting on ``meta`` tensors (how the scan reaches 200M elements) must see what a real CPU
    run dispatches, op for op and byte for byte (PyTorch path: no kernels on a plain CPU)."""
    numel = 64 * 1000 * 4 + 96  # GIFT, Euclidean, off and bf16 parameters, cut rows, padding
    real = _stage_counts(launches.Case(path, "plain", numel, 4, "pytorch", device="cpu"))
    meta = _stage_counts(launches.Case(path, "plain", numel, 4, "pytorch", device="meta"))
    assert real == meta


_INTERPRETED = textwrap.dedent("""
    import json, sys, torch
    from megatron_gift_tools.bench import launches
    from tests.tools.test_launches import _stage_counts
    out = {}
    for path in ("flat-rs", "two-level/fp8-ar"):
        for device in ("cpu", "meta"):
            case = launches.Case(path, "plain", launches.COLS * 8 * 4, 4, "fused", device=device)
            out[f"{path} {device}"] = _stage_counts(case)
    json.dump(out, sys.stdout)
""")


def test_stubbed_launches_equal_the_interpreters():
    """Under Triton's interpreter the fused path really launches its kernels on CPU tensors: the
    stubbed count on ``meta`` tensors must be the same launches with the same bytes, and the same
    ATen ops (a stub that skipped a wrapper's work, or a formula fed other arguments, differs)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT, "NO_VCS_VERSION": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    for path in ("flat-rs", "two-level/fp8-ar"):
        real, meta = out[f"{path} cpu"], out[f"{path} meta"]
        assert any(stage[5] for stage in real), "no kernel ran"
        assert real == meta, path


def test_bench_launches_smoke(tmp_path, monkeypatch):
    """``megatron-gift bench launches`` end to end on a small scan: every record with its stages,
    essential bytes and ratio, and the JSON written (the CLI's wiring)."""
    from megatron_gift_tools.cli import main

    path = tmp_path / "launches.json"
    cases = [("flat-rs", "plain", "1M", 8, "fused"), ("two-level/bf16-rs", "euclidean", "1M", 8, "fused")]
    monkeypatch.setattr(launches, "scan", lambda quick: cases)
    assert main(["bench", "launches", "--quick", "--no-launcher", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert "cpu" in doc["machine"]
    reductions = [r for r in doc["records"] if r["kind"] == "reduction"]
    assert [(r["path"], r["dp"]) for r in reductions] == [("flat-rs", 8), ("two-level/bf16-rs", 8)]
    assert [s["stage"] for s in reductions[1]["stages"]] == ["intra", "node_sums", "reduce", "finish"]
    for s in reductions[0]["stages"]:
        assert s["essential_read"] is not None and s["launches"] > 0
    assert {r["kind"] for r in doc["records"]} == {"reduction", "delta-gather", "refresh"}
    assert doc["date"].endswith("UTC") and doc["sources"] == launches.source_hash()
    doc["sources"]["sha256"] = "0" * 64  # records of other code are not resumed
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="other sources"):
        main(["bench", "launches", "--quick", "--no-launcher", "--json", str(path), "--resume"])
