"""``megatron-gift report`` on a telemetry file (moved from tests/megatron/test_profile_policy.py, whose
synthetic run it renders)."""

from megatron_gift_tools.cli import main as cli_main
from megatron_gift_tools.report import read_telemetry, render
from tests.megatron.test_profile_policy import _synthetic_run


def test_report_renders_plots_and_decisions(tmp_path):
    run = tmp_path / "run"
    _synthetic_run(run / "gift_telemetry.jsonl")
    with (run / "gift_telemetry.jsonl").open("a") as f:
        f.write('{"step": 99, "layers": {"fc')  # a run killed mid-line
    assert len(read_telemetry(run / "gift_telemetry.jsonl")) == 24
    written = render(run, out=tmp_path / "report")
    assert set(written) == {"report", "rel_l2_heatmap", "mode_timeline", "loss"}
    for key in ("rel_l2_heatmap", "mode_timeline", "loss"):
        data = written[key].read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000, key
    md = written["report"].read_text()
    assert "gift 0.012 < euclidean 0.019 × 0.95 for 2 profiles" in md and "step 16: `proj` euclidean → bf16" in md
    assert "| `fc2` | gift | 0.012 |" in md and "![mode per layer and step](mode_timeline.png)" in md
    assert "| all_to_all/fp8+scales | 1,012 |" in md
    assert cli_main(["report", str(run / "gift_telemetry.jsonl")]) == 0
    assert (run / "mode_timeline.png").exists() and (run / "report.md").exists()
