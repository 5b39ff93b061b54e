"""``GiftConfig`` by concern: which sub-config each setting and flag belongs to, present exactly where it applies."""

import argparse
import dataclasses

import pytest

from megatron_gift.arguments import _ineffective_flags, add_gift_args, flag_concerns, gift_config_from_args
from megatron_gift.config import (
    DeltaGatherConfig,
    Exchange,
    ExchangeConfig,
    GiftConfig,
    InterNodeFormat,
    Mode,
    PolicyConfig,
    Side,
    WhiteningConfig,
    WireConfig,
)
from megatron_gift.numerics.fp8 import CodecConfig, Scaling

# Written out by hand (not read from the code): each flag's concern, and a value other than its default.
CONCERN_OF_FLAG = {
    "--gift-mode": ("general", "gift"),
    "--gift-layers": ("general", "linear_fc1"),
    "--gift-euclidean-layers": ("general", "word_embeddings"),
    "--gift-log-interval": ("general", "5"),
    "--gift-telemetry-dir": ("general", "/tmp/x"),
    "--gift-allow-untested-megatron": ("general", None),
    "--gift-fp8-format": ("wire", "e5m2"),
    "--gift-scaling": ("wire", "row"),
    "--gift-block-size": ("wire", "64"),
    "--gift-inter-node-format": ("wire", "nvfp4"),
    "--gift-rotation": ("wire", "hadamard"),
    "--gift-error-feedback": ("wire", None),
    "--gift-rank": ("whitening", "8"),
    "--gift-sketch": ("whitening", "40"),
    "--gift-refresh-interval": ("whitening", "3"),
    "--gift-ema": ("whitening", "0.5"),
    "--gift-damping": ("whitening", "1.0"),
    "--gift-side": ("whitening", "both"),
    "--gift-profile-steps": ("policy", "3"),
    "--gift-profile-interval": ("policy", "20"),
    "--gift-policy-margin": ("policy", "0.1"),
    "--gift-policy-hysteresis": ("policy", "1"),
    "--gift-bf16-bound": ("policy", "0.2"),
    "--gift-exchange": ("exchange", "flat"),
    "--gift-intra-node": ("exchange", "fp8"),
    "--gift-ranks-per-node": ("exchange", "2"),
    "--gift-schedule": ("exchange", "eager"),
    "--gift-loopback": ("exchange", None),
    "--gift-inflight-mb": ("exchange", "64"),
    "--gift-param-gather": ("param_gather", "delta"),
    "--gift-param-gather-full-every": ("param_gather", "4"),
}


def _parse(*argv):
    return add_gift_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_each_flag_sits_in_its_concerns_group():
    """Bug caught: a flag added to the wrong argument group, so ``--help`` and the ineffective-flag
    warning (which reads the groups) put it under a concern whose absence does not switch it off."""
    got = {"--" + dest.replace("_", "-"): concern for dest, concern in flag_concerns().items() if dest != "help"}
    assert got == {flag: concern for flag, (concern, _) in CONCERN_OF_FLAG.items()}


def test_top_level_has_at_most_ten_fields_and_the_sub_configs_are_frozen():
    """Bug caught: settings piling up flat on ``GiftConfig`` again, or a sub-config one can mutate."""
    assert len(dataclasses.fields(GiftConfig)) <= 10
    for sub in (WireConfig(), WhiteningConfig(), ExchangeConfig(), DeltaGatherConfig(), PolicyConfig()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(sub, dataclasses.fields(sub)[0].name, None)


@pytest.mark.parametrize("mode", list(Mode), ids=[m.value for m in Mode])
def test_whitening_is_present_exactly_in_gift_mode(mode):
    """Bug caught: a whitening (rank, statistics, refresh) kept for a mode that never whitens, or GIFT
    without one; the flags' path and the flat builder agree."""
    built = GiftConfig.build(mode=mode, rank=8, sketch=16)
    from_flags = gift_config_from_args(_parse("--gift-mode", mode.value, "--gift-rank", "8", "--gift-sketch", "16"))
    if mode is Mode.GIFT:
        assert built.whitening == from_flags.whitening == WhiteningConfig(rank=8, sketch=16)
    else:
        assert built.whitening is None
        assert from_flags is None if mode is Mode.OFF else from_flags.whitening is None
    if mode is not Mode.GIFT:
        with pytest.raises(ValueError, match="need mode gift"):
            GiftConfig(mode=mode, whitening=WhiteningConfig())


def test_flat_settings_land_in_their_sub_config():
    """Bug caught: a flat setting (the flags' and the older flat ``GiftConfig``'s names) routed to the
    wrong sub-config or dropped by ``build``; ``flat()`` gives back what ``build`` took."""
    cfg = GiftConfig.build(
        mode="gift",
        codec=CodecConfig("e5m2", "row"),
        inter_node_format="nvfp4",
        rotation="hadamard",
        rotation_seed=7,
        rank=8,
        sketch=16,
        damping=2.0,
        side="input",
        ema=0.5,
        refresh_interval=3,
        exchange="flat",
        intra_node="fp8",
        ranks_per_node=2,
        schedule="lagged",
        kernels=False,
        loopback=True,
        inflight_mb=64,
        param_gather="delta",
        param_gather_full_every=4,
        param_gather_check_every=9,
        log_interval=5,
    )
    assert cfg.wire == WireConfig(CodecConfig("e5m2", "row"), InterNodeFormat.NVFP4, "hadamard", 7, False)
    assert cfg.whitening == WhiteningConfig(8, 16, 2.0, (0.3, 1.0, 3.0, 10.0), Side.INPUT, 0.5, 3)
    assert cfg.exchange == ExchangeConfig(Exchange.FLAT, "fp8", 2, "lagged", False, True, 64)
    assert cfg.param_gather == DeltaGatherConfig(4, 9) and cfg.log_interval == 5
    assert GiftConfig.build(**cfg.flat()) == cfg
    assert cfg.replace(mode="euclidean").whitening is None and cfg.replace(rank=4).whitening.rank == 4
    assert GiftConfig.build(param_gather_full_every=3).param_gather is None  # bf16 gather: nothing to set
    with pytest.raises(TypeError, match="unexpected setting 'rnak'"):
        GiftConfig.build(rnak=3)


def test_cross_concern_combinations_are_refused():
    """Bug caught: a combination no exchange can serve accepted silently (tensor scaling with four bits,
    a rotation with FP8, two-sided whitening with four bits, a policy without GIFT)."""
    with pytest.raises(ValueError, match="tensor scaling"):
        WireConfig(CodecConfig("e4m3", Scaling.TENSOR), inter_node_format="mxfp4")
    with pytest.raises(ValueError, match="needs inter_node_format nvfp4 or mxfp4"):
        WireConfig(rotation="hadamard")
    with pytest.raises(ValueError, match="whitens the input side alone"):
        GiftConfig.build(mode="gift", side="both", inter_node_format="nvfp4")
    with pytest.raises(ValueError, match="policy needs mode gift"):
        GiftConfig(mode=Mode.EUCLIDEAN, policy=PolicyConfig())


# Which concerns each mode (with no --gift-euclidean-layers, no auto, no delta gather) leaves absent.
ABSENT = {
    "bf16": {"wire", "whitening", "policy", "param_gather"},
    "euclidean": {"whitening", "policy", "param_gather"},
    "gift": {"policy", "param_gather"},
}


@pytest.mark.parametrize("mode", list(ABSENT))
def test_a_flag_is_ineffective_exactly_where_its_concern_is_absent(mode):
    """Bug caught: a flag the chosen configuration never reads passing without a warning (the user
    believes it acts), or a flag that does act warned about as ignored (``--gift-rotation`` acts in
    Euclidean mode too: it rotates every coded layer); the flags that refuse instead of warning, and the
    within-concern conditions (block size, intra-node, telemetry directory), are tested in
    tests/unit/test_arguments.py."""
    exceptions = {
        "--gift-mode",
        "--gift-param-gather",
        "--gift-param-gather-full-every",  # refused without delta
        "--gift-block-size",  # needs block scaling: given with the default block scaling here
        "--gift-telemetry-dir",  # needs --gift-log-interval
        "--gift-layers",  # 'auto' is the policy; a pattern always acts
        "--gift-side",  # refused with four bits, tested alone
        "--gift-inter-node-format",  # refused with --gift-side both, tested alone
    }
    for flag, (concern, value) in CONCERN_OF_FLAG.items():
        if flag in exceptions:
            continue
        argv = ["--gift-mode", mode, flag] + ([value] if value is not None else [])
        if flag == "--gift-rotation":
            argv += ["--gift-inter-node-format", "nvfp4"]
        args = _parse(*argv)
        warned = {"--" + k.replace("_", "-") for k, _ in _ineffective_flags(args, gift_config_from_args(args))}
        assert (flag in warned) == (concern in ABSENT[mode]), (mode, flag, warned)
