"""What the plugin takes from Megatron-Core by name (functions it re-implements, attributes it
reads) stays what it was written against, Megatron is accepted by those sources rather than its
version string, and what the plugin cannot serve is refused at start-up (CUDA graphs)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_gift import upstream
from megatron_gift.megatron.training import shim_typing_override, use_prebuilt_dataset_helpers


def test_upstream_sources_unchanged():
    """The installed megatron-core's row of ``KNOWN_GOOD`` is its sources' fingerprints: an upgrade, or a
    row recorded wrong, fails here. For a new release: re-read the changed upstream sources, update the
    plugin's code, then add the release's row (every key of ``UPSTREAM``)."""
    shim_typing_override()
    import megatron.training.checkpointing  # noqa: F401  (every module of UPSTREAM imported)
    import megatron.training.training  # noqa: F401

    version = upstream.installed_version()
    assert version in upstream.KNOWN_GOOD, f"megatron-core {version} has no row in upstream.KNOWN_GOOD"
    want = upstream.KNOWN_GOOD[version]
    changed = [
        f"{key} ({use}): recorded {want[key]}, installed {upstream.fingerprint(key)}"
        for key, use in upstream.UPSTREAM.items()
        if upstream.fingerprint(key) != want[key]
    ]
    assert not changed, "upstream Megatron changed under megatron-gift:\n" + "\n".join(changed)
    assert upstream.changed_upstream() == []


def test_every_known_good_row_covers_every_entry():
    """A row missing an entry (or naming one that is gone) would accept a release unchecked for it."""
    assert {"0.19.1", "0.19.2"} <= set(upstream.KNOWN_GOOD)
    for version, row in upstream.KNOWN_GOOD.items():
        assert set(row) == set(upstream.UPSTREAM), version


def test_fingerprints_read_upstream_through_the_plugins_patches(monkeypatch):
    """The launcher's no-op ``compile_helpers`` keeps upstream's source reachable: a guard run after
    it (the suite's in-process launches) fingerprinted the no-op and reported upstream as changed."""
    import megatron.core.datasets.utils as utils

    key = "megatron.core.datasets.utils:compile_helpers"
    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)  # restored after the test
    if not use_prebuilt_dataset_helpers():
        pytest.skip("no prebuilt dataset helpers: nothing is patched")
    assert (
        utils.compile_helpers() is None
        and upstream.fingerprint(key) == upstream.KNOWN_GOOD[upstream.installed_version()][key]
    )


@pytest.mark.cpu_harness
def test_fingerprints_read_upstream_through_the_launchers_patches(monkeypatch):
    """The start-up check runs with the launcher's patches in place: the CPU harness's RNG replacements
    and the checkpoint hooks were fingerprinted instead of Megatron's functions, refusing every launch."""
    from megatron_gift.config import GiftConfig, Mode
    from megatron_gift.megatron import cpu_harness
    from megatron_gift.megatron.training import gift_ddp

    monkeypatch.delenv(upstream.ALLOW_ENV, raising=False)
    with cpu_harness.install(), gift_ddp(GiftConfig(mode=Mode.EUCLIDEAN)):
        assert upstream.changed_upstream() == []
        upstream.check_upstream()


def test_fingerprint_sees_a_one_character_change(monkeypatch):
    """The fingerprint is of the source text: a changed line gives another one."""
    key = next(iter(upstream.UPSTREAM))
    source = upstream.inspect.getsource(upstream.resolve(key))
    monkeypatch.setattr(upstream.inspect, "getsource", lambda obj: source.replace("self", "selg", 1))
    assert upstream.fingerprint(key) != upstream.KNOWN_GOOD[upstream.installed_version()][key]


def test_megatron_names_still_defined():
    """A megatron-core upgrade that renames or drops an attribute the plugin uses (a bucket group's
    ``param_to_index``, the DDP's ``intra_expt_dp_group``, a ``DistributedDataParallelConfig`` field,
    a parameter tag) fails here instead of as an AttributeError, or a silent ``getattr`` default, in training."""
    shim_typing_override()
    gone = [
        f"{key}.{name} ({use})"
        for key, (names, use) in upstream.NAMES.items()
        for name in names
        if not upstream.defines(key, name)
    ]
    assert not gone, "names megatron-gift uses are gone from the installed Megatron:\n" + "\n".join(gone)


def test_defines_sees_a_removed_instance_attribute(monkeypatch):
    """An instance attribute is found by its assignment in the class source: without it, it is gone."""
    key = "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucket"
    assert upstream.defines(key, "param_to_index")
    source = upstream.inspect.getsource(upstream.resolve(key))
    monkeypatch.setattr(
        upstream.inspect, "getsource", lambda obj: source.replace("self.param_to_index =", "self.index =")
    )
    assert not upstream.defines(key, "param_to_index")


def _change_source(monkeypatch, key: str) -> None:
    """``key``'s source as ``inspect`` reads it, one character changed (what a new release could do)."""
    real = upstream.inspect.getsource
    target = upstream.inspect.unwrap(upstream.resolve(key))
    monkeypatch.setattr(
        upstream.inspect, "getsource", lambda obj: real(obj).replace("self", "selg", 1) if obj is target else real(obj)
    )


def test_megatron_accepted_by_its_sources_not_its_version(monkeypatch):
    """The documented Megatron-LM checkout (core_r0.19.0, megatron-core 0.19.1) was refused by its version
    string although every function the plugin depends on is the same: a version with matching
    fingerprints is accepted whatever it is called, and a changed function is refused by name."""
    info = __import__("megatron.core.package_info", fromlist=["x"])
    monkeypatch.delenv(upstream.ALLOW_ENV, raising=False)
    upstream.check_upstream()  # the installed version
    for version in ("0.19.1", "0.19.2", "0.20.0"):
        monkeypatch.setattr(info, "__shortversion__", version)
        upstream.check_upstream()
    key = "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.start_grad_sync"
    _change_source(monkeypatch, key)
    with pytest.raises(upstream.UntestedMegatronError) as exc:
        upstream.check_upstream()
    text = str(exc.value)
    assert key in text and upstream.UPSTREAM[key] in text and "megatron-core 0.20.0" in text
    others = [k for k in upstream.UPSTREAM if k != key]
    assert not any(k in text for k in others), "only the changed function is named"
    assert "--gift-allow-untested-megatron" in text and "tests/" not in text  # the image has no tests/
    upstream.check_upstream(allow_untested=True)
    monkeypatch.setenv(upstream.ALLOW_ENV, "1")
    upstream.check_upstream()


def test_any_matching_row_is_accepted_and_a_gone_function_refused(monkeypatch):
    """A release whose sources equal another release's row is accepted although its own row differs;
    a function gone from Megatron is refused by name (it raised AttributeError at start-up)."""
    import megatron.core.tensor_parallel.random as tp_random

    key = "megatron.core.tensor_parallel.random:_set_cuda_rng_state"
    version = upstream.installed_version()
    good = upstream.KNOWN_GOOD[version]
    wrong = {**good, key: "0" * 16}
    monkeypatch.delenv(upstream.ALLOW_ENV, raising=False)
    monkeypatch.setattr(upstream, "KNOWN_GOOD", {version: wrong, "0.19.99": good})
    upstream.check_upstream()  # another release's row matches
    monkeypatch.setattr(upstream, "KNOWN_GOOD", {version: wrong})
    with pytest.raises(upstream.UntestedMegatronError, match="_set_cuda_rng_state"):
        upstream.check_upstream()
    monkeypatch.setattr(upstream, "KNOWN_GOOD", {version: good})
    monkeypatch.delattr(tp_random, "_set_cuda_rng_state")
    with pytest.raises(upstream.UntestedMegatronError, match="_set_cuda_rng_state"):
        upstream.check_upstream()


def test_launcher_flag_overrides_the_guard(monkeypatch):
    """``--gift-allow-untested-megatron`` reaches the DDP's own check too (it used to pass the flag-level
    check and then be refused when the model was wrapped)."""
    shim_typing_override()
    from megatron.training.arguments import parse_args

    from megatron_gift.arguments import add_gift_args, gift_config_from_args, validate_gift_args
    from megatron_gift.megatron.ddp import refuse_unsupported

    monkeypatch.delenv(upstream.ALLOW_ENV, raising=False)
    _change_source(monkeypatch, "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork")
    base = ["x", "--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1", "--gift-mode", "euclidean"]
    monkeypatch.setattr("sys.argv", base)
    with pytest.raises(upstream.UntestedMegatronError, match="CudaRNGStatesTracker.fork"):
        validate_gift_args(parse_args(extra_args_provider=add_gift_args))
    monkeypatch.setattr("sys.argv", [*base, "--gift-allow-untested-megatron"])
    args = parse_args(extra_args_provider=add_gift_args)
    validate_gift_args(args)
    cfg = SimpleNamespace(enable_cuda_graph=False, external_cuda_graph=False, cuda_graph_impl="none")
    ddp_cfg = SimpleNamespace(reduce_scatter_with_fp32_accumulation=False, num_distributed_optimizer_instances=1)
    refuse_unsupported(cfg, ddp_cfg, gift_config_from_args(args))


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
        GiftDistributedDataParallel(
            cfg, DistributedDataParallelConfig(), torch.nn.Linear(2, 2), gift_config=GiftConfig(mode=Mode.EUCLIDEAN)
        )
