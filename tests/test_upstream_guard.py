"""What the plugin takes from Megatron-Core by name (functions it re-implements, attributes it
reads) stays what it was written against (defect 3), and what it cannot serve is refused at
start-up (defect 2: CUDA graphs)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_gift import upstream
from megatron_gift.megatron.training import shim_typing_override, use_prebuilt_dataset_helpers


def test_upstream_sources_unchanged():
    """A megatron-core upgrade that changes a re-implemented, wrapped or replaced function fails here:
    re-read the new upstream source, update the plugin's code, then its fingerprint in ``UPSTREAM``."""
    shim_typing_override()
    changed = [
        f"{key} ({use}): recorded {want}, installed {upstream.fingerprint(key)}"
        for key, (want, use) in upstream.UPSTREAM.items()
        if upstream.fingerprint(key) != want
    ]
    assert not changed, "upstream Megatron changed under megatron-gift:\n" + "\n".join(changed)


def test_fingerprints_read_upstream_through_the_plugins_patches(monkeypatch):
    """The launcher's no-op ``compile_helpers`` keeps upstream's source reachable: a guard run after
    it (the suite's in-process launches) fingerprinted the no-op and reported upstream as changed."""
    import megatron.core.datasets.utils as utils

    key = "megatron.core.datasets.utils:compile_helpers"
    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)  # restored after the test
    if not use_prebuilt_dataset_helpers():
        pytest.skip("no prebuilt dataset helpers: nothing is patched")
    assert utils.compile_helpers() is None and upstream.fingerprint(key) == upstream.UPSTREAM[key][0]


def test_fingerprint_sees_a_one_character_change(monkeypatch):
    """The fingerprint is of the source text: a changed line gives another one."""
    key = next(iter(upstream.UPSTREAM))
    source = upstream.inspect.getsource(upstream.resolve(key))
    monkeypatch.setattr(upstream.inspect, "getsource", lambda obj: source.replace("self", "selg", 1))
    assert upstream.fingerprint(key) != upstream.UPSTREAM[key][0]


def test_megatron_names_still_defined():
    """A megatron-core upgrade that renames or drops an attribute the plugin uses (a bucket group's
    ``param_to_index``, the DDP's ``intra_expt_dp_group``, a ``DistributedDataParallelConfig`` field,
    a parameter tag) fails here instead of as an AttributeError, or a silent ``getattr`` default, in training."""
    shim_typing_override()
    gone = [f"{key}.{name} ({use})" for key, (names, use) in upstream.NAMES.items() for name in names
            if not upstream.defines(key, name)]  # fmt: skip
    assert not gone, "names megatron-gift uses are gone from the installed Megatron:\n" + "\n".join(gone)


def test_defines_sees_a_removed_instance_attribute(monkeypatch):
    """An instance attribute is found by its assignment in the class source: without it, it is gone."""
    key = "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucket"
    assert upstream.defines(key, "param_to_index")
    source = upstream.inspect.getsource(upstream.resolve(key))
    monkeypatch.setattr(upstream.inspect, "getsource", lambda obj: source.replace("self.param_to_index =", "self.index ="))
    assert not upstream.defines(key, "param_to_index")


def test_untested_version_refused_with_override(monkeypatch):
    info = __import__("megatron.core.package_info", fromlist=["x"])
    monkeypatch.delenv(upstream.ALLOW_ENV, raising=False)
    upstream.check_version()  # the installed, tested version
    monkeypatch.setattr(info, "__shortversion__", "0.20.0")
    with pytest.raises(RuntimeError) as exc:
        upstream.check_version()
    assert "megatron-core 0.19.2" in str(exc.value) and "megatron-core 0.20.0" in str(exc.value)
    assert "--gift-allow-untested-megatron" in str(exc.value)
    upstream.check_version(allow_untested=True)
    monkeypatch.setenv(upstream.ALLOW_ENV, "1")
    upstream.check_version()


def test_launcher_flag_overrides_the_version_guard(monkeypatch):
    shim_typing_override()
    from megatron.training.arguments import parse_args

    from megatron_gift.arguments import add_gift_args, validate_gift_args

    info = __import__("megatron.core.package_info", fromlist=["x"])
    monkeypatch.delenv(upstream.ALLOW_ENV, raising=False)
    monkeypatch.setattr(info, "__shortversion__", "0.20.0")
    base = ["x", "--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1", "--gift-mode", "euclidean"]
    monkeypatch.setattr("sys.argv", base)
    with pytest.raises(RuntimeError, match="tested with megatron-core 0.19.2"):
        validate_gift_args(parse_args(extra_args_provider=add_gift_args))
    monkeypatch.setattr("sys.argv", [*base, "--gift-allow-untested-megatron"])
    validate_gift_args(parse_args(extra_args_provider=add_gift_args))


@pytest.mark.parametrize(
    "config, named",
    [
        (dict(enable_cuda_graph=True), "enable_cuda_graph"),
        (dict(external_cuda_graph=True), "external_cuda_graph"),
        (dict(cuda_graph_impl="transformer_engine"), "cuda_graph_impl='transformer_engine'"),
    ],
)
def test_python_api_refuses_cuda_graphs(config, named):
    """GiftDistributedDataParallel refuses before Megatron builds anything (no process group needed)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_gift.config import GiftConfig, Mode
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    cfg = SimpleNamespace(enable_cuda_graph=False, external_cuda_graph=False, cuda_graph_impl="none")
    cfg.__dict__.update(config)
    with pytest.raises(ValueError, match=rf"does not support CUDA graphs \({named}\)"):
        GiftDistributedDataParallel(cfg, DistributedDataParallelConfig(), torch.nn.Linear(2, 2),
                                    gift_config=GiftConfig(mode=Mode.EUCLIDEAN))  # fmt: skip
