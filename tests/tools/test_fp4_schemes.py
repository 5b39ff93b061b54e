"""FP4 schemes of ``bench pretrained`` (bench/fp4_schemes.py) on synthetic gradients and a tiny Llama."""

import pytest
import torch

from megatron_gift.numerics import LowRankWhitening
from megatron_gift.numerics.kfac import KFACStatistics
from megatron_gift_tools.bench import fp4_schemes, pretrained_steps
from megatron_gift_tools.bench.fidelity import rel_l2_noise


def _stack(ranks=2, d_out=48, d_in=128, seed=0):
    """Gradients with a few outlier input columns (what a rotation spreads and whitening flattens)."""
    gen = torch.Generator().manual_seed(seed)
    cols = torch.ones(d_in)
    cols[[3, 70]] = 40.0
    return torch.randn(ranks, d_out, d_in, generator=gen) * cols


def _whitening(stack, seed=0):
    stats = KFACStatistics(stack.shape[2], 0.95, 64, seed=seed)
    for g in stack:
        stats.accumulate(g)  # rows of G as "inputs": a map adapted to G's column geometry
    stats.fold()
    return LowRankWhitening(stats.low_rank_factor(32, 0.0).with_damping(1.0))


def test_records_cover_formats_and_schemes_and_ratio_to_own_euclidean():
    """Catches a missing format or scheme, FP8 measured here twice, or a ratio against the wrong base."""
    stack = _stack()
    truth = stack.sum(0)
    recs = fp4_schemes.measure(stack, truth, _whitening(stack), ("fp8", "nvfp4", "mxfp4"), {"k": 1}, rel_l2_noise)
    assert [(r["format"], r["scheme"]) for r in recs] == [
        (f, s) for f in ("nvfp4", "mxfp4") for s in fp4_schemes.SCHEMES
    ]
    for r in recs:
        base = next(b for b in recs if b["format"] == r["format"] and b["scheme"] == "euclidean")
        assert r["ratio"] == pytest.approx(r["rel_l2"] / base["rel_l2"]) and r["k"] == 1
        assert 0 < r["rel_l2_se"] < r["rel_l2"]


def test_rotation_and_whitening_are_undone_after_the_sum():
    """Catches a receiver that forgets Rᵀ or T⁻¹ (its error would be of order 1) and a composition in the
    wrong order: on outlier columns whitening lowers NVFP4's ~10% error and the rotation after it lowers it
    again (the rotation alone need not: 16-element blocks already isolate an outlier, as in issue 36's study)."""
    stack = _stack()
    truth = stack.sum(0)
    t = _whitening(stack)
    err = {}
    for scheme, tt, rot in [("e", None, None), ("h", None, 64), ("g", t, None), ("gh", t, 64)]:
        approx = fp4_schemes.fp4_sum(
            stack, fp4_schemes.FP4_FORMATS["nvfp4"], tt, rot and fp4_schemes.BlockHadamard(rot)
        )
        err[scheme] = float((approx - truth).norm() / truth.norm())
    assert all(0.01 < e < 0.3 for e in err.values()), err
    assert err["gh"] < err["g"] < err["e"], err  # whitening helps, and the rotation helps after it


def test_parse_formats():
    """Catches an unknown format accepted silently or fp8 dropped (its records are the baseline)."""
    assert fp4_schemes.parse_formats("nvfp4, mxfp4") == ("fp8", "nvfp4", "mxfp4")
    assert fp4_schemes.parse_formats("fp8") == ("fp8",)
    with pytest.raises(ValueError):
        fp4_schemes.parse_formats("fp8,int4")


def test_fp4_records_leave_fp8_records_bit_for_bit(monkeypatch):
    """Catches the FP4 measurement disturbing the FP8 one (records must only gain the ``format`` key) and
    the summary merging formats' schemes: a tiny Llama run with and without ``--formats nvfp4``."""
    from megatron_gift_tools.bench.llama import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=128, hidden=64, layers=1, heads=2, ffn_hidden=96, seq_len=32)

    def load(spec, docs):
        gen = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        model = LlamaModel(cfg)

        def batches():
            while True:
                x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=gen)
                yield x[:, :-1], x[:, 1:]

        return model, batches()

    monkeypatch.setattr(pretrained_steps, "_load", load)
    spec = pretrained_steps.ModelSpec("tiny", "causal", 2, 2, cfg.seq_len, 3, None)
    plain = pretrained_steps.run_model(spec, [])
    both = pretrained_steps.run_model(spec, [], formats=("fp8", "nvfp4"), blocks=(16,))
    assert [r for r in both if r["format"] == "fp8"] == plain
    fp4 = [r for r in both if r["format"] == "nvfp4"]
    wired = {"gift/wire-damping", "gift+hadamard/wire-damping"}  # T chosen on NVFP4's errors, as the runtime does
    # chosen: --gift-rotation auto's, from the first refresh on
    assert {r["scheme"] for r in fp4} == set(fp4_schemes.SCHEMES) | {"gift+hadamard@16", "chosen"} | wired
    assert {r["step"] for r in fp4 if r["scheme"] == "chosen"} == {1, 2}
    assert {r["scheme"] for r in fp4 if r["layer"].endswith("fc2")} == {"euclidean", "gift", "gift+hadamard@16"}
    names = {r["scheme"] for r in pretrained_steps.summarize(both)["per_type"]}
    assert {"nvfp4 euclidean", "nvfp4 gift+hadamard", "gift-chosen"} <= names


def test_chosen_takes_the_rotation_with_the_smaller_refresh_error():
    """``chosen`` (``--gift-rotation auto``) copies the wire-damping record of the rotation whose error the
    refresh measured smaller, per format, and nothing before a refresh. Bugs caught: the choice inverted, one
    format's choice applied to another, a record made without the refresh's errors."""
    recs = [
        {"format": f, "scheme": s, "rel_l2": v}
        for f, base in (("nvfp4", 1.0), ("mxfp4", 10.0))
        for s, v in (("gift/wire-damping", base + 1), ("gift+hadamard/wire-damping", base + 2), ("gift", base))
    ]
    err = {
        "input@('nvfp4', 'gift')": 0.5,
        "input@('nvfp4', 'gift+hadamard')": 0.4,  # rotation measured better for NVFP4
        "input@('mxfp4', 'gift')": 0.3,
        "input@('mxfp4', 'gift+hadamard')": 0.6,  # and worse for MXFP4
    }
    got = {r["format"]: (r["rel_l2"], r["rotate"], r["scheme"]) for r in fp4_schemes.chosen(recs, err)}
    assert got == {"nvfp4": (3.0, True, "chosen"), "mxfp4": (11.0, False, "chosen")}
    assert fp4_schemes.chosen(recs, {}) == []


def test_block_choice_takes_the_geometric_mean_over_common_layers():
    """Catches an arithmetic mean, cold-start steps counted, or layers missing a block skewing the choice."""
    recs = []
    for step, layer, ratios in [
        (2, "a", {16: 0.5, 64: 0.8}),
        (3, "a", {16: 2.0, 64: 0.8}),
        (0, "a", {16: 9.0}),
        (2, "b", {64: 0.01}),
    ]:
        for b, v in ratios.items():
            recs.append(dict(format="nvfp4", model="m", step=step, layer=layer, scheme=f"gift+hadamard@{b}", ratio=v))
    (got,) = fp4_schemes.block_choice(recs)
    assert got["records"] == 2 and got["best"] == 64
    assert got["ratio"][16] == pytest.approx(1.0) and got["ratio"][64] == pytest.approx(0.8)
