"""``--gift-*`` flags parsed by Megatron's real ``parse_args``, mapped to GiftConfig, and validated."""

import argparse
import sys
import typing

import pytest
import torch

from megatron_gift.arguments import (
    add_gift_args,
    chain_args_providers,
    gift_config_from_args,
    telemetry_dir,
    validate_gift_args,
)
from megatron_gift.config import (
    DeltaGatherConfig,
    GiftConfig,
    IntraNode,
    Mode,
    ParamGather,
    PolicyConfig,
    Side,
    WhiteningConfig,
)
from megatron_gift.numerics.fp8 import CodecConfig, FP8Format, Scaling

MEGATRON_ARGV = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "1",
]

H = 64
NAMED_PARAMS = [
    (name, torch.empty(shape))
    for name, shape in [
        ("embedding.word_embeddings.weight", (128, H)),
        ("decoder.layers.0.input_layernorm.weight", (H,)),
        ("decoder.layers.0.self_attention.linear_qkv.weight", (3 * H, H)),
        ("decoder.layers.0.self_attention.linear_proj.weight", (H, H)),
        ("decoder.layers.0.mlp.linear_fc1.weight", (4 * H, H)),
        ("decoder.layers.0.mlp.linear_fc2.weight", (H, 4 * H)),
        ("decoder.final_layernorm.weight", (H,)),
        ("output_layer.weight", (128, H)),
    ]
]


@pytest.fixture(scope="module")
def megatron_parse_args():
    """Megatron's ``parse_args``; ``megatron.training`` needs ``typing.override`` (Python 3.12) at import."""
    with pytest.MonkeyPatch.context() as mp:
        if not hasattr(typing, "override"):
            import typing_extensions

            mp.setattr(typing, "override", typing_extensions.override, raising=False)
        from megatron.training.arguments import parse_args
    return parse_args


@pytest.fixture
def parse(megatron_parse_args, monkeypatch):
    """``parse(*flags, provider=add_gift_args)``: Megatron's namespace for the minimal model plus ``flags``."""

    def run(*flags, provider=add_gift_args):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MEGATRON_ARGV, *flags])
        return megatron_parse_args(extra_args_provider=provider, ignore_unknown_args=False)

    return run


def test_defaults_change_nothing(parse):
    args = parse()
    assert args.gift_mode == "off" and args.gift_log_interval == 0
    assert gift_config_from_args(args) is None
    validate_gift_args(args, NAMED_PARAMS)
    plain = vars(parse(provider=None))
    assert {k: v for k, v in vars(args).items() if not k.startswith("gift_")} == plain


def test_default_mode_is_off_in_flags_and_config(parse):
    assert parse().gift_mode == GiftConfig().mode.value == "off"  # adding the flags changes nothing
    assert gift_config_from_args(parse()) is None


def test_defaults_come_from_gift_config(parse):
    """The flags' defaults are GiftConfig's, which are the documented ones (written out here, not
    read from GiftConfig: a changed default must change this test too)."""
    cfg = gift_config_from_args(parse("--gift-mode", "gift"))
    assert cfg == GiftConfig(mode=Mode.GIFT)
    assert (cfg.mode, cfg.wire.codec.fmt, cfg.wire.codec.scaling, cfg.wire.codec.block) == (
        Mode.GIFT,
        FP8Format.E4M3.wire,
        Scaling.BLOCK,
        128,
    )
    w = cfg.whitening
    assert (w.rank, w.sketch, w.damping, w.ema, w.refresh_interval) == (
        32,
        64,
        None,
        0.95,
        10,
    )  # damping None: auto
    assert w.damping_candidates == (0.3, 1.0, 3.0, 10.0)
    assert (cfg.wire.error_feedback, cfg.euclidean_layers, cfg.policy, cfg.log_interval) == (False, (), None, 0)
    assert cfg.layers == (r"\.linear_(qkv|proj|fc1|fc2)\.weight$",)
    assert w.side is Side.INPUT


@pytest.mark.parametrize("intra", ["fp32", "bf16", "fp8"])
def test_intra_node_flag_reaches_the_config(parse, intra):
    """Bug caught: ``--gift-intra-node fp8`` (or fp32) dropped on its way to ``GiftConfig``, the
    two-level exchange silently running its BF16 default (tests/dist/test_wire_paths.py holds the config
    to what the intra-node stage sends)."""
    assert gift_config_from_args(
        parse("--gift-mode", "gift", "--gift-intra-node", intra)
    ).exchange.intra_node is IntraNode(intra)


@pytest.mark.parametrize(
    "flags,want",
    [
        (["--gift-inter-node-format", "nvfp4", "--use-distributed-optimizer"], "reduce-scatter"),
        (["--gift-inter-node-format", "mxfp4", "--use-distributed-optimizer"], "reduce-scatter"),
        (["--gift-inter-node-format", "nvfp4"], "bf16"),  # no equal shards to reduce-scatter
        (["--use-distributed-optimizer"], "bf16"),  # FP8 between nodes: whitening the node's sums is FP4's
        (["--gift-inter-node-format", "nvfp4", "--use-distributed-optimizer", "--gift-exchange", "flat"], "bf16"),
        (["--gift-inter-node-format", "nvfp4", "--use-distributed-optimizer", "--gift-error-feedback"], "bf16"),
        (["--gift-inter-node-format", "nvfp4", "--use-distributed-optimizer", "--gift-intra-node", "bf16"], "bf16"),
    ],
)
def test_intra_node_auto_sums_first_where_it_runs(parse, flags, want):
    """``--gift-intra-node`` left at auto: a reduce-scatter first with four bits between nodes and the distributed
    optimizer, bf16 wherever that path cannot run (and an explicit choice kept), and every resolved configuration
    passes the start-up checks. Bugs caught: auto resolved to the sum-first path without the distributed
    optimizer (a start-up refusal of a flag the user never set), with FP8 between nodes, or over an explicit bf16."""
    args = parse("--gift-mode", "gift", *flags)
    validate_gift_args(args)
    assert gift_config_from_args(args).exchange.intra_node is IntraNode(want)


@pytest.mark.parametrize("side", ["input", "both", "auto"])
def test_side_flag_reaches_the_config(parse, side):
    """Bug caught: ``--gift-side both`` dropped on its way to ``GiftConfig`` (no output statistics kept,
    the run silently input-side); a spelling is accepted by ``GiftConfig`` as by its other enums."""
    assert gift_config_from_args(parse("--gift-mode", "gift", "--gift-side", side)).whitening.side is Side(side)
    assert GiftConfig.build(mode="gift", side=side).whitening.side is Side(side)


def test_bad_side_is_refused(parse, capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--gift-mode", "gift", "--gift-side", "output")
    assert exc.value.code == 2 and "--gift-side" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'output' is not a valid Side"):
        GiftConfig.build(mode="gift", side="output")


def test_side_help_says_what_each_choice_costs():
    """``--help`` named the choices without their cost (the refresh bytes and the per-step all-reduce)."""
    parser = add_gift_args(argparse.ArgumentParser())
    text = parser.format_help()  # argparse formats the help: a bare % would raise here
    side = next(a for a in parser._actions if "--gift-side" in a.option_strings)
    assert side.choices == ["input", "both", "auto"]
    assert all(f"{c}:" in side.help for c in side.choices) and "3.5%" in text and "all-reduce" in side.help


def test_rank_above_layer_output_size_with_two_sides(parse):
    """With the output side, ``--gift-rank`` must fit each GIFT layer's output size (its rows on this
    rank) as it must fit the input size; input side only, the output size does not matter."""
    named = [(n, p) for n, p in NAMED_PARAMS if "linear_fc2" in n]  # [64, 256]
    flags = ("--gift-mode", "gift", "--gift-layers", r"linear_fc2\.weight$", "--gift-rank", "100", "--gift-sketch", "0")
    with pytest.raises(ValueError) as exc:
        validate_gift_args(parse(*flags, "--gift-side", "both"), named)
    msg = str(exc.value)
    assert "--gift-side both: --gift-rank 100" in msg and "linear_fc2.weight (output size 64 on this rank)" in msg
    assert "at most 64" in msg and "--gift-side input" in msg
    validate_gift_args(parse(*flags, "--gift-side", "input"), named)


def test_side_with_rank_zero_is_noted(parse, capsys, monkeypatch):
    """``--gift-side both --gift-rank 0`` keeps no output statistics (a diagonal ``T_out`` is no
    whitening the FP8 scales don't already do): said once instead of silently input-side."""
    monkeypatch.delenv("RANK", raising=False)
    validate_gift_args(parse("--gift-mode", "gift", "--gift-rank", "0", "--gift-side", "both"))
    assert "--gift-side both with --gift-rank 0 whitens the input side alone" in capsys.readouterr().err
    validate_gift_args(parse("--gift-mode", "gift", "--gift-rank", "0"))
    assert "--gift-side" not in capsys.readouterr().err


def test_every_flag_maps_to_config(parse):
    args_whitening = ("--gift-rank", "8", "--gift-sketch", "0", "--gift-refresh-interval", "10", "--gift-ema", "0.5")
    args_whitening += ("--gift-damping", "0.01")
    args = parse(
        "--gift-mode",
        "euclidean",
        "--gift-fp8-format",
        "e5m2",
        "--gift-scaling",
        "row",
        "--gift-block-size",
        "64",
        "--gift-rank",
        "8",
        "--gift-sketch",
        "0",
        "--gift-refresh-interval",
        "10",
        "--gift-ema",
        "0.5",
        "--gift-damping",
        "0.01",
        "--gift-layers",
        r"linear_fc1\.weight$",
        r"linear_fc2\.weight$",
        "--gift-euclidean-layers",
        "word_embeddings",
        "output_layer",
        "--gift-error-feedback",
        "--gift-log-interval",
        "5",
        "--gift-telemetry-dir",
        "/tmp/run",
    )
    assert gift_config_from_args(args) == GiftConfig.build(
        mode=Mode.EUCLIDEAN,
        codec=CodecConfig(FP8Format.E5M2, Scaling.ROW, 64),
        rank=8,
        sketch=0,
        damping=0.01,
        ema=0.5,
        refresh_interval=10,
        error_feedback=True,
        layers=(r"linear_fc1\.weight$", r"linear_fc2\.weight$"),
        euclidean_layers=("word_embeddings", "output_layer"),
        log_interval=5,
    )
    assert gift_config_from_args(args).whitening is None  # Euclidean: the whitening flags have no effect
    whitening = gift_config_from_args(parse("--gift-mode", "gift", *args_whitening)).whitening
    assert whitening == WhiteningConfig(rank=8, sketch=0, damping=0.01, ema=0.5, refresh_interval=10)
    assert telemetry_dir(args) == "/tmp/run"
    validate_gift_args(args, NAMED_PARAMS)
    for mode in ("bf16", "gift"):
        assert gift_config_from_args(parse("--gift-mode", mode)).mode is Mode(mode)
    assert gift_config_from_args(parse("--gift-mode", "gift", "--gift-scaling", "mx")).wire.codec.block == 32
    assert (
        gift_config_from_args(parse("--gift-mode", "gift", "--gift-damping", "auto")).whitening.damping is None
    )  # per layer


@pytest.mark.parametrize(
    "flag, value", [("--gift-mode", "fp4"), ("--gift-fp8-format", "e3m4"), ("--gift-scaling", "column")]
)
def test_bad_choice_rejected_by_argparse(parse, capsys, flag, value):
    with pytest.raises(SystemExit) as exc:
        parse(flag, value)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and f"invalid choice: '{value}'" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gift-ema", "1.0"], "--gift-ema must be in [0, 1), got 1.0"),
        (["--gift-rank", "-1"], "--gift-rank must be >= 0"),
        (["--gift-sketch", "16"], "--gift-sketch (16) must be 0 (exact statistics) or >= --gift-rank (32)"),
        (["--gift-damping", "0"], "--gift-damping must be > 0"),
        (["--gift-refresh-interval", "0"], "--gift-refresh-interval must be >= 1"),
        (["--gift-block-size", "0"], "--gift-block-size must be positive"),
        (["--gift-log-interval", "-1"], "--gift-log-interval must be >= 0"),
        (["--gift-log-interval", "10"], "give --gift-telemetry-dir (or --save, or --tensorboard-dir)"),
        (["--gift-layers", "auto", "--gift-policy-margin", "1.5"], "--gift-policy-margin must be in [0, 1)"),
        (
            ["--gift-layers", "auto", "--gift-policy-hysteresis", "0"],
            "--gift-policy-hysteresis must be an integer >= 1",
        ),
        (["--gift-layers", "auto", "--gift-bf16-bound", "0"], "--gift-bf16-bound must be > 0"),
        (["--gift-layers", "auto", "--gift-profile-interval", "0"], "--gift-profile-interval must be an integer >= 1"),
        (["--gift-inflight-mb", "0"], "--gift-inflight-mb must be an integer >= 1"),
        (["--gift-layers", "linear_(qkv"], "--gift-layers: 'linear_(qkv' is not a valid regular expression"),
        (["--gift-euclidean-layers", "[emb"], "--gift-euclidean-layers: '[emb' is not a valid regular expression"),
        (["--use-megatron-fsdp"], "does not support --use-megatron-fsdp"),
        (["--use-torch-fsdp2"], "does not support --use-torch-fsdp2"),
        (
            ["--num-distributed-optimizer-instances", "2", "--gift-layers", "auto"],
            "compare with a reduction inside one",
        ),
        (["--enable-cuda-graph"], "does not support CUDA graphs (--enable-cuda-graph)"),
        (["--external-cuda-graph"], "does not support CUDA graphs (--external-cuda-graph)"),
        (["--cuda-graph-impl", "local"], "does not support CUDA graphs (--cuda-graph-impl local)"),
        (["--ddp-reduce-scatter-with-fp32-accumulation"], "--ddp-reduce-scatter-with-fp32-accumulation replaces"),
        (
            ["--gift-inter-node-format", "nvfp4", "--gift-intra-node", "reduce-scatter"],
            "--gift-intra-node reduce-scatter reduce-scatters the distributed optimizer's equal shards: add "
            "--use-distributed-optimizer",
        ),
    ],
)
def test_validation_errors_name_the_flag(parse, flags, message):
    args = parse("--gift-mode", "gift", *flags)
    with pytest.raises(ValueError) as exc:
        validate_gift_args(args)
    assert message in str(exc.value)
    if not flags[0].startswith("--gift-"):
        assert "--gift-mode off" in str(exc.value)
        validate_gift_args(parse(*flags))  # the same Megatron flags are fine with --gift-mode off


def test_reduce_scatter_intra_node_is_accepted_with_the_distributed_optimizer(parse):
    """Bug caught: ``--gift-intra-node reduce-scatter`` refused where it runs (four bits between nodes and
    Megatron's equal shards of the distributed optimizer)."""
    flags = ["--gift-inter-node-format", "nvfp4", "--gift-intra-node", "reduce-scatter", "--use-distributed-optimizer"]
    validate_gift_args(parse("--gift-mode", "gift", *flags))


def test_damping_typo_names_the_flag_and_the_choices(parse, capsys):
    """``--gift-damping foo`` said ``invalid _damping value`` (argparse quoted the converter's name)."""
    with pytest.raises(SystemExit) as exc:
        parse("--gift-mode", "gift", "--gift-damping", "foo")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --gift-damping: expected a number > 0 or 'auto', got 'foo'" in err, err
    assert "_damping" not in err


def test_rank_0_is_explained(parse, capsys, monkeypatch):
    """``--gift-mode gift --gift-rank 0`` trained with no word of what rank 0 does; ``--help`` did not say."""
    monkeypatch.delenv("RANK", raising=False)
    capsys.readouterr()
    validate_gift_args(parse("--gift-mode", "gift", "--gift-rank", "0"))
    assert "--gift-rank 0 scales each GIFT layer's input columns by the damped diagonal" in capsys.readouterr().err
    validate_gift_args(parse("--gift-mode", "gift", "--gift-rank", "4", "--gift-sketch", "8"))
    assert "--gift-rank" not in capsys.readouterr().err
    rank_help = next(
        a.help for a in add_gift_args(argparse.ArgumentParser())._actions if "--gift-rank" in a.option_strings
    )
    assert "0 scales each input column by its damped diagonal" in rank_help


def test_ranks_per_node_must_divide_the_run(parse, monkeypatch):
    """``--gift-ranks-per-node 3`` on 2 ranks was accepted silently (taken as one node of 2)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"--gift-ranks-per-node 3 does not divide the 2 processes"):
        validate_gift_args(parse("--gift-mode", "euclidean", "--gift-ranks-per-node", "3"))
    validate_gift_args(parse("--gift-mode", "euclidean", "--gift-ranks-per-node", "2"))
    monkeypatch.setenv("WORLD_SIZE", "8")
    validate_gift_args(parse("--gift-mode", "euclidean", "--gift-ranks-per-node", "4"))


def test_off_refuses_flags_that_ask_for_fp8(parse):
    """``--gift-mode off`` with a flag that asks for FP8 traffic (``--gift-euclidean-layers``,
    ``--gift-loopback``) is an error, as docs/integration.md says; other unused flags only warn."""
    for flags in (["--gift-euclidean-layers", ".*"], ["--gift-loopback"]):
        with pytest.raises(ValueError, match=f"{flags[0]} has no effect with --gift-mode off"):
            validate_gift_args(parse("--gift-mode", "off", *flags))
    validate_gift_args(parse("--gift-mode", "off", "--gift-rank", "8"))  # warned, not refused


def test_auto_layers_make_a_policy_over_the_candidates(parse):
    cfg = gift_config_from_args(
        parse(
            "--gift-mode",
            "gift",
            "--gift-layers",
            "auto",
            "--gift-profile-steps",
            "3",
            "--gift-profile-interval",
            "20",
            "--gift-policy-hysteresis",
            "1",
        )
    )
    assert cfg.layers == GiftConfig().layers  # the default candidates
    assert cfg.policy == PolicyConfig(hysteresis=1, profile_steps=3, profile_interval=20)
    assert [cfg.policy.is_profile_step(s) for s in (0, 2, 3, 19, 20, 40)] == [True, True, False, False, True, True]
    cfg = gift_config_from_args(parse("--gift-mode", "gift", "--gift-layers", "auto", r"linear_fc2\.weight$"))
    assert cfg.layers == (r"linear_fc2\.weight$",) and cfg.policy == PolicyConfig()
    assert gift_config_from_args(parse("--gift-mode", "gift")).policy is None
    with pytest.raises(
        ValueError, match="--gift-layers auto chooses among GIFT, Euclidean and BF16: it needs --gift-mode gift"
    ):
        gift_config_from_args(parse("--gift-mode", "euclidean", "--gift-layers", "auto"))


def test_deprecated_custom_fsdp_attribute_rejected(parse):
    args = parse("--gift-mode", "euclidean")
    args.use_custom_fsdp = True  # what Megatron's validate_args sets alongside --use-megatron-fsdp
    with pytest.raises(ValueError, match="does not support --use-megatron-fsdp"):
        validate_gift_args(args)


def test_euclidean_layers_need_a_mode(parse):
    with pytest.raises(ValueError, match="--gift-euclidean-layers has no effect with --gift-mode off"):
        validate_gift_args(parse("--gift-euclidean-layers", "word_embeddings"))


def test_unmatched_pattern_lists_parameter_names(parse):
    args = parse("--gift-mode", "gift", "--gift-euclidean-layers", "embeddings", r"lm_head\.weight")
    with pytest.raises(ValueError) as exc:
        validate_gift_args(args, NAMED_PARAMS)
    msg = str(exc.value)
    assert r"--gift-euclidean-layers 'lm_head\\.weight'" in msg and "'embeddings'" not in msg
    assert "embedding.word_embeddings.weight" in msg and "output_layer.weight" in msg
    validate_gift_args(args)  # without the model, patterns cannot be checked


def test_rank_above_layer_input_size(parse):
    args = parse("--gift-mode", "gift", "--gift-rank", "100", "--gift-sketch", "0")
    with pytest.raises(ValueError) as exc:
        validate_gift_args(args, NAMED_PARAMS)
    msg = str(exc.value)
    assert "--gift-rank 100" in msg and "decoder.layers.0.self_attention.linear_qkv.weight (input size 64)" in msg
    assert "linear_fc2" not in msg and "at most 64" in msg  # fc2's input is 4H = 256
    validate_gift_args(parse("--gift-mode", "euclidean", "--gift-rank", "100", "--gift-sketch", "0"), NAMED_PARAMS)


def test_one_dimensional_parameters_are_not_gift_layers(parse):
    """A pattern that also selects norms: those go Euclidean, so the rank check skips them."""
    validate_gift_args(parse("--gift-mode", "gift", "--gift-layers", r"decoder\..*weight$"), NAMED_PARAMS)


def test_chained_with_another_provider(parse):
    def own(parser):
        parser.add_argument_group("my-script").add_argument("--my-flag", type=int, default=7)
        return parser

    args = parse("--my-flag", "3", "--gift-mode", "gift", provider=chain_args_providers(own, add_gift_args))
    assert args.my_flag == 3 and gift_config_from_args(args) == GiftConfig(mode=Mode.GIFT)

    parser = chain_args_providers(add_gift_args, own)(argparse.ArgumentParser())
    assert "megatron-gift" in [g.title for g in parser._action_groups]
    assert vars(parser.parse_args([]))["my_flag"] == 7


def test_local_world_size_must_be_a_positive_integer(parse, monkeypatch):
    """``LOCAL_WORLD_SIZE`` (processes per node) groups the two-level exchange's nodes: a value that is
    no integer >= 1 is refused naming the variable and ``--gift-ranks-per-node``, which overrides it.
    Bug caught: ``int('2.5')`` raised deep inside the DDP, ``0`` / ``-2`` reached the topology."""
    args, override = parse("--gift-mode", "euclidean"), parse("--gift-mode", "euclidean", "--gift-ranks-per-node", "2")
    for bad in ("abc", "0", "-2", "2.5", " "):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(
            ValueError, match=f"LOCAL_WORLD_SIZE={bad!r} .* is not an integer >= 1.*--gift-ranks-per-node"
        ):
            validate_gift_args(args)
        validate_gift_args(override)  # the flag wins over the environment
    for good in ("1", "8"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", good)
        validate_gift_args(args)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    validate_gift_args(args)
    with pytest.raises(ValueError, match="--gift-ranks-per-node must be an integer >= 1"):
        gift_config_from_args(parse("--gift-mode", "euclidean", "--gift-ranks-per-node", "0"))


@pytest.mark.parametrize(
    "flags, warned",
    [
        (
            ["--gift-layers", "auto", "--gift-error-feedback", "--gift-rank", "8"],
            [
                "--gift-rank 8 has no effect with --gift-mode off",
                "--gift-layers auto has no effect with --gift-mode off",
                "--gift-error-feedback has no effect with --gift-mode off",
            ],
        ),
        (
            ["--gift-mode", "bf16", "--gift-error-feedback", "--gift-scaling", "row", "--gift-sketch", "0"],
            [
                "--gift-sketch 0 has no effect with --gift-mode bf16 (GIFT only)",
                "--gift-scaling row has no effect with --gift-mode bf16 and no --gift-euclidean-layers",
                "--gift-error-feedback has no effect with --gift-mode bf16 and no --gift-euclidean-layers",
            ],
        ),
        (["--gift-mode", "bf16", "--gift-error-feedback", "--gift-euclidean-layers", "embedding"], []),
        (
            ["--gift-mode", "euclidean", "--gift-side", "both"],
            ["--gift-side both has no effect with --gift-mode euclidean (GIFT only)"],
        ),
        (
            ["--gift-mode", "gift", "--gift-scaling", "mx", "--gift-block-size", "64"],
            ["--gift-block-size 64 has no effect with --gift-scaling mx (block only)"],
        ),
        (
            ["--gift-mode", "gift", "--gift-policy-margin", "0.2", "--gift-telemetry-dir", "/tmp/x"],
            [
                "--gift-policy-margin 0.2 has no effect without --gift-layers auto",
                "--gift-telemetry-dir /tmp/x has no effect without --gift-log-interval",
            ],
        ),
        (
            ["--gift-mode", "gift", "--gift-exchange", "flat", "--gift-intra-node", "fp8"],
            ["--gift-intra-node fp8 has no effect with --gift-exchange flat or --gift-error-feedback"],
        ),
        (
            ["--gift-mode", "euclidean", "--gift-inter-node-format", "nvfp4", "--gift-rotation", "auto"],
            ["--gift-rotation auto has no effect with --gift-mode euclidean (auto chooses per GIFT layer"],
        ),
        (["--gift-mode", "euclidean", "--gift-inter-node-format", "nvfp4", "--gift-rotation", "hadamard"], []),
        (
            [
                "--gift-mode",
                "gift",
                "--gift-rank",
                "8",
                "--gift-sketch",
                "16",
                "--gift-layers",
                "auto",
                "--gift-policy-margin",
                "0.2",
                "--gift-error-feedback",
                "--gift-ranks-per-node",
                "2",
            ],
            [],
        ),
    ],
)
def test_flags_without_effect_are_warned_once(parse, capsys, monkeypatch, flags, warned):
    """Each flag set away from its default that the chosen mode never reads is named in one warning
    (rank 0), and only those: a flag that does act is never warned about."""
    monkeypatch.delenv("RANK", raising=False)
    args = parse(*flags)
    capsys.readouterr()
    validate_gift_args(args)
    validate_gift_args(args, NAMED_PARAMS)  # the model-level call (when the DDP is built): no repeat
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == len(warned) and all(
        line.startswith("megatron-gift: warning: ") and line.endswith("; ignored") for line in lines
    ), lines
    assert all(any(w in line for line in lines) for w in warned), lines


def test_argparse_errors_print_on_rank_0_only(parse, capsys, monkeypatch):
    """argparse's error on a bad ``--gift-*`` value: one line naming the flag on rank 0, silence on the
    others, status 2 everywhere (argparse alone printed Megatron's whole usage on every rank)."""
    for rank, printed in (("0", True), ("3", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exc:
            parse("--gift-refresh-interval", "ten")
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "usage:" not in err
        assert (err.count("argument --gift-refresh-interval: invalid int value: 'ten'") == 1) == printed, err
        assert (err.strip() != "") == printed, err


def test_param_gather_flags_map_to_config_with_or_without_a_mode(parse):
    """Catches --gift-param-gather delta being dropped with --gift-mode off (the plugin must wrap the
    model for the parameter all-gather alone) and a default other than Megatron's own gather."""
    assert parse().gift_param_gather == "bf16" and GiftConfig().param_gather is None
    assert DeltaGatherConfig().full_every == 0
    args = parse("--gift-param-gather", "delta", "--gift-param-gather-full-every", "50", "--use-distributed-optimizer")
    assert gift_config_from_args(args) == GiftConfig.build(param_gather=ParamGather.DELTA, param_gather_full_every=50)
    validate_gift_args(args, NAMED_PARAMS)  # mode off: no --gift-layers pattern to match
    cfg = gift_config_from_args(
        parse("--gift-mode", "euclidean", "--gift-param-gather", "delta", "--use-distributed-optimizer")
    )
    assert (cfg.mode, cfg.param_gather) == (Mode.EUCLIDEAN, DeltaGatherConfig())


@pytest.mark.parametrize("mode", ["off", "gift"])
@pytest.mark.parametrize(
    "flags, message",
    [
        (
            [],
            "--gift-param-gather delta codes the distributed optimizer's parameter all-gather: "
            "add --use-distributed-optimizer",
        ),
        (
            ["--use-distributed-optimizer", "--fp8-param-gather"],
            "--gift-param-gather delta and --fp8-param-gather both replace",
        ),
        (["--use-distributed-optimizer", "--use-megatron-fsdp"], "--use-megatron-fsdp gathers parameters its own way"),
        (["--use-torch-fsdp2"], "--use-torch-fsdp2 gathers parameters its own way"),
        (["--use-distributed-optimizer", "--use-precision-aware-optimizer"], "drop --use-precision-aware-optimizer"),
        (
            ["--use-distributed-optimizer", "--gift-param-gather-full-every", "-1"],
            "--gift-param-gather-full-every must be an integer >= 0",
        ),
    ],
)
def test_delta_param_gather_refusals_name_the_flag(parse, mode, flags, message):
    with pytest.raises(ValueError) as exc:
        validate_gift_args(parse("--gift-mode", mode, "--gift-param-gather", "delta", *flags))
    assert message in str(exc.value)


def test_delta_param_gather_refuses_the_layer_wise_optimizer(parse):
    args = parse("--gift-param-gather", "delta", "--optimizer", "muon", "--use-distributed-optimizer")
    args.use_layer_wise_distributed_optimizer, args.use_distributed_optimizer = (
        True,
        False,
    )  # as validate_args sets them
    with pytest.raises(ValueError, match="--optimizer muon uses the layer-wise distributed optimizer"):
        validate_gift_args(args)


def test_full_every_needs_the_delta_gather(parse):
    with pytest.raises(
        ValueError, match="--gift-param-gather-full-every has no effect without --gift-param-gather delta"
    ):
        validate_gift_args(parse("--gift-param-gather-full-every", "5"))


def test_unwritable_telemetry_dir_refused_at_startup(parse, tmp_path):
    """Issue 37 item 2: a telemetry directory that cannot be written failed on rank 0 only after the model
    was built (FileNotFoundError there, gloo's "connection closed" on the others). The flag check refuses
    it with one line naming the flag (here the path runs through a file, which no user, root included, can
    make a directory under); a directory still to be made under a writable one passes."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    target = blocker / "telemetry"
    args = parse("--gift-mode", "gift", "--gift-log-interval", "5", "--gift-telemetry-dir", str(target))
    with pytest.raises(ValueError) as exc:
        validate_gift_args(args)
    assert "--gift-telemetry-dir" in str(exc.value) and str(target) in str(exc.value)
    fine = parse("--gift-mode", "gift", "--gift-log-interval", "5", "--gift-telemetry-dir", str(tmp_path / "a" / "b"))
    validate_gift_args(fine)
