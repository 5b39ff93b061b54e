"""Host synchronisations outside the reduction path, checked on a CPU: the loss read on logging
iterations only, and refresh and profile steps that copy nothing from host memory."""

import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_gift.config import GiftConfig
from megatron_gift.megatron import training
from megatron_gift.megatron.monitor import Monitor
from megatron_gift.numerics import CodecConfig, LowRankWhitening, profile_gradient
from megatron_gift.numerics.fp8 import Scaling, divisor
from megatron_gift.numerics.profile import damping_errors
from megatron_gift.testing.dispatch import SyncSanitizer
from tests.unit.test_whitening import sample_rows, spectrum_factor


def test_loss_is_read_on_logging_iterations_only(monkeypatch):
    """The launcher's hook on Megatron's ``training_log`` converted the loss with ``float`` every
    iteration: a host synchronisation each step, where Megatron reads it at log intervals only.
    Non-logging iterations now read nothing; logging ones record the value."""
    logged = []
    megatron_training = types.ModuleType("megatron.training.training")  # stands in for Megatron's module
    megatron_training.training_log = lambda loss_dict, *args, **kwargs: logged.append(loss_dict)
    monkeypatch.setitem(sys.modules, "megatron.training.training", megatron_training)
    monitor = Monitor(GiftConfig(log_interval=2), set_mode=None, verbose=False)
    reads, records = [], []
    with training._loss_hook([types.SimpleNamespace(monitor=monitor)]):
        for step in range(4):
            loss = torch.tensor(8.0 - step)  # made before the probe: the sanitizer takes it for a device tensor
            with SyncSanitizer() as sanitizer:
                megatron_training.training_log({"lm loss": loss}, {}, 1e-4, step + 1)
                records.append(monitor.close(step, [], {}))
            reads.append(len(sanitizer.events))
    assert len(logged) == 4  # Megatron's own function still runs
    assert reads[1] == reads[3] == 0, reads
    assert [r and r["loss"] for r in records] == [8.0, None, 6.0, None]


class _Foreign(TorchDispatchMode):
    """Records ops given a tensor that is neither one of ``inputs`` nor made by an op while active:
    a constant kept in host memory, which on a GPU is a pageable host-to-device copy."""

    def __init__(self, inputs):
        super().__init__()
        self.known = {id(t) for t in inputs}
        self.made, self.foreign = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [*args, *(kwargs or {}).values()]
        tensors = [t for a in flat for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
        if any(id(t) not in self.known for t in tensors):
            self.foreign.append(str(func))
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor):
                self.made.append(t)  # kept alive: ids stay unique
                self.known.add(id(t))
        return out


def _tensors_of(obj):
    return [v for v in vars(obj).values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("scaling", list(Scaling))
def test_refresh_and_profile_steps_copy_no_host_constants(scaling):
    """Every FP8 round trip of a refresh's damping choice (1 + candidates per owned layer) and of a
    profile copied the scaling groups' lengths from a host-memory cache: on a GPU a pageable copy,
    each a host synchronisation. They are now filled on the device: the calls touch only their
    inputs and what they make, and nothing synchronises."""
    cfg = CodecConfig("e4m3", scaling.value)
    basis, evals = spectrum_factor(200, seed=0)  # 200 columns: a cut 1x128 block per row
    g = sample_rows(basis, evals, 2, n=24, seed=1).float()
    a = ((basis * evals) @ basis.T).float()
    whitenings = [LowRankWhitening.from_statistics(a, rank=8, damping=d) for d in (1e-3, 1e-2)]
    # the codec's divisor (fp8.divisor) is a device constant, filled on the device once and cached: not a host copy
    inputs = [g, *(t for w in whitenings for t in _tensors_of(w)), divisor(cfg.fmt.max, g.device)]
    for run in (lambda: damping_errors(g, whitenings, cfg), lambda: profile_gradient(g, cfg, whitening=whitenings[0])):
        run()  # a cache filled on the first call would be read on the next
        with _Foreign(inputs) as foreign, SyncSanitizer() as sanitizer:
            run()
        assert not foreign.foreign, foreign.foreign
        assert not sanitizer.events, sanitizer.events


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_fp4_round_trip_copies_no_host_constants(name):
    """The FP4 codec decoded through a value table built from Python data on every call (on a GPU a
    pageable host-to-device copy per message). The round trip now touches only its inputs and what it
    makes, and nothing synchronises (``repeat_interleave``'s output size, a readback on CUDA only, is
    given in the code; a CPU cannot see that one)."""
    from megatron_gift.numerics.fp4 import _E2M1_PAIRS, FP4_FORMATS, _e2m1_values, roundtrip_fp4

    fmt = FP4_FORMATS[name]
    x = torch.randn(4 * 128, generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([128, 256, 128], dtype=torch.int64)
    roundtrip_fp4(x, fmt, lengths)  # a cache filled on the first call would be read on the next
    # device constants, made on the device once: the NVFP4 segment scale's divisor, the E2M1 code values
    # and their pairs per byte
    known = [x, lengths, divisor(6.0 * 448.0, x.device), _e2m1_values(x.device), _E2M1_PAIRS[str(x.device)]]
    with _Foreign(known) as foreign, SyncSanitizer() as sanitizer:
        roundtrip_fp4(x, fmt, lengths)
    assert not foreign.foreign, foreign.foreign
    assert not sanitizer.events, sanitizer.events
