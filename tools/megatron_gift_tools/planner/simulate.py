"""The schedules: when each task of the bucket chains runs next to the model's compute.

Compute is a sequence of chunks (the backward or forward of each bucket's parameters). Every task
runs after the previous task of its chain and of its stream (a CUDA stream or a communicator's
NCCL stream: first in, first out) and when its resources are free; links carry one collective at
a time, in the order the host enqueued them (the chains' order): a later collective never takes a
link ahead of an earlier one that is not ready yet, so that every start is a max-plus function of
the costs and no cost that rises shortens a step.

- ``eager`` (``simulate``): separate hardware queues. A chain is enqueued at its release (a
  bucket's backward hook: the end of its chunk) and each task starts as soon as it can. GPU tasks
  share the GPU with compute: while one runs, compute advances at ``overlap`` of its rate (0: the
  GPU time-shared); among ready GPU tasks the earliest ready runs first.
- ``lagged`` (``simulate_lagged``): one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``). Items
  start in the order the host submitted them, each no earlier than the one before it: at bucket
  k's hook the host submits bucket k's first stage, then the next stage of every earlier bucket
  with stages left; ``finish_grad_sync`` submits the rest, stage by stage. A GPU stage that waits
  on an unfinished collective holds up everything behind it, compute included; a collective,
  once started, does not. With ``blocking`` (the CPU, where ``Work.wait()`` blocks the host) each
  chain is submitted whole at its hook and every collective holds the queue until it ends.
"""

from __future__ import annotations

import math
from collections import defaultdict

from megatron_gift_tools.planner.tasks import Kind, Task

EPS = 1e-15


def _flatten(chains: list[list[Task]]) -> tuple[list[Task], list[int], list[int], list[int], list[list[int]]]:
    """Tasks in enqueue order with their chain index, chain predecessor, stream predecessor (-1: none) and
    link predecessors (the previous task on each of its links; the GPU is shared, not queued)."""
    tasks, chain_of, pred, stream_pred, link_pred, last = [], [], [], [], [], {}
    for k, chain in enumerate(chains):
        for j, task in enumerate(chain):
            i = len(tasks)
            tasks.append(task)
            chain_of.append(k)
            pred.append(i - 1 if j else -1)
            links = [r for r in task.resources if r != "gpu"]
            link_pred.append([last[r] for r in links if r in last])
            stream_pred.append(last.get(("stream", task.stream), -1))
            last.update({("stream", task.stream): i, **dict.fromkeys(links, i)})
    return tasks, chain_of, pred, stream_pred, link_pred


def simulate(
    chunks: list[float], chains: list[list[Task]], release: list[int | None], waits: list[int | None], overlap: float
) -> tuple[float, float]:
    """Eager: ``release[k]``: chain k starts after compute chunk ``release[k]`` (None: at 0); ``waits[i]``: chunk i
    starts after chain ``waits[i]`` has ended (None: no wait). Returns (compute end, end of everything)."""
    tasks, chain_of, pred, stream_pred, link_pred = _flatten(chains)
    start, end = [math.nan] * len(tasks), [math.nan] * len(tasks)
    chunk_end = [math.nan] * len(chunks)
    last_of = {k: i for i, k in enumerate(chain_of)}  # each chain's last task
    busy: dict[str, int] = {}
    t, ci, rem = 0.0, 0, chunks[0] if chunks else 0.0

    def done(i: int) -> bool:
        return i < 0 or end[i] <= t + EPS

    def ready_at(i: int) -> float | None:
        k = release[chain_of[i]]
        if not (done(pred[i]) and done(stream_pred[i]) and (k is None or chunk_end[k] <= t + EPS)):
            return None
        if any(math.isnan(start[j]) for j in link_pred[i]):  # an earlier collective on its links goes first
            return None
        return max([0.0 if k is None else chunk_end[k]] + [end[j] for j in (pred[i], stream_pred[i]) if j >= 0])

    heads = {k: chain_of.index(k) for k in last_of}  # each chain's first unstarted task (a chain runs in order)
    while True:
        started = True
        while started:  # a task of zero length ends at once and may let others start at the same time
            started = False
            ready = sorted((r, i) for i in heads.values() if (r := ready_at(i)) is not None)
            for _, i in ready:
                if not any(r in busy for r in tasks[i].resources):
                    start[i], end[i], started = t, t + tasks[i].seconds, True
                    busy.update(dict.fromkeys(tasks[i].resources, i))
                    if i < last_of[chain_of[i]]:
                        heads[chain_of[i]] = i + 1
                    else:
                        del heads[chain_of[i]]
            busy = {r: i for r, i in busy.items() if end[i] > t + EPS}
        w = waits[ci] if ci < len(chunks) else None
        computing = ci < len(chunks) and (w is None or w not in last_of or done(last_of[w]))
        rate = overlap if "gpu" in busy else 1.0
        t_chunk = t + rem / rate if computing and rate > 0 else math.inf
        t_next = min([e for e in end if e > t + EPS] + [t_chunk])
        if t_next == math.inf:
            break
        if computing:
            rem = max(0.0, rem - (t_next - t) * rate)
        t = t_next
        busy = {r: i for r, i in busy.items() if end[i] > t + EPS}
        if computing and (rem <= EPS or t + rem == t):  # the rest below the clock's resolution at t: done
            chunk_end[ci], ci = t, ci + 1
            rem = chunks[ci] if ci < len(chunks) else 0.0
    if any(math.isnan(s) for s in start) or ci < len(chunks):
        raise RuntimeError(
            "schedule deadlock: a task or chunk never started"
        )  # a bug in the chains, not a model result
    compute_end = chunk_end[-1] if chunks else 0.0
    return compute_end, max([compute_end] + end)


def _lagged_order(n_chunks: int, chains: list[list[Task]], blocking: bool) -> list[tuple]:
    """Submission order: ``("chunk", k)`` and ``("stage", k, s)`` (chain k's tasks of stage s)."""
    stages = [sorted({t.stage for t in chain}) for chain in chains]
    sent = [0] * len(chains)
    order: list[tuple] = []
    for k in range(n_chunks):
        order.append(("chunk", k))
        if k >= len(chains):
            continue
        hooks = [k] + [j for j in range(k) if not blocking]  # bucket k's first stage, then one more of the others
        for j in hooks:
            take = len(stages[j]) - sent[j] if blocking else min(1, len(stages[j]) - sent[j])
            order += [("stage", j, s) for s in stages[j][sent[j] : sent[j] + take]]
            sent[j] += take
    depth = max((len(s) for s in stages), default=0)
    for level in range(depth):  # finish_grad_sync: the rest, stage by stage
        for j in range(len(chains)):
            if sent[j] <= level < len(stages[j]):
                order.append(("stage", j, stages[j][level]))
                sent[j] = level + 1
    return order


def simulate_lagged(chunks: list[float], chains: list[list[Task]], blocking: bool = False) -> tuple[float, float]:
    """Lagged (or, with ``blocking``, the CPU's host waits): chain k belongs to chunk k's hook. Returns
    (compute end, end of everything)."""
    prev = gpu_free = 0.0
    free: dict[str, float] = defaultdict(float)
    stream_end: dict[str, float] = defaultdict(float)
    chain_end = [0.0] * len(chains)
    compute_end = 0.0
    for item in _lagged_order(len(chunks), chains, blocking):
        if item[0] == "chunk":  # many kernels: the next item is dispatched as the chunk's last one ends
            prev = gpu_free = compute_end = max(prev, gpu_free) + chunks[item[1]]
            continue
        _, k, s = item
        for task in (t for t in chains[k] if t.stage == s):
            ready = max(prev, chain_end[k], stream_end[task.stream])
            if task.kind is Kind.GPU:
                prev = begin = max(ready, gpu_free)
                gpu_free = begin + task.seconds
            else:
                prev = ready
                begin = max([ready] + [free[r] for r in task.resources])
                free.update(dict.fromkeys(task.resources, begin + task.seconds))
            chain_end[k] = stream_end[task.stream] = begin + task.seconds
            if blocking:
                prev = chain_end[k]
    return compute_end, max([compute_end, gpu_free] + chain_end)
