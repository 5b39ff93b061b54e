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

Bytes in flight: given an ``Arena``, a reduction's message buffers (the O(bucket) sends, receives
and gathers: ``Reduction.footprint`` bytes, the most any rank takes, so that every rank decides
alike) come from a region of it reserved at ``start``; a region still used by earlier reductions is
reused only after their last stage: what is left of them is enqueued first (in start order, as
``wait`` does) and the new reduction's stage 0 waits for their last events on the device. The
caching allocator could not bound this without a host synchronisation (it reuses a block only once
the streams it was recorded on are seen past it); the arena's reuse is ordered by the streams.
"""

from __future__ import annotations

import contextlib
import os
import types
import weakref
from collections import deque

import torch

from ..config import Schedule


def default_schedule(device: torch.device) -> Schedule:
    """``lagged`` on CPUs and where ``CUDA_DEVICE_MAX_CONNECTIONS=1``, else ``eager`` (module doc)."""
    if torch.device(device).type != "cuda" or os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return Schedule.LAGGED
    return Schedule.EAGER


class StageResult(types.SimpleNamespace):
    """What a stage leaves for the next, which is given it as its argument (``stage(prev)``): ``works``, the
    collectives its stream waits for first, and the handoff, every other keyword (read as attributes:
    ``prev.recv``). Every tensor in the handoff, also inside lists, tuples, dicts and objects with a
    ``tensors()`` method, is recorded on the next stage's stream: the only way a later stage gets a tensor
    is the way that keeps it alive (module doc). Keywords only (``works=[...]``)."""

    works = ()  # none unless given

    @property
    def handoff(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "works"}

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the handoff (module doc: what is recorded on the next stage's stream)."""
        return _tensors(list(self.handoff.values()))


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return x.tensors() if callable(getattr(x, "tensors", None)) else []


def then(stage, after):
    """One stage (its stream, its name): ``stage`` and then ``after`` given its result (a wrapper's work
    that belongs on the same stream, e.g. a collective launched once the inner's last stage wrote)."""

    def run(prev: StageResult) -> StageResult:
        return after(stage(prev) or StageResult())

    run.__name__ = getattr(stage, "__name__", "stage")  # the meter's stage names
    return run


class StageFlags:
    """Where reductions flag a NaN/Inf they wrote: one device flag per stage index, created when a stage
    of that index first sets it (how many stages a reduction has is its own business), each written
    only by the stage streams of that index, so that no two streams read-modify-write one flag.
    Read with ``any()`` once the step's reductions are waited for; ``zero_()`` before the next."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.flags: list[torch.Tensor] = []  # [1] bool tensors, stage index i's at i

    def mark(self, stage: int, values: torch.Tensor) -> None:
        """Stage ``stage``'s flag set (on the device) where ``values`` holds a NaN/Inf."""
        while len(self.flags) <= stage:
            self.flags.append(torch.zeros(1, dtype=torch.bool, device=self.device))
        self.flags[stage].logical_or_(torch.isfinite(values).all().logical_not())

    def any(self) -> torch.Tensor:
        """Whether any flag is set (a bool tensor on the device: no host synchronisation)."""
        if not self.flags:
            return torch.zeros((), dtype=torch.bool, device=self.device)
        return torch.cat(self.flags).any()

    def zero_(self) -> None:
        if self.flags:
            torch._foreach_zero_(self.flags)


ALIGN = 512  # bytes: every buffer taken from an arena region starts at a multiple (any dtype's view)


class Space:
    """Where a reduction's message buffers come from: a region of an ``Arena`` (``block``: a uint8
    view, taken front to back) or, without one, PyTorch's allocator."""

    def __init__(self, block: torch.Tensor | None = None):
        self.block, self.used = block, 0

    def empty(self, numel: int, dtype: torch.dtype = torch.uint8, device=None) -> torch.Tensor:
        if self.block is None:
            return torch.empty(numel, dtype=dtype, device=device)
        lo = self.used
        hi = lo + numel * dtype.itemsize
        if hi > self.block.numel():
            raise RuntimeError(
                f"a reduction took {hi} bytes from its arena region of {self.block.numel()}: its footprint() is wrong"
            )
        self.used = -(-hi // ALIGN) * ALIGN
        return self.block[lo:hi].view(dtype)

    def zeros(self, numel: int, dtype: torch.dtype = torch.uint8, device=None) -> torch.Tensor:
        return self.empty(numel, dtype, device).zero_()

    def keep(self, view: torch.Tensor) -> torch.Tensor:
        """A view of one of this space's buffers for a later stage: itself in an arena region (which
        lives for the reduction's whole run), else a copy, so that the buffer can go once its
        collective is done."""
        return view if self.block is not None else view.clone()


def taken(*sizes: int) -> int:
    """Arena bytes of buffers of ``sizes`` bytes taken one after another (``Space.empty``'s alignment)."""
    return sum(-(-n // ALIGN) * ALIGN for n in sizes)


class Reduction:
    """Base of a reduction run by ``ReductionQueue``: ``stages()`` lists callables, each given the last one's
    ``StageResult`` (the first an empty one) and returning its own.

    ``stage``: the index of the stage running now (set by the queue before it calls the stage), which
    is also the index of the stream it runs on. ``space``: where its message buffers come from (the
    queue sets a region of its arena); ``footprint()``: how many bytes of them it takes at most on any
    rank of its group (None: it takes none from an arena)."""

    stage = 0
    space = Space()

    def stages(self) -> list:
        raise NotImplementedError

    def footprint(self) -> int | None:
        return None


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

    @property
    def space(self) -> Space:
        return self.inner.space

    @space.setter
    def space(self, space: Space) -> None:
        self.inner.space = space

    def footprint(self) -> int | None:
        return self.inner.footprint()


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

    def created(self) -> list:
        return list(self._streams)

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


# (device, nbytes) -> Arena, held for the process: its ring's position must depend only on the
# reservations made (the same on every rank), never on when the collector frees an earlier DDP
_SHARED: dict = {}


class Arena:
    """Device memory that bounds the bytes of message buffers in flight (module doc): ``nbytes``
    (``None``: ``plan``'s size, grown to two of a reduction's footprint where one needs more than
    it holds), used as a ring of regions, one per reduction, allocated on first use. A reduction
    larger than a stated ``nbytes`` takes its buffers from PyTorch's allocator (``over`` counts them;
    ``warn``, when given, is called with a message the first time). Queues may share one arena: a
    region is given back through the queue that started the reduction holding it.

    Every decision (a region's place, the earlier reductions it makes complete) is a function of the
    ``plan`` and ``reserve`` calls alone, so ranks decide alike: never of whether the buffer is
    allocated, which is given back when the last queue that used it is freed (whenever the garbage
    collector gets to it) and allocated again, at the same size, by the next reservation."""

    @classmethod
    def shared(cls, device, nbytes: int | None, warn=None) -> Arena:
        """The arena of ``device`` for the bound ``nbytes``, one for the DDPs of a process (the model
        chunks of a virtual pipeline, whose reductions seldom overlap: the largest chunk's room, not
        their sum; a later model's DDPs continue its ring)."""
        key = (str(torch.device(device)), nbytes)
        arena = _SHARED.get(key)
        if arena is None:
            arena = _SHARED[key] = cls(nbytes, device, warn)
        return arena

    @staticmethod
    def forget_shared() -> None:
        """The next ``shared`` arena starts a ring of its own: for tools that build independent models one
        after another in a process (each measured alone); call it at the same point on every rank."""
        _SHARED.clear()

    def __init__(self, nbytes: int | None, device, warn=None):
        self.fixed, self.nbytes, self.device = nbytes is not None, nbytes or 0, torch.device(device)
        self.warn, self.warned = warn, False
        self.buffer: torch.Tensor | None = None
        self.at = 0
        self.regions: deque = deque()  # (lo, hi, weakref to the queue or None, flight) in reservation order
        self.queues: weakref.WeakSet = weakref.WeakSet()  # the queues that took regions
        self._live = 0  # of them, not yet freed
        self._streams: list[StageStreams] = []  # of every queue that took a region: the buffer was used on them
        self.over = 0

    def plan(self, needs: list[int]) -> None:
        """Sized from a step's reductions (``needs``, their footprints, known at start-up): without a
        stated size, room for two of the largest, so that one bucket's exchange runs while the next is
        encoded, and no more than all of them together (never less than an earlier plan); with one,
        a warning now for the largest if it does not fit."""
        if not needs:
            return
        if not self.fixed:  # shared: the largest of its queues' plans
            self._resize(max(self.nbytes, min(2 * max(needs), sum(needs))))
        elif max(needs) > self.nbytes:
            self._over(max(needs))

    def _resize(self, nbytes: int) -> None:
        """A larger ring, starting empty in a new buffer: earlier flights keep their views of the old."""
        if nbytes > self.nbytes:
            self._drop()
            self.nbytes, self.at = nbytes, 0
            self.regions.clear()

    def _drop(self) -> None:
        """Give the buffer back to PyTorch's allocator, which reuses it only once the streams that used
        it are past their work."""
        if self.buffer is not None and self.device.type == "cuda":
            for stream in [s for streams in self._streams for s in streams.created()]:
                self.buffer.record_stream(stream)
        self.buffer = None

    def _left(self) -> None:
        """A queue that used the buffer was freed: with none left, the buffer goes (the ring stays)."""
        self._live -= 1
        if not self._live:
            self._drop()
            self._streams.clear()

    def _over(self, need: int) -> None:
        if self.warned or self.warn is None:
            return
        self.warned = True
        self.warn(
            f"megatron-gift: a bucket's message buffers ({need / 2**20:.1f} MiB) exceed --gift-inflight-mb "
            f"{self.nbytes >> 20}: they will come from PyTorch's allocator, unbounded; raise the bound or lower "
            "--ddp-bucket-size"
        )

    def reserve(self, need: int, flight, queue=None) -> tuple[torch.Tensor | None, list]:
        """A region of ``need`` bytes for ``flight`` (started by ``queue``) and ``(queue, flight)`` of the
        earlier flights whose regions it overlaps (they must be done before it is written; ``queue`` is
        ``None`` where theirs was freed: what it enqueued is all they do); ``(None, [])`` where ``need``
        exceeds a fixed size. Growing (no fixed size) starts a new buffer: earlier flights keep their
        views of the old one."""
        if need > self.nbytes:
            if self.fixed:
                self._over(need)
                self.over += 1
                return None, []
            self._resize(2 * need)
        if queue is not None and queue not in self.queues:  # first: a collection from here on keeps the buffer
            self.queues.add(queue)
            self._live += 1
            weakref.finalize(queue, self._left)
            if all(streams is not queue.streams for streams in self._streams):
                self._streams.append(queue.streams)
        if self.buffer is None:
            self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        buffer = self.buffer
        if self.at + need > self.nbytes:
            self.at = 0
        lo, hi = self.at, self.at + need
        overlapped = [r for r in self.regions if r[0] < hi and lo < r[1]]
        self.regions = deque(r for r in self.regions if not (r[0] < hi and lo < r[1]))
        self.regions.append((lo, hi, None if queue is None else weakref.ref(queue), flight))
        self.at = hi
        return buffer[lo:hi], [(None if ref is None else ref(), f) for _, _, ref, f in overlapped]


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

    def __init__(self, streams: StageStreams, schedule: Schedule, watch=None, arena: Arena | None = None):
        self.streams, self.schedule, self.arena = streams, schedule, arena
        self._pending: deque[_InFlight] = deque()
        self.probe = None  # benchmarks: a callable returning a context every stage runs in (e.g. an op counter)
        # tests: ``watch.stage(flight, s)``, a context stage ``s`` of ``flight`` runs in, and
        # ``watch.handed(flight, s, step)`` after it (``testing.dispatch.Lifetimes``: the module doc's rule)
        self.watch = watch

    def start(self, reduction: Reduction) -> _InFlight:
        """Enqueue ``reduction``'s first stage (all of them when eager); returns its handle for ``wait``."""
        flight = _InFlight(reduction)
        self.streams.wait_current(0)
        need = reduction.footprint() if self.arena is not None else None
        if need:
            block, earlier = self.arena.reserve(need, flight, self)
            for queue, f in earlier:  # their stages all enqueued (each queue's in its start order)
                if queue is not None:
                    queue._complete(f)
                self.streams.wait_event(0, f.event)
            reduction.space = Space(block)
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
        self._complete(flight)
        self.streams.wait_event(None, flight.event)

    def _complete(self, flight: _InFlight) -> None:
        """Enqueue what is left of every reduction started up to ``flight``, in start order."""
        while not flight.done:
            earliest = self._pending[0]
            while not earliest.done:
                self._enqueue(earliest)
            self._pending.popleft()

    def _enqueue(self, flight: _InFlight) -> None:
        s = flight.next
        with self.streams.context(s), self.probe() if self.probe is not None else contextlib.nullcontext():
            if s > 0:
                self.streams.wait_event(s, flight.event)
            for work in flight.step.works:
                work.wait()
            flight.reduction.stage = s
            with self.watch.stage(flight, s) if self.watch is not None else contextlib.nullcontext():
                step = flight.stages[s](flight.step) or StageResult()
            if self.watch is not None:
                self.watch.handed(flight, s, step)
        if s == flight.count - 1 and step.works:
            raise RuntimeError("a reduction's last stage must not leave collectives in flight")
        if self.streams.cuda:
            for t in step.tensors():
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
