"""FP4 inter-node formats in the planner (issue 36 item 6 groundwork): their bytes against a hand count, the
two-level stage that carries them, and today's default plans unchanged without ``--inter-node-format``."""

from __future__ import annotations

import math

import pytest

from megatron_gift_tools.planner import fp4, model, output, plan
from megatron_gift_tools.planner.buckets import buckets
from megatron_gift_tools.planner.cluster import CLUSTERS
from megatron_gift_tools.planner.costs import KernelCosts
from megatron_gift_tools.planner.schemes import BASE, Scheme, schemes
from megatron_gift_tools.planner.workloads import workload


def test_fp4_bytes_against_a_hand_count():
    """A 4096 x 4096 gradient: nvfp4 = 8,388,608 B of codes + 1,048,576 E4M3 block scales (16 per block) + one
    4 B FP32 segment scale; mxfp4 = the codes + 524,288 E8M0 scales (32 per block). A partial last block has a
    scale too (1 x 17: 8.5 + 2 + 4). Catches a scale per 32 for nvfp4, a missing segment scale or block."""
    assert fp4.FORMATS["nvfp4"].param_bytes(4096, 4096) == 8_388_608 + 1_048_576 + 4
    assert fp4.FORMATS["mxfp4"].param_bytes(4096, 4096) == 8_388_608 + 524_288
    assert fp4.FORMATS["nvfp4"].param_bytes(1, 17) == 14.5


def test_fp4_buckets_carry_fp4_inter_node_bytes():
    """600M's buckets: the nvfp4 scheme's inter-node bytes are the hand count per parameter (every gradient FP8
    elsewhere, ``fp8_params`` all), its FP8 bytes (intra stage, gathers) unchanged; an FP8 scheme's inter-node
    bytes are its wire bytes (the runtime's two-level exchange, unchanged)."""
    w = workload("600m")
    hand = sum(r * c / 2 + math.ceil(r * c / 16) + 4 for _, (r, c), _ in w.parameters())
    nv, fp8 = buckets(w, Scheme.GIFT_2LEVEL_NVFP4, 128), buckets(w, Scheme.GIFT_2LEVEL, 128)
    assert sum(b.inter_bytes for b in nv) == pytest.approx(hand, rel=1e-12)
    assert [b.wire_bytes for b in nv] == [b.wire_bytes for b in fp8]
    assert all(b.inter_bytes == b.wire_bytes for b in fp8)


@pytest.mark.parametrize("fmt, per_element", [("nvfp4", 0.5 + 1 / 16), ("mxfp4", 0.5 + 1 / 32)])
def test_fp4_row_sends_fp4_bytes_through_the_nic(fmt, per_element):
    """512 GH200 (4 per node): the two-level row's NIC bytes scale from FP8's (1 B + a 4 B scale per 128) to
    FP4's bytes per element; its NVLink bytes (the BF16 intra stage) do not move. Catches the FP4 bytes on the
    wrong stage or not at all."""
    w, c = workload("600m"), CLUSTERS["gh200"]
    fp8 = model.step_time(w, c, Scheme.GIFT_2LEVEL, 512)
    low = model.step_time(w, c, Scheme(f"gift-2level-{fmt}"), 512)
    assert low["nic_bytes_per_rank"] / fp8["nic_bytes_per_rank"] == pytest.approx(per_element / (1 + 4 / 128), 1e-3)
    assert low["nvlink_bytes_per_rank"] == fp8["nvlink_bytes_per_rank"]
    assert low["step_s"] < fp8["step_s"]


def test_fp4_rows_only_on_request_and_never_recommended():
    """Without an inter-node format a plan's rows are today's schemes (its JSON unchanged); with nvfp4 the two
    two-level FP4 rows follow, named with the format, then the two that reduce-scatter inside the node first
    (not without the distributed optimizer, where the runtime refuses them), and the recommendation stays
    among the runtime's schemes (FP4 is not in it yet) while their verdict says so."""
    w, c = workload("600m"), CLUSTERS["gh200"]
    costs = KernelCosts.from_hbm(c)
    plain = plan.plan(w, c, 512, costs, with_break_even=False)
    assert [r["mode"] for r in plain["rows"]] == [s.value for s in BASE]
    p = plan.plan(w, c, 512, costs, with_break_even=False, inter_format="nvfp4")
    modes = [r["mode"] for r in p["rows"]]
    fp4_modes = ["euclidean-2level-nvfp4", "gift-2level-nvfp4", "euclidean-2level-rs-nvfp4", "gift-2level-rs-nvfp4"]
    assert modes == [s.value for s in BASE] + fp4_modes
    assert [s.value for s in schemes("nvfp4", sum_first=False)] == [s.value for s in BASE] + fp4_modes[:2]
    assert Scheme(p["recommended"]).inter_format is None
    rows = {r["mode"]: r for r in p["rows"]}
    assert rows["gift-2level-nvfp4"]["step_s"] < rows["gift-2level"]["step_s"]
    line = output.verdict(rows["gift-2level-nvfp4"], p)
    assert line.startswith("GIFT two-level NVFP4 inter-node") and "use it" not in line


def test_nvfp4_rows_take_the_meters_fp4_records():
    """With the distributed optimizer the nvfp4 rows' GPU stages are the meter's records of the FP4 exchange
    (``two-level/bf16-nvfp4-rs``): priced on the same meter without those records (FP8's stages at the FP4
    bytes) their plugin GPU time differs, the FP8 row's does not, and mxfp4's (never metered) stays FP8's.
    Catches the FP4 records never looked up, or looked up for an FP8 row."""
    import json

    from megatron_gift_tools.planner.metered import LAUNCHES_JSON, Meter

    doc = json.loads(LAUNCHES_JSON.read_text())
    assert {r["path"] for r in doc["records"] if "nvfp4" in r.get("path", "")} >= {"two-level/bf16-nvfp4-rs"}
    without = dict(doc, records=[r for r in doc["records"] if "fp4" not in r.get("path", "")])
    w, c = workload("600m"), CLUSTERS["gh200"]
    plugin = {}
    for name, meter in (("with", Meter(doc, "with")), ("without", Meter(without, "without"))):
        costs = KernelCosts.from_hbm(c, meter)
        for s in (Scheme.GIFT_2LEVEL, Scheme.GIFT_2LEVEL_NVFP4, Scheme.GIFT_2LEVEL_MXFP4):
            plugin[(name, s)] = model.step_time(w, c, s, 512, costs)["plugin_s"]
    assert plugin[("with", Scheme.GIFT_2LEVEL_NVFP4)] != plugin[("without", Scheme.GIFT_2LEVEL_NVFP4)]
    assert plugin[("with", Scheme.GIFT_2LEVEL)] == plugin[("without", Scheme.GIFT_2LEVEL)]
    assert plugin[("with", Scheme.GIFT_2LEVEL_MXFP4)] == plugin[("without", Scheme.GIFT_2LEVEL_MXFP4)]


def test_sum_first_rows_reduce_scatter_fp32_in_the_node_and_skip_the_whole_bucket_pass():
    """``gift-2level-rs-nvfp4`` (``--gift-intra-node reduce-scatter``) on 8-GPU H100 nodes: its NVLink bytes are
    a ring reduce-scatter of the FP32 gradient, (g-1)/g x 4 B per parameter element where the BF16 intra stage
    sends 2 B (a hand count over the model's parameters: the difference is (g-1)/g x 2 B x elements), its NIC
    bytes the same FP4 messages, and no GPU stage over the whole bucket: no ``cast`` stage, less plugin GPU
    time. Catches the rows priced as the whitening-first exchange, or with BF16 inside the node."""
    from megatron_gift_tools.planner.metered import Meter

    w, c = workload("600m"), CLUSTERS["h100"]
    costs = KernelCosts.from_hbm(c, Meter.load())
    rs = model.step_time(w, c, Scheme.GIFT_2LEVEL_RS_NVFP4, 512, costs)
    a2a = model.step_time(w, c, Scheme.GIFT_2LEVEL_NVFP4, 512, costs)
    g = rs["ranks_per_node"]
    assert g == 8 and rs["intra_dtype"] == "reduce-scatter" and a2a["intra_dtype"] == "bf16"
    elements = sum(r * k for _, (r, k), _ in w.parameters())
    assert rs["nvlink_bytes_per_rank"] - a2a["nvlink_bytes_per_rank"] == pytest.approx((g - 1) / g * 2 * elements, 1e-9)
    assert rs["nic_bytes_per_rank"] == pytest.approx(a2a["nic_bytes_per_rank"], 1e-12)
    assert "cast" not in [s["stage"] for s in rs["first_bucket_gpu_stages"]]
    assert "cast" in [s["stage"] for s in a2a["first_bucket_gpu_stages"]]
    assert rs["plugin_s"] < a2a["plugin_s"]


def test_bf16_gradient_buffers_halve_the_sum_first_reduce_scatter_alone():
    """``--grad-reduce-in-bf16`` (``Options.grad_reduce_in_bf16``): the sum-first rows' NVLink bytes are a ring
    reduce-scatter of BF16 gradients, (g-1)/g x 2 B per parameter element (a hand count over the model's
    parameters), equal to the BF16 intra stage's; the per-rank rows, the NIC bytes and Megatron's rings are
    unchanged (an ``fp32`` intra stage is never widened either); the recommended flags of a plugin row carry
    Megatron's flag. Catches the option priced nowhere, on the rings, or on the inter-node messages."""
    from megatron_gift_tools.planner.metered import Meter
    from megatron_gift_tools.planner.options import Options

    w, c = workload("600m"), CLUSTERS["h100"]
    costs = KernelCosts.from_hbm(c, Meter.load())
    bf16 = Options(grad_reduce_in_bf16=True)
    elements = sum(r * k for _, (r, k), _ in w.parameters())
    rows = {
        (s, o is bf16): model.step_time(w, c, s, 512, costs, o)
        for s in (Scheme.GIFT_2LEVEL_RS_NVFP4, Scheme.GIFT_2LEVEL_NVFP4, Scheme.BF16, Scheme.FP32)
        for o in (Options(), bf16)
    }
    rs, g = rows[Scheme.GIFT_2LEVEL_RS_NVFP4, True], rows[Scheme.GIFT_2LEVEL_RS_NVFP4, True]["ranks_per_node"]
    assert rs["nvlink_bytes_per_rank"] == pytest.approx((g - 1) / g * 2 * elements, 1e-9)
    assert rs["nvlink_bytes_per_rank"] == pytest.approx(rows[Scheme.GIFT_2LEVEL_NVFP4, True]["nvlink_bytes_per_rank"])
    assert rs["nic_bytes_per_rank"] == pytest.approx(rows[Scheme.GIFT_2LEVEL_RS_NVFP4, False]["nic_bytes_per_rank"])
    assert rs["step_s"] < rows[Scheme.GIFT_2LEVEL_RS_NVFP4, False]["step_s"]
    for s in (Scheme.GIFT_2LEVEL_NVFP4, Scheme.BF16, Scheme.FP32):
        assert rows[s, True]["step_s"] == rows[s, False]["step_s"], s
    assert [rows[s, True]["grad_reduce_in_bf16"] for s in (Scheme.GIFT_2LEVEL_RS_NVFP4, Scheme.BF16, Scheme.FP32)] == [
        True,
        True,
        False,
    ]
    fp32 = Options(grad_reduce_in_bf16=True, intra_dtype="fp32")
    per_rank = model.step_time(w, c, Scheme.GIFT_2LEVEL_NVFP4, 512, costs, fp32)
    assert per_rank["nvlink_bytes_per_rank"] == pytest.approx(
        rows[Scheme.GIFT_2LEVEL_NVFP4, True]["nvlink_bytes_per_rank"]
    )
    row = dict(rs, vs_bf16_pct=-5.0, schedule="overlap")
    p = dict(rows=[row], recommended=row["mode"], recommended_param_gather="bf16", recommended_bucket_size=None)
    assert "--grad-reduce-in-bf16" in output.launcher_flags(p)
