"""``bench/gpu_check.sh --dry-run``: the GPU check's own script and code path on the CPU at tiny
shapes, so that it still runs when a GPU is next lent. Checks that every part ran and wrote its
JSON, the machine is named, the step-time model accepted the overhead JSON, byte counts follow
from the shapes, every training mode started from the same weights and data, the steady-step
looks (host synchronisations, trace, peak memory) ran, and the delta codec's part runs with or
without the codec; the trace's overlap arithmetic against a hand-made trace."""

import json
import math
import os
import subprocess
import sys
import types
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from megatron_gift_tools.bench import gpu_check, gpu_codec, gpu_step, gpu_trace

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = float(os.environ.get("GPU_CHECK_DRY_RUN_TIMEOUT", 1800))  # generous: CI machines are shared
FILES = [
    "gpu-check.log",
    "kernel-tests.xml",
    "overhead-gpu.json",
    "gpu-codec.json",
    "gpu-step.json",
    "model-gpu.json",
    "gpu-check.json",
    "gpu-profile.json",
]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return proc, out


def _load(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


@pytest.mark.slow
def test_every_part_runs_and_writes_its_file(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)  # <= 8 files: all come back from a device call
    check = _load(out, "gpu-check.json")
    assert check["kind"] == "dry-run"
    assert all("error" not in part and part["file"] == gpu_check.FILES[name] for name, part in check["parts"].items())
    assert set(check["parts"]) == {"overhead", "codec", "step"}
    # the kernel tests were collected and, on a CPU, all skipped: counted from their JUnit file as
    # skips, none as passed (bug caught: a dry run reporting GPU kernel tests it never ran as passing)
    suite = ET.parse(out / "kernel-tests.xml").getroot().find("testsuite")
    kt = check["kernel_tests"]
    assert kt["tests"] == int(suite.get("tests")) > 0 and kt["skipped"] == int(suite.get("skipped"))
    assert kt["failures"] == kt["errors"] == 0
    if not torch.cuda.is_available():
        assert kt["skipped"] == kt["tests"] and kt["passed"] == 0
    for name in ("overhead-gpu.json", "gpu-codec.json", "gpu-step.json", "gpu-check.json", "gpu-profile.json"):
        machine = _load(out, name)["machine"]
        assert {"gpu", "driver", "torch", "cuda", "triton", "megatron_core", "python"} <= set(machine), name
        assert machine["gpu"] is None and machine["device"] == "cpu"  # the dry run names no GPU
    assert "failed" not in proc.stdout


@pytest.mark.slow
def test_overhead_json_times_bf16_layers_for_the_model(dry_run):
    _, out = dry_run
    doc = _load(out, "overhead-gpu.json")
    fwd = [r for r in doc["results"] if r["path"] == "layer_fwd_bwd"]
    assert len(fwd) == 4 and all(r["dtype"] == "bfloat16" for r in fwd)
    assert {s["layer"] for s in doc["summary"]} == {"qkv", "proj", "fc1", "fc2"}
    assert _load(
        out, "model-gpu.json"
    )  # `megatron-gift model --overhead-json` read it (its exit status is checked above)


@pytest.mark.slow
def test_codec_bytes_follow_from_the_shapes(dry_run):
    _, out = dry_run
    doc = _load(out, "gpu-codec.json")
    m = gpu_check.DRY_RUN_MODEL
    h, f = m["hidden"], m["ffn"]
    shapes = {"qkv": (3 * h, h), "proj": (h, h), "fc1": (2 * f, h), "fc2": (h, f)}
    for r in doc["results"]:
        d_out, d_in = shapes[r["layer"]]
        scales = lambda rows: rows * math.ceil(d_in / 128) * 4  # noqa: E731  one FP32 scale per 1x128 block
        if r["path"] in ("encode", "whiten_encode", "whiten_encode_groups"):
            assert r["bytes"] == 4 * d_out * d_in + d_out * d_in + scales(d_out)
        else:
            rows = d_out // 8
            assert (r["rows"], r["peers"]) == (rows, 8)
            assert r["bytes"] == 8 * (rows * d_in + scales(rows)) + 4 * rows * d_in
        assert r["seconds"] > 0 and r["host_s"] > 0 and r["bytes_per_s"] == pytest.approx(r["bytes"] / r["seconds"])
    assert {(s["path"], s["impl"]) for s in doc["summary"]} == {(p, "reference") for p in gpu_codec.PATHS}
    assert doc["targets"]["fused_timed"] is False  # no compiled Triton on a CPU
    # the sender's paths again at the sender model's shapes (the dry run's own model; the 8B's on a GPU)
    sender = doc["sender"]
    expected = {(k, p) for k in shapes for p in gpu_codec.SENDER_PATHS}
    assert {(r["layer"], r["path"]) for r in sender["results"]} == expected
    for r in sender["results"]:
        d_out, d_in = shapes[r["layer"]]
        assert r["bytes"] == 5 * d_out * d_in + d_out * math.ceil(d_in / 128) * 4 and r["host_s"] > 0
    assert gpu_check.SENDER_MODEL["gpu"]["hidden"] == 4096 and gpu_check.SENDER_MODEL["gpu"]["ffn"] == 14336
    # the four-bit codec: encode reads the FP32 values and writes half a byte plus a block scale per
    # element (NVFP4: 16-element blocks and a 4-byte segment scale; MXFP4: 32); the decode-sum reads 8
    # senders' messages of this rank's shard and writes it in FP32 (bug caught: FP8's byte per element);
    # the rotation reads and writes the values once
    fp4 = doc["fp4"]
    assert {(s["path"], s["impl"]) for s in fp4["summary"]} == {(p, "reference") for p in gpu_codec.FP4_PATHS}
    for r in fp4["results"]:
        d_out, d_in = shapes[r["layer"]]
        block, seg = (16, 4) if r["path"].endswith("nvfp4") else (32, 0)
        if r["path"].startswith("fp4_rotate"):  # the layer's whole 64-blocks read and written in FP32
            n = d_out * d_in // 64 * 64
            assert (r["cols"], r["bytes"]) == (n, 8 * n)
        elif r["path"].startswith("fp4_encode"):
            n = d_out * d_in // block * block
            assert (r["cols"], r["bytes"]) == (n, 4 * n + n // 2 + n // block + seg)
        else:
            m = d_out * d_in // 8 // block * block
            assert (r["cols"], r["bytes"]) == (m, 8 * (m // 2 + m // block + seg) + 4 * m)
        assert r["seconds"] > 0 and r["host_s"] > 0


@pytest.mark.slow
def test_step_runs_every_mode_from_the_same_start(dry_run):
    _, out = dry_run
    doc = _load(out, "gpu-step.json")
    results = {r["mode"]: r for r in doc["results"]}
    assert list(results) == list(gpu_step.MODES)
    spec = gpu_step.SPECS["dry-run"]
    h, f, layers = spec["hidden"], spec["ffn"], spec["layers"]
    linear = layers * (3 * h * h + h * h + 2 * f * h + h * f)  # the weights --gift-layers selects by default
    for mode, r in results.items():
        assert r["coded_elements"] == (0 if mode.startswith("off") else linear), mode
        timed = r["step_times_s"] + r["refresh_step_times_s"] + r["after_refresh_step_times_s"]
        assert len(timed) == spec["steps"] and len(r["step_times_s"]) >= 2
        assert all(t > 0 and math.isfinite(t) for t in r["step_times_s"])
        assert r["losses"][0] == results["off"]["losses"][0], mode  # same weights, same tokens
        assert all(math.isfinite(x) for x in r["losses"])
    # GIFT's warm-up refreshes fall in the timed steps (2 and 4 of steps 2..7), each followed by a step that
    # finishes its build (3 and 5), timed apart from the steady ones (bug caught: those in the steady median)
    assert len(results["gift"]["refresh_step_times_s"]) == len(results["gift"]["after_refresh_step_times_s"]) == 2
    assert results["euclidean"]["after_refresh_step_times_s"] == []
    assert set(doc["summary"]["modes"]) == set(gpu_step.MODES)
    lagged = results["gift-lagged"]["gift_config"]
    assert "Schedule.LAGGED" in lagged and "Schedule.LAGGED" not in results["gift"]["gift_config"]
    assert doc["summary"]["eager_over_lagged"] > 0  # the first GPU run's answer (issue 35 item 7)
    assert doc["summary"]["tokens_per_step"] == spec["micro_batch"] * spec["microbatches"] * spec["seq"]


@pytest.mark.slow
def test_steady_step_looks_ran_for_every_mode(dry_run):
    """Each mode but the repeat got a steady step under the sync probe (the CPU's sanitizer), a profiled step
    and no error-mode step (CUDA only); stock Megatron's own synchronisations are never the plugin's."""
    _, out = dry_run
    doc = _load(out, "gpu-step.json")
    results = {r["mode"]: r for r in doc["results"]}
    for mode in gpu_step.CLOSE_LOOKS:
        r = results[mode]
        assert r["steady_syncs"]["method"].startswith("testing.dispatch.SyncSanitizer"), mode
        assert r["overlap"]["codec_kernels"] == 0 and r["overlap"]["share_overlapping_backward"] is None  # no CUDA
        assert r["sync_error"] is None and r["steady_step_peak_extra_bytes"] is None
    assert results["off"]["steady_syncs"]["plugin"] == {}
    assert "steady_syncs" not in results["off-again"]
    # after the timed steps 2..7: GIFT refreshes at 8 and 10 (interval 10), finishes their builds at 9 and 11, so
    # its looks (two on a CPU: no error-mode step) are 12 and 13 (bugs caught: a look on a refresh step or on a
    # build-finishing one, whose host waits are the refresh's; the first H200 run traced step 20, a refresh)
    spec = gpu_step.SPECS["dry-run"]
    assert results["gift"]["looked_steps"] == [12, 13]
    assert results["euclidean"]["looked_steps"] == [spec["warmup"] + spec["steps"] + i for i in range(2)]
    assert set(doc["targets"]["steady_plugin_syncs"]) == {"bf16", "euclidean", "gift", "gift-lagged"}


@pytest.mark.slow
def test_delta_codec_part_reports_its_absence(dry_run):
    _, out = dry_run
    delta = _load(out, "gpu-codec.json")["delta"]
    try:
        __import__(gpu_codec.DELTA_MODULE)
        present = True
    except ImportError:
        present = False
    assert delta["available"] is present and delta["module"] == gpu_codec.DELTA_MODULE
    assert _load(out, "gpu-check.json")["targets"]["delta_codec"]["available"] is present


def test_delta_codec_bytes_follow_from_the_shapes(monkeypatch):
    """With a codec installed (a stand-in with the module's three names), both paths run on every layer and
    count the bytes the module docstring lists: encode 2n + 2n + message, decode 8 messages + 2n + 2n."""
    calls = []
    fake = types.ModuleType(gpu_codec.DELTA_MODULE)
    fake.message_bytes = lambda n: n + -(-n // 32)
    fake.encode = lambda new, prev, out: calls.append(("encode", new.numel()))
    fake.decode_into = lambda messages, base: calls.append(("decode", base.numel()))
    monkeypatch.setitem(sys.modules, gpu_codec.DELTA_MODULE, fake)
    model = dict(hidden=64, ffn=128)
    large = gpu_codec.copy_record(1 << 16, torch.device("cpu"))
    doc = gpu_codec.measure_delta(model, torch.device("cpu"), large)
    assert doc["available"] and {s["path"] for s in doc["summary"]} == set(gpu_codec.DELTA_PATHS)
    shapes = {"qkv": (192, 64), "proj": (64, 64), "fc1": (256, 64), "fc2": (64, 128)}
    for r in doc["results"]:
        n = shapes[r["layer"]][0] * shapes[r["layer"]][1]
        if r["path"] == "delta_encode":
            assert r["bytes"] == 4 * n + n + -(-n // 32)
        else:
            assert r["bytes"] == 8 * (n // 8 + -(-(n // 8) // 32)) + 4 * n
    assert {("encode", n) for n in (192 * 64, 64 * 64, 256 * 64, 64 * 128)} <= set(calls)


def test_trace_overlap_by_hand():
    """A hand-made trace: compute kernels on stream 7 at [120, 170] and [180, 230] us (launched inside the
    backward mark), codec kernels on stream 20 at [160, 200] and [240, 260], an NCCL kernel left out: 30 of the
    codec's 60 us overlap compute, 40 fall inside the backward's window [120, 230]."""

    def kernel(corr, stream, t0, t1, name="k"):
        return dict(cat="kernel", name=name, ts=t0, dur=t1 - t0, args=dict(stream=stream, correlation=corr))

    def launch(corr, ts):
        return dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=ts, dur=1, args=dict(correlation=corr))

    events = [
        dict(cat="user_annotation", name=gpu_trace.BACKWARD, ts=100, dur=100),
        launch(1, 110),
        launch(2, 150),
        launch(3, 160),
        launch(4, 300),
        launch(5, 155),
        kernel(1, 7, 120, 170),
        kernel(2, 7, 180, 230),
        kernel(3, 20, 160, 200),
        kernel(4, 20, 240, 260),
        kernel(5, 21, 150, 250, "ncclDevKernel_SendRecv"),
    ]
    got = gpu_trace.overlap(dict(traceEvents=events))
    assert got["compute_stream"] == 7 and got["codec_kernels"] == 2 and got["codec_s"] == pytest.approx(60e-6)
    assert got["share_overlapping_backward"] == pytest.approx(0.5)
    assert got["share_in_backward_window"] == pytest.approx(40 / 60)
    assert got["backward_window_s"] == pytest.approx(110e-6)


def test_trace_compute_stream_is_the_forwards_stream():
    """The compute stream is the one running the forward passes, even where the plugin's stream runs more
    kernels inside the last backward (the 600M GPU run picked the codec's stream and called the whole
    step's compute "codec"): forward kernels on stream 7 before the mark, in the backward 1 compute
    kernel on 7 at [120, 170] and 3 codec kernels on 20 at [130, 140], [150, 160], [200, 230]."""

    def kernel(corr, stream, t0, t1):
        return dict(cat="kernel", name="k", ts=t0, dur=t1 - t0, args=dict(stream=stream, correlation=corr))

    def launch(corr, ts):
        return dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=ts, dur=1, args=dict(correlation=corr))

    events = [dict(cat="user_annotation", name=gpu_trace.BACKWARD, ts=100, dur=150)]
    events += [launch(10, 10), launch(11, 20), kernel(10, 7, 15, 40), kernel(11, 7, 40, 90)]
    events += [launch(1, 110), launch(2, 112), launch(3, 114), launch(4, 116)]
    events += [kernel(1, 7, 120, 170), kernel(2, 20, 130, 140), kernel(3, 20, 150, 160), kernel(4, 20, 200, 230)]
    got = gpu_trace.overlap(dict(traceEvents=events))
    assert got["compute_stream"] == 7 and got["backward_kernels"] == 1 and got["codec_kernels"] == 3
    assert got["codec_s"] == pytest.approx(50e-6)
    assert got["share_overlapping_backward"] == pytest.approx(20 / 50)


def test_profiled_steps_are_steady():
    """gpu_profile times and profiles two steps neither of which builds factors (``gpu_step.steady_from`` with
    count 2): with refreshes at steps 0, 1, 2, 4, 8, 10 (the default schedule's start, interval 10), after 3
    warm-up steps, the first such pair is 6 and 7, after 8 it is 12 and 13 (the first GPU profile took step 4,
    a refresh, as GIFT's steady step)."""
    refreshes = {0, 1, 2, 4, 8, 10, 20}
    assert gpu_step.steady_from(refreshes.__contains__, 3, count=2) == 6
    assert gpu_step.steady_from(refreshes.__contains__, 8, count=2) == 12
    assert gpu_step.steady_from(lambda n: False, 3, count=2) == 3


@pytest.mark.slow
def test_profile_times_the_plugin_ranges(dry_run):
    """gpu_profile's steady GIFT step runs the statistics hook once per GIFT layer and micro-batch (2 layers x
    4 linear weights x 2 micro-batches = 16 in the dry run's spec) and Euclidean none; both run reduction
    stages, `off` none of the plugin's ranges (bugs caught: a profiled step without statistics, e.g. a refresh
    step's successor or a step with collection off, or ranges left wrapped after the profile)."""
    from megatron_gift.numerics.kfac import KFACStatistics

    _, out = dry_run
    doc = _load(out, "gpu-profile.json")
    by_mode = {r["mode"]: r for r in doc["results"]}
    assert set(by_mode) == {"off", "euclidean", "gift"}
    assert by_mode["off"]["ranges"] == {}
    assert "gift/statistics" not in by_mode["euclidean"]["ranges"]
    assert by_mode["gift"]["ranges"]["gift/statistics"]["count"] == 2 * 4 * 2
    assert by_mode["euclidean"]["ranges"]["gift/stage"]["count"] > 0
    from megatron_gift_tools.bench import gpu_profile

    original = KFACStatistics.accumulate
    with gpu_profile.ranges():
        assert KFACStatistics.accumulate is not original
    assert KFACStatistics.accumulate is original
