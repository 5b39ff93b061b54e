"""Put :class:`GiftDistributedDataParallel` where ``megatron.training`` builds its DDP wrapper
(and its state into Megatron's checkpoints, :mod:`megatron_gift.megatron.checkpoint`).

Megatron-Core 0.19's training loop constructs ``DistributedDataParallel`` itself, looked up by
name at call time in two places:

* ``megatron.training.models.dist_utils.DistributedDataParallel`` -- the ``ModelConfig`` /
  ``ModelBuilder`` path that Megatron-LM's ``pretrain_gpt.py`` (and
  :mod:`megatron_gift.pretrain_gpt`) takes (``_ddp_wrap``);
* ``megatron.training.training.DDP`` -- the older ``model_provider`` path (``get_model``).

:func:`gift_ddp` rebinds both names, for the duration of a ``with`` block around
``pretrain(...)``, to a subclass of :class:`GiftDistributedDataParallel` that carries the
:class:`GiftConfig` (Megatron passes only its own constructor arguments). Both places compare
the class they picked with that same global (``DP is DistributedDataParallel`` decides whether
the distributed optimizer's parameter layout is computed), so the swap keeps those branches.
Nothing else in Megatron changes: isinstance checks against Megatron's class still hold for
the subclass. With ``gift_config=None`` (``--gift-mode off``) the block changes nothing, so
Megatron's own ``DistributedDataParallel`` is used.

The alternative, a ``ModelConfig.post_wrap_hooks`` entry, runs after Megatron's DDP has built
its buffers and registered its gradient hooks; converting that object in place would mean
re-running DDP's constructor on it. Rebinding the class before construction is smaller.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import typing
from pathlib import Path

from ..arguments import startup_errors
from ..config import GiftConfig
from ..telemetry import TELEMETRY_FILE, TelemetryWriter
from .checkpoint import checkpoint_hooks
from .ddp import GiftDistributedDataParallel

# (module, global name) where megatron.training looks up the DDP class when it wraps a model.
DDP_SITES = (
    ("megatron.training.models.dist_utils", "DistributedDataParallel"),
    ("megatron.training.training", "DDP"),
)


def _print_rank0(msg: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def shim_typing_override() -> None:
    """``megatron.training`` imports ``typing.override`` (Python 3.12); provide it on 3.11."""
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def gift_ddp_class(gift_config: GiftConfig, validate=None, telemetry_dir=None, instances: list | None = None) -> type:
    """A :class:`GiftDistributedDataParallel` subclass constructed with Megatron's arguments only.

    ``validate``: called with the wrapped module's trainable ``(name, param)`` pairs before the
    buffers are built (e.g. ``functools.partial(validate_gift_args, args)``); its ``ValueError``, or the
    DDP's refusal of a setting, ends the run as a start-up error (``arguments.startup_errors``). Every
    ``gift_config.log_interval`` iterations rank 0 prints the bytes the last iteration's
    gradient reduction sent, and the step's telemetry record goes to :func:`telemetry_sink`
    (``telemetry_dir``). ``instances``: a list each new instance is appended to (the checkpoint
    and loss hooks find them there)."""
    log_interval = gift_config.log_interval

    class TrainingGiftDistributedDataParallel(GiftDistributedDataParallel):
        """GiftDistributedDataParallel with the launcher's GiftConfig bound (see :func:`gift_ddp`)."""

        def __init__(self, config, ddp_config, module, *args, **kwargs):
            kwargs.setdefault("gift_config", gift_config)
            with startup_errors():  # a refused model or setting: one message from rank 0, exit status 2
                if validate is not None:
                    validate([(n, p) for n, p in module.named_parameters() if p.requires_grad])
                super().__init__(config, ddp_config, module, *args, **kwargs)
            if instances is not None:
                instances.append(self)
            if log_interval:
                self.monitor.sink = telemetry_sink(telemetry_dir)

        def _close_step(self):
            # when a step closes: at the next iteration's start, or at a checkpoint (the last iteration's)
            iteration = self.step + 1 if self.gift_state.step_open else None  # Megatron's count, from 1
            super()._close_step()
            sent = self.last_step_bytes
            if log_interval and iteration is not None and iteration % log_interval == 0 and sent:
                _print_rank0(
                    f"megatron-gift: iteration {iteration}: gradient reduction sent {sum(sent.values())} bytes "
                    f"from this rank ({', '.join(f'{k} {v}' for k, v in sent.items())})"
                )

    TrainingGiftDistributedDataParallel.__qualname__ = TrainingGiftDistributedDataParallel.__name__
    return TrainingGiftDistributedDataParallel


def telemetry_sink(directory):
    """Where this rank's telemetry records go: ``<directory>/gift_telemetry.jsonl`` from data-parallel
    rank 0 (``gift_telemetry-pp<P>-tp<T>.jsonl`` for the other model-parallel coordinates), and
    Megatron's TensorBoard / W&B writers on the rank that holds them; None if neither applies."""
    from megatron.core import parallel_state as ps
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    path = None
    if directory is not None and ps.get_data_parallel_rank(with_context_parallel=True) == 0:
        pp, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
        coords = ps.get_pipeline_model_parallel_world_size() > 1 or ps.get_tensor_model_parallel_world_size() > 1
        path = Path(directory) / (f"gift_telemetry-pp{pp}-tp{tp}.jsonl" if coords and (pp or tp) else TELEMETRY_FILE)
    tensorboard, wandb = get_tensorboard_writer(), get_wandb_writer()
    if path is None and tensorboard is None and wandb is None:
        return None
    return TelemetryWriter(path, tensorboard=tensorboard, wandb=wandb).log


@contextlib.contextmanager
def _loss_hook(instances: list):
    """Hand the logged language-model loss of each iteration to the instances' telemetry, as it is
    (a tensor on the device: ``Monitor.close`` reads it on logging steps only, no host sync otherwise)."""
    training = importlib.import_module("megatron.training.training")
    original = training.training_log

    @functools.wraps(original)
    def training_log(loss_dict, *args, **kwargs):
        loss = loss_dict.get("lm loss", next(iter(loss_dict.values()), None)) if loss_dict else None
        for ddp in instances:
            ddp.monitor.loss = loss
        return original(loss_dict, *args, **kwargs)

    training.training_log = training_log
    try:
        yield
    finally:
        training.training_log = original


@contextlib.contextmanager
def gift_ddp(gift_config: GiftConfig | None, validate=None, telemetry_dir=None):
    """Within the block, ``megatron.training`` wraps models in GIFT's DDP (see the module doc).

    Yields the class installed, or None when ``gift_config`` is None (nothing changes then).
    Raises ``RuntimeError`` if a site no longer holds Megatron's ``DistributedDataParallel``
    (another patch, or a Megatron version that moved it) instead of silently training without GIFT.
    """
    if gift_config is None:
        yield None
        return
    shim_typing_override()
    from megatron.core.distributed import DistributedDataParallel

    instances = []
    cls = gift_ddp_class(gift_config, validate=validate, telemetry_dir=telemetry_dir, instances=instances)
    saved = []
    for module_name, attr in DDP_SITES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # an older megatron.training without the ModelBuilder path
            continue
        current = getattr(module, attr, None)
        if current is not DistributedDataParallel:
            raise RuntimeError(
                f"megatron-gift: {module_name}.{attr} is {current!r}, not Megatron-Core's DistributedDataParallel; "
                "cannot install GiftDistributedDataParallel there"
            )
        saved.append((module, attr, current))
    if not saved:
        raise RuntimeError(f"megatron-gift: none of {[f'{m}.{a}' for m, a in DDP_SITES]} can be imported")
    for module, attr, _ in saved:
        setattr(module, attr, cls)
    try:
        with checkpoint_hooks(instances), _loss_hook(instances):
            yield cls
        # training ended: no next iteration (nor, without --save, a checkpoint) closes the last step,
        # whose bytes line and telemetry record are written now (collectives: every rank gets here)
        for ddp in instances:
            ddp._close_step()
    finally:
        for module, attr, original in saved:
            setattr(module, attr, original)


def describe_wrappers(model_chunks) -> str:
    """``'<module>.<class>'`` of the DDP wrapper(s) of ``model_chunks`` (for the launcher's log line)."""
    names = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model_chunks})
    gift = all(isinstance(m, GiftDistributedDataParallel) for m in model_chunks)
    return f"{', '.join(names)} ({'a GiftDistributedDataParallel' if gift else 'not GIFT'})"


def use_prebuilt_dataset_helpers() -> bool:
    """Skip ``initialize_megatron``'s ``make`` of the dataset helpers when they are already built.

    ``pretrain`` -> ``initialize_megatron`` -> ``_compile_dependencies`` runs
    ``megatron.core.datasets.utils.compile_helpers()`` (``make -C megatron/core/datasets``) on
    rank 0 and exits if it fails. The PyPI wheel ships the compiled ``helpers_cpp`` extension
    but no Makefile, so that ``make`` always fails there. When ``helpers_cpp`` imports, this
    replaces ``compile_helpers`` with a no-op and returns True; otherwise (a source checkout
    with its Makefile) it changes nothing and returns False."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    utils = importlib.import_module("megatron.core.datasets.utils")

    @functools.wraps(inspect.unwrap(utils.compile_helpers))  # upstream's source stays reachable (its fingerprint)
    def prebuilt() -> None:
        return None

    utils.compile_helpers = prebuilt
    return True
