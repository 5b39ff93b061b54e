"""The measuring half of ``bench/gpu_check.sh``: names the machine, then times the plugin on it and
writes one JSON per part to ``--out`` (docs/gpu-check.md says what each holds):

- ``overhead-gpu.json``: ``bench overhead`` at the Llama-600M layer shapes with each layer's
  forward+backward in BF16, the schema ``megatron-gift model --overhead-json`` reads;
- ``gpu-codec.json``: encode, decode+sum (8 peers), fused whiten+encode and decode+sum+unwhiten
  as bytes per second against copies of the same run (``gpu_codec``);
- ``gpu-codec.json`` also holds the delta parameter gather's codec against copy where it is installed;
- ``gpu-step.json``: a single-GPU Megatron GPTModel training step per mode, codec in loopback,
  against ``--gift-mode off``, with peak memory; per mode a steady step's host synchronisations, its
  peak memory, a profiler trace's codec/backward overlap and a step under
  ``set_sync_debug_mode("error")`` (``gpu_step``, ``gpu_trace``);
- ``gpu-check.json``: the machine, the kernel tests' counts (``--kernel-tests``: their JUnit XML),
  every part's wall time or error, and the targets.

``--dry-run`` runs the same code on the CPU at tiny shapes (CI keeps the script from rotting).
Every part runs even when one fails; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from megatron_gift_tools.bench import gpu_codec, gpu_step, overhead
from megatron_gift_tools.planner.workloads import PRESETS

DRY_RUN_MODEL = {k: gpu_step.SPECS["dry-run"][k] for k in ("layers", "hidden", "heads", "ffn", "seq", "micro_batch")}
SENDER_MODEL = {"gpu": PRESETS["8b"]}  # gpu_codec's sender paths at the 8B's shapes (the dry run: its own model's)
FILES = {"overhead": "overhead-gpu.json", "codec": "gpu-codec.json", "step": "gpu-step.json", "check": "gpu-check.json"}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    """The NVIDIA driver's version from ``nvidia-smi`` (None where it does not answer)."""
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else None


def machine(device: torch.device) -> dict:
    """GPU, driver, CUDA, torch, triton and megatron-core versions, host and Python."""
    info = dict(
        device=str(device),
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpus=os.cpu_count(),
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=_version("triton"),
        megatron_core=_version("megatron-core"),
        gpu=None,
        driver=None,
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            driver=_driver(),
            gpu_memory_bytes=props.total_memory,
            multiprocessors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
        )
    return info


def kernel_tests(path: str | None) -> dict | None:
    """Counts from the kernel tests' JUnit XML: tests, failures, errors, skipped (None without a file)."""
    if not path or not os.path.exists(path):
        return None
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def _overhead(model_name: str, model: dict, device: torch.device, mach: dict) -> dict:
    doc = overhead.run(
        models={model_name: model},
        device=str(device),
        layer_dtype=torch.bfloat16,
        command="bench/gpu_check.sh (megatron_gift_tools.bench.gpu_check)",
    )
    doc["machine"].update(mach)
    return doc


def plugin_over_linear_gemms(ovh: dict | None, step: dict | None) -> dict | None:
    """The plugin's per-step work (``gpu-step``) over the BF16 fwd+bwd matmuls of the step's linear
    layers alone (``overhead``'s ``layer_fwd_bwd`` per token x layers x tokens per step): a stricter
    yardstick than the whole step, whose unfused local-spec attention a TE/flash-attention run would not pay."""
    if ovh is None or step is None:
        return None
    layers = next(iter(ovh["config"]["models"].values()))["layers"]
    gemm_s = (
        layers * step["summary"]["tokens_per_step"] * sum(s["layer_fwd_bwd_s"] / s["tokens"] for s in ovh["summary"])
    )
    modes = {m: r["plugin_s"] / gemm_s for m, r in step["summary"]["modes"].items() if not m.startswith("off")}
    return dict(linear_gemms_s=gemm_s, plugin_over_linear_gemms=modes)


def delta_over_copy(delta: dict) -> dict:
    """The delta codec's encode and decode bandwidth over the same-size copy's (no target), or why not."""
    if not delta["available"]:
        return dict(available=False, note=delta["note"])
    return dict(available=True, over_copy={s["path"]: s["over_copy"] for s in delta["summary"]})


def _part(name: str, fn, out: Path, mach: dict, kind: str, status: dict) -> dict | None:
    """Run one part, write its JSON (with the machine named), record its wall time or its error."""
    print(f"== gpu_check: {name} ({kind})", flush=True)
    t0 = time.time()
    try:
        doc = fn()
    except Exception:  # every part runs; the failure is reported in gpu-check.json and the exit status
        status[name] = dict(error=traceback.format_exc(), seconds=round(time.time() - t0, 1))
        print(status[name]["error"], file=sys.stderr, flush=True)
        return None
    doc.setdefault("benchmark", f"gpu-check-{name}")
    doc.setdefault("machine", mach)
    doc["kind"] = kind
    (out / FILES[name]).write_text(json.dumps(doc, indent=1))
    status[name] = dict(file=FILES[name], seconds=round(time.time() - t0, 1))
    return doc


def run(out: Path, dry_run: bool, kernel_xml: str | None = None) -> int:
    """All parts; returns the exit status (0: every part ran)."""
    kind = "dry-run" if dry_run else "gpu"
    device = torch.device("cpu" if dry_run else "cuda")
    out.mkdir(parents=True, exist_ok=True)
    mach = machine(device)
    model_name, model = ("tiny", DRY_RUN_MODEL) if dry_run else ("llama-600m", overhead.MODELS["llama-600m"])
    status: dict = {}
    t0 = time.time()
    ovh = _part("overhead", lambda: _overhead(model_name, model, device, mach), out, mach, kind, status)
    codec = _part(
        "codec",
        lambda: gpu_codec.run(model, device, gpu_codec.LARGE_COPY_BYTES[kind], SENDER_MODEL.get(kind, model)),
        out,
        mach,
        kind,
        status,
    )
    step = _part("step", lambda: gpu_step.run(gpu_step.SPECS[kind], device), out, mach, kind, status)
    for doc, fmt in ((codec, gpu_codec.format_table), (step, gpu_step.format_table)):
        if doc is not None:
            print(fmt(doc), flush=True)
    summary = dict(
        benchmark="gpu-check",
        kind=kind,
        machine=mach,
        wall_seconds=round(time.time() - t0, 1),
        parts=status,
        kernel_tests=kernel_tests(kernel_xml),
        targets=dict(
            overhead=ovh and ovh["targets"],
            codec=codec and codec["targets"],
            step=step and step["targets"],
            strict=plugin_over_linear_gemms(ovh, step),
            delta_codec=codec and delta_over_copy(codec["delta"]),
            codec_overlap=step
            and {m: r["codec_overlap_share"] for m, r in step["summary"]["modes"].items() if not m.startswith("off")},
        ),
    )
    (out / FILES["check"]).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary["targets"], indent=1), flush=True)
    return 1 if any("error" in s for s in status.values()) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_gift_tools.bench.gpu_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="folder for the JSON files")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (gloo, CPU harness)")
    parser.add_argument(
        "--kernel-tests", metavar="XML", help="JUnit XML of the kernel tests, counted in gpu-check.json"
    )
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is false); use --dry-run", file=sys.stderr)
        return 2
    return run(args.out, args.dry_run, args.kernel_tests)


if __name__ == "__main__":
    sys.exit(main())
