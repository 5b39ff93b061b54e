"""Run a function on N local CPU processes joined by a gloo process group (multi-rank tests).

Process start-up dominates (``import megatron.core`` takes seconds of CPU), so on a machine without
CUDA the ranks are forked from one server process that has imported torch and Megatron-Core once
(multiprocessing's forkserver, preloaded); with CUDA they are spawned (a fork after the driver is
initialised is unsafe). Each rank still starts from a fresh copy of that server, with the caller's
environment, working directory and ``sys.path``, and imports everything else itself. Put many
checks into one :func:`run_on_ranks` call rather than one call per check all the same.
"""

import contextlib
import datetime
import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from megatron_gift.megatron import cpu_harness as _cpu_harness
from megatron_gift.testing import kernel_log
from megatron_gift.testing.limits import TIMEOUT_SCALE_ENV, wall_limit

_GRACE_S = 3.0  # after a failure, how long to wait for the other ranks' reports
_DUMP_S = 3.0  # how long a hung rank gets to write its threads' stacks
# How long the ranks get to start and join the group, before ``timeout`` starts counting: a fork
# server started afresh imports torch and Megatron-Core first (5 s idle, 14 s beside two busy cores).
_START_S = 120.0
# What the fork server imports once. Triton (which Megatron-Core imports) makes each @jit function
# interpreted or compiled by TRITON_INTERPRET when it is defined: a rank whose value differs from
# the server's is spawned.
_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.distributed", "megatron.core.optimizer"]
_SERVER_ENV = {"OMP_NUM_THREADS": "1", "NO_VCS_VERSION": "1"}  # read by libraries when they load
_INTERPRET = os.environ.get("TRITON_INTERPRET")  # the fork server's: this process's at import


class RankError(RuntimeError):
    """A rank raised, crashed or hung; the message names the rank and carries its traceback."""


def run_on_ranks(fn, world_size, *args, timeout=180.0, cpu_harness=False, backend="gloo", **kwargs):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned processes.

    Each process joins a ``backend`` process group (``torch.distributed`` default group; gloo,
    or nccl with rank ``r`` on CUDA device ``r``) through a store this process hosts, with
    ``OMP_NUM_THREADS=1`` and ``NO_VCS_VERSION=1``; with ``cpu_harness=True`` it also calls
    :func:`cpu_harness.install` first. ``fn`` must be a
    module-level (picklable) function and its return value picklable (tensors are fine).

    Returns the per-rank return values in rank order. Raises :class:`RankError` when a rank
    raises or dies (naming each failed rank with its traceback, the earliest failure first,
    after at most a few seconds' wait for the peers' reports) or when ``wall_limit(timeout)``
    seconds pass after every rank joined the group (starting has its own limit, so a hang is
    caught where ``fn`` waits, whatever the machine's load); the remaining processes are killed.
    """
    timeout = wall_limit(timeout)
    if cpu_harness:
        _cpu_harness.check_host()
    ctx = _context()
    results = ctx.Queue()
    # This process hosts the ranks' store, as torchrun's agent does, on a port the system gives it while
    # it listens: a port chosen free and bound later by rank 0 can be taken meanwhile (or, while nothing
    # listens on it yet, a rank's retried connect can land on its own source port and hang).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {
        **os.environ,
        **_SERVER_ENV,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "WORLD_SIZE": str(world_size),
    }
    # Unpickled by the rank after its environment is set (the test module's imports read it).
    fn_bytes = pickle.dumps(fn)
    procs = []
    dumps = tempfile.TemporaryDirectory(prefix="ranks-")
    try:
        for rank in range(world_size):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            proc = ctx.Process(
                target=_child,
                name=f"rank{rank}",
                daemon=True,
                args=(
                    fn_bytes,
                    rank,
                    world_size,
                    args,
                    kwargs,
                    rank_env,
                    cpu_harness,
                    backend,
                    # the group's own timeout outlasts both limits, so a hang is this process's to report
                    # (with the ranks' stacks), not a collective's timeout in one rank
                    timeout + wall_limit(_START_S),
                    results,
                    dumps.name,
                ),
            )
            # A spawned interpreter reads the environment when it starts.
            with _environ(rank_env):
                proc.start()
            procs.append(proc)
        values = _collect(procs, results, timeout, dumps.name)
        for rank in range(world_size):  # what interpreted ranks launched, for tests/conftest.py's check
            kernel_log.SPAWNED.update(kernel_log.load_specs(os.path.join(dumps.name, f"specs{rank}.json")))
        return values
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        dumps.cleanup()
        del store


def _collect(procs, results, timeout, dump_dir):
    """Wait for each rank's two messages (joined, then its result); after the first failure, wait
    briefly for the others.

    ``timeout`` counts from when the last rank joined the group; until then the start limit
    applies. A failing rank usually makes its peers fail too (their collectives lose the
    connection), so failures are reported in the order they happened: the first one is the cause.
    Ranks that never report are asked for their threads' Python stacks (SIGUSR1), which go into
    the error.
    """
    start_limit = wall_limit(_START_S)
    deadline = time.monotonic() + start_limit
    joined, values, failures = set(), {}, {}  # ranks; rank -> result; rank -> (wall time, description)
    while len(values) + len(failures) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if rank not in values and rank not in failures and proc.exitcode not in (None, 0):
                    failures[rank] = (time.time(), f"died with exit code {proc.exitcode}")
        else:
            if ok is None:  # joined the group: once all have, the run's own limit starts
                joined.add(rank)
                if len(joined) == len(procs) and not failures:
                    deadline = time.monotonic() + timeout
            elif ok:
                values[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
        if failures:
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    silent = [rank for rank in range(len(procs)) if rank not in values and rank not in failures]
    stacks = _stacks(procs, silent, dump_dir)
    if failures:
        ordered = sorted(failures.items(), key=lambda item: item[1][0])
        raise RankError(
            "\n".join(f"rank {rank} of {len(procs)} failed:\n{text}" for rank, (_, text) in ordered) + stacks
        )
    if silent:
        waiting = sorted(set(range(len(procs))) - joined)
        what = (
            f"did not finish within {timeout:.0f} s of joining the group"
            if not waiting
            else f"did not finish: ranks {waiting} had not joined the group within {start_limit:.0f} s"
        )
        raise RankError(
            f"ranks {silent} {what}; killed "
            f"(on a slow machine, raise the limit with {TIMEOUT_SCALE_ENV}=<factor>)" + stacks
        )
    return [values[rank] for rank in range(len(procs))]


def _stacks(procs, ranks, dump_dir):
    """The Python stacks of every thread of the live ``ranks``, as text (empty when there are none)."""
    alive = [rank for rank in ranks if procs[rank].is_alive()]
    for rank in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[rank].pid, signal.SIGUSR1)
    deadline = time.monotonic() + _DUMP_S
    text = {}
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        last = dict(text)
        for rank in alive:
            with contextlib.suppress(OSError):
                with open(os.path.join(dump_dir, f"rank{rank}.txt")) as dump:
                    text[rank] = dump.read()
        if all(text.get(rank) for rank in alive) and text == last:  # written, and no longer growing
            break
    return "".join(f"\nrank {rank}'s threads when it was stopped:\n{text.get(rank) or '(no dump)'}" for rank in alive)


def _context():
    """The fork server, started once with torch and Megatron-Core imported, where there is no CUDA
    and Triton's mode is the server's; otherwise plain spawning."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != _INTERPRET:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    with _environ(_SERVER_ENV):
        multiprocessing.forkserver.ensure_running()  # inherits this environment, once
    return ctx


def _child(fn_bytes, rank, world_size, args, kwargs, env, cpu_harness, backend, timeout, results, dump_dir):
    """Process body: take the caller's environment, join the group, run ``fn``, report
    ``(rank, ok, payload)``, leave the group. SIGUSR1 writes every thread's stack to
    ``dump_dir/rank<r>.txt`` (how a hung rank is diagnosed).

    The report goes out before the group is destroyed, so a failing rank's report (and its
    time stamp) comes before the failures it causes in its peers.
    """
    dump = open(os.path.join(dump_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    try:
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(1)
        fn = pickle.loads(fn_bytes)
        if cpu_harness:
            _cpu_harness.install()
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        results.put((rank, None, None))  # joined: the caller's clock for ``fn`` starts once all have
        interpreted = env.get("TRITON_INTERPRET") == "1"
        with kernel_log.launched_specialisations() if interpreted else contextlib.nullcontext() as seen:
            value = fn(rank, world_size, *args, **kwargs)
        if interpreted:
            kernel_log.save_specs(os.path.join(dump_dir, f"specs{rank}.json"), seen)
        # Plain pickle copies tensors by value; the default multiprocessing reducers would
        # hand over shared memory that disappears when this process exits.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, (time.time(), traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _environ(updates):
    """Set environment variables for the duration of the block, then restore them."""
    old = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
