"""``bench telemetry --quick`` on 2 CPU ranks: JSON schema and configurations, and that only the
logging configurations wrote telemetry records and only the profiling ones profiled (no timing asserts)."""

import json

import pytest

from megatron_gift.bench import telemetry_cost
from megatron_gift.cli import build_parser, main

SPEC = telemetry_cost.PRESETS["quick"]
STEPS = SPEC["warmup"] + SPEC["steps"]


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
    assert auto["ratio_to_baseline"] == pytest.approx(auto["median_ms"] / euclid["median_ms"], rel=1e-3)
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


def test_cli_parses_bench_telemetry():
    args = build_parser().parse_args(["bench", "telemetry", "--json", "x.json"])
    assert not args.quick and args.json == "x.json" and args.func.__name__ == "_bench_telemetry"
