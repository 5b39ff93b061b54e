"""``megatron-gift bench training``: its gaps and verdicts against numbers worked by hand, its log
parsing, identical runs but for the mode's flags (fast), and a short real run whose validation losses
are the logs' and whose NVFP4 inter-node bytes are the format's share of FP8's (slow)."""

from __future__ import annotations

import json
import re

import pytest

from megatron_gift_tools.bench import training
from megatron_gift_tools.cli import build_parser


def _rec(mode, seed, val):
    coded = {"x/nvfp4+scales": 3, "y/bf16": 7}
    return dict(
        mode=mode,
        seed=seed,
        final_val_loss=val,
        bytes_per_step=10.0,
        bytes=coded,
        train_loss=[val] * 60,
        val_curve=[[60, val]],
        wall_seconds=1.0,
    )


def test_gap_to_bf16_is_paired_by_seed():
    """Catches a gap taken between means of unpaired runs, or a population sd: worked by hand, the
    gaps 0.02, 0.05, 0.01 have mean 0.026667 and sample sd sqrt(8.6667e-4 / 2) = 0.020817."""
    recs = [_rec("bf16", s, v) for s, v in ((1, 5.0), (2, 5.1), (3, 4.9))]
    recs += [_rec("nvfp4-gift+hadamard", s, v) for s, v in ((1, 5.02), (2, 5.15), (3, 4.91))]
    recs += [_rec("fp8-euclidean", s, v) for s, v in ((1, 5.0), (2, 5.1), (3, 4.9))]
    agg = training.aggregate(recs, [1, 2, 3], ["bf16", "nvfp4-gift+hadamard", "fp8-euclidean"])
    g = agg["nvfp4-gift+hadamard"]
    assert g["gap_to_bf16"] == pytest.approx(0.026667, abs=1e-6) and g["gap_sd"] == pytest.approx(0.020817, abs=1e-6)
    assert (g["format"], g["scheme"]) == ("nvfp4", "gift+hadamard") and g["coded_bytes_per_step"] == 3
    assert agg["bf16"]["gap_to_bf16"] == 0
    v = training.verdicts(agg)
    # 0.0267 <= 2 x 0.0208; Euclidean FP8's gap is 0 with sd 0: 0.0267 <= 0 + 2 x 0.0208
    assert v["nvfp4-gift+hadamard"] == dict(within_2sd_of_zero=True, le_fp8_euclidean_plus_noise=True)


def test_reduction_error_is_the_geometric_mean_of_the_logged_steps(tmp_path):
    """Catches the telemetry's errors averaged arithmetically, taken from the first steps (before a tenth of the
    run), mixed across layer modes, or reported where a seed's telemetry is missing. By hand: GIFT layers log
    0.01 and 0.04 at step 20 and 0.02 at step 30 (geometric mean (8e-6)^(1/3) = 0.02), Euclidean 0.1 at 20 and
    0.1 at 30; step 5 (before iters/10 = 10) logs 1.0 for both and is left out."""

    def log(step, gift, euclid):
        layers = {f"g{i}": {"mode": "gift", "rel_l2": v} for i, v in enumerate(gift)}
        layers |= {"e": {"mode": "euclidean", "rel_l2": euclid}, "b": {"mode": "bf16", "rel_l2": None}}
        return json.dumps({"step": step, "layers": layers})

    for seed, lines in ((1, [log(5, [1.0], 1.0), log(20, [0.01, 0.04], 0.1)]), (2, [log(30, [0.02], 0.1)])):
        d = tmp_path / "telemetry" / f"nvfp4-gift-s{seed}"
        d.mkdir(parents=True)
        (d / "gift_telemetry.jsonl").write_text("\n".join(lines) + "\n")
    got = training.reduction_error(tmp_path, "nvfp4-gift", [1, 2], 100)
    assert got == {"euclidean": pytest.approx(0.1), "gift": pytest.approx(0.02)}
    assert training.reduction_error(tmp_path, "nvfp4-gift", [1, 2, 3], 100) is None


def test_parse_reads_validation_and_bytes():
    """Catches a final validation loss taken from a training line or the wrong evaluation."""
    log = (
        " [t] iteration        1/       2 | consumed samples: 8 | lm loss: 7.5E+00 | loss scale: 1.0 |\n"
        " validation loss at iteration 1 | lm loss value: 7.400000E+00 | lm loss PPL: 1.6E+03 | \n"
        "megatron-gift: iteration 1: gradient reduction sent 50 bytes from this rank "
        "(all_to_all/bf16 30, all_to_all/nvfp4+scales 20)\n"
        " [t] iteration        2/       2 | consumed samples: 16 | lm loss: 7.25E+00 | loss scale: 1.0 |\n"
        " validation loss at iteration 2 | lm loss value: 7.100000E+00 | lm loss PPL: 1.2E+03 | \n"
    )
    rec = training.parse(log, "nvfp4-gift", 2)
    assert rec["final_val_loss"] == 7.1 and rec["val_curve"] == [(1, 7.4), (2, 7.1)]
    assert rec["train_loss"] == [7.5, 7.25] and rec["bytes"] == {"all_to_all/bf16": 30, "all_to_all/nvfp4+scales": 20}
    with pytest.raises(RuntimeError, match="validation"):
        training.parse(log.replace("validation", "v"), "nvfp4-gift", 2)


def test_runs_differ_only_in_mode_flags(tmp_path):
    """Catches a mode trained on other data, padding, nodes or schedule than the others."""
    p = dict(training.PRESET, eval_iters=20)
    cmds = {m: training.flags(p, 7, m, tmp_path) for m in training.MODES}
    base = cmds["bf16"][: -len(training.MODES["bf16"])]
    assert "--ddp-pad-buckets-for-high-nccl-busbw" in base and base[base.index("--seed") + 1] == "7"
    assert base[base.index("--eval-iters") + 1] == "20" and base[base.index("--ffn-hidden-size") + 1] == "192"
    for m, cmd in cmds.items():
        if m != "bf16":
            plugin = ["--gift-ranks-per-node", "2", "--gift-log-interval", "100", "--gift-telemetry-dir", str(tmp_path)]
            assert cmd == [*base, *plugin, *training.MODES[m]], m
    args = build_parser().parse_args(["bench", "training", "--quick", "--modes", "fp8-gift"])
    assert args.quick and args.modes == ["fp8-gift"] and args.func.__name__ == "_bench_training"


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_quick_run_writes_losses_and_bytes(tmp_path):
    """A real 10-iteration run of BF16, Euclidean FP8 and GIFT + Hadamard NVFP4 on 2 nodes x 2: catches
    a validation loss not the log's last, a mode not run through the plugin, or an inter-node message
    that is not NVFP4's 0.5625 B per element against FP8's 1 B plus an FP32 scale per group: groups of
    128, or of 64 on this model's 64-wide rows, so the ratio lies in [0.5625 / 1.0625, 0.5625 / 1.03125]
    = [0.529, 0.545] (the FP32 scale per NVFP4 segment adds under 0.5%)."""
    from megatron_gift_tools.cli import main

    out, path = tmp_path / "runs", tmp_path / "training.json"
    argv = ["bench", "training", "--quick", "--modes", "fp8-euclidean", "nvfp4-gift+hadamard"]
    assert main([*argv, "--out", str(out), "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["iters"] == 10 and doc["seeds"] == [1234] and path.with_suffix(".png").stat().st_size > 10_000
    assert list(doc["modes"]) == ["bf16", "fp8-euclidean", "nvfp4-gift+hadamard"]
    bf16 = doc["modes"]["bf16"]["final_val_loss"][0]
    for m, v in doc["modes"].items():
        log = (out / "logs" / f"{m}-s1234.log").read_text()
        logged = float(re.findall(r"validation loss at iteration\s+\d+ \| lm loss value: (\S+)", log)[-1])
        assert v["final_val_loss"] == [logged] and v["gap_to_bf16"] == pytest.approx(logged - bf16, abs=1e-12), m
    fp8, fp4 = (doc["modes"][m]["bytes_detail"] for m in ("fp8-euclidean", "nvfp4-gift+hadamard"))
    assert set(fp8) == {"all_to_all/bf16", "all_to_all/fp8+scales"} and "all_to_all/nvfp4+scales" in fp4
    assert 0.529 <= fp4["all_to_all/nvfp4+scales"] / fp8["all_to_all/fp8+scales"] <= 0.548


def test_reuse_takes_an_earlier_jsons_runs_except_those_rerun(tmp_path):
    """``--reuse``: each mode of the earlier JSON with today's flags and not in ``--rerun`` becomes one
    record per seed under ``--out`` (its losses by seed, as ``train`` reads them back); a rerun mode, or
    one whose flags changed, is left to run; another preset, other seeds or runs on another CPU model (whose FP32
    rounding differs: a seed's runs would not pair) refused. Bugs caught: seeds mixed up between records, a rerun
    mode silently reused, a stale mode's runs taken for today's flags, another machine's runs paired with these."""
    from megatron_gift_tools.bench.fidelity import machine

    seeds, modes = [1, 2], ["bf16", "nvfp4-gift", "nvfp4-hadamard", "fp8-gift"]
    recs = [_rec(m, s, 5.0 + k + s / 10) for k, m in enumerate(modes) for s in seeds]
    p = dict(training.PRESET, eval_iters=20)
    agg = training.aggregate(recs, seeds, modes)
    agg["fp8-gift"]["flags"] = ["--gift-mode", "gift"]  # a mode whose flags have changed since
    doc = dict(command="earlier", machine=machine(), iters=p["iters"], seeds=seeds, preset=p, modes=agg)
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(doc))
    out = tmp_path / "out"
    out.mkdir()
    taken = training.reuse(str(path), ["nvfp4-hadamard"], p, seeds, modes, out)
    assert sorted(taken) == ["bf16", "nvfp4-gift"] and taken["bf16"]["command"] == "earlier"
    assert sorted(f.name for f in out.iterdir()) == [f"{m}-s{s}.json" for m in ("bf16", "nvfp4-gift") for s in seeds]
    back = json.loads((out / "nvfp4-gift-s2.json").read_text())
    assert back["final_val_loss"] == pytest.approx(6.2) and back["seed"] == 2 and back["train_loss"] == [6.2] * 60
    with pytest.raises(SystemExit, match="another preset or seeds"):
        training.reuse(str(path), [], p, [1, 2, 3], modes, out)
    assert training.train("nvfp4-gift", 2, p, [], out, 1.0) == back  # a record here is read back, not rerun
    (out / "nvfp4-gift-s2.json").write_text(json.dumps(dict(back, cpu_model="another CPU")))
    with pytest.raises(SystemExit, match="ran on 'another CPU'"):
        training.train("nvfp4-gift", 2, p, [], out, 1.0)
    for other in (dict(doc, machine={"cpu_model": "another CPU"}), dict(doc, reused={"bf16": {"machine": {}}})):
        path.write_text(json.dumps(other))
        with pytest.raises(SystemExit, match="FP32 rounding differs between CPU models"):
            training.reuse(str(path), [], p, seeds, modes, out)
