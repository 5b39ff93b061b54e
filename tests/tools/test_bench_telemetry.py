"""``bench telemetry --quick`` on 2 CPU ranks: JSON schema and configurations, and that only the
logging configurations wrote telemetry records and only the profiling ones profiled (no timing asserts)."""

import json
import statistics

import pytest

from megatron_gift_tools.bench import telemetry_cost
from megatron_gift_tools.cli import build_parser, main

SPEC = telemetry_cost.PRESETS["quick"]
STEPS = SPEC["warmup"] + SPEC["steps"]


@pytest.mark.cpu_harness
def test_bench_telemetry_quick(tmp_path, capsys):
    path = tmp_path / "telemetry.json"
    assert main(["bench", "telemetry", "--quick", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["command"] == f"megatron-gift bench telemetry --quick --json {path}"
    assert {"platform", "processor", "torch"} <= set(doc["machine"])
    rows = {r["config"]: r for r in doc["results"]}
    assert list(rows) == list(telemetry_cost.CONFIGS)
    for r in rows.values():
        assert {"config", "median_ms", "iqr_ms", "ratio_to_logging_off", "steps"} <= set(r)
        assert r["steps"] == SPEC["steps"] and r["median_ms"] > 0 and r["iqr_ms"] >= 0
    assert rows["gift-log-off"]["ratio_to_logging_off"] == 1.0
    auto, euclid = rows["auto-no-profile"], rows["euclidean-log-off"]  # same mode of the candidates
    assert auto["baseline"] == "euclidean-log-off"
    # the ratio of the medians of the per-step times the JSON lists (statistics.median here; the
    # times are rounded to 0.01 ms, the ratio to 1e-4), inside its bootstrap interval
    median = {name: statistics.median(rows[name]["times_ms"]) for name in (auto["config"], euclid["config"])}
    assert auto["ratio_to_baseline"] == pytest.approx(median["auto-no-profile"] / median["euclidean-log-off"], abs=2e-3)
    # the interval is the (seeded) bootstrap of the per-step times the JSON lists, not of others
    # (its times are rounded to 0.01 ms: the ratios to ~1e-4)
    want = telemetry_cost._ratio_ci(rows["auto-no-profile"]["times_ms"], rows["euclidean-log-off"]["times_ms"])
    assert auto["ratio_to_baseline_ci95"] == pytest.approx(want, abs=2e-3)
    # records in gift_telemetry.jsonl, steps on which the monitor held profiles
    expected = {
        "euclidean-log-off": (0, 0),
        "gift-log-off": (0, 0),
        "gift-log-off-again": (0, 0),
        "gift-log-interval-1e6": (1, 1),  # step 0 only, before the timed steps
        "auto-no-profile": (0, 1),
        "gift-log-every-step": (STEPS, STEPS),
        "auto-profile-every-step": (0, STEPS),
    }
    assert {k: (r["records"], r["profiled_steps"]) for k, r in rows.items()} == expected
    assert set(rows["euclidean-log-off"]["modes"]) == {"euclidean"}
    assert rows["gift-log-off"]["modes"] == {"gift": 8}  # 2 layers x qkv, proj, fc1, fc2
    assert set(rows["auto-no-profile"]["modes"]) == {"euclidean"}  # no profile after step 0: no switch
    out = capsys.readouterr().out
    assert "| gift-log-every-step |" in out


def test_median_iqr_and_interval_of_known_times():
    # inclusive quartiles of 1..5 are 2 and 4; a configuration always 1.5x its baseline has ratio 1.5 in every resample
    assert telemetry_cost._stats([5.0, 1.0, 4.0, 2.0, 3.0]) == (3.0, 2.0)
    base = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert telemetry_cost._ratio_ci([1.5 * t for t in base], base) == pytest.approx((1.5, 1.5))


def test_cli_parses_bench_telemetry():
    args = build_parser().parse_args(["bench", "telemetry", "--json", "x.json"])
    assert not args.quick and args.json == "x.json" and args.func.__name__ == "_bench_telemetry"
