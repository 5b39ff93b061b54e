"""Dispatch-level probes for the GPU rules of the reduction path, usable on a CPU.

``SyncSanitizer`` records every ATen op that would make the host wait for a GPU
(``../shared/docs/gpu-execution.md``): tensor-to-Python conversions (``.item()``, ``float(t)``,
``bool(t)``: ``aten._local_scalar_dense``; ``torch.equal``, ``is_nonzero``), ops whose
output size depends on data (``nonzero``, ``masked_select``, boolean-mask indexing, ``unique``,
``repeat_interleave`` without ``output_size``), tensors made from Python data (``aten.lift_fresh``:
on a GPU a pageable host-to-device copy), copies between devices, and ``torch.linalg`` calls that
check their info code on the host (``aten._linalg_check_errors``). On a CPU nothing actually waits,
but the same ops run, so counting them around a step is a portable check.

Reads of a tensor's data into Python that dispatch no ATen op on a CPU tensor (``.tolist()``,
``.numpy()``, ``.cpu()``, ``.to("cpu")``) are seen one level up, by a ``TorchFunctionMode``. On a CPU
run every tensor is on the host, so the mode tracks which ones would be there in a GPU run too (what
a host read or ``HostCopy.wait`` returned, what a factory made without a ``device``, what is
computed from those alone) and counts a read (these, and ``.item()``, ``float(t)``, ``bool(t)``) of
any other tensor: in a GPU run it would be a device-to-host copy. ``HostCopy.wait`` itself counts
once (on CUDA it waits for its event). The autograd engine runs the backward's hooks (where
the bucket groups' reductions start) without the function modes of the ``backward()`` call, so while
active the sanitizer also wraps those reads and the factories (``_WRAPPED``), which judge themselves there.

An op counts when the innermost frame of the Python stack that belongs to ``megatron_gift`` is the
plugin's: frames of torch, Megatron and other libraries are skipped, so a plugin call into Megatron
that synchronises is the plugin's. Stock behaviour does not count: an op reached from
``megatron_gift.testing`` (the tests' own loops) or from the launcher ``pretrain_gpt.py`` (Megatron-LM's
script transcribed: its training loop, batches, loss function), or inside one of the Megatron
functions in ``STOCK`` that the plugin's overrides call as Megatron does.

``OpCounter`` counts every ATen op dispatched while active (views included: each one is a host
dispatch), to check that a bucket's work does not grow with the data-parallel size. ``LiveBytes``
counts the bytes of the storages made while active (``bench memory``, the PyTorch path's memory tests).

``Lifetimes`` (a ``comm.schedule.ReductionQueue``'s ``watch``) checks the stage protocol's lifetime
rule: every tensor a stage gives a collective, or creates for a later stage, is in the handoff of
every stage until that one (on CUDA, recorded on their streams).
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

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
_LAUNCHER = os.path.join(_PACKAGE, "pretrain_gpt.py")
# Megatron functions (file, name) the plugin calls in its overrides whose synchronisations are
# Megatron's own, as in a stock run: its gradient check (``--check-for-nan-in-loss-and-grad``, every
# step) and its ``training_log`` (the loss and timers at its log interval).
STOCK = {("param_and_grad_buffer.py", "check_grads"), ("training.py", "training_log")}
# frames of these are never callers: this module's modes, the CPU harness's redirections of CUDA calls
_HARNESS = os.path.join(_PACKAGE, "megatron", "cpu_harness.py")  # the CPU stand-ins for CUDA calls
_TRANSPARENT = (os.path.abspath(__file__), _HARNESS)


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


def _plugin_frame(frame):
    """The innermost frame of ``megatron_gift`` at or above ``frame`` (past the sanitizer's and the CPU
    harness's own frames) if it is the plugin's, else None: not ``testing``, not the launcher (Megatron-LM's
    ``pretrain_gpt.py`` transcribed), not reached through one of Megatron's ``STOCK`` functions (module doc)."""
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGE) and path not in _TRANSPARENT:
            return None if path.startswith(_TESTING) or path == _LAUNCHER else frame
        if (os.path.basename(path), frame.f_code.co_name) in STOCK and f"{os.sep}megatron{os.sep}" in path:
            return None
        frame = frame.f_back
    return None


def _where(frame) -> str:
    return f"{os.path.relpath(frame.f_code.co_filename, os.path.dirname(_PACKAGE))}:{frame.f_lineno}"


_READS = (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu)
_TO = torch.Tensor.to
_FROM_DATA = (torch.tensor, torch.as_tensor, torch.Tensor.new_tensor)  # aten.lift_fresh behind them
_FACTORIES = (*_FROM_DATA, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.eye, torch.linspace)
# What ``SyncSanitizer`` wraps while active, ``(owner, name, original)``: the autograd engine runs the backward's
# hooks (the bucket groups' reductions) without the function modes of the ``backward()`` call (a mode
# is popped while it handles a call), so there the wrappers judge the host reads and make the host
# tensors themselves (what is computed from host tensors alone, this dispatch mode marks).
_WRAPPED = [
    (torch.Tensor if f.__qualname__.startswith(("Tensor", "TensorBase")) else torch, f.__name__, f)
    for f in (*_READS, _TO, *_FACTORIES)
]
_JUDGED = frozenset(f for _, _, f in _WRAPPED)


def _device_arg(args, kwargs):
    """The ``device`` a ``Tensor.to`` or factory call names (keyword or positional), or None."""
    return kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class _HostReads(TorchFunctionMode):
    """The half of ``SyncSanitizer`` that works at the level of Python calls. It keeps track of the
    tensors that live on the host in a GPU run too (``host``: what a host read, ``HostCopy.wait`` or a
    factory without a ``device`` returned, and what is computed from such tensors alone) and records:

    * a host read (``tolist``, ``numpy``, ``cpu``, ``to("cpu")``) of any other tensor: a device-to-host copy;
    * a host tensor moved ``.to(device)`` without ``non_blocking=True``: a host-to-device copy that the
      host waits for (the plugin's own transfers go from pinned memory without blocking);
    * a tensor made from Python data on a ``device`` (``torch.tensor(x, device=d)``, ``t.new_tensor(x)`` of a
      device tensor): the same. Made without one it is a host tensor (no copy), and a Python number
      assigned into a tensor (``t[i] = 0``) is a kernel argument: the ``aten.lift_fresh`` behind both is
      not counted at dispatch (``quiet``)."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events
        self.host = WeakIdKeyDictionary()
        self.quiet = 0  # > 0 while a call whose lift_fresh this mode has judged runs
        self.judging = 0  # > 0 while this mode runs one of ``_WRAPPED`` (popped, as a mode is while it handles a call)

    def is_host(self, t: torch.Tensor) -> bool:
        return t in self.host

    def mark(self, out) -> None:
        for t in _tensors(out):
            self.host[t] = True

    def record(self, op: str, frame) -> None:
        frame = _plugin_frame(frame)
        if frame is not None:
            self.events.append((op, _where(frame)))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        func = getattr(func, "_sanitized", func)  # a wrapped method: judged as the original (``_WRAPPED``)
        judged = func in _FROM_DATA or (func is torch.Tensor.__setitem__ and not isinstance(args[2], torch.Tensor))
        wrapped = func in _JUDGED
        self.quiet += judged
        self.judging += wrapped
        try:
            out = func(*args, **kwargs)
        finally:
            self.quiet -= judged
            self.judging -= wrapped
        inputs = _tensors((args, kwargs))
        device = _device_arg(args, kwargs) if func is _TO or func in _FACTORIES else None
        to_cpu = device is not None and torch.device(device).type == "cpu" and isinstance(device, str)
        if func in _READS or (func is _TO and to_cpu):
            if not self.is_host(args[0]):
                self.record(func.__name__, sys._getframe(1))
            self.mark(out)
        elif func is _TO and device is not None and self.is_host(args[0]) and not kwargs.get("non_blocking"):
            self.record("to(device)", sys._getframe(1))
        elif func in _FROM_DATA and (device is not None or (func is _FROM_DATA[2] and not self.is_host(args[0]))):
            self.record(func.__name__, sys._getframe(1))
        elif (func in _FACTORIES and device is None and not inputs) or (inputs and all(map(self.is_host, inputs))):
            self.mark(out)
        return out

    def wrap(self, method):
        """``method`` (one of ``_WRAPPED``) judged by this mode where it is not on the function-mode stack
        (the backward's hooks); where it is, the mode sees the call and judges it. Nor where the mode is
        running this call: a function mode below it on the stack (the CPU harness's) that handles the call
        reaches the wrapper again, with this mode popped, and judging it there counted one read twice."""

        def wrapper(*args, **kwargs):
            if self.judging or self in torch.overrides._get_current_function_mode_stack():
                return method(*args, **kwargs)
            return self.__torch_function__(method, (), args, kwargs)

        wrapper._sanitized = method
        return wrapper

    def host_copy_wait(self, wait):
        """``HostCopy.wait`` counted as one host synchronisation (on CUDA an event wait), its tensors on the host."""

        def counted(copy):
            self.record("HostCopy.wait", sys._getframe(1))
            out = wait(copy)
            self.mark(out)
            return out

        return counted


class SyncSanitizer(TorchDispatchMode):
    """Records the plugin's host-synchronising ops and host reads: ``events`` lists ``(op name,
    plugin frame)``. Entering it also enters its ``_HostReads`` function mode."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self._reads = _HostReads(self.events)

    def __enter__(self):
        from ..numerics.refresh import HostCopy

        self._wait = HostCopy.wait
        HostCopy.wait = self._reads.host_copy_wait(self._wait)
        for owner, name, method in _WRAPPED:
            setattr(owner, name, self._reads.wrap(method))
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc_info):
        from ..numerics.refresh import HostCopy

        try:
            return super().__exit__(*exc_info)
        finally:
            self._reads.__exit__(*exc_info)
            HostCopy.wait = self._wait
            for owner, name, method in _WRAPPED:
                setattr(owner, name, method)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and self._reads.is_host(args[0]):
            return func(*args, **kwargs)  # a value already on the host
        if func.overloadpacket in (aten.lift_fresh, aten.lift_fresh_copy) and self._reads.quiet:
            return func(*args, **kwargs)  # judged by the function mode
        if _syncs(func, args, kwargs):
            frame = _plugin_frame(sys._getframe(1))
            if frame is not None:
                self.events.append((str(func.overloadpacket.__name__), _where(frame)))
        out = func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        if inputs and all(map(self._reads.is_host, inputs)):  # computed from host tensors alone (in a hook too)
            self._reads.mark(out)
        return out

    def counts(self) -> collections.Counter:
        """How often each plugin frame synchronised, ``"file:line (op)"`` keyed."""
        return collections.Counter(f"{where} ({op})" for op, where in self.events)


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


_LIFTS = (torch.ops.aten.lift_fresh.default,)


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created while active, each from the op that returns it, new (aliasing
    none of the op's inputs), until it is freed: ``live`` now, ``peak`` the most at once. A storage made out
    of the mode's sight (before it, or inside a collective: gloo's reduce-scatter copies its input and
    splits the copy in ``wait()``, then frees it from its worker thread whenever) never counts, nor do the
    storages of ``known`` tensors."""

    def __init__(self, *known):
        super().__init__()
        self.live = self.peak = 0
        self._seen = {t.untyped_storage()._cdata for t in pytree.tree_leaves(known)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # ``torch.tensor(data)`` fills its storage out of sight and hands it to ``lift_fresh``: that counts
        inputs = (
            set()
            if func in _LIFTS
            else {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        )
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self._seen and key not in inputs:
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)


# Ops that allocate or alias: a dispatch each, no memory traffic.
NO_TRAFFIC = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten.set_.source_Storage_storage_offset,
    torch.ops.aten.resize_.default,
    torch.ops.aten.record_stream.default,
}


def launches(func) -> bool:
    """Whether a dispatched ATen op is a device launch on a GPU: it touches memory (not a view, not an
    allocation)."""
    return not (func.is_view or func in NO_TRAFFIC)


def _ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s block (0: no memory), what the caching allocator's reuse is about."""
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else 0


class Lifetimes(TorchDispatchMode):
    """The stage protocol's lifetime rule (``comm.schedule``'s module doc) checked on a CPU, as a
    ``ReductionQueue``'s ``watch``: while a stage runs it records the blocks the stage's ops create and
    the tensors it gives to collectives (``c10d`` ops), and raises ``RuntimeError`` where

    * a stage gives a collective a tensor its handoff does not hold (``ProcessGroupNCCL`` drops it at
      the wait, on the next stage's stream: the block returns to its pool while NCCL uses it);
    * a stage reads a block an earlier stage of the same reduction created that a stage in between did
      not hand on (recorded on none of those streams, the block may be taken by the creating stream's
      next allocation while the later stream still reads it).

    What ``BucketLayout.cached`` builds belongs to the layout (kept with it), not to a stage. Records are
    keyed by the block's address and dropped once the block is freed (``StorageWeakRef``), so a reused
    address is a new block. ``stages`` counts the stages watched."""

    def __init__(self):
        super().__init__()
        self._created: dict[int, tuple] = {}  # block address -> (flight, stage, StorageWeakRef)
        self._handed: dict[int, dict[int, set]] = {}  # flight -> stage -> block addresses of its handoff
        self._running: tuple | None = None  # (flight, stage) while a stage runs
        self._given: list = []  # (op, tensor) of the running stage's collectives
        self._quiet = 0  # > 0 while a layout cache is built
        self.stages = 0

    @contextlib.contextmanager
    def stage(self, flight, s: int):
        """The context stage ``s`` of ``flight`` (a key: the queue's ``_InFlight``) runs in."""
        from torch.multiprocessing.reductions import StorageWeakRef

        from ..comm.layout import BucketLayout

        self._weak = StorageWeakRef
        cached = BucketLayout.cached

        def layout_owned(layout, key, build):
            def quiet():
                self._quiet += 1
                try:
                    return build()
                finally:
                    self._quiet -= 1

            return cached(layout, key, quiet)

        self._running, self._given = (id(flight), s), []
        BucketLayout.cached = layout_owned
        try:
            with self:
                yield
        finally:
            BucketLayout.cached = cached
            self._running = None
        self.stages += 1

    def handed(self, flight, s: int, step) -> None:
        """Stage ``s`` of ``flight`` returned ``step`` (its ``works`` and ``handoff``); ``flight.count``
        stages in all (its records go after the last)."""
        key, held = id(flight), {_ptr(t) for t in step.tensors()} - {0}
        given, self._given = self._given, []
        for op, t in given:
            if _ptr(t) not in held:
                raise RuntimeError(
                    f"stage {s} gave {op} a tensor its handoff does not hold: the caching allocator "
                    "may reuse its block while the collective still reads or writes it"
                )
        self._handed.setdefault(key, {})[s] = held
        if s == flight.count - 1:
            self._handed.pop(key, None)
            self._created = {p: r for p, r in self._created.items() if r[0] != key}

    def _read(self, t: torch.Tensor, func) -> None:
        p = _ptr(t)
        record = self._created.get(p)
        if record is None:
            return
        key, s0, ref = record
        if ref.expired():
            del self._created[p]
            return
        key_now, s = self._running
        if key != key_now or s0 >= s:
            return
        handed = self._handed.get(key, {})
        missing = [k for k in range(s0, s) if p not in handed.get(k, ())]
        if missing:
            raise RuntimeError(
                f"stage {s} reads ({func}) a tensor stage {s0} created that the handoff of stage(s) {missing} "
                "does not hold: the creating stream may reuse its block while this stage reads it"
            )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._quiet or self._running is None:
            return out
        inputs = _tensors((args, kwargs))
        for t in inputs:
            self._read(t, func)
        if func.namespace == "c10d":
            self._given += [(func.name(), t) for t in inputs if _ptr(t)]
        elif not func.is_view:
            known = {_ptr(t) for t in inputs}
            for t in _tensors(out):
                p = _ptr(t)
                if p and p not in known:
                    self._created[p] = (self._running[0], self._running[1], self._weak(t.untyped_storage()))
        return out
