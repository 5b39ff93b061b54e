"""``megatron-gift demo``: the command line parses (fast), and a short real run of all five modes
writes its report, plots and metrics with finite losses and FP8 bytes well under FP32's (slow)."""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from megatron_gift_tools import demo
from megatron_gift_tools.cli import build_parser


def test_demo_cli_parses():
    args = build_parser().parse_args(["demo"])
    assert args.func.__name__ == "_demo" and not args.quick and args.out == "runs/demo" and args.train_iters is None
    args = build_parser().parse_args(["demo", "--quick", "--out", "x/y", "--train-iters", "3"])
    assert args.quick and args.out == "x/y" and args.train_iters == 3


def test_demo_command_lines_differ_only_in_mode_flags(tmp_path):
    data = ["--data-path", "p"]
    cmds = {m: demo.launcher_command(demo.PRESETS["quick"], m, data, tmp_path, 1) for m in demo.MODES}
    common = cmds["fp32"][: -len(demo.MODES["fp32"])]
    for mode, cmd in cmds.items():
        assert cmd == [*common, *demo.MODES[mode]]
    for flag in (
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--gift-cpu",
    ):
        assert flag in common
    assert common[common.index("--normalization") + 1] == "RMSNorm"
    assert common[common.index("--position-embedding-type") + 1] == "rope"


def test_demo_log_parsing_and_ring_bytes():
    log = (
        "Params for bucket 1 (100 elements, 128 padded size, 0 param(s) with extra main_grads):\n"
        " [t] iteration        1/       2 | consumed samples: 4 | lm loss: 7.5E+00 | loss scale: 1.0 |\n"
        "megatron-gift: iteration 1: gradient reduction sent 40 bytes from this rank (all_to_all/fp8+scales 40)\n"
        " [t] iteration        2/       2 | consumed samples: 8 | lm loss: 7.25E+00 | loss scale: 1.0 |\n"
    )
    parsed = demo.parse_log(log)
    assert parsed["loss_curve"] == [7.5, 7.25] and parsed["bytes_lines"] == [40]
    assert parsed["bucket_padded_elements"] == [128]
    assert demo.ring_reduce_scatter_bytes([128], ranks=2) == 256  # (R-1)/R * 4 B * 128


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_demo_writes_report_plots_and_metrics(tmp_path):
    from megatron_gift_tools.cli import main

    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--train-iters", "13", "--out", str(out)]) == 0  # the last step is no refresh
    assert (out / "report.md").is_file() and "| GIFT-E4M3 |" in (out / "report.md").read_text()
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) >= 2 and all(p.stat().st_size > 10_000 for p in pngs)
    doc = json.loads((out / "metrics.json").read_text())
    assert set(doc["modes"]) == {"fp32", "bf16", "euclidean-e4m3", "gift-e4m3", "gift-auto"}
    fp32 = doc["modes"]["fp32"]["bytes_per_step"]
    for name, m in doc["modes"].items():
        assert len(m["loss_curve"]) == 13 and all(math.isfinite(v) for v in m["loss_curve"]), (name, m["loss_curve"])
        # the losses Megatron printed, read from the run's own log with this test's pattern
        logged = re.findall(r"lm loss: ([-+0-9.eE]+) \|", (out / "logs" / f"{name}.log").read_text())
        assert m["loss_curve"] == [float(v) for v in logged] and m["final_loss"] == float(logged[-1]), name
        assert m["bytes_per_step"] > 0
    # A step without a factor refresh sends 1 B per element plus an FP32 scale per group, against
    # FP32's 4 B: 0.25 + 4 / (4 · 64) = 0.2656x, since the quick model's widest group is a 64-wide
    # row (hidden 64); 1% more for shard padding. Euclidean never refreshes; GIFT's average also
    # carries the FP32 statistics all-reduces and factor broadcasts of its warm-up refreshes (steps 0,
    # 1, 2, 4, 8, 10 here: 6 of 13), large next to this tiny model's gradients.
    fp8_share = (0.25 + 4 / (4 * demo.PRESETS["quick"]["hidden"])) * 1.01
    for name, bound in (("euclidean-e4m3", fp8_share), ("gift-e4m3", 0.6), ("gift-auto", 0.6)):
        m = doc["modes"][name]
        last = sum(int(n) for n in re.findall(r"\S+ (\d+)", m["bytes_detail_last"]))
        assert last <= fp8_share * fp32 and m["bytes_per_step"] < bound * fp32, (name, last, m["bytes_per_step"], fp32)
    assert doc["modes"]["bf16"]["bytes_per_step"] == pytest.approx(0.5 * fp32, rel=0.02)
    # Same model, data and seed: the first iteration (before any reduction) has the same loss.
    first = [m["loss_curve"][0] for m in doc["modes"].values()]
    assert first == pytest.approx([first[0]] * 5, rel=1e-6)
    # Per-layer RelL2 from each plugin mode's telemetry, and auto's decisions rendered by `report`.
    auto = doc["auto"]
    assert auto["candidates"] == len(auto["layers"]) == 8  # 2 layers x qkv, proj, fc1, fc2
    # "within 5%" counted again from the per-layer RelL2 it summarizes
    assert auto["within_5_percent"] == sum(
        v["auto"] <= 1.05 * min(v["euclidean-e4m3"], v["gift-e4m3"]) for v in auto["layers"].values()
    )
    for layer in auto["layers"].values():
        assert layer["bf16"] < min(layer["euclidean-e4m3"], layer["gift-e4m3"]) < 0.1 and layer["auto"] < 0.1
    # auto's final mode per layer: the last switch Megatron's log printed for it (Euclidean, the
    # policy's start, without one), and the mode of the run's last telemetry record
    log = (out / "logs" / "gift-auto.log").read_text()
    switched = {name: to for name, to in re.findall(r"megatron-gift: iteration \d+: (\S+): \w+ -> (\w+) ", log)}
    last = json.loads((out / "telemetry" / "gift-auto" / "gift_telemetry.jsonl").read_text().splitlines()[-1])
    for name, layer in auto["layers"].items():
        assert layer["auto_mode"] == switched.get(name, "euclidean") == last["layers"][name]["mode"], name
    assert (out / "per_layer_rel_l2.png").stat().st_size > 10_000
    assert {"report", "mode_timeline", "rel_l2_heatmap"} <= set(doc["auto_report"])
    assert all((out / path).is_file() for path in doc["auto_report"].values())
    assert "auto / best FP8" in (out / "report.md").read_text()
    assert set(doc["launcher_commands"]) == set(doc["modes"]) and doc["machine"]["cpus"] == os.cpu_count()


def _synthetic_doc():
    labels = {
        "fp32": "FP32",
        "bf16": "BF16",
        "euclidean-e4m3": "Euclidean-E4M3",
        "gift-e4m3": "GIFT-E4M3",
        "gift-auto": "auto (GIFT/Euclidean/BF16 per layer)",
    }
    modes = {
        k: {
            "label": v,
            "loss_curve": [8.0 - 0.1 * i for i in range(10)],
            "final_loss": 7.1,
            "bytes_per_step": 2_000_000 // (i + 1),
            "bytes_ratio_to_fp32": 1 / (i + 1),
        }
        for i, (k, v) in enumerate(labels.items())
    }
    layers = {
        f"decoder.layers.{i}.mlp.linear_fc{j}.weight": {
            "bf16": 2e-4,
            "euclidean-e4m3": 0.03,
            "gift-e4m3": 0.015,
            "auto": 0.016,
        }
        for i in range(2)
        for j in (1, 2)
    }
    return {"modes": modes, "preset": {"layers": 2, "hidden": 64, "seq": 64}, "ranks": 2, "auto": {"layers": layers}}


def test_demo_plots_are_readable(tmp_path, monkeypatch):
    """Issue 37 item 5: bytes_per_step.png's mode labels overlapped; per_layer_rel_l2.png's legend covered
    bars and its log axis drew BF16's bars (error ~100x below FP8's) with no length. Checked on the drawn
    figures: no two x labels overlap, the legend lies outside the axes, every BF16 bar is visibly long."""
    import matplotlib.pyplot as plt

    figs, close = [], plt.close
    monkeypatch.setattr(plt, "close", figs.append)
    demo.write_plots(_synthetic_doc(), tmp_path)
    by_name = {f.axes[0].get_title(): f for f in figs if f is not None and hasattr(f, "axes")}
    bytes_fig = next(f for t, f in by_name.items() if t.startswith("Gradient-reduction bytes"))
    bytes_fig.canvas.draw()
    boxes = [t.get_window_extent() for t in bytes_fig.axes[0].get_xticklabels() if t.get_text()]
    assert len(boxes) == 5 and not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    rel_fig = next(f for t, f in by_name.items() if t.startswith("Per-layer fidelity"))
    rel_fig.canvas.draw()
    ax = rel_fig.axes[0]
    assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1
    bf16 = next(c for c in ax.containers if c.get_label() == "BF16")
    assert all(bar.get_window_extent().width > 20 for bar in bf16), "BF16 bars drawn with (almost) no length"
    for f in figs:
        close(f)
