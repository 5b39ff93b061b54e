"""The planner prices each GPU stage from the launch-and-traffic meter's JSON (``planner.metered``), and
that JSON was measured on the checkout's code."""

import json

import pytest

from megatron_gift_tools.bench import launches
from megatron_gift_tools.planner import metered
from megatron_gift_tools.planner.buckets import Bucket
from megatron_gift_tools.planner.cluster import GH200
from megatron_gift_tools.planner.costs import KernelCosts
from megatron_gift_tools.planner.options import Options
from megatron_gift_tools.planner.schemes import Scheme
from megatron_gift_tools.planner.stages import Context, Kind, reduction_chain


def test_committed_meter_json_measured_this_code():
    """The committed ``launches-cpu.json`` records the SHA-256 of the kernels, reduction and gather code it
    metered; a change to any of them without a new scan (the planner would price code that no longer runs)
    fails here. Fix: run the command in the message (about two minutes on two cores)."""
    assert metered.REGENERATE == launches.REGENERATE  # one command in both messages
    with open(metered.LAUNCHES_JSON) as f:
        doc = json.load(f)
    now = launches.source_hash()
    recorded = doc.get("sources", {})
    changed = sorted(set(now["files"]) ^ set(recorded.get("files", [])))
    assert recorded.get("sha256") == now["sha256"], (
        f"{metered.LAUNCHES_JSON} is older than the code it meters (files added or removed: {changed or 'none'}); "
        f"regenerate it: {launches.REGENERATE}"
    )


def test_source_hash_sees_a_change(tmp_path, monkeypatch):
    """A hash that ignored a file's bytes (or its name) would let a stale JSON pass the test above."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(launches, "ROOT", tmp_path)
    monkeypatch.setattr(launches, "SOURCES", ("kernels/*.py",))
    first = launches.source_hash()
    (tmp_path / "kernels" / "a.py").write_text("x = 2\n")
    second = launches.source_hash()
    (tmp_path / "kernels" / "a.py").rename(tmp_path / "kernels" / "b.py")
    third = launches.source_hash()
    assert first["files"] == ["kernels/a.py"] and len({first["sha256"], second["sha256"], third["sha256"]}) == 3


def _stage(name, launches_, moved, essential):
    return dict(
        stage=name, launches=launches_, bytes_read=moved, bytes_written=0, essential_read=essential, essential_written=0
    )


def _doc():
    """A meter JSON by hand: flat-rs at DP 8 and 512, 1M and 200M elements; 8-parameter buckets at 10M."""
    recs = []
    for bucket, send, reduce_ in (("euclidean", 8, 4), ("gift", 16, 12), ("euclidean/8", 12, 4), ("gift/8", 24, 12)):
        sizes = (10 << 20,) if bucket.endswith("/8") else (1 << 20, 200 << 20)
        for dp in (8, 512):
            for n in sizes:
                big = 2 if n > 1 << 20 else 1  # the 200M records: a different ratio, to see which is taken
                ratio = (1.5 if "gift" in bucket else 1.25) * big
                recs.append(
                    dict(
                        kind="reduction",
                        kernels="fused",
                        path="flat-rs",
                        bucket=bucket,
                        dp=dp,
                        elements=n,
                        stages=[
                            _stage("send", send, ratio * 100, 100),
                            _stage("reduce", reduce_, 100, 100),
                            _stage("finish", 7 if "gift" in bucket else 0, 0, 0),
                        ],
                    )
                )
    recs.append(
        dict(
            kind="reduction",
            kernels="pytorch",
            path="flat-rs",
            bucket="euclidean",
            dp=8,
            elements=1 << 20,
            stages=[_stage("send", 999, 999, 1)],
        )
    )
    for dp in (8, 512):
        recs.append(
            dict(
                kind="delta-gather",
                kernels="fused",
                dp=dp,
                elements=1 << 20,
                stages=[_stage("encode", 1, 1.1e3, 1e3), _stage("decode", 1, 1e3, 1e3)],
            )
        )
    return dict(date="2026-12-02 06:00 UTC", sources=dict(sha256="ab" * 32), records=recs)


def test_meter_counts_by_hand():
    """Record choice (nearest DP, then nearest size, in log), launches ``fixed + per parameter`` from the
    8-parameter records, ratios moved/essential: numbers worked by hand from ``_doc``. Taking the PyTorch
    records, the farther size, or launches without the per-parameter slope fails."""
    m = metered.Meter(_doc(), "by hand")
    # Euclidean send: 4 params 8 launches, 8 params 12: 1 per parameter, 4 fixed; 30 params -> 34
    c = m.reduction("flat-rs", "send", 400, 5e6, 30, 0)
    assert (c.launches, c.ratio, c.gift_ratio) == (34.0, 1.25, 1.5)  # DP 512, 1M (nearer 5M than 200M)
    assert m.reduction("flat-rs", "send", 400, 1e8, 30, 0).ratio == 2.5  # 200M nearer in log
    # GIFT fixed: 16 - 4*2 = 8, plus 2 per GIFT parameter, 1 per Euclidean one: 8 + 2*3 + 27 = 41
    assert m.reduction("flat-rs", "send", 16, 5e6, 30, 3).launches == 41.0
    assert m.reduction("flat-rs", "finish", 16, 5e6, 30, 0) == metered.StageCount(0.0, 1.0, 1.0)
    assert m.delta("encode", 600, 4e8) == metered.StageCount(1.0, 1.1, 1.1)


def test_launches_grow_with_the_widths_where_the_meter_has_two():
    """A path with ``gift/2w`` records (the FP4 paths: four GIFT parameters of two widths) adds their launches
    less the ``gift`` ones' for each width beyond the first; a bucket of one width, or a path without such
    records, is priced as before. Numbers by hand: ``gift`` reduce 12 launches, ``gift/2w`` 15: 3 per width,
    so 3 widths add 6. Bug caught: widths ignored (the sum-first exchange's per-shape launches priced as if
    every model had one shape), or counted for the first width too."""
    doc = _doc()
    for r in [r for r in doc["records"] if r.get("bucket") == "gift" and r["kind"] == "reduction"]:
        two = dict(r, bucket="gift/2w", stages=[dict(st, launches=st["launches"] + 3) for st in r["stages"]])
        doc["records"].append(two)
    m, plain = metered.Meter(doc, "by hand"), metered.Meter(_doc(), "by hand")
    one = plain.reduction("flat-rs", "reduce", 16, 5e6, 30, 3).launches
    assert m.reduction("flat-rs", "reduce", 16, 5e6, 30, 3, gift_widths=1).launches == one
    assert m.reduction("flat-rs", "reduce", 16, 5e6, 30, 3, gift_widths=3).launches == one + 6
    assert plain.reduction("flat-rs", "reduce", 16, 5e6, 30, 3, gift_widths=3).launches == one
    assert (
        m.reduction("flat-rs", "reduce", 16, 5e6, 30, 0, gift_widths=3).launches
        == plain.reduction("flat-rs", "reduce", 16, 5e6, 30, 0).launches
    )  # no GIFT parameters: no widths


def test_stage_seconds_are_launches_plus_ratio_times_bytes():
    """One flat reduce-scatter bucket at 8 ranks priced from ``_doc``: send = 34 launches x 5 us + (1.25 x the
    Euclidean share + 1.5 x the GIFT share of 4N + F, + 1.5 x 4N_g) / (0.6 x 4 TB/s). Pricing the essential
    bytes without the ratio, or the launches as a constant, fails."""
    costs = KernelCosts.from_hbm(GH200, metered.Meter(_doc(), "by hand"))
    b = Bucket(elements=10**6, wire_bytes=1.03125e6, gift_elements=250_000, parameters=30, gift_parameters=3)
    x = Context(8, 1, GH200, costs, Options())
    gpu = [t for t in reduction_chain(b, Scheme.GIFT, x) if t.kind is Kind.GPU]
    assert [t.label for t in gpu] == ["encode", "decode-sum", "cut-row sums"]
    bw = 0.6 * 4.0e12
    send = 41 * 5e-6 + ((4e6 + 1.03125e6) * (0.75 * 1.25 + 0.25 * 1.5) + 1.5 * 1e6) / bw
    assert gpu[0].seconds == pytest.approx(send, rel=1e-12) and gpu[0].launches == 41
    # finish: GIFT fixed 7 (7 - 4 x 0 per parameter), no bytes
    assert gpu[2].seconds == pytest.approx(7 * 5e-6, rel=1e-12)


def test_missing_meter_json_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="bench launches --json"):
        metered.Meter.load(tmp_path / "none.json")
    (tmp_path / "old.json").write_text(json.dumps(dict(records=[])))
    with pytest.raises(ValueError, match="lacks the fused records"):
        metered.Meter.load(tmp_path / "old.json")


@pytest.mark.parametrize("p", [2, 64])
def test_fused_delta_gather_moves_its_essential_bytes(p):
    """Target: the delta encode and decode move at most 1.25x their essential bytes, one launch each per bucket,
    as CUDA runs them (the fused kernels, stubbed on meta tensors). The unfused decode moved ~11x."""
    rec = launches.delta_gather(1 << 20, p, "fused")
    for s in rec["stages"]:
        assert s["launches"] == 1 and s["triton_launches"] == 1, s
        assert (s["bytes_read"] + s["bytes_written"]) <= 1.25 * (s["essential_read"] + s["essential_written"]), s
