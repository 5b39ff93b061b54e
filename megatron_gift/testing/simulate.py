"""Simulated data-parallel layouts for the launch meter: one process plays rank ``r`` of ``p``.

- ``FakeGroup(p, r)``: ``size()`` and ``rank()``, all a reduction asks of its process group, and the
  group's coalesced reduce-scatter, recorded like the collectives below;
- ``recorded_collectives()``: in every imported ``megatron_gift.comm`` module, the name ``dist`` (when
  it is ``torch.distributed``) becomes a proxy whose collectives, and any module-level alias of one
  (e.g. ``_all_gather``, ``_coalescing_manager``), only record ``(name, bytes in, bytes out)`` and
  return a ``FakeWork``; the receive buffers keep whatever they held;
- ``kernels_on(device)``: ``kernels.available`` true for ``device`` too (``meta``: the fused path's
  wrappers run, their launches recorded by a stubbing ``meter.Meter``).

Together with ``meta`` tensors (ATen ops dispatch, nothing is computed) a rank of a 512-way group
reducing a 200M-element bucket runs on a laptop; on real CPU tensors the same code gives the same
counts (the tests check it). Everything is restored on exit.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.distributed as dist

_COLLECTIVES = (
    "all_to_all_single",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "reduce_scatter_tensor",
    "broadcast",
    "all_gather",
    "_all_gather_base",
)


class FakeGroup:
    """Rank ``rank`` of a process group of ``size`` ranks that never communicates."""

    def __init__(self, size: int, rank: int = 0):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a group of {size}")
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None) -> FakeWork:
        """The process group's own coalesced reduce-scatter (``comm.sum_first``): recorded as the module-level
        collectives are, within ``recorded_collectives``."""
        for calls in _RECORDING[-1:]:
            calls.append(("reduce_scatter_tensor_coalesced", _tensor_bytes(outputs), _tensor_bytes(inputs)))
        return FakeWork()


_RECORDING: list[list] = []  # the calls lists of the recordings in progress, innermost last


class FakeWork:
    """A finished collective."""

    def wait(self, *args) -> bool:
        return True


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class _Recorder:
    """A collective that records ``(name, bytes of its first tensor argument, of its second)``."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def __call__(self, *args, **kwargs):
        tensors = [a for a in args if isinstance(a, (torch.Tensor, list))][:2]
        self.calls.append((self.name, *(_tensor_bytes(t) for t in tensors)))
        return FakeWork()


class _Coalescing:
    """``_coalescing_manager``'s stand-in: the block's collectives recorded, ``wait()`` does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait(self):
        return None


def _proxy(calls: list) -> types.SimpleNamespace:
    """``torch.distributed`` with its collectives recorded (everything else passes through)."""

    class Dist(types.ModuleType):
        def __getattr__(self, name):
            return getattr(dist, name)

    proxy = Dist("recorded_distributed")
    for name in _COLLECTIVES:
        setattr(proxy, name, _Recorder(name, calls))
    return proxy


@contextlib.contextmanager
def recorded_collectives(calls: list | None = None):
    """Collectives of the comm modules recorded into ``calls`` (module doc); yields ``calls``."""
    calls = [] if calls is None else calls
    proxy = _proxy(calls)
    real = {getattr(dist, n): n for n in _COLLECTIVES if hasattr(dist, n)}
    from torch.distributed import _coalescing_manager

    saved = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("megatron_gift.comm") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            new = None
            if value is dist:
                new = proxy
            elif value is _coalescing_manager:
                new = _Coalescing
            elif callable(value) and value in real:
                new = _Recorder(real[value], calls)
            if new is not None:
                saved.append((mod, attr, value))
                setattr(mod, attr, new)
    _RECORDING.append(calls)
    try:
        yield calls
    finally:
        _RECORDING.pop()
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


@contextlib.contextmanager
def kernels_on(device):
    """``kernels.available`` true on ``device`` as well (module doc)."""
    from .. import kernels

    real, device = kernels.available, torch.device(device)
    kernels.available = lambda d: torch.device(d).type == device.type or real(d)
    try:
        yield
    finally:
        kernels.available = real
