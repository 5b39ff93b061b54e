"""The launcher runs that test_launcher, test_checkpoint and test_faults share (2 gloo ranks through
``torch.distributed.run``, ``--gift-cpu``; each launch costs tens of seconds, so one family serves
all three files): one configuration, 6 iterations, checkpoints every 2 iterations, telemetry every
iteration, on ``testing.indexed_data``'s synthetic corpus.

* ``whole``: GIFT with error feedback and the delta parameter gather, uninterrupted.
* ``killed``: the same, rank 1 SIGKILLed during iteration 3; ``resumed`` restarts it from its
  iteration-2 checkpoint and runs to 6 (its checkpoints must equal ``whole``'s bit for bit).
* ``one_rank``: 1 rank loads ``whole``'s iteration-4 checkpoint (another data-parallel size).
* ``off``: ``--gift-mode off`` (Megatron's own DDP), with ``--gift-*`` flags it never reads (warned);
  ``from_off``: GIFT loading ``off``'s iteration-4 checkpoint (no GIFT state in it).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import psutil

from megatron_gift.megatron import cpu_harness
from megatron_gift.testing.indexed_data import synthetic_data_args
from megatron_gift.testing.launch import ENV, ROOT, launcher_command, run_launcher
from megatron_gift.testing.limits import wall_limit

ITERS, SAVE_EVERY, KILL_IN = 6, 2, 3
FLAGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    str(ITERS),
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--bf16",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    "--split",
    "98,2,0",
    "--save-interval",
    str(SAVE_EVERY),
]
GIFT = [
    "--gift-mode",
    "gift",
    "--gift-rank",
    "8",
    "--gift-sketch",
    "16",
    "--gift-refresh-interval",
    "2",
    "--gift-error-feedback",
    "--gift-log-interval",
    "1",
    "--gift-param-gather",
    "delta",
    "--overlap-param-gather",  # the weights are the reconstructed ones
]
# flags --gift-mode off never reads: each must be warned about once
IGNORED_BY_OFF = ["--gift-layers", "auto", "--gift-error-feedback", "--gift-rank", "8", "--gift-log-interval", "1"]
LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([-+0-9.eE]+|nan|inf)")
KILL_AT = re.compile(rf"iteration\s+{KILL_IN}/")


def _args(tmp: Path, name: str, *args: str) -> list[str]:
    data = synthetic_data_args(tmp / "data")  # written by the first run, read by the others
    return [
        *FLAGS,
        *data,
        "--data-cache-path",
        str(tmp / "index-cache"),
        "--gift-telemetry-dir",
        str(tmp / "telemetry" / name),
        *args,
    ]


def checkpoint_at(src: Path, iteration: int, dst: Path) -> Path:
    """A checkpoint directory holding only ``src``'s iteration ``iteration``."""
    name = f"iter_{iteration:07d}"
    dst.mkdir(parents=True)
    shutil.copytree(src / name, dst / name)
    (dst / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return dst


def _run_and_kill(tmp: Path, *args: str) -> tuple[str, int]:
    """The launcher until it logs iteration ``KILL_IN``, then SIGKILL to one rank: its output and exit status.

    The launcher runs in its own process group, killed whole once it has exited: a helper process a rank
    spawned outlives that rank and holds the output pipe open (a run of the suite hung on it)."""
    cpu_harness.check_host()
    cmd = launcher_command(2, *_args(tmp, "killed", *args))
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, **ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out, killed = [], []

    def read():
        for line in proc.stdout:
            out.append(line)
            if not killed and KILL_AT.search(line):
                ranks = [
                    c
                    for c in psutil.Process(proc.pid).children(recursive=True)
                    if "megatron_gift.pretrain_gpt" in " ".join(c.cmdline())
                ]
                killed.append(max(ranks, key=lambda c: c.pid))
                os.kill(killed[0].pid, signal.SIGKILL)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=wall_limit(900.0))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the run is left: the pipe closes
        reader.join(timeout=60)
    assert killed, "".join(out[-50:])
    return "".join(out), proc.returncode


def run_family(tmp: Path) -> dict:
    """Every run of the module doc: ``{"tmp": tmp, "logs": {name: output}, "killed_rc": int}``."""
    logs = {"whole": run_launcher(2, *_args(tmp, "whole", *GIFT, "--save", str(tmp / "whole")))}
    logs["killed"], killed_rc = _run_and_kill(tmp, *GIFT, "--save", str(tmp / "killed"))
    latest = (tmp / "killed" / "latest_checkpointed_iteration.txt").read_text().strip()
    logs["resumed"] = run_launcher(
        2, *_args(tmp, "resumed", *GIFT, "--load", str(tmp / "killed"), "--save", str(tmp / "killed"))
    )
    logs["one_rank"] = run_launcher(
        1, *_args(tmp, "one_rank", *GIFT, "--load", str(checkpoint_at(tmp / "whole", 4, tmp / "one-rank")))
    )
    logs["off"] = run_launcher(2, *_args(tmp, "off", "--gift-mode", "off", *IGNORED_BY_OFF, "--save", str(tmp / "off")))
    logs["from_off"] = run_launcher(
        2, *_args(tmp, "from_off", *GIFT, "--load", str(checkpoint_at(tmp / "off", 4, tmp / "from-off")))
    )
    for name, log in logs.items():  # for a look after a failure
        (tmp / f"{name}.log").write_text(log)
    return dict(tmp=tmp, logs=logs, killed_rc=killed_rc, killed_latest=latest)


def losses(log: str) -> dict[int, float]:
    """Megatron's logged ``lm loss`` by iteration."""
    return {int(i): float(v) for i, v in LOSS_RE.findall(log)}
