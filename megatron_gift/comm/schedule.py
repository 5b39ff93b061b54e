"""The one protocol every quantized reduction runs through: stages enqueued on side streams.

A reduction is a list of *stages*. A stage enqueues device work and launches its collectives
asynchronously; the next stage starts with a device-side wait for them (``Work.wait()`` on the
stage's stream; with gloo on a CPU it blocks the host, and the same code runs). Stage ``s`` runs on
stream ``s`` of the DDP's ``StageStreams``, which first waits (an event, on the device) for stage
``s-1``'s stream, so the stages of consecutive buckets pipeline: bucket k+1's encode runs while
bucket k's all-to-all is in flight. Stage 0's stream first waits for the compute stream (the
bucket's gradients are ready).

``ReductionQueue`` decides *when* each stage is enqueued, in an order that depends only on the
order of ``start`` / ``wait`` calls (the same on every rank: Megatron's bucket order), never on
timing, so every rank issues its collectives on every communicator in the same order (NCCL's rule
for concurrent communicators):

* ``eager``: all of a reduction's stages at ``start`` (the bucket's backward hook);
* ``lagged``: stage 0 at ``start``, then one further stage of each earlier reduction, in start
  order; whatever remains at ``wait``. For ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware queue:
  a kernel waiting on a collective would hold up every later kernel of every stream) and CPUs
  (gloo's waits block the host: this way the backward runs while buckets are in flight).

``wait`` enqueues what is left up to that reduction and makes the current stream wait for its
last stage; no host synchronisation anywhere. A tensor a stage hands to a later stage is recorded
on that stage's stream, so the caching allocator does not reuse it early; reductions drop their
buffers as soon as their last stage is enqueued (temporaries live as long as the device needs them).

Every tensor a stage gives to a collective must be in its ``handoff`` (a view of one suffices:
``record_stream`` acts on the whole block): since PyTorch 2.7 ProcessGroupNCCL keeps a collective's
tensors only until ``work.wait()``, which runs on the *next* stage's stream, so a tensor allocated
on this stage's stream and held by nothing else goes back to that stream's pool while NCCL may
still read it. More generally, every tensor a stage creates and a later stage reads must be in the
handoff of every stage in between (it is recorded on each of their streams): the tests' lifetime
check (``testing.dispatch.Lifetimes``, a queue's ``watch``) asserts both, on a CPU too.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from dataclasses import dataclass, field

import torch

from ..config import Schedule

# the most stages a reduction has (the two-level all-reduce with the output side, comm.output_side):
# per-stage flags' length
MAX_STAGES = 6


def default_schedule(device: torch.device) -> Schedule:
    """``lagged`` on CPUs and where ``CUDA_DEVICE_MAX_CONNECTIONS=1``, else ``eager`` (module doc)."""
    if torch.device(device).type != "cuda" or os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return Schedule.LAGGED
    return Schedule.EAGER


@dataclass
class StageResult:
    """What a stage leaves for the next: collectives to wait for, tensors it hands over."""

    works: list = field(default_factory=list)
    handoff: list = field(default_factory=list)


class Reduction:
    """Base of a reduction run by ``ReductionQueue``: ``stages()`` lists callables returning a ``StageResult``.

    ``stage``: the index of the stage running now (set by the queue before it calls the stage), which
    is also the index of the stream it runs on."""

    stage = 0

    def stages(self) -> list:
        raise NotImplementedError


class Wrapping(Reduction):
    """A reduction that extends ``inner``'s stages with its own (``comm.instances``, ``comm.output_side``):
    ``stage`` is the inner's, whose stages set their own stage's flags."""

    inner: Reduction

    @property
    def stage(self) -> int:
        return self.inner.stage

    @stage.setter
    def stage(self, s: int) -> None:
        self.inner.stage = s


class StageStreams:
    """One CUDA stream per stage for reductions on ``device`` (created on first use); off CUDA,
    no-op contexts and waits."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._streams: list = []

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def stream(self, s: int):
        while len(self._streams) <= s:
            self._streams.append(torch.cuda.Stream(device=self.device))
        return self._streams[s]

    def context(self, s: int):
        return torch.cuda.stream(self.stream(s)) if self.cuda else contextlib.nullcontext()

    def record(self, s: int):
        """An event recorded on stream ``s`` now (None off CUDA)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream(s))
        return event

    def wait_current(self, s: int) -> None:
        """Stream ``s`` waits for the current stream (the gradients a stage reads are ready)."""
        if self.cuda:
            self.stream(s).wait_stream(torch.cuda.current_stream(self.device))

    def wait_event(self, s: int | None, event) -> None:
        """Stream ``s`` (None: the current stream) waits for ``event``."""
        if event is not None:
            (torch.cuda.current_stream(self.device) if s is None else self.stream(s)).wait_event(event)


class _InFlight:
    """A started reduction: its stages, the next one to enqueue, and what the last one left."""

    def __init__(self, reduction: Reduction):
        self.reduction = reduction
        self.stages = reduction.stages()
        self.count, self.next = len(self.stages), 0
        self.step = StageResult()
        self.event = None  # recorded after the last enqueued stage

    @property
    def done(self) -> bool:
        return self.next == self.count


class ReductionQueue:
    """Enqueues the stages of started reductions by ``schedule`` (module doc) on ``streams``."""

    def __init__(self, streams: StageStreams, schedule: Schedule, watch=None):
        self.streams, self.schedule = streams, schedule
        self._pending: deque[_InFlight] = deque()
        self.probe = None  # benchmarks: a callable returning a context every stage runs in (e.g. an op counter)
        # tests: ``watch.stage(flight, s)``, a context stage ``s`` of ``flight`` runs in, and
        # ``watch.handed(flight, s, step)`` after it (``testing.dispatch.Lifetimes``: the module doc's rule)
        self.watch = watch

    def start(self, reduction: Reduction) -> _InFlight:
        """Enqueue ``reduction``'s first stage (all of them when eager); returns its handle for ``wait``."""
        flight = _InFlight(reduction)
        self.streams.wait_current(0)
        self._enqueue(flight)
        if self.schedule is Schedule.EAGER:
            while not flight.done:
                self._enqueue(flight)
        else:
            for earlier in list(self._pending):
                self._enqueue(earlier)
        self._pending = deque(f for f in self._pending if not f.done)
        if not flight.done:
            self._pending.append(flight)
        return flight

    def wait(self, flight: _InFlight) -> None:
        """Enqueue what is left of every reduction started up to ``flight``, in start order; the
        current stream then waits for ``flight``'s last stage (on the device)."""
        while not flight.done:
            earliest = self._pending[0]
            while not earliest.done:
                self._enqueue(earliest)
            self._pending.popleft()
        self.streams.wait_event(None, flight.event)

    def _enqueue(self, flight: _InFlight) -> None:
        s = flight.next
        with self.streams.context(s), self.probe() if self.probe is not None else contextlib.nullcontext():
            if s > 0:
                self.streams.wait_event(s, flight.event)
            for work in flight.step.works:
                work.wait()
            flight.reduction.stage = s
            with self.watch.stage(flight, s) if self.watch is not None else contextlib.nullcontext():
                step = flight.stages[s]() or StageResult()
            if self.watch is not None:
                self.watch.handed(flight, s, step)
        if s == flight.count - 1 and step.works:
            raise RuntimeError("a reduction's last stage must not leave collectives in flight")
        if self.streams.cuda:
            for t in step.handoff:
                t.record_stream(self.streams.stream(s + 1))
        flight.step, flight.next = step, s + 1
        flight.event = self.streams.record(s)
        if flight.done:
            flight.stages, flight.reduction = [], None  # the reduction (and its buffers) go


def reduce_now(reduction: Reduction, device, watch=None) -> None:
    """Run ``reduction`` to the end, its stages on fresh stage streams of ``device``, the current
    stream waiting for it (tests, benchmarks; ``watch``: ``ReductionQueue``'s)."""
    queue = ReductionQueue(StageStreams(device), Schedule.EAGER, watch)
    queue.wait(queue.start(reduction))
