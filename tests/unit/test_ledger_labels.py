"""The byte ledger's name of a bucket's messages (``comm.ledger.message_label``)."""

import torch

from megatron_gift.comm.layout import BucketLayout, Segment
from megatron_gift.comm.ledger import message_label
from megatron_gift.config import Mode
from megatron_gift.numerics.fp8 import CodecConfig


def _layout(*modes):
    segs = [Segment(i * 256, 2, 128, m, f"p{i}") for i, m in enumerate(modes)]
    return BucketLayout(256 * len(modes), 2, segs, CodecConfig(), torch.float32)


def test_messages_are_named_by_what_they_carry():
    """Issue 37 item 5: a bucket of --gift-mode bf16 parameters was logged (and reported by
    ``megatron-gift report``) as ``fp8+scales``; codes keep their format's name, plain values theirs."""
    assert message_label(_layout(Mode.GIFT, Mode.BF16)) == "fp8+scales"
    assert message_label(_layout(Mode.EUCLIDEAN)) == "fp8+scales"
    assert message_label(_layout(Mode.BF16, Mode.BF16)) == "bf16"
    assert message_label(_layout(Mode.BF16, Mode.OFF)) == "fp32+bf16"
