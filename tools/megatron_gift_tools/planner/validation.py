"""Step times of the model against CPU runs: the demo model trained on 2 gloo ranks per mode,
gloo's latency and bandwidth fitted on this machine. Training needs the demo and the corpus
(imported only inside ``validate_cpu``); ``measured_json`` reuses an earlier run's measurements."""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import asdict
from pathlib import Path

from megatron_gift_tools.planner.cluster import Cluster
from megatron_gift_tools.planner.costs import KernelCosts
from megatron_gift_tools.planner.model import step_time
from megatron_gift_tools.planner.options import Options
from megatron_gift_tools.planner.schemes import Scheme
from megatron_gift_tools.planner.workloads import LINEAR_KINDS, Workload

ELAPSED_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")
VALIDATION_MODES = (("fp32", "fp32"), ("bf16", "bf16"), ("euclidean", "euclidean-e4m3"), ("gift", "gift-e4m3"))


def _gloo_probe(rank: int, world: int, sizes: list[int], repeats: int) -> list[tuple[str, int, float]]:
    import time

    import torch
    import torch.distributed as dist

    out = []
    for nbytes in sizes:
        n = nbytes // 4
        x = torch.ones(n)
        ops = {
            "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(x), x),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(n // world), x),
            "all_gather": lambda: dist.all_gather_into_tensor(torch.empty(n), x[: n // world]),
        }
        for name, op in ops.items():
            op()
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                times.append(time.perf_counter() - t0)
            out.append((name, nbytes, statistics.median(times)))
    return out


def measure_gloo(sizes=(1 << 14, 1 << 17, 1 << 20, 1 << 22), repeats: int = 7) -> dict:
    """Latency and bandwidth of 2-rank gloo collectives on this machine: least-squares fits of
    ``t = α + (p-1)/p·S/B`` for the ring collectives (reduce-scatter, all-gather) and for all-to-all."""
    from megatron_gift.testing import run_on_ranks

    samples = run_on_ranks(_gloo_probe, 2, list(sizes), repeats, timeout=300)[0]
    fits = {}
    for kind, names in (("ring", ("reduce_scatter", "all_gather")), ("all_to_all", ("all_to_all",))):
        xs, ts = zip(*[(s / 2, t) for name, s, t in samples if name in names])
        slope, alpha = statistics.linear_regression(xs, ts)
        fits[kind] = dict(alpha_s=max(alpha, 0.0), bandwidth=1.0 / slope)
    return dict(fits=fits, samples=samples)


def measured_step_seconds(log_text: str, skip: int = 3) -> float:
    """Lower quartile of Megatron's 'elapsed time per iteration' after the first ``skip`` iterations:
    on a shared machine other jobs' bursts only ever lengthen an iteration."""
    times = [float(ms) / 1e3 for it, ms in ELAPSED_RE.findall(log_text) if int(it) > skip]
    if len(times) < 2:
        raise ValueError("fewer than 2 'elapsed time per iteration' lines after the warm-up iterations")
    return statistics.quantiles(times, n=4)[0]


def validate_cpu(
    overhead_json: str,
    iters: int = 30,
    out: str = "runs/model-validation",
    seed: int = 1234,
    timeout: float = 1800,
    measured_json: str | None = None,
) -> dict:
    """Train the demo model (``demo.PRESETS['default']``, ``iters`` iterations, 2 gloo ranks) once per mode
    through the demo's launcher command without telemetry, logs in ``out/logs/<mode>.log``; measure gloo's
    latency and bandwidth; compare with the model (``predict_validation``). ``measured_json``: take the step
    times and gloo fits from that model JSON's ``cpu_validation`` instead (no training)."""
    if measured_json:
        old = json.load(open(measured_json))["cpu_validation"]
        measured = {key: r["measured_s"] for (_, key), r in zip(VALIDATION_MODES, old["rows"])}
        return dict(
            predict_validation(old["preset"], measured, old["gloo"], overhead_json),
            measured_in=f"reused from {measured_json}",
        )
    from megatron_gift_tools.bench.corpus import build_token_corpus
    from megatron_gift_tools.bench.indexed_data import megatron_data_args
    from megatron_gift_tools.demo import PRESETS, launcher_command, run_mode

    p = dict(PRESETS["default"], iters=iters)
    logs = Path(out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    data_args = megatron_data_args(build_token_corpus(vocab_size=p["vocab"]))
    measured = {}
    for _, m in VALIDATION_MODES:
        cmd = launcher_command(p, m, data_args, Path(out) / "index-cache", seed)
        measured[m] = measured_step_seconds(run_mode(m, cmd, logs / f"{m}.log", iters, timeout))
    return dict(predict_validation(p, measured, measure_gloo(), overhead_json), measured_in="measured by this run")


def predict_validation(p: dict, measured: dict, gloo: dict, overhead_json: str) -> dict:
    """Each mode's measured step time next to the model's: compute is calibrated on the FP32 run (its step
    minus the modeled FP32 communication), everything else is predicted (gloo α/β on one 2-rank node, the
    plugin's kernel costs from ``overhead_json``, its waits blocking the host as they do on a CPU)."""
    ring, a2a = gloo["fits"]["ring"], gloo["fits"]["all_to_all"]
    ratio = a2a["bandwidth"] / ring["bandwidth"]
    cpu = Cluster(
        name="cpu-gloo",
        gpus_per_node=2,
        intra_bw=ring["bandwidth"],
        latency_s=ring["alpha_s"],
        a2a_peer_latency=max(0.0, a2a["alpha_s"] - ring["alpha_s"]),
        efficiency=1.0,
        a2a_nic_ratio=ratio,
        a2a_nvlink_ratio=ratio,
    )
    w = Workload(
        name="demo",
        layers=p["layers"],
        hidden=p["hidden"],
        heads=p["heads"],
        ffn=p["ffn"],
        seq=p["seq"],
        micro_batch=p["micro_batch"],
        global_batch=p["global_batch"],
        vocab=p["vocab"],
    )
    costs = KernelCosts.from_json(overhead_json, cpu, "demo")
    opts = Options(gift_layers=LINEAR_KINDS, cpu_waits=True)
    compute = measured["fp32"]
    for _ in range(5):  # fixed point: FP32 step = compute + modeled FP32 communication
        fp32 = step_time(w, cpu, Scheme.FP32, 2, costs, opts, compute_seconds=compute)
        compute = measured["fp32"] - (fp32["step_s"] - fp32["compute_s"])
    rows = []
    for mode, key in VALIDATION_MODES:
        pred = step_time(w, cpu, Scheme(mode), 2, costs, opts, compute_seconds=compute)
        rows.append(
            dict(
                mode=mode,
                measured_s=measured[key],
                predicted_s=pred["step_s"],
                error_pct=100 * (pred["step_s"] / measured[key] - 1),
                prediction=pred,
            )
        )
    return dict(
        preset=p,
        gloo=gloo,
        cluster=asdict(cpu),
        costs=asdict(costs),
        compute_s_calibrated=compute,
        rows=rows,
        note="every mode measured without telemetry (--gift-log-interval 0); compute calibrated on the FP32 "
        "run, so its prediction equals the measurement by construction; the demo's BF16 mode is the "
        "plugin's (all-to-all of BF16), modeled as a 2-byte ring reduce-scatter (the same bytes on 2 ranks); "
        "the plugin modes are the flat exchange with the CPU's host-blocking waits; the reused measurements "
        "predate the stage-stream execution model",
    )
