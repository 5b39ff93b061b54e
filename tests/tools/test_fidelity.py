"""The fidelity benchmark on a tiny model (schema, the schemes it claims to measure) and the CLI.

One tiny run (1 layer, 4 ranks, 2 points) is shared by the tests; it takes a few seconds
once the corpus is cached. Whether whitening beats Euclidean on rows drawn from N(0, A²)
is covered in test_whitening.py.
"""

import dataclasses
import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from megatron_gift.config import GiftConfig, Mode
from megatron_gift.numerics import LowRankWhitening, TwoSidedWhitening, approximate_factor
from megatron_gift.testing.dense import DenseCholeskyWhitening
from megatron_gift_tools import cli
from megatron_gift_tools.bench import fidelity
from megatron_gift_tools.bench.llama import LlamaConfig
from tests.reference import fp8_roundtrip

TINY = fidelity.FidelityConfig(
    model=LlamaConfig(hidden=32, layers=1, heads=2, ffn_hidden=48, seq_len=16),
    points=(3, 6),
    batch_size=4,
    warmup_steps=2,
    seqs_per_rank=1,
    accumulation=2,
    gift=dataclasses.replace(fidelity.DEFAULT, rank=4, sketch=8, refresh_interval=2),
    paper=dataclasses.replace(fidelity.PAPER, rank=4, refresh_interval=4),
    formats=("fp8", "nvfp4"),
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


def test_defaults_are_what_ships():
    """The default GIFT scheme is GiftConfig()'s (bug caught: the benchmark measuring settings the
    product no longer ships, as it once measured damping 1e-3); --quick has >= 1024 tokens per rank."""
    shipped = GiftConfig(mode=Mode.GIFT).whitening
    d = fidelity.DEFAULT
    assert (d.rank, d.sketch, d.ema, d.refresh_interval, d.damping, d.candidates, d.per_refresh) == (
        shipped.rank,
        shipped.sketch,
        shipped.ema,
        shipped.refresh_interval,
        shipped.damping,
        shipped.damping_candidates,
        False,
    )
    assert fidelity.QUICK.gift == fidelity.FULL.gift == d
    assert (
        fidelity.PAPER.damping,
        fidelity.PAPER.refresh_interval,
        fidelity.PAPER.per_refresh,
        fidelity.PAPER.sketch,
    ) == (1e-3, 50, True, 0)
    for cfg in (fidelity.QUICK, fidelity.FULL):
        assert cfg.seqs_per_rank * cfg.model.seq_len >= 1024
    # the schedule is the plugin's: every interval, and 1, 2, 4, 8 before the first one
    assert [s for s in range(25) if d.is_refresh(s)] == [0, 1, 2, 4, 8, 10, 20]


def test_json_schema(report):
    _, data = report
    for key in (
        "schema",
        "command",
        "machine",
        "config",
        "corpus",
        "schemes",
        "points",
        "results",
        "geometry",
        "summary",
        "wall_seconds",
    ):
        assert key in data, key
    assert data["command"] == "test" and data["config"]["ranks"] == RANKS
    assert {"platform", "cpu_count", "torch"} <= set(data["machine"])
    assert len(data["corpus"]["sha256"]) == 64
    assert [p["step"] for p in data["points"]] == [*TINY.cold_points, *TINY.points]
    names = set(data["schemes"])
    plugin = {"gift-chosen-e4m3-block", "gift-both-e4m3-block", "gift-auto-e4m3-block"}
    assert {
        "bf16",
        "euclid-e5m2-tensor-shared",
        "euclid-e4m3-block",
        "gift-e4m3-block",
        "gift-paper-e4m3-mx",
        "gift-paper-dense-e4m3-block",
        *plugin,
    } <= names
    assert len(names) == len(fidelity.schemes()) == 1 + 4 * len(fidelity.CODECS) + len(plugin)
    assert data["schemes"]["gift-e4m3-block"]["settings"]["damping"] is None  # auto
    assert data["schemes"]["gift-both-e4m3-block"]["side"] == "both"
    for r in data["results"]:
        assert {"step", "layer", "layer_type", "scheme", "tokens_per_rank", "rel_l2", "cos"} <= set(r)
        assert r["layer_type"] in fidelity.LAYER_TYPES
        gift = data["schemes"][r["scheme"]]["family"].startswith("gift")
        assert ({"ratio_vs_euclid", "ratio_vs_best_euclid", "damping"} <= set(r)) == gift
        assert ("factor_age" in r) == (gift and r["scheme"] not in plugin)
    tokens = {r["tokens_per_rank"] for r in data["results"]}
    assert tokens == {TINY.seqs_per_rank * 16, TINY.accumulation * TINY.seqs_per_rank * 16}
    cells = by_cell(data["results"])
    assert len(cells) == (len(TINY.cold_points) + len(TINY.points)) * 4 * len(tokens)  # 4 linear layers
    plain = {n for n in names if not data["schemes"][n]["family"].startswith("gift")}
    for (step, _, _), c in cells.items():
        assert set(c) == (plain | plugin if step in TINY.cold_points else names), step


def test_factor_ages_follow_the_schedules(report):
    """Each record's factor is the one of the scheme's last refresh before the measured weights:
    point 3 (weights after steps 0-2), point 6 (after 0-5); default refresh 2 (0, 1, 2, 4, ...), paper 4
    (0, 1, 2, 4, ...). Bug caught: a factor built from the measured batch, or from a later step."""
    out, _ = report
    want = {("gift", 3): 0, ("gift", 6): 1, ("gift-paper", 3): 0, ("gift-paper", 6): 1}  # last refresh 2 / 4
    for r in out["results"]:
        family = out["schemes"][r["scheme"]]["family"].removesuffix("-dense")
        if family in ("gift", "gift-paper"):
            assert r["factor_age"] == want[family, r["step"]], r


def test_errors_follow_the_formats(report):
    """Per cell: BF16 (2^-8 unit roundoff) below an eighth of every FP8 scheme's error (E4M3: 2^-4,
    so 1/16 in the rounding model of tests/bounds.py, for the same gradients); E4M3 with 1x128 block
    scales below the paper's E5M2 with one shared scale (half the unit roundoff, finer scales)."""
    out, _ = report
    for cell in by_cell(out["results"]).values():
        fp8 = [r["rel_l2"] for s, r in cell.items() if s != "bf16"]
        assert 0 < cell["bf16"]["rel_l2"] < min(fp8) / 8
        assert cell["euclid-e4m3-block"]["rel_l2"] < cell["euclid-e5m2-tensor-shared"]["rel_l2"]


def test_measure_layer_against_references():
    """Errors of one layer's schemes against references built here: the FP64 sum of the ranks'
    gradients, the FP8 round trip from its definition (tests/reference.py), BF16 by torch's cast;
    the default scheme's damping the candidate (or Euclidean) of least error on rank 0's gradient,
    found here by the same definition; the paper's at its fixed 1e-3, low-rank and dense."""
    gen = torch.Generator().manual_seed(0)
    stack = torch.randn(3, 40, 256, generator=gen) * torch.linspace(0.01, 2.0, 256)
    x = torch.randn(600, 256, generator=gen) * torch.linspace(0.01, 2.0, 256)
    a = x.T @ x / 600
    factor = approximate_factor(a, 4, 0.0)
    results, geometry = fidelity.measure_layer(stack, {"gift": (factor, 3), "gift-paper": (factor, 7)}, TINY)
    rec = {r["scheme"]: r for r in results}
    truth = stack.double().sum(0)

    def rel(approx):
        return float((approx.double() - truth).norm() / truth.norm())

    # Sums (the truth, BF16's) in FP64 here, in FP32 there: they differ by at most
    # · 2^-24 · Σ_r |G_r| per element, and a RelL2 by that norm over ‖truth‖ (twice, to first order).
    tol = 2 * (len(stack) - 1) * 2.0**-24 * float(stack.double().abs().sum(0).norm() / truth.norm())
    assert rec["bf16"]["rel_l2"] == pytest.approx(rel(sum(g.bfloat16().double() for g in stack)), abs=tol)
    euclid = rel(sum(fp8_roundtrip(g) for g in stack))
    row = rel(sum(fp8_roundtrip(g, width=g.shape[1]) for g in stack))
    assert rec["euclid-e4m3-block"]["rel_l2"] == pytest.approx(euclid, abs=tol)

    def gift(w):
        return rel(w.inverse(sum(fp8_roundtrip(w.apply(g)) for g in stack)))

    own = stack[0]
    errs = {None: float((fp8_roundtrip(own) - own).norm())}
    for c in TINY.gift.candidates:
        w = LowRankWhitening(approximate_factor(a, 4, c))
        errs[c] = float((w.inverse(fp8_roundtrip(w.apply(own))) - own).norm())
    chosen = min(errs, key=lambda c: (errs[c], c is not None))
    assert rec["gift-e4m3-block"]["damping"] == ("euclidean" if chosen is None else chosen)
    want = euclid if chosen is None else gift(LowRankWhitening(approximate_factor(a, 4, chosen)))
    assert rec["gift-e4m3-block"]["rel_l2"] == pytest.approx(want, abs=tol)
    assert rec["gift-e4m3-block"]["ratio_vs_best_euclid"] == pytest.approx(
        want / min(euclid, row), rel=tol / want + tol / min(euclid, row)
    )
    assert rec["gift-e4m3-block"]["factor_age"] == 3 and rec["gift-paper-e4m3-block"]["factor_age"] == 7
    paper = gift(LowRankWhitening(approximate_factor(a, 4, 1e-3)))
    assert rec["gift-paper-e4m3-block"]["rel_l2"] == pytest.approx(paper, abs=tol)
    assert rec["gift-paper-e4m3-block"]["ratio_vs_euclid"] == pytest.approx(
        paper / euclid, rel=tol / paper + tol / euclid
    )
    assert rec["gift-paper-dense-e4m3-block"]["rel_l2"] == pytest.approx(
        gift(DenseCholeskyWhitening(approximate_factor(a, 4, 1e-3))), abs=tol
    )
    # geometry: the paper's factor, its top-r share of tr(A) and of the gradients' energy, by hand
    (geo,) = [g for g in geometry if g["family"] == "gift-paper"]
    f = approximate_factor(a, 4, 1e-3)
    assert geo["trace_share_top_r"] == pytest.approx(float(f.lam.sum() / torch.diagonal(a).double().sum()), rel=1e-9)
    flat = stack.reshape(-1, 256).double()
    assert geo["grad_energy_share_top_r"] == pytest.approx(float((flat @ f.v).norm() ** 2 / flat.norm() ** 2), rel=1e-9)
    assert set(geo["measured_ratio"]) == {s.codec_name for s in fidelity.schemes() if s.family == "gift-paper"}


def test_plugin_schemes_against_a_dense_reference():
    """The plugin's schemes send the ``T`` their ``GiftLayer`` installed (input side and two-sided),
    summed as the plugin sums: checked against dense FP64 maps built here, each rank's
    ``T_outᵀ G_r T_in`` rounded by tests/reference.py's FP8 and the sum mapped back by dense
    inverses. Bugs caught: a side sending another side's ``T``, the output side applied on the wrong
    side of ``G`` or not inverted."""
    gen = torch.Generator().manual_seed(1)
    d_out, d_in = 48, 256
    stack = (
        torch.randn(3, d_out, d_in, generator=gen)
        * torch.linspace(0.01, 2.0, d_in)
        * torch.linspace(0.1, 3.0, d_out)[:, None]
    )

    def whitening(d, damping):
        x = torch.randn(600, d, generator=gen) * torch.linspace(0.01, 2.0, d)
        return LowRankWhitening(approximate_factor(x.T @ x / 600, 4, damping))

    t_in, t_out = whitening(d_in, 1.0), whitening(d_out, 0.3)
    layer = SimpleNamespace(
        sent={("input", True): (t_in, 1.0), ("both", True): (TwoSidedWhitening(t_in, t_out), "1.0/0.3")}
    )
    results, _ = fidelity.measure_layer(stack, {}, TINY, layer)
    rec = {r["scheme"]: r for r in results}
    truth = stack.double().sum(0)
    ti, ti_inv = (m.double() for m in t_in.dense())
    to, to_inv = (m.double() for m in t_out.dense())

    def rel(approx):
        return float((approx - truth).norm() / truth.norm())

    # FP32 maps and sums there against FP64 here: each map adds O(d·2^-24) relative error per element, far
    # below the FP8 error (2^-4 relative) they are compared at; 1e-3 of the RelL2 bounds it with margin.
    one = rel(sum(fp8_roundtrip((g.double() @ ti).float()).double() for g in stack) @ ti_inv)
    two = rel(to_inv.T @ sum(fp8_roundtrip((to.T @ g.double() @ ti).float()).double() for g in stack) @ ti_inv)
    assert rec["gift-chosen-e4m3-block"]["rel_l2"] == pytest.approx(one, rel=1e-3)
    assert rec["gift-both-e4m3-block"]["rel_l2"] == pytest.approx(two, rel=1e-3)
    assert rec["gift-both-e4m3-block"]["damping"] == "1.0/0.3"
    euclid = rel(sum(fp8_roundtrip(g).double() for g in stack))
    assert rec["gift-auto-e4m3-block"]["damping"] == "none"  # nothing installed for the side: plain FP8
    assert rec["gift-auto-e4m3-block"]["rel_l2"] == pytest.approx(euclid, rel=1e-3)
    assert not any(r["scheme"].startswith(("gift-e", "gift-paper")) for r in results)  # no factors given


def test_cold_start_steps_send_plain_fp8(report):
    """Step 1 sends what the refresh of step 0 allows, and that refresh has no held-out ``T`` to
    check its choice: every plugin record of step 1 is plain FP8, with the error of
    euclid-e4m3-block (bug caught: a ``T`` chosen on step 0's batch alone sent at step 1, the
    cold start the issue measured worse than plain FP8). The per-step summary counts the same."""
    out, _ = report
    cells = by_cell(out["results"])
    for (step, layer, _tokens), c in cells.items():
        if step == 1:
            for s in ("gift-chosen", "gift-both", "gift-auto"):
                assert c[f"{s}-e4m3-block"]["damping"] == "euclidean", (layer, s)
                assert c[f"{s}-e4m3-block"]["rel_l2"] == c["euclid-e4m3-block"]["rel_l2"]
    per_step = {(r["step"], r["family"]): r for r in out["summary"]["plugin_per_step"]}
    assert set(per_step) == {(t, f) for t in (*TINY.cold_points, *TINY.points) for f in fidelity.PLUGIN}
    assert all(per_step[(1, f)]["whitened"] == 0 for f in fidelity.PLUGIN)
    for (t, f), row in per_step.items():
        recs = [c[f"{f}-e4m3-block"] for (step, _, _), c in cells.items() if step == t]
        assert row["n"] == len(recs) and row["worst"] == max(r["ratio_vs_best_euclid"] for r in recs)
        assert row["whitened"] == sum(r["damping"] not in ("euclidean", "none") for r in recs)


def test_plugin_output_statistics_fold_a_step_late():
    """The two-sided schemes' output statistics come from the training backward and are folded a step
    later than the inputs', as the runtime folds them: after steps 0-2 the input EMA holds 3 steps'
    tokens, the output EMA 2 (bug caught: no output gradients captured, so ``both`` silently sends the
    input side alone)."""
    cfg = dataclasses.replace(TINY, cold_points=(), points=(3,))
    model = fidelity.LlamaModel(cfg.model, seed=0)
    corpus = fidelity.build_token_corpus(vocab_size=cfg.model.vocab_size)
    trainer = fidelity.Trainer(model, corpus, batch_size=cfg.batch_size, warmup_steps=cfg.warmup_steps)
    layers = fidelity.linear_layers(model)
    plugin = fidelity._PluginLayers(cfg.gift, layers)
    for step in range(3):
        with fidelity.capture_inputs(model, layers) as acts, fidelity.capture_output_grads(model, layers) as dys:
            trainer.run(1)
        plugin.after_step(step, acts, dys, {n: m.weight.grad for n, m in layers.items()})
    for name, layer in plugin.layers.items():
        assert layer.out_stats.d_in == layers[name].out_features
        assert layer.stats.folds == 3 and layer.out_stats.folds == 2, name
        assert float(layer.out_stats.tokens) == cfg.batch_size * cfg.model.seq_len, name  # step 2's, not yet folded


def test_summary_and_tables(report):
    out, _ = report
    summary = out["summary"]
    # the GIFT / best-Euclidean summary is the geomean of its records (counted again here)
    ratios = [r["ratio_vs_best_euclid"] for r in out["results"] if r["scheme"] == "gift-e4m3-block"]
    (row,) = [
        r
        for r in summary["gift_vs_best_euclid"]
        if (r["tokens_per_rank"], r["family"], r["layer_type"]) == ("all", "gift", "all")
    ]
    assert row["n"] == len(ratios) and row["worst"] == max(ratios)
    assert row["ratio_geomean"] == pytest.approx(math.exp(sum(math.log(v) for v in ratios) / len(ratios)))
    assert sum(sum(c.values()) for c in summary["damping_choices"].values()) == len(ratios)
    assert len(summary["prediction_fit"]) == len(fidelity.CODECS)
    text = fidelity.format_tables(out)
    assert "| scheme | qkv | proj | fc1 | fc2 | all |" in text and "GIFT / best Euclidean" in text
    assert "euclid-e5m2-tensor-shared" in text and "pred model" in text and "Damping chosen" in text


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
    assert calls == [
        dict(
            quick=True,
            json_path="x.json",
            ranks=4,
            config=fidelity.QUICK,
            command="megatron-gift bench fidelity --quick --json x.json --ranks 4",
            threads=1,
        )
    ]
    calls.clear()
    assert cli.main(["bench", "fidelity", "--formats", "nvfp4,mxfp4"]) == 0
    assert calls[0]["config"] == dataclasses.replace(fidelity.FULL, formats=("fp8", "nvfp4", "mxfp4"))
    calls.clear()
    assert cli.main(["bench", "fidelity", "--quick", "--ffn-hidden", "384"]) == 0
    assert calls[0]["config"].model == dataclasses.replace(fidelity.QUICK.model, ffn_hidden=384)
    assert "| bf16 |" in capsys.readouterr().out


def test_fp4_records_and_their_summary(report):
    """``--formats nvfp4``: every measured layer and step gets the FP4 schemes with the names readers
    rely on (model, format, scheme, layer_type, rel_l2), Euclidean as each cell's reference (ratio 1), and
    the summary's per-type geomean and worst recomputed from the records (bug caught: records dropped,
    a scheme measured against another cell's Euclidean, or a summary not of its records)."""
    out, doc = report
    recs = out["fp4"]
    assert len(doc["fp4"]) == len(recs)  # written to the JSON too
    cells = defaultdict(dict)
    for r in recs:
        assert {"model", "format", "scheme", "layer_type", "rel_l2", "rel_l2_se", "ratio"} <= set(r)
        cells[(r["step"], r["layer"], r["tokens_per_rank"])][r["scheme"]] = r
    measured = {(r["step"], r["layer"], r["tokens_per_rank"]) for r in out["results"] if r["step"] in TINY.points}
    assert set(cells) == measured and all(r["format"] == "nvfp4" for r in recs)
    for cell in cells.values():
        # the 64-element Hadamard block divides none of the tiny model's inputs (32 and 48 wide): skipped
        assert set(cell) == {"euclidean", "gift"}
        assert cell["euclidean"]["ratio"] == 1.0
        for r in cell.values():
            assert r["ratio"] == pytest.approx(r["rel_l2"] / cell["euclidean"]["rel_l2"], rel=1e-5)
    for row in out["summary"]["fp4"]:
        ratios = [r["ratio"] for r in recs if (r["scheme"], r["layer_type"]) == (row["scheme"], row["layer_type"])]
        assert row["n"] == len(ratios) and row["worst"] == max(ratios)
        assert row["ratio"] == pytest.approx(math.exp(sum(map(math.log, ratios)) / len(ratios)))
    assert "Four-bit schemes" in fidelity.format_tables(out)
