"""The CPU launcher as a subprocess: ``python -m torch.distributed.run ... -m megatron_gift.pretrain_gpt --gift-cpu``
on gloo ranks (tests, the demo and the step-time model's CPU validation)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# one intra-op thread per rank (ranks share the cores); no git lookup for the package version
ENV = {"OMP_NUM_THREADS": "1", "NO_VCS_VERSION": "1"}


def launcher_command(ranks: int, *args: str) -> list[str]:
    """``megatron_gift.pretrain_gpt --gift-cpu`` on ``ranks`` local gloo ranks with Megatron / ``--gift-*`` ``args``."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
        "-m", "megatron_gift.pretrain_gpt", "--gift-cpu", *args,
    ]  # fmt: skip


def run_launcher(ranks: int, *args: str, timeout: float) -> str:
    """Run :func:`launcher_command` to the end; its output (stdout + stderr), or ``RuntimeError`` with its tail."""
    res = subprocess.run(
        launcher_command(ranks, *args), cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    out = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"launcher failed ({res.returncode}):\n{out[-6000:]}")
    return out
