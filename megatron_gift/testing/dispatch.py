"""Dispatch-level probes for the GPU rules of the reduction path, usable on a CPU.

``SyncSanitizer`` records every ATen op that would make the host wait for a GPU
(``../shared/docs/gpu-execution.md``): tensor-to-Python conversions (``.item()``, ``float(t)``,
``bool(t)``, ``.tolist()``: ``aten._local_scalar_dense``; ``torch.equal``, ``is_nonzero``), ops whose
output size depends on data (``nonzero``, ``masked_select``, boolean-mask indexing, ``unique``,
``repeat_interleave`` without ``output_size``), tensors made from Python data (``aten.lift_fresh``:
on a GPU a pageable host-to-device copy), copies between devices, and ``torch.linalg`` calls that
check their info code on the host (``aten._linalg_check_errors``). On a CPU nothing actually waits,
but the same ops run, so counting them around a step is a portable check.

An op counts only when the innermost frame of the Python stack that belongs to ``megatron_gift``
or ``megatron`` is the plugin's (outside ``megatron_gift.testing``): Megatron's own
synchronisations (its NaN check, its loss logging) are stock behaviour, not the plugin's.

``OpCounter`` counts every ATen op dispatched while active (views included: each one is a host
dispatch), to check that a bucket's work does not grow with the data-parallel size.
"""

from __future__ import annotations

import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_ALWAYS = {
    aten._local_scalar_dense.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.nonzero.default,
    aten.nonzero_static.default,
    aten.masked_select.default,
    aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
    aten._linalg_check_errors.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
}
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../megatron_gift
_TESTING = os.path.join(_PACKAGE, "testing")


def _syncs(func, args, kwargs) -> bool:
    """Whether ``func(*args, **kwargs)`` synchronises the host with a GPU (see module doc)."""
    if func in _ALWAYS:
        return True
    packet = func.overloadpacket
    if packet is aten.repeat_interleave:
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if packet in (aten.index, aten.index_put, aten.index_put_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    if packet in (aten._to_copy, aten.copy_):
        device = kwargs.get("device")
        if packet is aten.copy_:
            device = args[0].device
        return device is not None and torch.device(device) != args[0 if packet is aten._to_copy else 1].device
    return False


def _owner(frame) -> str | None:
    """``"plugin"``, ``"megatron"`` or None: who the innermost frame of either package belongs to."""
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGE) and not path.startswith(_TESTING):
            return "plugin"
        if f"{os.sep}megatron{os.sep}" in path and not path.startswith(_PACKAGE):
            return "megatron"
        frame = frame.f_back
    return None


class SyncSanitizer(TorchDispatchMode):
    """Records the plugin's host-synchronising ops: ``events`` lists ``(op name, plugin frame)``."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs) and _owner(sys._getframe(1)) == "plugin":
            self.events.append((str(func.overloadpacket.__name__), _plugin_frame(sys._getframe(1))))
        return func(*args, **kwargs)

    def counts(self) -> collections.Counter:
        """How often each plugin frame synchronised, ``"file:line (op)"`` keyed."""
        return collections.Counter(f"{where} ({op})" for op, where in self.events)


def _plugin_frame(frame) -> str:
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGE) and not path.startswith(_TESTING):
            return f"{os.path.relpath(path, os.path.dirname(_PACKAGE))}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while active (``total``, and ``by_op``)."""

    def __init__(self):
        super().__init__()
        self.by_op: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_op[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_op.values())
