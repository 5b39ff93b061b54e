"""``bench overhead`` on tiny shapes: JSON schema, every path timed, the ratios' arithmetic, and the
work each timed path does (FLOPs counted: the low-rank T does d_in / 2r less than dense Cholesky's)."""

import json

import pytest
import torch

from megatron_gift.config import WhiteningConfig
from megatron_gift_tools.bench import overhead
from megatron_gift_tools.cli import build_parser, main

TINY = {"tiny": dict(layers=1, hidden=64, heads=2, ffn=176, seq=16, micro_batch=2)}
PATHS = {
    "layer_fwd_bwd",
    "lowrank_apply",
    "lowrank_inverse",
    "dense_apply",
    "dense_inverse",
    "fp8_encode_decode",
    "copy",
    "factor_build",
    "statistics",
}


def test_cli_runs_bench_overhead_quick(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(overhead, "MODELS", TINY)
    monkeypatch.setattr(overhead, "QUICK_MODELS", ("tiny",))
    monkeypatch.setattr(overhead, "QUICK_TOKENS", 8)
    path = tmp_path / "o.json"
    assert main(["bench", "overhead", "--quick", "--device", "cpu", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert {"machine", "command", "config", "schema", "results", "summary", "targets"} <= set(doc)
    assert doc["command"] == f"megatron-gift bench overhead --quick --device cpu --json {path}"
    assert doc["config"]["tokens_per_micro_batch"] == 8
    layers = {"qkv": [192, 64], "proj": [64, 64], "fc1": [352, 64], "fc2": [64, 176]}
    for layer, shape in layers.items():
        recs = {r["path"]: r for r in doc["results"] if r["layer"] == layer}
        assert PATHS <= set(recs), layer
        for r in recs.values():
            assert r["model"] == "tiny" and r["shape"] == shape and r["seconds"] > 0 and r["samples"] >= 2
            assert r["device"] == "cpu"
        assert recs["layer_fwd_bwd"]["tokens"] == 8
        assert recs["statistics"]["tokens"] == 8 and recs["statistics"]["sketch"] == WhiteningConfig().sketch == 64
        assert recs["copy"]["bytes_per_s"] > 0 and recs["fp8_encode_decode"]["bytes_per_s"] > 0
        assert {"whiten_encode_reference", "decode_sum_unwhiten_reference"} <= set(recs)
        assert "whiten_encode_fused" not in recs  # only where compiled Triton runs (CUDA)
    assert [s["layer"] for s in doc["summary"]] == list(layers)
    for s in doc["summary"]:
        assert s["pipeline"] == "reference" and s["pipeline_s"] > 0
        assert s["statistics_s"] > 0 and s["statistics_over_layer"] > 0
    assert "statistics" in doc["schema"]["results"]
    assert "statistics_s" in doc["schema"]["summary"] and "statistics_over_layer" in doc["schema"]["summary"]
    assert doc["config"]["sketch"] == 64
    assert "| stats ms | stats/layer |" in capsys.readouterr().out
    assert doc["targets"] == {"device": "cpu"}  # no Llama-600M shapes in this run


# Times handed out in the order measure_layer times its paths, and the ratios they give, by hand.
KNOWN_SECONDS = {
    "layer_fwd_bwd": 1.0,
    "lowrank_apply": 0.01,
    "lowrank_inverse": 0.02,
    "dense_apply": 0.3,
    "dense_inverse": 0.5,
    "fp8_encode_decode": 0.04,
    "copy": 0.002,
    "whiten_encode_reference": 0.05,
    "decode_sum_unwhiten_reference": 0.07,
    "factor_build": 3.0,
    "statistics": 0.006,
}


def test_ratios_from_known_times(monkeypatch):
    times = iter(KNOWN_SECONDS.values())
    monkeypatch.setattr(overhead, "time_call", lambda fn, device: (next(times), 2))
    monkeypatch.setattr(overhead, "fused_timed", lambda device: False)
    recs = overhead.measure_layer(("t", "fc2"), (128, 256), 8, torch.device("cpu"), overhead.CodecConfig())
    assert {r["path"]: r["seconds"] for r in recs} == KNOWN_SECONDS  # the order assumed above
    by_path = {r["path"]: r for r in recs}
    assert by_path["dense_apply"]["dense_over_lowrank"] == pytest.approx(30.0)  # 0.3 / 0.01
    assert by_path["dense_inverse"]["dense_over_lowrank"] == pytest.approx(25.0)  # 0.5 / 0.02
    # encode + decode move 10 B per element (read 4, write 1, read 1, write 4) plus the scales twice:
    # 128 x 256 elements, 128 x 2 FP32 block scales
    assert by_path["fp8_encode_decode"]["bytes_per_s"] == pytest.approx((10 * 32768 + 2 * 1024) / 0.04)
    (row,) = overhead.summarize(recs)
    assert row["transform_s"] == pytest.approx(0.03) and row["codec_s"] == pytest.approx(0.04)
    assert row["dense_over_lowrank"] == pytest.approx(0.8 / 0.03)
    assert row["transform_codec_over_layer"] == pytest.approx(0.07)  # (0.03 + 0.04) / 1.0
    assert row["pipeline_s"] == pytest.approx(0.12) and row["pipeline_over_layer"] == pytest.approx(0.12)
    assert row["statistics_s"] == 0.006 and row["statistics_over_layer"] == pytest.approx(0.006)  # 0.006 / 1.0


def test_dense_transform_does_d_in_over_2r_times_the_low_rank_work(monkeypatch):
    """What the timed paths compute, counted instead of timed (a timing ratio would depend on the
    machine): with ``time_call`` replaced by torch's FLOP counter, the dense ``T⁻¹`` (``U Lᵀ``:
    ``2 d_out d_in²``) does ``d_in / (2r)`` times the low-rank one's matrix products (``U Q`` and
    ``(U Q) Qᵀ``: ``4 d_out d_in r``). Bug caught: the low-rank path timing a dense product, or the
    dense one a low-rank shortcut."""
    from torch.utils.flop_counter import FlopCounterMode

    def flops(fn, device):
        with FlopCounterMode(display=False) as counter:
            fn()
        return max(counter.get_total_flops(), 1), 1

    monkeypatch.setattr(overhead, "time_call", flops)
    d_out, d_in, r = 128, 2048, overhead.RANK
    recs = {
        rec["path"]: rec
        for rec in overhead.measure_layer(("t", "fc2"), (d_out, d_in), 16, torch.device("cpu"), overhead.CodecConfig())
    }
    assert recs["lowrank_inverse"]["seconds"] == 4 * d_out * d_in * r
    assert recs["dense_inverse"]["seconds"] == 2 * d_out * d_in * d_in
    assert recs["dense_inverse"]["dense_over_lowrank"] == d_in / (2 * r)


def test_targets_read_the_600m_rows():
    doc = {
        "results": [{"device": "cuda"}],
        "summary": [
            dict(
                model="llama-600m", layer=k, layer_fwd_bwd_s=1.0, transform_s=0.004, codec_s=0.006, dense_over_lowrank=d
            )
            for k, d in (("qkv", 3.0), ("fc2", 20.0))
        ],
    }
    t = overhead.targets(doc)
    assert t["transform_codec_over_layer_fwd_bwd_600m"] == pytest.approx(0.01)
    assert t["target_transform_codec_le_2pct"] and t["dense_over_lowrank_d_in_3456"] == 20.0
    assert t["target_dense_over_lowrank_ge_15"]


def test_layer_shapes_swiglu():
    assert overhead.layer_shapes(overhead.MODELS["llama-600m"]) == {
        "qkv": (3840, 1280),
        "proj": (1280, 1280),
        "fc1": (6912, 1280),
        "fc2": (1280, 3456),
    }


def test_cli_parses_bench_overhead():
    args = build_parser().parse_args(["bench", "overhead", "--quick", "--json", "x.json"])
    assert args.quick and args.json == "x.json" and args.device is None and args.func.__name__ == "_bench_overhead"
