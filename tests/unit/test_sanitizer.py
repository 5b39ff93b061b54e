"""``testing.dispatch.SyncSanitizer`` has no CPU blind spot: each way the plugin can make a GPU run's
host wait for the device is counted on a CPU run, once, and at the plugin's frame; what would stay on
the host, and Megatron's own synchronisations, are not.

Code "in the plugin" or "in Megatron" is compiled here under a file name inside that package: the
sanitizer attributes by the frames' file names only."""

import os

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_gift.numerics.refresh import HostCopy
from megatron_gift.testing import dispatch
from megatron_gift.testing.dispatch import SyncSanitizer

PLUGIN = os.path.join(dispatch._PACKAGE, "comm", "probe_target.py")
MEGATRON = os.path.join(os.sep, "site", "megatron", "core", "distributed", "param_and_grad_buffer.py")


def _function(path: str, source: str, **names):
    """The function ``f`` of ``source``, compiled as if it were in file ``path``."""
    ns = {"torch": torch, **names}
    exec(compile(source, path, "exec"), ns)
    return ns["f"]


def _events(fn, *args) -> list[str]:
    with SyncSanitizer() as s:
        fn(*args)
    return [op for op, _ in s.events]


READS = {
    "tolist": "x.tolist()",
    "numpy": "x.numpy()",
    "cpu": "x.cpu()",
    "to": "x.to('cpu')",
    "item": "x[0].item()",
    "float": "float(x[0])",
    "bool": "bool(x[0] > 0)",
    "int": "int(x[0])",
    "new_tensor": "x.new_tensor([1.0, 2.0])",
    "tensor on a device": "torch.tensor([1.0], device=x.device)",
    "nonzero": "torch.nonzero(x)",
    "mask": "x[x > 0]",
}


@pytest.mark.parametrize("read", list(READS), ids=list(READS))
def test_each_host_read_of_a_device_tensor_counts_once(read):
    """``.tolist()``, ``.cpu()``, ``.numpy()`` and ``.to("cpu")`` dispatch no ATen op on a CPU tensor:
    a sanitizer at dispatch level alone passes a steady path that calls them, though each is a
    device-to-host copy on a GPU. Every read of a tensor the plugin computed counts exactly once."""
    fn = _function(PLUGIN, f"def f(x):\n    {READS[read]}\n")
    x = torch.arange(1.0, 4.0) * 2  # computed: on the device in a GPU run
    assert len(_events(fn, x)) == 1, _events(fn, x)


class _Below(TorchFunctionMode):
    """A function mode entered before the sanitizer, as the CPU harness's is in a launcher run."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("read", list(READS), ids=list(READS))
def test_each_host_read_counts_once_above_another_function_mode(read):
    """With the reads wrapped (for the backward's hooks), a function mode below the sanitizer's that
    handles a read calls the wrapper again with the sanitizer's popped: judged there too, one
    ``sums.tolist()`` of the telemetry counted twice in the launcher (the CPU harness's mode)."""
    fn = _function(PLUGIN, f"def f(x):\n    {READS[read]}\n")
    x = torch.arange(1.0, 4.0) * 2
    with _Below():
        assert len(_events(fn, x)) == 1, _events(fn, x)


def test_tensors_that_stay_on_the_host_are_free_to_read():
    """Plans are built from Python data on the host, and ``HostCopy.wait`` hands over host copies: reading
    them waits for nothing. Counting them would hide real syncs in noise; the wait itself counts once."""
    fn = _function(
        PLUGIN,
        """def f(device_tensor):
    plan = torch.tensor([3, 1, 2])          # no device: a host tensor
    total = plan.cumsum(0)[-1].tolist() + int(plan.max())
    host = HostCopy([device_tensor], device_tensor.device).wait()[0]
    total += host.sum().tolist()
    plan[0] = 5                            # a Python number into a host tensor
    device_tensor[0] = 0                   # a Python number into a device tensor: a kernel argument
    return total
""",
        HostCopy=HostCopy,
    )
    assert _events(fn, torch.ones(3) * 2) == ["HostCopy.wait"]


def test_host_to_device_copies_count_unless_non_blocking():
    """A host tensor moved to the device from pageable memory blocks the host; the plugin's own
    transfers are non-blocking from pinned memory and must stay so."""
    blocking = _function(PLUGIN, "def f(d):\n    torch.tensor([1.0, 2.0]).to(d)\n")
    pinned = _function(PLUGIN, "def f(d):\n    torch.tensor([1.0, 2.0]).to(d, non_blocking=True)\n")
    assert _events(blocking, torch.device("cpu")) == ["to(device)"]
    assert _events(pinned, torch.device("cpu")) == []


def test_a_plugin_call_into_megatron_that_syncs_is_the_plugins():
    """A sanitizer that stops at the innermost Megatron frame lets the plugin hide a sync behind any
    Megatron helper it calls; Megatron's ``STOCK`` functions (its own gradient check, its training log)
    stay Megatron's, as do syncs reached from the tests' and the launcher's loops."""
    helper = _function(
        MEGATRON.replace("param_and_grad_buffer.py", "utils.py"), "def f(x):\n    return x.sum().item()\n"
    )
    stock = _function(MEGATRON, "def check_grads(x):\n    return x.sum().item()\nf = check_grads\n")
    launcher = _function(dispatch._LAUNCHER, "def f(g, x):\n    return g(x)\n")
    x = torch.ones(3) * 2
    assert _events(_function(PLUGIN, "def f(x):\n    return helper(x)\n", helper=helper), x) == ["_local_scalar_dense"]
    assert _events(_function(PLUGIN, "def f(x):\n    return stock(x)\n", stock=stock), x) == []
    assert _events(helper, x) == []  # from this test's frames
    assert _events(launcher, _function(MEGATRON, "def f(x):\n    return x.sum().item()\n"), x) == []


def test_host_reads_in_the_backwards_hooks_count():
    """The bucket groups' reductions start in autograd hooks, which the engine runs without the
    function modes of the ``backward()`` call: a ``.tolist()`` or ``.cpu()`` there passed unseen (the
    dispatch-level ``.item()`` did not). Each counts once in a hook as outside one; a host copy, and a host
    tensor made or computed from host tensors in the hook, stay free to read."""
    fn = _function(
        PLUGIN,
        "def f(p):\n    p.grad.sum().tolist()\n    [r.tolist() for r in p.grad.view(2, 2).cpu()]\n"
        "    (torch.zeros(2) + 1).tolist()\n",
    )
    w = torch.nn.Parameter(torch.ones(4))
    w.register_post_accumulate_grad_hook(fn)
    with SyncSanitizer() as s:
        (w * (torch.ones(4) * 3)).sum().backward()
    assert [op for op, _ in s.events] == ["tolist", "cpu"], s.events
    assert _events(fn, w) == ["tolist", "cpu"]
    assert torch.Tensor.tolist is dispatch._READS[0]  # the wrappers are gone with the sanitizer
