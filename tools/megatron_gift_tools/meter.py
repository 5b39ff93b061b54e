"""A launch-and-traffic meter: per stage of a reduction, the ATen ops and Triton launches it issues
and the bytes each reads and writes (``bench launches``, the launch-count tests).

``Meter.probe`` is what ``comm.schedule.ReductionQueue.probe`` takes (every stage runs inside one
context it returns); ``Meter.stage(name)`` meters any other block (a delta gather, a refresh call).
Inside a stage:

- every ATen op dispatched is counted (a ``TorchDispatchMode``) with the bytes it touches: a tensor
  argument it reads counts the bytes of the elements its view addresses (``numel x itemsize``:
  a slice of a buffer counts the slice, an expanded tensor every element it repeats), a tensor it
  writes (an output, or an argument its schema marks as written) likewise; the written argument of
  ``copy_``/``fill_``/``zero_`` is not read, that of the other in-place ops is. Indexed ops count
  the elements they index: ``index_copy_``/``index_add_``/``index_put_`` write as many as their
  source holds, ``index_select`` reads as many as it returns (plus the index). Views and
  allocations (``empty``, ``as_strided``, ``view``, ``slice`` ...) touch nothing: counted as ops
  (each is a host dispatch), zero bytes, and tallied apart (``no_traffic_ops``); ``launches`` are
  the others plus the Triton launches (what a GPU would run);
- every Triton launch (``JITFunction.run``, or ``InterpretedFunction.run`` under
  ``TRITON_INTERPRET=1``) is recorded with its kernel name and bound arguments (by parameter name,
  constexprs included, plus ``"grid"``); its bytes come from the ``TRAFFIC`` dict of the kernel's
  module (``TRAFFIC[name](args) -> (bytes_read, bytes_written)``), checked against the tensors the
  launch is given: the bytes written may not exceed the bytes those tensors address, the bytes read
  not those once per program (an entry counts what each program loads). A kernel without an entry
  is an error.

``Meter(stub=True)`` records the launches without running them (for ``meta`` tensors, and to time
the plugin's host work without kernel time); ``stub=False`` runs them after recording.
``Meter(count_ops=False)`` times instead: each stage's wall and thread CPU time and the part of
the latter spent inside ATen dispatch (on ``meta`` tensors an op's shape function alone
costs 0.1-4 ms of Python, far more than a CUDA launch's host side, so the plugin's own host time
is what is left: ``python_s``; it still holds the ~µs per op of entering the dispatch probe).
No state outside the ``Meter`` object: the launcher patch lives only inside ``with meter:``.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import math
import sys
import time
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from megatron_gift.testing.dispatch import launches

aten = torch.ops.aten

_NOT_READ = {aten.copy_, aten.fill_, aten.zero_, aten.normal_, aten.uniform_, aten.random_, aten.bernoulli_}
# written argument -> the argument whose elements say how many of it are written
_INDEXED_WRITE = {
    aten.index_copy_: "source",
    aten.index_add_: "source",
    aten.index_put_: "values",
    aten.scatter_: "src",
    aten.scatter_add_: "src",
    aten.masked_scatter_: "source",
}


def nbytes(t: torch.Tensor) -> int:
    """Bytes of the elements ``t`` addresses (its view, not its storage)."""
    return t.numel() * t.element_size()


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def aten_traffic(func, args, kwargs, out) -> tuple[int, int] | None:
    """``(bytes read, bytes written)`` of one dispatched ATen op by the module doc's rule; None for
    an op that touches nothing (a view or an allocation)."""
    if not launches(func):
        return None
    packet = func.overloadpacket
    bound = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            bound[a.name] = (a, args[i])
        elif a.name in kwargs:
            bound[a.name] = (a, kwargs[a.name])
    read = written = 0
    mutated = set()
    for name, (a, value) in bound.items():
        ts = _tensors(value)
        if not ts:
            continue
        if a.alias_info is not None and a.alias_info.is_write:
            mutated.update(id(t) for t in ts)
            if packet in _INDEXED_WRITE and _INDEXED_WRITE[packet] in bound:
                src = _tensors(bound[_INDEXED_WRITE[packet]][1])
                written += sum(nbytes(s) for s in src)
            else:
                written += sum(nbytes(t) for t in ts)
            if packet not in _NOT_READ and packet not in _INDEXED_WRITE:
                read += sum(nbytes(t) for t in ts)
        elif packet is aten.index_select and name == "self":
            read += sum(nbytes(o) for o in _tensors(out))
        else:
            read += sum(nbytes(t) for t in ts)
    written += sum(nbytes(t) for t in _tensors(out) if id(t) not in mutated)
    return read, written


@dataclass
class Launch:
    """One Triton launch: the kernel, its grid and its bytes (its ``TRAFFIC`` entry)."""

    kernel: str
    grid: tuple
    read: int
    written: int


@dataclass
class StageCount:
    """What one stage issued."""

    name: str
    aten_ops: int = 0
    no_traffic_ops: int = 0  # views and allocations among aten_ops
    aten_read: int = 0
    aten_written: int = 0
    by_op: collections.Counter = field(default_factory=collections.Counter)
    launches: list[Launch] = field(default_factory=list)
    host_s: float = 0.0  # the stage's wall time
    cpu_s: float = 0.0  # its thread's CPU time (what other processes on the machine take is not in it)
    aten_s: float = 0.0  # of which inside ATen dispatch (CPU time; ``Meter(count_ops=False)`` only)

    @property
    def python_s(self) -> float:
        """The stage's host CPU time outside ATen dispatch: the plugin's Python (and the launch stubs)."""
        return self.cpu_s - self.aten_s

    @property
    def triton_launches(self) -> int:
        return len(self.launches)

    @property
    def gpu_launches(self) -> int:
        """Device launches on a GPU: the ATen ops that touch memory and the Triton launches."""
        return self.aten_ops - self.no_traffic_ops + self.triton_launches

    @property
    def read(self) -> int:
        return self.aten_read + sum(k.read for k in self.launches)

    @property
    def written(self) -> int:
        return self.aten_written + sum(k.written for k in self.launches)

    def as_dict(self) -> dict:
        kernels = collections.Counter(k.kernel for k in self.launches)
        return dict(
            stage=self.name,
            aten_ops=self.aten_ops,
            no_traffic_ops=self.no_traffic_ops,
            triton_launches=self.triton_launches,
            launches=self.gpu_launches,
            aten_bytes_read=self.aten_read,
            aten_bytes_written=self.aten_written,
            triton_bytes_read=sum(k.read for k in self.launches),
            triton_bytes_written=sum(k.written for k in self.launches),
            bytes_read=self.read,
            bytes_written=self.written,
            kernels=dict(kernels),
            top_ops=dict(self.by_op.most_common(8)),
        )


class _OpTraffic(TorchDispatchMode):
    """Counts every ATen op dispatched while active into ``count`` (module doc)."""

    def __init__(self, count: StageCount):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.count
        c.aten_ops += 1
        c.by_op[str(func.overloadpacket.__name__)] += 1
        traffic = aten_traffic(func, args, kwargs, out)
        if traffic is None:
            c.no_traffic_ops += 1
        else:
            c.aten_read += traffic[0]
            c.aten_written += traffic[1]
        return out


class _OpTimer(TorchDispatchMode):
    """Counts the ATen ops dispatched while active and the time spent dispatching them (its own
    Python included, so that what is left of a stage's wall time is the caller's)."""

    def __init__(self, count: StageCount):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.thread_time()
        out = func(*args, **(kwargs or {}))
        self.count.aten_ops += 1
        self.count.aten_s += time.thread_time() - t0
        return out


def bound_arguments(fn, args: tuple, kwargs: dict, grid) -> dict:
    """A launch's arguments by parameter name (defaults filled in), plus ``"grid"`` (a tuple)."""
    sig = inspect.signature(fn)
    names = sig.parameters
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    out = dict(bound.arguments)
    out = {k: (v.value if hasattr(v, "value") and not isinstance(v, torch.Tensor) else v) for k, v in out.items()}
    out["grid"] = tuple(grid(out)) if callable(grid) else tuple(grid)
    return out


def kernel_traffic(fn, bound: dict) -> tuple[int, int]:
    """``TRAFFIC[name](bound)`` of the kernel's module, checked against the tensors it is given."""
    name = fn.__name__
    table = getattr(sys.modules[fn.__module__], "TRAFFIC", {})
    if name not in table:
        raise KeyError(f"Triton kernel {fn.__module__}.{name} launched without an entry in its module's TRAFFIC dict")
    read, written = table[name](bound)
    given = {id(t): nbytes(t) for t in bound.values() if isinstance(t, torch.Tensor)}
    limit, programs = sum(given.values()), max(1, math.prod(bound["grid"]))
    if not (0 <= read <= limit * programs and 0 <= written <= limit):
        raise AssertionError(
            f"TRAFFIC[{name!r}] gives {read} B read, {written} B written: more than the {limit} B its tensors address "
            f"(read: once per program of {programs})"
        )
    return int(read), int(written)


def _launchers() -> list:
    """The classes whose ``run`` launches a Triton kernel (the interpreter's where triton has one)."""
    from triton.runtime.jit import JITFunction

    out = [JITFunction]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        out.append(InterpretedFunction)
    return out


class Meter:
    """Per-stage counts (module doc); ``with meter:`` installs the Triton launch recorder."""

    def __init__(self, stub: bool = True, count_ops: bool = True):
        self.stub, self.count_ops = stub, count_ops
        self.stages: list[StageCount] = []
        self.outside: list[Launch] = []  # launches outside any stage
        self._current: StageCount | None = None
        self._saved: list = []
        self.names: list[str] | None = None  # stage names for ``probe``, in order (else "stage k")

    # -- the Triton launcher -------------------------------------------------------------------
    def __enter__(self) -> Meter:
        meter = self
        for cls in _launchers():
            real = cls.run

            def run(self, *args, grid, warmup, _real=real, **kwargs):
                if warmup:
                    return _real(self, *args, grid=grid, warmup=warmup, **kwargs)
                if meter.count_ops:
                    bound = bound_arguments(self.fn, args, kwargs, grid)
                    read, written = kernel_traffic(self.fn, bound)
                    launch = Launch(self.fn.__name__, bound["grid"], read, written)
                else:  # timing: as little host work as a launch needs
                    launch = Launch(self.fn.__name__, (), 0, 0)
                (meter._current.launches if meter._current is not None else meter.outside).append(launch)
                if meter.stub:
                    return None
                with _disable_current_modes():  # the interpreter's own tensor copies are not the plugin's
                    return _real(self, *args, grid=grid, warmup=warmup, **kwargs)

            self._saved.append((cls, real))
            cls.run = run
        return self

    def __exit__(self, *exc) -> None:
        while self._saved:
            cls, real = self._saved.pop()
            cls.run = real

    # -- stages --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stage(self, name: str):
        """Meter the block as one stage called ``name``."""
        count = StageCount(name)
        self.stages.append(count)
        outer, self._current = self._current, count
        mode = (_OpTraffic if self.count_ops else _OpTimer)(count)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            with mode:
                yield count
        finally:
            count.host_s, count.cpu_s = time.perf_counter() - t0, time.thread_time() - c0
            self._current = outer

    def probe(self):
        """A context for the next stage of a ``ReductionQueue`` (its ``probe``)."""
        k = len(self.stages)
        name = self.names[k] if self.names is not None and k < len(self.names) else f"stage {k}"
        return self.stage(name)


def probe_overhead(n: int = 2000) -> float:
    """Seconds per ATen op that ``_OpTimer`` leaves in ``python_s`` (entering the probe and leaving it),
    from ``n`` views of a meta tensor: what a stage's ``python_s`` should be lessened by per op."""
    x, count = torch.empty(4, device="meta"), StageCount("calibration")
    best = float("inf")
    for _ in range(3):
        count.cpu_s = count.aten_s = 0.0
        t0 = time.thread_time()
        with _OpTimer(count):
            for _ in range(n):
                x.view(-1)
        count.cpu_s = time.thread_time() - t0
        best = min(best, count.python_s / n)
    return best
