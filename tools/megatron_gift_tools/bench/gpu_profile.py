"""GPU check, where the time goes: one steady training step per mode under ``torch.profiler``, reported as
the plugin's ranges (``RANGES``: the statistics hooks, the reduction's stages, the step's close), the top
device kernels by total time and the top host operators by self time, so that a plugin cost seen in
``gpu_step`` (a mode's step over ``off``'s) can be split into kernels, launches and host work.

Same model, optimizer and loopback codec as ``gpu_step`` (its ``_build``/``_step``), at the Llama-600M widths
but ``--layers`` layers (default 4) and ``--microbatches`` micro-batches (default 8), to fit a short device call.
Writes ``gpu-profile.json`` (``--out``) and prints the tables::

    python -m megatron_gift_tools.bench.gpu_profile --out DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time
from pathlib import Path

import torch

from megatron_gift_tools.bench import gpu_step
from megatron_gift_tools.bench.gpu_check import machine

MODES = ("off", "euclidean", "gift")
TOP = 25
# the plugin's host entry points, each timed as a profiler range (host time, and device time of the kernels it launches)
RANGES = {
    "gift/statistics": ("megatron_gift.numerics.kfac", "KFACStatistics", "accumulate"),  # forward hooks, per layer
    "gift/stage": ("megatron_gift.comm.schedule", "ReductionQueue", "_enqueue"),  # one stage of one bucket
    "gift/step-close": ("megatron_gift.megatron.ddp", "GiftDistributedDataParallel", "_close_step"),  # folds
}


@contextlib.contextmanager
def ranges():
    """Wrap each of ``RANGES`` in ``torch.profiler.record_function`` for the duration (tools only: the runtime
    has no profiler marks)."""
    import importlib

    saved = []
    for name, (module, cls, attr) in RANGES.items():
        owner = getattr(importlib.import_module(module), cls)
        fn = getattr(owner, attr)

        def marked(*args, _fn=fn, _name=name, **kwargs):
            with torch.profiler.record_function(_name):
                return _fn(*args, **kwargs)

        saved.append((owner, attr, fn))
        setattr(owner, attr, functools.wraps(fn)(marked))
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def _device_us(e) -> float:
    return getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)


def _table(events, key: str, n: int) -> list[dict]:
    rows = sorted(events, key=(_device_us if key == "device" else lambda e: e.self_cpu_time_total), reverse=True)[:n]
    return [
        dict(
            name=e.key[:120],
            count=e.count,
            device_us=round(_device_us(e), 1),
            host_self_us=round(e.self_cpu_time_total, 1),
        )
        for e in rows
    ]


def profile_mode(mode: str, spec: dict, device: torch.device) -> dict:
    """Warm up, step past refreshes, then profile one steady step; host time of that step and the tables."""
    from torch.profiler import ProfilerActivity, profile

    ddp, opt = gpu_step._build(mode, spec)
    batches_of = gpu_step.batches_for(spec, device)
    # two steady steps: timed, then profiled
    step = gpu_step.steady_from(gpu_step.refresh_schedule(ddp), spec["warmup"], count=2)
    for earlier in range(step):
        gpu_step._step(ddp, opt, batches_of(earlier))
    gpu_step._sync(device)
    t0 = time.perf_counter()
    gpu_step._step(ddp, opt, batches_of(step))
    gpu_step._sync(device)
    unprofiled = time.perf_counter() - t0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with ranges(), profile(activities=activities) as prof:
        gpu_step._step(ddp, opt, batches_of(step + 1))
        gpu_step._sync(device)
    events = prof.key_averages()
    marks = {
        e.key: dict(
            count=e.count,
            host_us=round(e.cpu_time_total, 1),
            device_us=round(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0), 1),
        )
        for e in events
        if e.key in RANGES
    }
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e for e in events if e.device_type == cuda or (_device_us(e) > 0 and e.self_cpu_time_total == 0)]
    del ddp, opt
    return dict(
        mode=mode,
        step_s=unprofiled,
        device_kernels=sum(e.count for e in kernels),
        device_us=round(sum(_device_us(e) for e in kernels), 1),
        host_self_us=round(sum(e.self_cpu_time_total for e in events), 1),
        ranges=marks,
        top_device=_table(kernels, "device", TOP),
        top_host=_table(events, "host", TOP),
    )


def format_tables(doc: dict) -> str:
    lines = []
    for r in doc["results"]:
        lines.append(
            f"\n## {r['mode']}: step {r['step_s'] * 1e3:.1f} ms, {r['device_kernels']} kernels, "
            f"device {r['device_us'] / 1e3:.1f} ms, host self {r['host_self_us'] / 1e3:.1f} ms"
        )
        for name, m in r["ranges"].items():
            lines.append(
                f"{name}: {m['count']} calls, host {m['host_us'] / 1e3:.2f} ms, device {m['device_us'] / 1e3:.2f} ms"
            )
        for title, rows, col in (("device", r["top_device"], "device_us"), ("host", r["top_host"], "host_self_us")):
            lines.append(f"| top {title} | count | ms |")
            lines.append("|---|---|---|")
            lines += [f"| {x['name']} | {x['count']} | {x[col] / 1e3:.2f} |" for x in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (gloo, CPU harness)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=gpu_step.MODES)
    args = parser.parse_args(argv)
    kind = "dry-run" if args.dry_run else "gpu"
    device = torch.device("cpu" if args.dry_run else "cuda")
    spec = dict(gpu_step.SPECS[kind])
    if not args.dry_run:
        spec.update(layers=args.layers, microbatches=args.microbatches)
    results = []
    with gpu_step.one_rank_group(device):
        for mode in args.modes:
            results.append(profile_mode(mode, spec, device))
    doc = dict(benchmark="gpu-profile", kind=kind, spec=spec, machine=machine(device), results=results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-profile.json").write_text(json.dumps(doc, indent=1))
    print(format_tables(doc), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
