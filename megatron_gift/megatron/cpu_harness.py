"""Run real Megatron-Core training code on a CPU-only machine (tests and CPU demos only).

Megatron-Core assumes CUDA in a handful of places that have nothing to do with the
arithmetic: it asks for the current CUDA device and stream, allocates small bookkeeping
tensors with ``device='cuda'``, checks ``tensor.type() == 'torch.cuda.FloatTensor'`` and keeps
per-region CUDA RNG states. :func:`install` redirects exactly those to CPU so that GPTModel
(local spec), ``DistributedDataParallel`` and the Megatron optimizers run unchanged over gloo:

* ``torch.cuda.current_device()`` returns ``torch.device('cpu')``;
* ``torch.cuda.current_stream()`` / ``torch.cuda.Stream(...)`` return a stream stand-in whose
  ``wait_event`` / ``wait_stream`` do nothing (CPU work is already ordered);
  ``torch.cuda.stream(s)`` needs no patch (it is a no-op for a non-CUDA stream);
* a torch-function mode moves ``device='cuda'`` / ``'cuda:N'`` arguments and ``Tensor.cuda()``
  to CPU, and answers ``Tensor.type()`` with the CUDA name (``'torch.cuda.FloatTensor'``);
* ``CudaRNGStatesTracker.add`` / ``.fork`` keep their named states as CPU generator states and
  fork the CPU default generator (dropout in tensor-parallel regions draws from it);
* the CUDA generator state that activation recomputation (``tensor_parallel.checkpoint``) saves
  and restores around the recomputed forward is empty (it restores the CPU generator and the
  tracker's states, which is all a CPU run draws from), and the recomputation itself runs with
  these redirections (``CheckpointFunction.backward``, ``CheckpointWithoutOutput._recompute``);
* a warning raised inside the mode's handler (Megatron's own, e.g. its distributed optimizer's
  ``zero_grad`` reading ``.grad`` of non-leaf shard views) names the code that made the call, as
  without the harness, not the handler.

On Python 3.11 it also provides ``typing.override`` (from ``typing_extensions``), which
``megatron.training`` imports.

Nothing happens until :func:`install` is called; :func:`uninstall` (or leaving the
``with install():`` block) restores everything. On a machine with CUDA, :func:`install` refuses:
the redirections would silently move a real GPU run to the CPU. Limits: the torch-function mode
acts only in the thread that called :func:`install`; positional devices (``t.to('cuda')``) are
not rewritten.
"""

import contextlib
import functools
import sys
import typing
import warnings

import torch
from torch.overrides import TorchFunctionMode

_MISSING = object()
_saved = []  # (owner, attribute name, original value or _MISSING) for every patched attribute
_mode = None  # the active _CudaToCpu mode while installed


class _Stream:
    """CPU stand-in for ``torch.cuda.Stream``: CPU ops run in order, so every wait is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


def _is_cuda(device):
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Send CUDA placements to the CPU and report CPU tensors under their CUDA type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and not kwargs and len(args) == 1 and args[0].is_cpu:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func == _GRAD_GET:  # the one call seen warning (a non-leaf's .grad): name its caller
            return _warning_at_caller(func, args, kwargs)
        return func(*args, **kwargs)


_GRAD_GET = torch.Tensor.grad.__get__


def _warning_at_caller(func, args, kwargs):
    """``func(*args, **kwargs)``, a warning it shows named at the first frame outside this module and
    ``torch.overrides`` (where it points without the harness). The filters and their once-per-place
    registry act as usual (on the handler's line); only where the shown warning says it comes from changes."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__") in (__name__, "torch.overrides"):
        frame = frame.f_back
    show = warnings.showwarning

    def show_at_caller(message, category, filename, lineno, file=None, line=None):
        show(message, category, frame.f_code.co_filename, frame.f_lineno, file, None)

    warnings.showwarning = show_at_caller
    try:
        return func(*args, **kwargs)
    finally:
        warnings.showwarning = show


def _in_mode(fn):
    """``fn`` with the redirections active: a mode is off inside its own handler, so a backward
    started through it runs without them, and activation recomputation runs forwards in there."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _mode is None or _mode in torch.overrides._get_current_function_mode_stack():
            return fn(*args, **kwargs)
        with _mode:
            return fn(*args, **kwargs)

    return wrapper


def _rng_add(self, name, seed):
    """``CudaRNGStatesTracker.add`` on CPU: store a CPU generator state seeded with ``seed``."""
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self._is_initialized = True
    self.seeds_.add(seed)
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


@contextlib.contextmanager
def _rng_fork(self, name="model-parallel-rng"):  # Megatron's default tracker name
    """``CudaRNGStatesTracker.fork`` on CPU: run the block on the named CPU generator state."""
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    outer = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)


def _replacing(original, fn):
    """``fn`` in place of Megatron's ``original``, unwrapping to it: ``upstream.fingerprint`` (the
    start-up check) reads upstream's source, not the replacement's."""

    @functools.wraps(original)
    def replacement(*args, **kwargs):
        return fn(*args, **kwargs)

    return replacement


def _patch(owner, name, value):
    _saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
    setattr(owner, name, value)


class _Installed:
    """What :func:`install` returns: leaving a ``with`` block on it uninstalls."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        uninstall()


def check_host() -> None:
    """``RuntimeError`` where CUDA is available: the harness (and the ``--gift-cpu`` launcher) runs
    Megatron on CPU-only machines. Called in the parent too, before ranks or a launcher start, so the
    refusal comes at once (and the test suite checks that such tests carry the ``cpu_harness`` marker)."""
    if torch.cuda.is_available():
        raise RuntimeError(
            "megatron_gift.megatron.cpu_harness is for CPU-only machines; CUDA is available, "
            "so run on the GPU instead of redirecting CUDA calls to the CPU."
        )


def install():
    """Redirect Megatron-Core's CUDA-only calls to CPU (idempotent).

    Returns a context manager that calls :func:`uninstall` on exit, so both
    ``install()`` and ``with install(): ...`` work.
    """
    global _mode
    check_host()
    if _mode is None:
        from megatron.core.tensor_parallel import random as tp_random
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

        if not hasattr(typing, "override"):  # Python < 3.12; megatron.training needs it
            import typing_extensions

            _patch(typing, "override", typing_extensions.override)
        _patch(torch.cuda, "current_device", lambda: torch.device("cpu"))
        _patch(torch.cuda, "current_stream", lambda device=None: _Stream())
        _patch(torch.cuda, "Stream", _Stream)
        _patch(torch.cuda, "synchronize", lambda device=None: None)  # pipeline p2p after send/recv
        _patch(CudaRNGStatesTracker, "add", _replacing(CudaRNGStatesTracker.add, _rng_add))
        _patch(CudaRNGStatesTracker, "fork", _replacing(CudaRNGStatesTracker.fork, _rng_fork))
        _patch(
            tp_random,
            "_get_cuda_rng_state",
            _replacing(tp_random._get_cuda_rng_state, lambda *a, **k: torch.empty(0, dtype=torch.uint8)),
        )
        _patch(tp_random, "_set_cuda_rng_state", _replacing(tp_random._set_cuda_rng_state, lambda *a, **k: None))
        _patch(tp_random.CheckpointFunction, "backward", staticmethod(_in_mode(tp_random.CheckpointFunction.backward)))
        _patch(tp_random.CheckpointWithoutOutput, "_recompute", _in_mode(tp_random.CheckpointWithoutOutput._recompute))
        _mode = _CudaToCpu()
        _mode.__enter__()
    return _Installed()


def _state_dict_with_optimizer_state(state_dict):
    @functools.wraps(state_dict)
    def wrapper(self):
        if not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return state_dict(self)

    return wrapper


def _load_state_dict_with_steps(load_state_dict):
    @functools.wraps(load_state_dict)
    def wrapper(self, state_dict):
        load_state_dict(self, state_dict)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                if "step" in group and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]))

    return wrapper


def install_for_training():
    """:func:`install`, plus what ``megatron.training.pretrain``'s start-up needs on CPU (the CPU
    demo and launcher tests; combine with :data:`TRAINING_FLAGS`). Undone by :func:`uninstall`.

    * ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda=True``: it gets that argument;
    * ``torch.cuda.device_count()`` is 1: Megatron builds the model-parallel groups and the
      tensor-parallel RNG states only when it is positive; ``torch.cuda.set_device`` does nothing;
    * ``get_device_arch_version()`` is 0 (``validate_args`` asks for the GPU architecture with
      tensor or context parallelism) and ``CUDA_DEVICE_MAX_CONNECTIONS=1`` is set if unset;
    * ``torch.cuda.get_rng_state()`` is an empty state and ``set_rng_state`` does nothing (there is
      no CUDA generator; checkpoints save the CPU generator and the tracker's CPU states anyway);
    * two fixes of the distributed optimizer's torch-optimizer fallback (no Transformer Engine or
      apex), which checkpoint loading needs: ``state_dict()`` first gives an optimizer without
      state its dummy state (Megatron's own ``_init_optimizer_states_with_dummy_values``, which
      loading overwrites; the fallback reads ``step`` from that state and fails otherwise), and
      ``load_state_dict()`` gives every parameter its own ``step`` tensor holding the checkpoint's
      step (the fallback shares one tensor, which torch's Adam increments once per parameter, and
      the parameter-state load then overwrites it with the dummy step: wrong bias correction).
    """
    import importlib
    import os

    installed_harness = install()
    training = importlib.import_module("megatron.training.training")
    if not getattr(training.initialize_megatron, "_cpu_harness", False):
        patched = functools.partial(training.initialize_megatron, allow_no_cuda=True)
        patched._cpu_harness = True
        _patch(training, "initialize_megatron", patched)
        _patch(torch.cuda, "device_count", lambda: 1)
        _patch(torch.cuda, "set_device", lambda device: None)
        _patch(importlib.import_module("megatron.training.arguments"), "get_device_arch_version", lambda: 0)
        _patch(torch.cuda, "get_rng_state", lambda device="cuda": torch.empty(0, dtype=torch.uint8))
        _patch(torch.cuda, "set_rng_state", lambda new_state, device="cuda": None)
        distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer").DistributedOptimizer
        _patch(distrib, "state_dict", _state_dict_with_optimizer_state(distrib.state_dict))
        _patch(distrib, "load_state_dict", _load_state_dict_with_steps(distrib.load_state_dict))
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return installed_harness


TRAINING_FLAGS = (
    "--distributed-backend",
    "gloo",
    "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--transformer-impl",
    "local",
    "--rerun-mode",
    "disabled",  # its state saving reads torch.cuda.get_rng_state()
    "--num-workers",
    "0",  # a data-loader worker forked from a rank whose gloo threads run can hang in the child (CPython's
    # after-fork lock: a run of the suite did, its worker stuck in os.fork's child); the main process loads
)
"""Megatron flags a CPU training run puts in front of its command line (later flags win)."""


def uninstall():
    """Undo :func:`install` (no-op when not installed)."""
    global _mode
    if _mode is None:
        return
    _mode.__exit__(None, None, None)
    _mode = None
    while _saved:
        owner, name, value = _saved.pop()
        if value is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, value)


def installed():
    """Whether the redirections are active."""
    return _mode is not None
