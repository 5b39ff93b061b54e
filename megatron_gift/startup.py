"""Leaving together after a start-up error: rank 0's message is printed before any rank exits.

Every rank checks the same flags, but only rank 0 prints the error. torchrun stops the other ranks as
soon as one fails, so a rank that exits at once can have rank 0 killed before it prints: the user then
sees ``exitcode: 2`` and no message (issue 37 item 1, once in ~45 start-up failures). Here rank 0
prints, then sets a key in the job's rendezvous store (torch.distributed's default store once
initialised, else the store torchrun's agent keeps at ``MASTER_ADDR:MASTER_PORT``); the other ranks
wait for that key, acknowledge it, and only then exit. Every wait is bounded (``WAIT_S``) and any
store failure falls back to exiting at once: a start-up error never hangs a job.
"""

from __future__ import annotations

import os
from datetime import timedelta

WAIT_S = 60.0  # longest a rank waits for rank 0's message (rank 0 prints within milliseconds)
ACK_S = 10.0  # longest rank 0 waits for the others' acknowledgements before it exits
_KEY = "megatron_gift/startup_error"


def _world() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _store(rank: int):
    """The job's store, or None where there is none to reach (one process, no launcher)."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    if dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    # torchrun's agent hosts a store at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE); other
    # launchers leave it to rank 0's process group, which does not exist yet: rank 0 hosts it then.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(
        addr, int(port), is_master=not agent and rank == 0, timeout=timedelta(seconds=WAIT_S), wait_for_workers=False
    )


def exit_after_rank0(status: int, rank: int) -> None:
    """Raise ``SystemExit(status)`` once rank 0 has printed (call it right after rank 0's print)."""
    world = _world()
    if world > 1:
        try:
            _meet(rank, world)
        except Exception:  # noqa: BLE001 (a store we cannot reach: exit at once, as before)
            pass
    raise SystemExit(status)


def _meet(rank: int, world: int) -> None:
    """Rank 0 marks its message printed and waits (bounded) until the others have seen the mark."""
    import time

    store = _store(rank)
    if store is None:
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    printed, left = f"{_KEY}/{attempt}/printed", f"{_KEY}/{attempt}/left"
    if rank == 0:
        store.set(printed, "1")
        deadline = time.monotonic() + ACK_S
        while store.add(left, 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        store.wait([printed], timedelta(seconds=WAIT_S))
        store.add(left, 1)
