"""The step-time model: byte counts, monotonicity, overlap bounds, the bench-comm byte check, the CLI."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from megatron_gift import perfmodel as pm
from megatron_gift.cli import main

W = pm.WORKLOADS["llama-600m"]
OVH = pm.Overheads.from_hbm(pm.GH200)
ROOT = Path(__file__).resolve().parents[1]


def test_parameter_count_and_buckets():
    # 32 x (qkv 4.9M + proj 1.6M + fc1 8.8M + fc2 4.4M + 2 norms) + 2 x 50304 x 1280 + final norm
    assert W.numel() == 32 * (3840 * 1280 + 1280**2 + 6912 * 1280 + 1280 * 3456 + 2 * 1280) + 2 * 50304 * 1280 + 1280
    bks = pm.buckets(W, "fp32", 64)
    assert sum(b.elements for b in bks) == W.numel()
    assert all(b.elements >= 40_000_000 for b in bks[:-1])  # Megatron closes a bucket once it is full


def test_fp8_bytes_are_a_quarter_of_fp32_plus_block_scales():
    fp32 = sum(b.wire_bytes for b in pm.buckets(W, "fp32", 64))
    bf16 = sum(b.wire_bytes for b in pm.buckets(W, "bf16", 64))
    fp8 = sum(b.wire_bytes for b in pm.buckets(W, "euclidean", 64, fp8_params="all"))
    assert bf16 == fp32 / 2
    assert fp8 == pytest.approx(fp32 * (0.25 + 2 / 128 / 4), rel=1e-12)  # every width here is a multiple of 128
    recipe = sum(b.wire_bytes for b in pm.buckets(W, "euclidean", 64, fp8_params="linear"))
    assert fp8 < recipe < fp32  # embeddings and output layer stay FP32


@pytest.mark.parametrize("mode", pm.MODES)
@pytest.mark.parametrize("schedule", ["overlap", "sync"])
def test_more_bandwidth_or_less_latency_never_slows_a_step(mode, schedule):
    base = pm.step_time(W, pm.GH200, mode, 64, OVH, schedule=schedule)["step_s"]
    for field, factor in (("inter_bw", 2.0), ("intra_bw", 2.0), ("inter_latency", 0.5), ("intra_latency", 0.5)):
        faster = dataclasses.replace(pm.GH200, **{field: getattr(pm.GH200, field) * factor})
        assert pm.step_time(W, faster, mode, 64, OVH, schedule=schedule)["step_s"] <= base + 1e-12, field
    slower = dataclasses.replace(pm.GH200, inter_bw=pm.GH200.inter_bw / 4)
    assert pm.step_time(W, slower, mode, 64, OVH, schedule=schedule)["step_s"] > base


@pytest.mark.parametrize("gpus", [8, 64, 512])
@pytest.mark.parametrize("mode", pm.MODES)
def test_overlap_bounds(gpus, mode):
    r = pm.step_time(W, pm.GH200, mode, gpus, OVH, schedule="overlap")
    assert r["step_s"] >= r["compute_s"]  # communication never makes a step faster than compute alone
    assert 0 <= r["grad_exposed_s"] <= r["grad_comm_s"] + r["plugin_s"] + 1e-12
    assert 0 <= r["param_gather_exposed_s"] <= r["param_gather_s"] + 1e-12
    s = pm.step_time(W, pm.GH200, mode, gpus, OVH, schedule="sync")
    assert s["grad_exposed_s"] == pytest.approx(s["grad_comm_s"] + s["plugin_s"])


def test_collective_times():
    c = pm.GH200
    assert pm.ring_time(1e9, 1, c) == 0 and pm.all_to_all_time(1e9, 1, c) == 0
    # one node: the ring's (g-1)/g of the buffer over NVLink
    assert pm.ring_time(1e9, 4, c) == pytest.approx(3 * c.intra_latency + 0.75e9 / (c.intra_bw * c.efficiency))
    # across nodes the ring sends 1/g of the buffer per NIC, the all-to-all (p-g)/p of it: on 4-GPU nodes
    # an FP8 all-to-all of S bytes is not much faster than an FP32 ring reduce-scatter of 4S bytes
    assert 0.75 < pm.all_to_all_time(1e9, 64, c) / pm.ring_time(4e9, 64, c) < 1.0
    assert pm.two_level_all_to_all_time(1e9, 64, c) < pm.all_to_all_time(1e9, 64, c)


def test_gift_costs_more_than_euclidean_and_refresh_amortizes():
    e = pm.step_time(W, pm.GH200, "euclidean", 64, OVH)
    g = pm.step_time(W, pm.GH200, "gift", 64, OVH)
    assert g["step_s"] > e["step_s"] and g["refresh_s"] > 0 and e["refresh_s"] == 0
    # refresh_s = statistics every step + (sum, build, broadcast) / interval
    r = {n: pm.step_time(W, pm.GH200, "gift", 64, OVH, refresh_interval=n)["refresh_s"] for n in (10, 20, 40, 10**9)}
    assert r[10] - r[20] == pytest.approx(2 * (r[20] - r[40])) and r[10] > r[20] > r[40]
    assert r[10**9] > 0  # the sketch statistics themselves are computed every step


def test_factor_builds_are_shared_over_ranks():
    # 32 GIFT layers (fc2), each built on one owner: ceil(32/N) builds per rank, then one broadcast per layer
    slow = dataclasses.replace(OVH, factor_build_s=1.0)
    for gpus, builds in ((8, 4), (64, 1), (16, 2)):
        r = pm.step_time(W, pm.GH200, "gift", gpus, slow)
        fast = pm.step_time(W, pm.GH200, "gift", gpus, dataclasses.replace(OVH, factor_build_s=0.0))
        assert (r["refresh_s"] - fast["refresh_s"]) * 10 == pytest.approx(builds)  # refresh every 10 steps
    d, r = 3456, 32  # fc2's factor (FP64, 3-value header) and T (FP32), on top of the statistics all-reduce
    bcast = 32 * (8 * (d * r + d + r + 3) + 4 * (d * r + 2 * d + 2 * r))
    stats = 32 * (d * 64 + d + 1) * 4  # the EMAs of the sketch, diagonal and token count, FP32
    assert pm.step_time(W, pm.GH200, "gift", 64, OVH)["refresh_bytes_per_rank"] == pytest.approx(63 / 64 * (2 * stats + bcast) / 10)


def test_byte_model_matches_bench_comm():
    rows = pm.comm_bytes_check(str(ROOT / "bench/results/comm-cpu.json"))
    assert len(rows) == 16
    for r in rows:  # padding of Megatron's buckets and GIFT's split-row partials are not modeled
        assert r["ratio"] == pytest.approx(1.0, abs=0.005), r


def test_overheads_from_json(tmp_path):
    doc = {"results": [{"device": "cpu"}], "summary": [
        dict(model="m", layer="fc1", shape=[10, 10], codec_s=1e-4, transform_s=0.0, factor_build_s=0.0),
        dict(model="m", layer="fc2", shape=[10, 20], codec_s=2e-4, transform_s=4e-4, factor_build_s=0.01)]}  # fmt: skip
    path = tmp_path / "o.json"
    path.write_text(json.dumps(doc))
    o = pm.Overheads.from_json(str(path), "m")
    assert o.encode == o.decode == pytest.approx(3e-4 / 300 / 2)
    assert o.transform == pytest.approx(4e-4 / 200) and o.factor_build_s == 0.01 and "measured" in o.source


def test_measured_step_seconds():
    log = "".join(f" [2026] iteration {i}/ 6 | consumed samples: 8 | elapsed time per iteration (ms): {ms} | lm loss: 7.0\n"
                  for i, ms in enumerate([900.0, 500.0, 400.0, 100.0, 120.0, 110.0], start=1))  # fmt: skip
    assert pm.measured_step_seconds(log) == pytest.approx(0.100)  # lower quartile of 100, 120, 110 ms
    with pytest.raises(ValueError):
        pm.measured_step_seconds(log, skip=5)


def test_cli_model_json_and_set(tmp_path, capsys):
    path = tmp_path / "m.json"
    assert main(["model", "--json", str(path), "--set", "inter_bw=50e9", "--set", "gpus_per_node=8"]) == 0
    doc = json.loads(path.read_text())
    assert doc["cluster"]["inter_bw"] == 50e9 and doc["cluster"]["gpus_per_node"] == 8
    assert set(doc["tables"]) == {"overlap-all", "overlap-linear", "sync-all"}
    rows = doc["tables"]["overlap-all"]["rows"]
    assert {r["gpus"] for r in rows} == {8, 16, 32, 64, 128, 256, 512} and {r["mode"] for r in rows} == set(pm.MODES)
    assert all(math.isfinite(r["step_s"]) and r["step_s"] > 0 for r in rows)
    t = doc["tables"]["overlap-all"]["targets"]
    assert set(t) >= {"gift_vs_fp32_pct", "euclidean_vs_fp32_pct", "gift_at_least_10_5_pct_faster"}
    assert all(doc["cluster_sources"][k] for k in ("inter_bw", "intra_bw", "mfu", "peak_flops", "gpus_per_node"))
    assert len(doc["bytes_check"]["rows"]) == 16
    out = capsys.readouterr().out
    assert "paper (64 GH200)" in out and "| GIFT -7.60%, FP8 -10.79% |" in out  # the paper's figures in the 64-GPU rows
    with pytest.raises(SystemExit):
        main(["model", "--set", "warp_speed=9"])
