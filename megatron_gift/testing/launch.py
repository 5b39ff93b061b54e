"""The CPU launcher as a subprocess: ``python -m torch.distributed.run ... -m megatron_gift.pretrain_gpt --gift-cpu``
on gloo ranks (tests, the demo and the step-time model's CPU validation)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_gift.megatron import cpu_harness
from megatron_gift.testing.limits import TIMEOUT_SCALE_ENV, wall_limit

ROOT = Path(__file__).resolve().parents[2]
# one intra-op thread per rank (ranks share the cores); no git lookup for the package version
ENV = {"OMP_NUM_THREADS": "1", "NO_VCS_VERSION": "1"}


def launcher_command(ranks: int, *args: str) -> list[str]:
    """``megatron_gift.pretrain_gpt --gift-cpu`` on ``ranks`` local gloo ranks with Megatron / ``--gift-*`` ``args``
    (through ``testing.sync_probe`` where its directory variable is set)."""
    from megatron_gift.testing import sync_probe

    module = "megatron_gift.testing.sync_probe" if os.environ.get(sync_probe.ENV) else "megatron_gift.pretrain_gpt"
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "-m",
        module,
        "--gift-cpu",
        *args,
    ]


def run_launcher(ranks: int, *args: str, timeout: float = 900.0) -> str:
    """Run :func:`launcher_command` to the end within ``wall_limit(timeout)`` seconds; its output
    (stdout + stderr), or ``RuntimeError`` with its tail (at once where CUDA is available: the CPU
    launcher refuses it). The time taken goes to stderr."""
    cpu_harness.check_host()
    limit, t0 = wall_limit(timeout), time.monotonic()
    try:
        res = subprocess.run(
            launcher_command(ranks, *args),
            cwd=ROOT,
            env={**os.environ, **ENV},
            capture_output=True,
            text=True,
            timeout=limit,
        )
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"") + (e.stderr or b"")).decode(errors="replace")[-6000:]
        raise RuntimeError(
            f"launcher ({ranks} ranks) killed after {limit:.0f} s; on a slow machine raise the "
            f"limit with {TIMEOUT_SCALE_ENV}=<factor>:\n{tail}"
        ) from None
    elapsed = time.monotonic() - t0
    print(f"launcher: {ranks} ranks finished in {elapsed:.1f} s (limit {limit:.0f} s)", file=sys.stderr)
    out = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"launcher failed ({res.returncode}) after {elapsed:.1f} s:\n{out[-6000:]}")
    return out
