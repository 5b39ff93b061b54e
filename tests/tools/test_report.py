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


def test_heat_map_colours_noise_as_one_shade():
    """RelL2s a few percent apart (run-to-run noise) take a sliver of the heat map's log colour scale,
    and every value lies inside it. Bug caught: a min-to-max colour range, which paints a 5% spread
    from the darkest colour to the brightest, as if the layers differed."""
    import math

    import numpy as np

    from megatron_gift_tools.report import colour_range

    for values in ([0.0200, 0.0210], [0.0095, 0.0099], [0.031]):
        lo, hi = colour_range(np.array(values))
        assert lo <= min(values) and max(values) <= hi
        assert math.log10(max(values) / min(values)) <= 0.05 * math.log10(hi / lo), values
    lo, hi = colour_range(np.array([3e-4, 0.5]))  # three decades apart: the scale spans them, not ten
    assert lo <= 3e-4 and 0.5 <= hi and math.log10(hi / lo) <= 5
