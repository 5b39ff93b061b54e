"""``megatron-gift bench telemetry``: what telemetry and ``--gift-layers auto`` cost per training
step, and that with logging off (or between logging/profiling steps) they cost nothing.

A small Megatron GPTModel trains on 2 gloo ranks (CPU harness) through
GiftDistributedDataParallel (distributed optimizer, overlapped gradient reduction), one model per
configuration (:data:`CONFIGS`), all built up front and stepped round-robin (one step each per
round, the order rotated every round) so that load from other jobs on the machine hits every
configuration alike. A timed step is ``zero_grad_buffer`` (which closes the previous step: its
telemetry record is written there) + forward + backward + ``finish_grad_sync`` + optimizer step,
``time.perf_counter`` after a barrier, the slower rank's time; the first ``warmup`` steps
(which include step 0, a logging/profiling step in every configuration that logs or profiles at all,
and its close) are not timed. ``gift-log-off-again`` repeats the baseline: its ratio to it shows
the resolution of the run (also a bootstrap interval per ratio). Because other jobs' load limits
that resolution to several percent on a shared CPU, the time spent inside the monitor
(``before_reduce``, ``after_reduce``, ``close``: the only telemetry/profiling code in a step) is
also measured per step. Records go through the training loop's :class:`TelemetryWriter` to a
``gift_telemetry.jsonl`` (rank 0); each configuration reports how many records its file holds and
on how many steps the monitor profiled.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_gift.config import GiftConfig, Mode, PolicyConfig
from megatron_gift.telemetry import jsonable

NEVER = 10**9  # an interval no run reaches after step 0
BASELINE = "gift-log-off"

# name -> (GiftConfig keyword arguments, the configuration whose plugin mode it shares, when logging is off)
CONFIGS = {
    "euclidean-log-off": (dict(mode=Mode.EUCLIDEAN), None),
    "gift-log-off": (dict(mode=Mode.GIFT), None),
    "gift-log-off-again": (dict(mode=Mode.GIFT), BASELINE),
    "gift-log-interval-1e6": (dict(mode=Mode.GIFT, log_interval=10**6), BASELINE),
    # the policy starts its candidates in Euclidean mode and needs two profiles to switch
    "auto-no-profile": (
        dict(mode=Mode.GIFT, policy=PolicyConfig(profile_steps=0, profile_interval=NEVER)),
        "euclidean-log-off",
    ),
    "gift-log-every-step": (dict(mode=Mode.GIFT, log_interval=1), BASELINE),
    "auto-profile-every-step": (dict(mode=Mode.GIFT, policy=PolicyConfig(profile_steps=NEVER)), None),
}

PRESETS = {
    "quick": dict(
        steps=4,
        warmup=2,
        seq=32,
        batch=2,
        vocab=256,
        bucket_size=6000,
        model=dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128),
    ),
    "default": dict(
        steps=100,
        warmup=4,
        seq=64,
        batch=2,
        vocab=2048,
        bucket_size=40000,
        model=dict(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=352),
    ),
}


def _rank_main(rank: int, world: int, spec: dict, out_dir: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.telemetry import TELEMETRY_FILE, TelemetryWriter
    from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens

    parallel_state.initialize_model_parallel(1, 1)
    runs = {}
    for name, (kwargs, _) in CONFIGS.items():
        model = build_tiny_gpt(vocab=spec["vocab"], seq=spec["seq"], **spec["model"])
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=spec["bucket_size"]
        )
        ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=GiftConfig.build(**kwargs))
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [ddp])
        path = os.path.join(out_dir, name, TELEMETRY_FILE) if rank == 0 else None
        writer = TelemetryWriter(path)
        ddp.monitor.sink = writer.log
        ddp.monitor.verbose = False  # the policy's decisions show in the modes reported, not on stdout
        spent = [0.0]
        for method in ("before_reduce", "after_reduce", "close"):
            setattr(ddp.monitor, method, _timed(getattr(ddp.monitor, method), spent))
        runs[name] = dict(ddp=ddp, opt=opt, writer=writer, path=path, times=[], monitor=[], spent=spent, profiled=0)

    names = list(CONFIGS)
    for step in range(spec["warmup"] + spec["steps"]):
        tokens = random_tokens(step, rank, batch=spec["batch"], vocab=spec["vocab"], seq=spec["seq"])
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            r = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            before = r["spent"][0]
            r["ddp"].zero_grad_buffer()
            r["opt"].zero_grad()
            lm_loss(r["ddp"], tokens).backward()
            r["ddp"].finish_grad_sync()
            r["opt"].step()
            elapsed = time.perf_counter() - t0
            if step >= spec["warmup"]:
                r["times"].append(elapsed)
                r["monitor"].append(r["spent"][0] - before)
            r["profiled"] += bool(r["ddp"].monitor.summaries)  # this step's profiles, cleared when it closes

    out = {}
    for name, r in runs.items():
        r["ddp"].zero_grad_buffer()  # closes the last step (its record, if it logs)
        r["writer"].close()
        modes = [g.mode.value for g in r["ddp"].gift_params.values()]
        records = None
        if r["path"] is not None:
            records = len(Path(r["path"]).read_text().splitlines()) if os.path.exists(r["path"]) else 0
        out[name] = dict(
            times=r["times"],
            monitor=r["monitor"],
            profiled_steps=r["profiled"],
            records=records,
            modes={m: modes.count(m) for m in sorted(set(modes))},
        )
    parallel_state.destroy_model_parallel()
    return out


def _timed(method, spent: list[float]):
    """``method`` adding its wall time to ``spent[0]``: the monitor's share of a step."""

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    return timed


def _stats(values: list[float]) -> tuple[float, float]:
    """Median and interquartile range."""
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q2, q3 - q1


def _ratio_ci(times: list[float], base: list[float], resamples: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of ``median(times) / median(base)``, resampling rounds (both
    configurations' steps of a round together: they ran under the same load)."""
    rng = random.Random(0)
    n = len(times)
    ratios = []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        ratios.append(statistics.median(times[i] for i in pick) / statistics.median(base[i] for i in pick))
    ratios.sort()
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def run(quick: bool = False, json_path: str | None = None, command: str | None = None) -> dict:
    """Time every configuration, print the table, write JSON; returns the JSON document."""
    from megatron_gift.testing import run_on_ranks

    spec = PRESETS["quick" if quick else "default"]
    t0, load = time.time(), os.getloadavg()[0]
    print(
        f"[bench telemetry] {len(CONFIGS)} configurations x {spec['steps']} timed steps on 2 ranks ...",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory() as out_dir:
        per_rank = run_on_ranks(_rank_main, 2, spec, out_dir, cpu_harness=True, timeout=1800)
    times = {
        name: [max(ts) for ts in zip(*(r[name]["times"] for r in per_rank))] for name in CONFIGS
    }  # the slower rank
    medians = {name: _stats(ts)[0] for name, ts in times.items()}
    monitor = {name: [max(ts) for ts in zip(*(r[name]["monitor"] for r in per_rank))] for name in CONFIGS}
    results = []
    for name, (kwargs, baseline) in CONFIGS.items():
        baseline = baseline or BASELINE
        rank0 = per_rank[0][name]
        results.append(
            dict(
                config=name,
                median_ms=round(1e3 * medians[name], 3),
                iqr_ms=round(1e3 * _stats(times[name])[1], 3),
                ratio_to_logging_off=round(medians[name] / medians[BASELINE], 4),
                baseline=baseline,
                ratio_to_baseline=round(medians[name] / medians[baseline], 4),
                ratio_to_baseline_ci95=[round(x, 4) for x in _ratio_ci(times[name], times[baseline])],
                monitor_median_ms=round(1e3 * _stats(monitor[name])[0], 4),
                monitor_max_ms=round(1e3 * max(monitor[name]), 4),
                steps=len(times[name]),
                records=rank0["records"],
                profiled_steps=rank0["profiled_steps"],
                modes=rank0["modes"],
                gift_config=jsonable(kwargs),
                times_ms=[round(1e3 * t, 2) for t in times[name]],
            )
        )
    doc = dict(
        benchmark="telemetry",
        command=command or "megatron-gift bench telemetry" + (" --quick" if quick else ""),
        machine=dict(
            platform=platform.platform(),
            processor=platform.processor() or platform.machine(),
            cpus=os.cpu_count(),
            torch=torch.__version__,
            threads_per_rank=1,
            load_average_before_after=[load, os.getloadavg()[0]],
        ),
        spec=spec,
        timed_step="barrier, then zero_grad_buffer + optimizer zero_grad + forward + backward + finish_grad_sync + "
        "optimizer step (distributed optimizer, overlap_grad_reduce); per step the slower rank's time; "
        "configurations interleaved round-robin; the first `warmup` steps untimed",
        wall_seconds=round(time.time() - t0, 1),
        results=results,
    )
    print(format_table(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def format_table(rows: list[dict]) -> str:
    head = (
        "| configuration | median ms/step | IQR ms | ÷ gift-log-off | ÷ same-mode baseline [95% CI] "
        "| monitor ms/step (median) | records | profiled steps |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['config']} | {r['median_ms']:.1f} | {r['iqr_ms']:.1f} | {r['ratio_to_logging_off']:.3f} | "
        f"{r['ratio_to_baseline']:.3f} [{r['ratio_to_baseline_ci95'][0]:.3f}, {r['ratio_to_baseline_ci95'][1]:.3f}] "
        f"({r['baseline']}) | {r['monitor_median_ms']:.4f} | {r['records']} | {r['profiled_steps']} |"
        for r in rows
    ]
    return "\n".join([head, *lines])
