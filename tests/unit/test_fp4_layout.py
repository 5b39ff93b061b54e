"""``--gift-inter-node-format`` from the flag to the config, its start-up refusals, and the layout's
block rule (``BucketLayout.check_blocks``): every boundary of the coded sequence on a whole FP4 block."""

import argparse

import pytest
import torch

from megatron_gift.arguments import _ineffective_flags, add_gift_args, gift_config_from_args
from megatron_gift.comm.layout import BucketLayout, Segment
from megatron_gift.config import GiftConfig, InterNodeFormat, Mode
from megatron_gift.numerics.fp8 import CodecConfig

BLOCKS = {"nvfp4": 16, "mxfp4": 32}


def parse(*flags):
    return add_gift_args(argparse.ArgumentParser()).parse_args(list(flags))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_inter_node_format_flag_reaches_the_config(fmt):
    """Bug caught: ``--gift-inter-node-format nvfp4`` dropped on its way to ``GiftConfig`` (the exchange
    silently sending FP8), or its default not FP8 (a run that never asked for four bits getting them)."""
    assert gift_config_from_args(
        parse("--gift-mode", "gift", "--gift-inter-node-format", fmt)
    ).wire.inter_node_format is (InterNodeFormat(fmt))
    assert gift_config_from_args(parse("--gift-mode", "gift")).wire.inter_node_format is InterNodeFormat.FP8
    assert GiftConfig.build(inter_node_format=fmt).wire.inter_node_format is InterNodeFormat(
        fmt
    )  # a spelling, as other enums


def test_block_sizes_are_the_formats():
    """Bug caught: a format's block size other than NVFP4's 16 or MXFP4's 32 (the layout would check
    boundaries against the wrong block, and block scales would straddle messages)."""
    assert {f.value: f.block for f in InterNodeFormat} == {"fp8": None, **BLOCKS}


def test_inter_node_format_without_coded_values_is_warned_ineffective():
    """Bug caught: ``--gift-inter-node-format`` accepted silently with ``--gift-mode bf16`` (nothing is
    coded, so nothing goes in four bits); and warned about where it does act."""
    args = parse("--gift-mode", "bf16", "--gift-inter-node-format", "nvfp4")
    assert [k for k, _ in _ineffective_flags(args, gift_config_from_args(args))] == ["gift_inter_node_format"]
    args = parse("--gift-mode", "euclidean", "--gift-inter-node-format", "nvfp4")
    assert _ineffective_flags(args, gift_config_from_args(args)) == []


def layout(segments, numel, shards):
    return BucketLayout(numel, shards, segments, CodecConfig(), torch.float32)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_megatron_padded_buckets_are_aligned(fmt):
    """Bug caught: a false refusal of the layouts Megatron builds (parameter starts padded to 64
    elements, buckets to a multiple of 128 x the group size), including a GIFT row cut by a shard
    boundary; their shards then start on whole blocks of the coded sequence."""
    block = BLOCKS[fmt]
    segs = [
        Segment(0, 24, 64, Mode.GIFT, "fc1"),  # 1536 elements
        Segment(1536, 1, 64, Mode.EUCLIDEAN, "norm"),
        Segment(1600, 1, 30, Mode.OFF, "bias"),  # plain: any size
        Segment(1664, 8, 96, Mode.GIFT, "fc2"),
    ]
    lay = layout(segs, 2560, 4)  # shards of 640: a cut inside a row of fc1 (640 = 10 rows) and of fc2
    lay.check_blocks(block, f"--gift-inter-node-format {fmt}")
    assert all(p.coded_lo % block == 0 and p.n_coded % block == 0 for p in lay.shards)
    assert any(p.pieces for p in lay.shards)  # a row cut by a shard was checked, not absent


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp8_groups_are_whole_fp4_blocks(fmt):
    """Bug caught: relying on the FP8 1x128 groups (where the PyTorch path cuts its chunks) being whole
    FP4 blocks when they are not: 128 is 8 NVFP4 and 4 MXFP4 blocks, so with rows of whole blocks every
    group, hence every chunk boundary, starts on a block."""
    block = BLOCKS[fmt]
    assert CodecConfig().block % block == 0
    lay = layout([Segment(0, 6, 160, Mode.GIFT, "w")], 960, 2)  # rows of 128 + 32: a short last group
    lay.check_blocks(block, "x")
    starts = torch.cumsum(lay.group_lengths, 0) - lay.group_lengths
    assert bool((starts % block == 0).all()) and bool((lay.group_lengths % block == 0).all())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_rows_that_are_not_whole_blocks_are_refused(fmt):
    """Bug caught: a parameter whose rows are not whole blocks planned anyway (a block, and its scale,
    would straddle two rows, and a row-aligned GIFT chunk end would split a byte of two codes); the
    message names the parameter and the flag, on one line."""
    block = BLOCKS[fmt]
    lay = layout([Segment(0, 4, 64, Mode.GIFT, "ok"), Segment(256, 1, block + 8, Mode.EUCLIDEAN, "norm")], 512, 2)
    with pytest.raises(ValueError) as exc:
        lay.check_blocks(block, f"--gift-inter-node-format {fmt}")
    msg = str(exc.value)
    assert "'norm'" in msg and f"--gift-inter-node-format {fmt}" in msg and f"{block}-element" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_shard_boundary_inside_a_block_is_refused(fmt):
    """Bug caught: a shard boundary falling inside a block planned anyway (the block's codes and scale
    would be split between two ranks' messages); the message names the parameter, the boundary, the
    flag and Megatron's padding flag that fixes it (the bare advice to "pad the buckets" left a user with
    no flag to add). Plain parameters cut anywhere are no reason to refuse."""
    block = BLOCKS[fmt]
    numel = 2 * (256 + 8)  # shards of 264: the cut is 8 elements into a block of "w"
    lay = layout([Segment(0, 8, 64, Mode.EUCLIDEAN, "w")], numel, 2)
    with pytest.raises(ValueError) as exc:
        lay.check_blocks(block, f"--gift-inter-node-format {fmt}")
    msg = str(exc.value)
    assert "'w'" in msg and "264" in msg and f"--gift-inter-node-format {fmt}" in msg and "\n" not in msg
    assert "--ddp-pad-buckets-for-high-nccl-busbw" in msg  # the Megatron flag that aligns the shards
    plain = layout([Segment(0, 8, 64, Mode.OFF, "w")], numel, 2)
    plain.check_blocks(block, "x")  # nothing coded: nothing to align


@pytest.mark.parametrize("side", ["both", "auto"])
def test_output_side_with_fp4_is_refused(side):
    """Bug caught: ``--gift-side both`` accepted with a four-bit exchange, which never applies the
    output side's ``T_out`` (the gradient would come back un-whitened on one side only)."""
    with pytest.raises(ValueError) as exc:
        gift_config_from_args(
            parse("--gift-mode", "gift", "--gift-side", side, "--gift-inter-node-format", "mxfp4", "--gift-rank", "8")
        )
    msg = str(exc.value)
    assert "--gift-side input" in msg and "--gift-inter-node-format mxfp4" in msg and "\n" not in msg


@pytest.mark.parametrize("value", ["hadamard", "auto"])
def test_rotation_flag_reaches_the_config_with_the_seed(value):
    """Bug caught: ``--gift-rotation hadamard|auto`` dropped on its way to ``GiftConfig``, or its signs not
    seeded from Megatron's ``--seed`` (ranks or runs with other signs); asked for with FP8, where no
    exchange applies it, refused naming both flags."""
    args = parse("--gift-mode", "gift", "--gift-inter-node-format", "nvfp4", "--gift-rotation", value)
    args.seed = 1234  # Megatron's flag
    cfg = gift_config_from_args(args)
    assert cfg.wire.rotation.value == value and cfg.wire.rotation_seed == 1234
    assert gift_config_from_args(parse("--gift-mode", "gift")).wire.rotation.value == "none"
    with pytest.raises(ValueError) as exc:
        gift_config_from_args(parse("--gift-mode", "gift", "--gift-rotation", value))
    assert f"--gift-rotation {value}" in str(exc.value) and "--gift-inter-node-format" in str(exc.value)


def test_all_reduce_shards_can_be_aligned_to_whole_blocks():
    """Bug caught: an all-reduce layout (no distributed optimizer: Megatron neither pads parameters
    nor buckets) whose shard boundaries fall inside blocks, refused though its shards are the plugin's
    own choice: with ``align`` they are whole blocks and the same layout passes the block rule."""
    segs = [Segment(0, 10, 64, Mode.GIFT, "w"), Segment(640, 1, 360, Mode.OFF, "rest")]
    plain = layout(segs, 1000, 4)  # shards of 250: a cut 58 columns into a row of "w"
    with pytest.raises(ValueError):
        plain.check_blocks(32, "x")
    aligned = BucketLayout(1000, 4, segs, CodecConfig(), torch.float32, align=64)
    assert aligned.shard_size == 256 and [p.hi for p in aligned.shards] == [256, 512, 768, 1000]
    aligned.check_blocks(64, "x")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_with_tensor_scaling_is_refused_naming_both_flags(fmt):
    """Bug caught: ``--gift-scaling tensor`` accepted with a four-bit exchange, whose chunks are cut at
    whole FP8 scaling groups (under tensor scaling one group is a whole segment); refused at start-up
    naming both flags. Block scaling, the default, passes."""
    with pytest.raises(ValueError) as exc:
        gift_config_from_args(parse("--gift-mode", "gift", "--gift-scaling", "tensor", "--gift-inter-node-format", fmt))
    msg = str(exc.value)
    assert msg.startswith("megatron-gift: ") and "\n" not in msg
    assert "--gift-scaling" in msg and f"--gift-inter-node-format {fmt}" in msg
    assert gift_config_from_args(
        parse("--gift-mode", "gift", "--gift-inter-node-format", fmt)
    ).wire.codec.scaling.value == ("block")


def test_reduce_scatter_intra_node_reaches_the_config_and_needs_four_bits():
    """Bug caught: ``--gift-intra-node reduce-scatter`` dropped on its way to ``GiftConfig`` (the
    two-level exchange silently whitening at the sender), or accepted with FP8 between nodes, whose
    two-level exchange has no such stage (it would fail inside the first step, or send FP8 of
    unwhitened sums): refused at start-up naming both flags, in one line."""
    args = parse("--gift-mode", "gift", "--gift-inter-node-format", "nvfp4", "--gift-intra-node", "reduce-scatter")
    assert gift_config_from_args(args).exchange.intra_node.value == "reduce-scatter"
    with pytest.raises(ValueError) as exc:
        gift_config_from_args(parse("--gift-mode", "gift", "--gift-intra-node", "reduce-scatter"))
    msg = str(exc.value)
    assert msg.startswith("megatron-gift: ") and "\n" not in msg
    assert "--gift-intra-node reduce-scatter" in msg and "--gift-inter-node-format nvfp4" in msg
