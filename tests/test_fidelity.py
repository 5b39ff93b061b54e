"""The fidelity benchmark on a tiny model (schema and sanity of the numbers) and the CLI.

One tiny run (1 layer, 4 ranks, 2 points) is shared by the tests; it takes a few seconds
once the corpus is cached. Whether whitening beats Euclidean on rows drawn from N(0, A²)
is covered in test_whitening.py.
"""

import json
import math
from collections import defaultdict

import pytest
import torch

from megatron_gift import cli
from megatron_gift.bench import fidelity
from megatron_gift.bench.llama import LlamaConfig
from megatron_gift.numerics import LowRankWhitening, approximate_factor
from tests.reference import fp8_roundtrip

TINY = fidelity.FidelityConfig(
    model=LlamaConfig(hidden=32, layers=1, heads=2, ffn_hidden=48, seq_len=16),
    points=(3, 6),
    batch_size=4,
    warmup_steps=2,
    seqs_per_rank=1,
    accumulation=2,
    kfac_batches=2,
    gift_ranks=(4, 8),
    dense_rank=8,
)
RANKS = 4


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("fidelity") / "tiny.json"
    out = fidelity.run(json_path=path, ranks=RANKS, config=TINY, command="test")
    return out, json.loads(path.read_text())


def by_cell(results):
    """``(step, layer, tokens_per_rank) -> {scheme: record}``."""
    cells = defaultdict(dict)
    for r in results:
        cells[(r["step"], r["layer"], r["tokens_per_rank"])][r["scheme"]] = r
    return cells


def test_json_schema(report):
    _, data = report
    for key in ("schema", "command", "machine", "config", "corpus", "schemes", "points", "results", "geometry", "summary", "wall_seconds"):
        assert key in data, key
    assert data["command"] == "test" and data["config"]["ranks"] == RANKS
    assert {"platform", "cpu_count", "torch"} <= set(data["machine"])
    assert len(data["corpus"]["sha256"]) == 64
    assert [p["step"] for p in data["points"]] == list(TINY.points)
    names = set(data["schemes"])
    assert {"bf16", "euclid-e5m2-tensor-shared", "euclid-e4m3-block", "gift-r8-e4m3-mx", "gift-dense-r8-e4m3-block"} <= names
    assert len(names) == len(fidelity.schemes(TINY))
    for r in data["results"]:
        assert {"step", "layer", "layer_type", "scheme", "tokens_per_rank", "rel_l2", "cos"} <= set(r)
        assert r["layer_type"] in fidelity.LAYER_TYPES
        assert ("ratio_vs_euclid" in r) == data["schemes"][r["scheme"]]["family"].startswith("gift")
    tokens = {r["tokens_per_rank"] for r in data["results"]}
    assert tokens == {TINY.seqs_per_rank * 16, TINY.accumulation * TINY.seqs_per_rank * 16}
    cells = by_cell(data["results"])
    assert len(cells) == len(TINY.points) * 4 * len(tokens)  # 4 linear layers
    assert all(set(c) == names for c in cells.values())


def test_errors_are_sane(report):
    out, _ = report
    for cell in by_cell(out["results"]).values():
        for rec in cell.values():
            assert 0 < rec["rel_l2"] < 1 and 0.5 < rec["cos"] <= 1 + 1e-12
        fp8 = [r["rel_l2"] for s, r in cell.items() if s != "bf16"]
        assert cell["bf16"]["rel_l2"] < 0.2 * min(fp8)
        assert cell["euclid-e4m3-block"]["rel_l2"] < cell["euclid-e5m2-tensor-shared"]["rel_l2"]


def test_measure_layer_against_references():
    """Errors of one layer's schemes against references built here: the FP64 sum of the ranks'
    gradients, the FP8 round trip from its definition (tests/reference.py), BF16 by torch's cast."""
    gen = torch.Generator().manual_seed(0)
    stack = torch.randn(3, 40, 256, generator=gen) * torch.linspace(0.01, 2.0, 256)
    x = torch.randn(600, 256, generator=gen) * torch.linspace(0.01, 2.0, 256)
    a = x.T @ x / 600
    results, _ = fidelity.measure_layer(stack, a, TINY)
    rec = {r["scheme"]: r for r in results}
    truth = stack.double().sum(0)

    def rel(approx):
        return float((approx.double() - truth).norm() / truth.norm())

    # Sums (the truth, BF16's) in FP64 here, in FP32 there: they differ by at most
    # · 2^-24 · Σ_r |G_r| per element, and a RelL2 by that norm over ‖truth‖ (twice, to first order).
    tol = 2 * (len(stack) - 1) * 2.0**-24 * float(stack.double().abs().sum(0).norm() / truth.norm())
    assert rec["bf16"]["rel_l2"] == pytest.approx(rel(sum(g.bfloat16().double() for g in stack)), abs=tol)
    euclid = rel(sum(fp8_roundtrip(g) for g in stack))
    assert rec["euclid-e4m3-block"]["rel_l2"] == pytest.approx(euclid, abs=tol)
    w = LowRankWhitening(approximate_factor(a, 4, TINY.damping))
    gift = rel(w.inverse(sum(fp8_roundtrip(w.apply(g)) for g in stack)))
    assert rec["gift-r4-e4m3-block"]["rel_l2"] == pytest.approx(gift, abs=tol)
    assert rec["gift-r4-e4m3-block"]["ratio_vs_euclid"] == pytest.approx(gift / euclid, rel=tol / gift + tol / euclid)


def test_geometry_records(report):
    out, _ = report
    geo = out["geometry"]
    assert len(geo) == len(TINY.points) * 4 * 2 * len(TINY.gift_ranks)
    codecs = {s.codec_name for s in fidelity.schemes(TINY) if s.codec is not None}
    for g in geo:
        assert 0 < g["trace_share_top_r"] <= 1 and 0 < g["grad_energy_share_top_r"] <= 1
        assert g["predicted_ratio_model"] > 0 and g["predicted_ratio_shares"] > 0
        assert set(g["measured_ratio"]) == codecs


def test_summary_and_tables(report):
    out, _ = report
    summary = out["summary"]
    rows = [r for r in summary["rel_l2_geomean"] if r["scheme"] == "bf16" and r["layer_type"] == "all"]
    assert len(rows) == 2 and all(0 < r["rel_l2"] < 0.01 for r in rows)
    assert len(summary["prediction_fit"]) == len(fidelity.CODECS)
    text = fidelity.format_tables(out)
    assert "| scheme | qkv | proj | fc1 | fc2 | all |" in text
    assert "euclid-e5m2-tensor-shared" in text and "pred model" in text


def test_cli_parses_bench_fidelity():
    args = cli.build_parser().parse_args(["bench", "fidelity", "--quick", "--json", "out.json", "--ranks", "16"])
    assert (args.quick, args.json, args.ranks, args.threads) == (True, "out.json", 16, 1)
    assert args.func is cli._bench_fidelity
    defaults = cli.build_parser().parse_args(["bench", "fidelity"])
    assert (defaults.quick, defaults.json, defaults.ranks) == (False, None, 8)
    for bad in ([], ["bench"], ["bench", "fidelity", "--ranks", "0"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(bad)


def test_cli_runs_fidelity_and_prints_tables(report, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(fidelity, "run", lambda **kw: calls.append(kw) or report[0])
    assert cli.main(["bench", "fidelity", "--quick", "--json", "x.json", "--ranks", "4"]) == 0
    assert calls == [dict(quick=True, json_path="x.json", ranks=4, command="megatron-gift bench fidelity --quick --json x.json --ranks 4", threads=1)]
    assert "| bf16 |" in capsys.readouterr().out
