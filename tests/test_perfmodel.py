"""The step-time model and planner: byte counts, collective times worked out by hand, the two-level
exchange's pipeline, monotonicity, overlap bounds, TP/PP sharding, the bench-comm byte check, the CLI."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from megatron_gift import perfmodel as pm
from megatron_gift.cli import main

W = pm.workload("600m")
OVH = pm.Overheads.from_hbm(pm.GH200)
FREE = dataclasses.replace(OVH, encode=0.0, decode=0.0, transform=0.0, factor_build_s=0.0)
ROOT = Path(__file__).resolve().parents[1]
# a small machine with round numbers for hand-computed references
TOY = pm.Cluster(name="toy", gpus_per_node=4, intra_bw=100e9, inter_bw=10e9, intra_latency=1e-6, inter_latency=1e-5,
                 a2a_peer_latency=1e-7, efficiency=1.0, a2a_efficiency=0.5, nvlink_a2a_efficiency=0.5)  # fmt: skip


def test_parameter_count_and_buckets():
    # 32 x (qkv 4.9M + proj 1.6M + fc1 8.8M + fc2 4.4M + 2 norms) + 2 x 50304 x 1280 + final norm
    assert W.numel() == 32 * (3840 * 1280 + 1280**2 + 6912 * 1280 + 1280 * 3456 + 2 * 1280) + 2 * 50304 * 1280 + 1280
    bks = pm.buckets(W, "fp32", 64)
    assert sum(b.elements for b in bks) == W.numel()
    assert all(b.elements >= 40_000_000 for b in bks[:-1])  # Megatron closes a bucket once it is full


def test_tensor_and_pipeline_parallel_shards():
    h, f, v = 4096, 11008, 32000  # Llama-2-7B, TP 4: linear layers, embedding and output layer split 4 ways
    seven = pm.workload("7b", tp=4)
    assert seven.numel() == 32 * (h * 3 * h // 4 + h * h // 4 + 2 * f // 4 * h + h * f // 4 + 2 * h) + 2 * v // 4 * h + h
    two = pm.workload("600m", pp=2)  # first stage: embedding and 16 layers, no output layer or final norm
    assert two.numel() == 16 * (3840 * 1280 + 1280**2 + 6912 * 1280 + 1280 * 3456 + 2 * 1280) + 50304 * 1280
    with pytest.raises(ValueError, match="divide"):
        pm.workload("600m", tp=3)
    with pytest.raises(ValueError, match="needs"):
        pm.workload("custom", layers=2, hidden=64)


def test_placement():
    assert pm.placement(16, 4, pm.GH200) == (1, 16)  # TP fills the node: one DP rank per node
    assert pm.placement(32, 2, pm.GH200) == (2, 16)
    assert pm.placement(2, 1, pm.GH200) == (2, 1)  # all on one node
    with pytest.raises(ValueError, match="divide"):
        pm.placement(8, 3, pm.GH200)
    with pytest.raises(ValueError, match="unequal"):
        pm.placement(6, 1, pm.GH200)


def test_fp8_bytes_are_a_quarter_of_fp32_plus_block_scales():
    fp32 = sum(b.wire_bytes for b in pm.buckets(W, "fp32", 64))
    bf16 = sum(b.wire_bytes for b in pm.buckets(W, "bf16", 64))
    fp8 = sum(b.wire_bytes for b in pm.buckets(W, "euclidean", 64, fp8_params="all"))
    assert bf16 == fp32 / 2
    assert fp8 == pytest.approx(fp32 * (0.25 + 4 / 128 / 4), rel=1e-12)  # an FP32 scale per 1x128 block; every width here is a multiple of 128
    recipe = sum(b.wire_bytes for b in pm.buckets(W, "euclidean", 64, fp8_params="linear"))
    assert fp8 < recipe < bf16  # embeddings, output layer and norms go as BF16


def test_ring_time_by_hand():
    # 8 ranks as 2 nodes x 4: each rank sends 7/8 of 1 GB, 1/4 of it through its NIC at 10 GB/s (NIC-bound:
    # 1/(4 x 10) > (3/4)/100 s/GB), pipelined with NVLink; latency (8-2) x 1 us + 1 x 10 us
    assert pm.ring_time(1e9, 8, TOY) == pytest.approx(7 / 8 * 1e9 / 40e9 + 6e-6 + 1e-5, rel=1e-12)
    # one node of 4: 3/4 of the buffer over NVLink, 3 steps
    assert pm.ring_time(1e9, 4, TOY) == pytest.approx(0.75e9 / 100e9 + 3e-6, rel=1e-12)
    # NVLink-bound when the NIC is fast: (3/4)/10 > 1/(4 x 100)
    slow_nvlink = dataclasses.replace(TOY, intra_bw=10e9, inter_bw=100e9)
    assert pm.ring_time(1e9, 8, slow_nvlink) == pytest.approx(7 / 8 * 1e9 * 0.75 / 10e9 + 6e-6 + 1e-5, rel=1e-12)
    assert pm.ring_time(1e9, 1, TOY) == 0 and pm.all_to_all_time(1e9, 1, TOY) == 0


def test_two_level_exchange_by_hand():
    b = pm.Bucket(elements=10**6, wire_bytes=1e6, intra_bytes={"fp32": 4e6, "bf16": 2e6, "fp8": 1e6})
    x = pm.exchange(b, "euclidean-2level", 4, 8, TOY, FREE, dist_opt=True, intra_dtype="bf16")
    times = {r[0]: s for r, s in x.stages}
    # BF16 all-to-all among the node's 4 at half the NVLink rate: 3/4 x 2 MB / 50 GB/s + 1 us + 3 x 0.1 us
    assert times["nvlink"] == pytest.approx(0.75 * 2e6 / 50e9 + 1e-6 + 3e-7, rel=1e-12)
    # FP8 all-to-all of the 1/4 slice among 8 nodes at half the link rate: 7/8 x 250 kB / 5 GB/s + 10 us + 7 x 0.1 us
    assert times["nic"] == pytest.approx(7 / 8 * 250e3 / 5e9 + 1e-5 + 7e-7, rel=1e-12)
    assert (x.nvlink_bytes, x.nic_bytes) == (pytest.approx(1.5e6), pytest.approx(7 / 8 * 250e3))
    assert pm.two_level_bytes(2e6, 1.2e6, 4, 3) == (pytest.approx(1.5e6), pytest.approx(2e5))
    fp32 = pm.exchange(b, "euclidean-2level", 4, 8, TOY, FREE, dist_opt=True, intra_dtype="fp32")
    assert fp32.nvlink_bytes == pytest.approx(3e6) and fp32.nic_bytes == x.nic_bytes
    # plugin work, 1 s per element each: node partial sums of E elements, G T and encode of E/4 (1/4 of the GIFT
    # rows), then decode of E/4 and T^-1 of the rank's 1/32 shard
    ones = dataclasses.replace(FREE, encode=1.0, decode=1.0, transform=2.0)
    gb = dataclasses.replace(b, gift_elements=4000)
    work = {r[0]: s for r, s in pm.exchange(gb, "gift-2level", 4, 8, TOY, ones, True).stages}
    assert work["encode"] == pytest.approx(1e6 + 1e6 / 4 + 4000 / 4) and work["decode"] == pytest.approx(1e6 / 4 + 4000 / 32)
    for g, n in ((1, 8), (4, 1)):  # one rank per node or one node: the flat exchange
        assert pm.exchange(b, "euclidean-2level", g, n, TOY, ones, True) == pm.exchange(b, "euclidean", g, n, TOY, ones, True)


def test_pipeline_and_decode_placement_by_hand():
    def ex(stages, recv=0.0):
        return pm.Exchange(0.0, stages, recv, 0.0, 0.0)

    # two buckets ready at t=1 and t=2; NVLink stage 0.5 s and NIC stage 2 s pipeline: the second bucket's NVLink
    # stage runs while the first is on the NIC; the NIC ends at 3.5 + 2 = 5.5, 3.5 s after the backward (t=2)
    two = [ex([(("nvlink",), 0.5), (("nic",), 2.0)])] * 2
    assert pm.overlapped_grad_reduce([1.0, 1.0], two) == pytest.approx(3.5)
    # on one resource (a ring on both links) nothing pipelines: 1 + 2.5 + 2.5 = 6, i.e. 4 s exposed
    assert pm.overlapped_grad_reduce([1.0, 1.0], [ex([(pm.BOTH, 2.5)])] * 2) == pytest.approx(4.0)
    # decode 0.6 s per bucket: inside Megatron's waits on the compute stream both are exposed (1.2 s), on the
    # communication side only the last bucket's (NIC 2 -> 2.5, decode 2.5 -> 3.1: 1.1 s)
    inline = [ex([(("nic",), 0.5)], recv=0.6)] * 2
    side = [ex([(("nic",), 0.5), (("decode",), 0.6)])] * 2
    assert pm.overlapped_grad_reduce([1.0, 1.0], inline) == pytest.approx(1.2)
    assert pm.overlapped_grad_reduce([1.0, 1.0], side) == pytest.approx(1.1)


def test_one_data_parallel_rank_costs_nothing():
    # TP 4 x PP 2 on 8 GPUs: one data-parallel rank, every mode is Megatron's step
    w = pm.workload("600m", tp=4, pp=2, global_batch=8)
    steps = {m: pm.step_time(w, pm.GH200, m, 8, OVH) for m in pm.MODES}
    assert len({r["step_s"] for r in steps.values()}) == 1
    assert all(r["grad_bytes_per_rank"] == 0 and r["plugin_s"] == 0 == r["refresh_s"] for r in steps.values())


def test_ledger_per_rank_matches_the_byte_formulas():
    s8, s2 = W.numel() * (1 + 4 / 128), W.numel() * 2.0  # FP8 payload + FP32 1x128 block scales; BF16
    c = dataclasses.replace(pm.GH200, gpus_per_node=4)
    two = pm.step_time(W, c, "euclidean-2level", 512, FREE)  # 4 per node x 128 nodes
    assert two["nic_bytes_per_rank"] == pytest.approx(127 / 128 * s8 / 4, rel=1e-9)
    assert two["nvlink_bytes_per_rank"] == pytest.approx(3 / 4 * s2, rel=1e-9)
    flat = pm.step_time(W, c, "euclidean", 512, FREE)
    assert flat["nic_bytes_per_rank"] == pytest.approx(508 / 512 * s8, rel=1e-9)
    ring = pm.step_time(W, c, "bf16", 512, FREE)
    assert ring["nic_bytes_per_rank"] == pytest.approx(511 / 512 * s2 / 4, rel=1e-9)
    # the point: the flat FP8 all-to-all moves about twice a BF16 ring's NIC bytes on 4-GPU nodes
    assert 1.9 < flat["nic_bytes_per_rank"] / ring["nic_bytes_per_rank"] < 2.1
    assert 0.49 < two["nic_bytes_per_rank"] / ring["nic_bytes_per_rank"] < 0.53


@pytest.mark.parametrize("mode", pm.MODES)
@pytest.mark.parametrize("schedule", ["overlap", "sync"])
def test_more_bandwidth_or_less_latency_never_slows_a_step(mode, schedule):
    base = pm.step_time(W, pm.GH200, mode, 64, OVH, schedule=schedule)["step_s"]
    for field, factor in (("inter_bw", 2.0), ("intra_bw", 2.0), ("inter_latency", 0.5), ("intra_latency", 0.5),
                          ("a2a_efficiency", 1.25), ("nvlink_a2a_efficiency", 1.25)):  # fmt: skip
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


def test_gift_costs_more_than_euclidean_and_refresh_amortizes():
    for e_mode, g_mode in (("euclidean", "gift"), ("euclidean-2level", "gift-2level")):
        e = pm.step_time(W, pm.GH200, e_mode, 64, OVH)
        g = pm.step_time(W, pm.GH200, g_mode, 64, OVH)
        assert g["step_s"] > e["step_s"] and g["refresh_s"] > 0 and e["refresh_s"] == 0
        # refresh_s = statistics every step + (sum, build, broadcast) / interval
        r = {n: pm.step_time(W, pm.GH200, g_mode, 64, OVH, refresh_interval=n)["refresh_s"] for n in (10, 20, 40, 10**9)}
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


def test_verdicts_and_recommendation():
    assert pm.verdict({"mode": "euclidean-2level", "vs_bf16_pct": -12.34}) == (
        "Euclidean FP8 two-level: -12.3% step time vs BF16: use it")
    assert pm.verdict({"mode": "gift", "vs_bf16_pct": -0.5}).endswith("no gain here: keep BF16")
    for name, cluster in pm.CLUSTERS.items():  # the planner never recommends a mode slower than BF16
        for model, tp in (("600m", 1), ("7b", 4)):
            w = pm.workload(model, tp=tp)
            for gpus in (64, 512):
                p = pm.plan(w, cluster, gpus, OVH)
                by = {r["mode"]: r for r in p["rows"]}
                assert by[p["recommended"]]["step_s"] <= by["bf16"]["step_s"], (name, model, gpus)
                beaten = [m for m in pm.PLUGIN_MODES if by[m]["vs_bf16_pct"] <= -pm.MIN_GAIN_PCT]
                assert (p["recommended"] == "bf16") == (not beaten)


def test_byte_model_matches_bench_comm():
    rows = pm.comm_bytes_check(str(ROOT / "bench/results/comm-cpu.json"))
    assert len(rows) == 16
    for r in rows:  # padding of Megatron's buckets and GIFT's split-row partials are not modeled
        assert r["ratio"] == pytest.approx(1.0, abs=0.005), r


def test_link_check_on_simulated_nodes(tmp_path):
    doc = json.loads((ROOT / "bench/results/comm-cpu.json").read_text())
    # bench comm's model: 4 layers, hidden 192, FFN 512, vocabulary 2048; FP8 payload + a 4 B scale per row and 128 columns
    shapes = 4 * [(576, 192), (192, 192), (1024, 192), (192, 512), (1, 192), (1, 192)] + [(2048, 192)] * 2 + [(1, 192)]
    numel = sum(r * c for r, c in shapes)
    s8 = sum(r * c + 4 * r * -(-c // 128) for r, c in shapes)
    intra, inter = 1 / 2 * 2 * numel, 1 / 2 * s8 / 2  # 2 nodes x 2 ranks, BF16 within the node
    doc["links"] = [dict(nodes=2, ranks_per_node=2, mode="euclidean-e4m3", distributed_optimizer=True, exchange="two-level",
                         intra_node="bf16", intra_per_rank=intra, inter_per_rank=inter)]  # fmt: skip
    path = tmp_path / "comm.json"
    path.write_text(json.dumps(doc))
    (row,) = pm.comm_links_check(str(path))
    assert row["mode"] == "euclidean-2level" and not row["ring_vs_direct"]
    assert row["intra_ratio"] == pytest.approx(1.0, rel=1e-12) and row["inter_ratio"] == pytest.approx(1.0, rel=1e-12)


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


def test_validation_from_earlier_measurements():
    old = ROOT / "bench/results/model-gh200.json"
    v = pm.validate_cpu(str(ROOT / "bench/results/overhead-cpu.json"), measured_json=str(old))
    measured = {r["mode"]: r["measured_s"] for r in json.loads(old.read_text())["cpu_validation"]["rows"]}
    assert [r["mode"] for r in v["rows"]] == ["fp32", "bf16", "euclidean", "gift"]
    assert all(r["measured_s"] == measured[r["mode"]] for r in v["rows"])
    # compute is calibrated on the FP32 run (its prediction equals its measurement by construction):
    # what can fail is the calibration itself, which leaves a positive compute time below the FP32
    # step, and the model's response to bytes: BF16 (half FP32's, the same compute) predicted faster
    pred = {r["mode"]: r["predicted_s"] for r in v["rows"]}
    assert 0 < v["compute_s_calibrated"] < measured["fp32"]
    assert pred["bf16"] < pred["fp32"] and pred["fp32"] == pytest.approx(measured["fp32"], rel=1e-6)


def test_cli_planner(tmp_path, capsys):
    path = tmp_path / "m.json"
    argv = ["model", "--gpus", "512", "--gpus-per-node", "4", "--nic-gbps", "200", "--micro-batch", "1",
            "--json", str(path), "--set", "mfu=0.5"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| Euclidean FP8 two-level (intra bf16) |" in out and "recommended:" in out
    assert out.count("step time vs BF16:") == len(pm.MODES) - 1  # a verdict per mode
    doc = json.loads(path.read_text())
    assert doc["cluster"]["inter_bw"] == 25e9 and doc["cluster"]["mfu"] == 0.5 and doc["cluster"]["gpus_per_node"] == 4
    (p,) = doc["plans"]
    assert p["gpus"] == 512 and {r["mode"] for r in p["rows"]} == set(pm.MODES)
    assert all(math.isfinite(r["step_s"]) and r["step_s"] > 0 for r in p["rows"])
    assert set(p["targets"]) >= {"euclidean_vs_bf16_pct", "gift_minus_euclidean_points", "recommended_not_slower_than_bf16"}
    assert all(doc["cluster_sources"][k] for k in ("inter_bw", "intra_bw", "a2a_efficiency", "efficiency", "mfu"))
    assert len(doc["bytes_check"]["rows"]) == 16
    for bad in (["--set", "warp_speed=9"], ["--tp", "3"], ["--model", "custom", "--layers", "2"],
                ["--gpus", "100"], ["--measured", "x.json"], ["--nic-gbps", "-1"], ["--set", "mfu=0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            main(["model", *bad])


def test_cli_custom_model_and_nvlink(capsys):
    assert main(["model", "--model", "custom", "--layers", "2", "--hidden", "256", "--heads", "4", "--ffn", "688",
                 "--seq", "512", "--vocab", "1024", "--gpus", "16", "--cluster", "h100", "--nvlink-gbps", "800",
                 "--comm-json", "none", "--sensitivity"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "2 per node x 8 nodes" not in out and "8 per node x 2 nodes" in out and "Sensitivity at 16 GPUs" in out
