"""The planner's price of two-sided GIFT (``--gift-side both``/``auto``, ``comm/output_side.py``): the
meter's ``gift+out`` counts, the FP32 all-reduce of ``P`` and the output stage, each against numbers
worked by hand from the meter's records; ``--gift-side input`` priced as before."""

import json
import math

import pytest

from megatron_gift_tools.cli import main
from megatron_gift_tools.planner import metered, model
from megatron_gift_tools.planner.buckets import Bucket
from megatron_gift_tools.planner.choices import MegatronSchedule
from megatron_gift_tools.planner.cluster import GH200
from megatron_gift_tools.planner.costs import KernelCosts
from megatron_gift_tools.planner.options import Options
from megatron_gift_tools.planner.schemes import Scheme
from megatron_gift_tools.planner.stages import Context, Kind, reduction_chain
from megatron_gift_tools.planner.workloads import workload

METER = metered.Meter.load()
COSTS = KernelCosts.from_hbm(GH200, METER)


def _stage(name, launches, moved, essential):
    return dict(
        stage=name, launches=launches, bytes_read=moved, bytes_written=0, essential_read=essential, essential_written=0
    )


def _doc(paths=("flat-rs", "flat-ar")):
    """A meter JSON by hand, DP 8 and 512: per path each bucket's (send, last stage) launches; ``gift+out`` adds 12
    send launches, 3 (rs ``finish``: no per-parameter slope) or 5 (ar ``decode_all``: 5 per GIFT parameter) to the
    last stage and an ``output`` stage of 5 (rs) or 12 (ar) launches. Ratios: Euclidean 1.25, GIFT 1.5, gift+out
    1.75 (send) and 2.5 (output)."""
    launches = {
        "flat-rs": {
            "euclidean": (8, 0),
            "euclidean/8": (12, 0),
            "gift": (16, 7),
            "gift/8": (24, 7),
            "gift+out": (28, 10),
        },
        "flat-ar": {
            "euclidean": (8, 4),
            "euclidean/8": (12, 8),
            "gift": (16, 20),
            "gift/8": (24, 40),
            "gift+out": (28, 25),
        },
    }
    last = {"flat-rs": "finish", "flat-ar": "decode_all"}
    recs = []
    for path, by_bucket in launches.items():
        for bucket, (send, end) in by_bucket.items():
            if bucket == "gift+out" and path not in paths:
                continue
            ratio = {"euclidean": 1.25, "gift": 1.5, "gift+out": 1.75}[bucket.removesuffix("/8")]
            stages = [_stage("send", send, ratio * 100, 100), _stage(last[path], end, 100, 100)]
            if bucket == "gift+out":
                stages.append(_stage("output", 5 if path == "flat-rs" else 12, 250, 100))
            for dp in (8, 512):
                for n in (10 << 20,) if bucket.endswith("/8") else (1 << 20, 200 << 20):
                    recs.append(
                        dict(
                            kind="reduction",
                            kernels="fused",
                            path=path,
                            bucket=bucket,
                            dp=dp,
                            elements=n,
                            stages=stages,
                        )
                    )
    recs += [
        dict(
            kind="delta-gather",
            kernels="fused",
            dp=dp,
            elements=1 << 20,
            stages=[_stage("encode", 1, 1e3, 1e3), _stage("decode", 1, 1e3, 1e3)],
        )
        for dp in (8, 512)
    ]
    return dict(date="2026-12-02", sources=dict(sha256="ab" * 32), records=recs)


def test_two_sided_counts_by_hand():
    """A bucket of 30 parameters, 3 of them GIFT's, at 8 ranks. Send: GIFT fixed 16 - 4 x 2 = 8, + 2 per GIFT and
    1 per Euclidean parameter, + 12/4 = 3 per two-sided one: 8 + 6 + 27 + 9 = 50, GIFT ratio 1.75 (gift+out's). The
    shard's last stage (rs finish: no per-parameter slope) adds its 3 as they are: 7 + 3; rs output: 5, fixed;
    all-reduce decode_all: 0 fixed + 1 x 27 + 5 x 3, + 5/4 x 3; output 12/4 x 3 = 9, ratio 2.5. Adding the output
    side's launches as a constant, or per parameter in the shard's stages, or keeping the GIFT ratio, fails."""
    m = metered.Meter(_doc(), "by hand")
    c = m.reduction("flat-rs", "send", 8, 5e6, 30, 3, two_sided=True)
    assert (c.launches, c.ratio, c.gift_ratio) == (50.0, 1.25, 1.75)
    assert m.reduction("flat-rs", "send", 8, 5e6, 30, 3).launches == 41.0  # one-sided: no gift+out
    assert m.reduction("flat-rs", "finish", 8, 5e6, 30, 3, two_sided=True).launches == 10.0
    assert m.reduction("flat-rs", "output", 8, 5e6, 30, 3, two_sided=True) == metered.StageCount(5.0, 2.5, 2.5)
    assert m.reduction("flat-ar", "decode_all", 8, 5e6, 30, 3, two_sided=True).launches == 27 + 15 + 3.75
    assert m.reduction("flat-ar", "output", 8, 5e6, 30, 3, two_sided=True).launches == 9.0
    # no GIFT parameter in the bucket: nothing two-sided
    assert m.reduction("flat-rs", "send", 8, 5e6, 30, 0, two_sided=True).launches == 34.0


def test_meter_without_gift_out_records_falls_back():
    """A path the meter has no gift+out records for: the GIFT counts and one pass for the output stage (module
    doc), not a KeyError."""
    m = metered.Meter(_doc(paths=("flat-rs",)), "by hand")
    assert m.reduction("flat-ar", "send", 8, 5e6, 30, 3, two_sided=True) == m.reduction(
        "flat-ar", "send", 8, 5e6, 30, 3
    )
    assert m.reduction("flat-ar", "output", 8, 5e6, 30, 3, two_sided=True) == metered.ONE_PASS


def _record(path: str, bucket: str, dp: int, elements: float) -> dict:
    """The committed meter JSON's fused record nearest ``dp``, then ``elements`` (in log), its stages by name."""
    recs = [
        r
        for r in json.loads(metered.LAUNCHES_JSON.read_text())["records"]
        if r["kind"] == "reduction" and r["kernels"] == "fused" and r["path"] == path and r["bucket"] == bucket
    ]
    dp = min({r["dp"] for r in recs}, key=lambda d: abs(math.log(d / dp)))
    rec = min((r for r in recs if r["dp"] == dp), key=lambda r: abs(math.log(r["elements"] / elements)))
    return {s["stage"]: s for s in rec["stages"]}


def _moved_ratio(s: dict) -> float:
    return (s["bytes_read"] + s["bytes_written"]) / (s["essential_read"] + s["essential_written"])


# three fc2 weights of the 600M model (d_out 1280 > rank 32: r_out 32) and one of 16 rows (r_out 16)
SHAPES = [(1280, 3456)] * 3 + [(16, 100)]
GIFT_ELEMENTS = sum(r * c for r, c in SHAPES)


def _bucket() -> Bucket:
    n = 40_000_000
    return Bucket(
        elements=n,
        wire_bytes=1.03 * n,
        intra_bytes={"bf16": 2.0 * n, "fp8": 1.03 * n, "fp32": 4.0 * n},
        gift_elements=GIFT_ELEMENTS,
        parameters=10,
        gift_parameters=len(SHAPES),
        gift_shapes=list(SHAPES),
    )


@pytest.mark.parametrize("scheme, path", [(Scheme.GIFT, "flat-rs"), (Scheme.GIFT_2LEVEL, "two-level/bf16-rs")])
def test_p_all_reduce_and_output_stage_by_hand(scheme, path):
    """With the distributed optimizer at 64 ranks (16 nodes of 4): after the cut rows, one FP32 all-reduce of
    ``P`` on the data-parallel group, 4 x (3 x 32 x 3456 + 16 x 100) bytes (r_out clipped to d_out = 16), a ring's
    2 x 63/64 of it per rank; then the output stage at the gift+out record's launches, moving its ratio x 8 bytes
    per two-sided element of the shard; the encode adds the records' gift+out - gift launches (4 two-sided
    parameters, as the records'). Missing the all-reduce, sizing it by d_out or the unclipped rank, or pricing the
    output stage over the whole bucket fails."""
    b, p = _bucket(), 64
    one = reduction_chain(b, scheme, Context(4, 16, GH200, COSTS, Options(side="input")))
    two = reduction_chain(b, scheme, Context(4, 16, GH200, COSTS, Options(side="both")))
    assert [t.label for t in two[: len(one)]] == [t.label for t in one]
    assert [t.label for t in two[len(one) :]] == ["P all-reduce (FP32)", "output side"]
    ar, out = two[len(one) :]
    nbytes = 4 * (3 * 32 * 3456 + 16 * 100)
    assert ar.kind is Kind.COMM and ar.stream == "dp" and ar.stage == one[-1].stage
    assert ar.nvlink_bytes + ar.nic_bytes == pytest.approx(2 * (p - 1) / p * nbytes, rel=1e-12)
    rec, gift = _record(path, "gift+out", p, b.elements), _record(path, "gift", p, b.elements)
    assert out.kind is Kind.GPU and out.stage == one[-1].stage + 1
    assert out.launches == rec["output"]["launches"]
    assert out.hbm_bytes == pytest.approx(_moved_ratio(rec["output"]) * 8 * GIFT_ELEMENTS / p, rel=1e-12)
    first = "send" if path == "flat-rs" else "intra"
    assert two[0].launches - one[0].launches == rec[first]["launches"] - gift[first]["launches"]


def test_all_reduce_sends_no_p():
    """Without the distributed optimizer every rank holds all of ``W``: no collective, the output stage over every
    two-sided element at 12/4 = 3 launches per two-sided parameter (the all-reduce records')."""
    b, p = _bucket(), 64
    opts = Options(side="both", schedule=MegatronSchedule.SYNC)
    chain = reduction_chain(b, Scheme.GIFT, Context(4, 16, GH200, COSTS, opts))
    assert [t.label for t in chain[-2:]] == ["decode bucket", "output side"]
    assert not any(t.label.startswith("P all-reduce") for t in chain)
    rec = _record("flat-ar", "gift+out", p, b.elements)["output"]
    assert chain[-1].launches == rec["launches"] / 4 * len(SHAPES)
    assert chain[-1].hbm_bytes == pytest.approx(_moved_ratio(rec) * 8 * GIFT_ELEMENTS, rel=1e-12)


def _without_gift_out() -> metered.Meter:
    doc = json.loads(metered.LAUNCHES_JSON.read_text())
    doc["records"] = [r for r in doc["records"] if r.get("bucket") != "gift+out"]
    return metered.Meter(doc, "no gift+out")


@pytest.mark.parametrize("schedule", list(MegatronSchedule))
def test_input_side_and_euclidean_unchanged(schedule):
    """``--gift-side input`` never reads the gift+out records (its step times equal those from a meter without
    them), Euclidean rows do not depend on the side, and auto is priced as both (its upper bound), which costs
    more than input for GIFT."""
    w, c = workload("600m"), GH200
    bare = KernelCosts.from_hbm(c, _without_gift_out())
    for gpus in (64, 512):
        for s in Scheme:
            step = {
                side: model.step_time(w, c, s, gpus, COSTS, Options(side=side, schedule=schedule))["step_s"]
                for side in ("input", "both", "auto")
            }
            assert step["input"] == model.step_time(w, c, s, gpus, bare, Options(schedule=schedule))["step_s"]
            assert step["auto"] == step["both"]
            if s.mode.value == "gift":
                assert step["both"] > step["input"], (s, gpus)
            else:
                assert step["both"] == step["input"], (s, gpus)


def test_cli_gift_side(tmp_path, capsys):
    """``--gift-side both`` reaches the pricing and the JSON (options and every GIFT row) and names the GIFT rows;
    a side the runtime does not have is refused."""
    path = tmp_path / "m.json"
    assert main(["model", "--gpus", "64", "--gift-side", "both", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| GIFT FP8 flat (--gift-side both) |" in out
    doc = json.loads(path.read_text())
    assert doc["options"]["side"] == "both"
    rows = doc["plans"][0]["rows"]
    assert {r["mode"]: r["gift_side"] for r in rows if r["gift_side"]} == {"gift": "both", "gift-2level": "both"}
    with pytest.raises(SystemExit):
        main(["model", "--gift-side", "output"])
