"""The planner's options as enums (torch-free, so that the command's argument table stays light).

The plugin's gradient modes are ``megatron_gift.config.Mode`` (``schemes.Scheme`` pairs them with
an exchange); the enums here are options the runtime does not have as enums yet: Megatron's
schedule, the plugin's stream schedule (``--gift-schedule``, being built in issue 17) and the
parameter all-gather (``--gift-param-gather``, issue 18). Move them to ``config`` once the runtime
has them, so that both read one enum."""

from __future__ import annotations

import enum


class Schedule(enum.Enum):
    """Megatron's schedule. ``overlap``: the recipes (distributed optimizer, ``--overlap-grad-reduce``
    during the last micro-batch's backward, ``--overlap-param-gather`` during the next forward);
    ``sync``: the paper's artifact (one all-reduce after the backward, nothing overlapped)."""

    OVERLAP = "overlap"
    SYNC = "sync"


class GiftSchedule(enum.Enum):
    """When the plugin enqueues a bucket's stages (issue 17's execution model). ``eager``: all of a
    bucket's work at its backward hook, on stage streams joined by events (the default where
    ``CUDA_DEVICE_MAX_CONNECTIONS != 1``); ``lagged``: stage s+1 of bucket k at bucket k+1's hook, the
    rest at ``finish_grad_sync`` (the default where ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which Megatron
    sets for TP/SP comm overlap: one hardware queue)."""

    EAGER = "eager"
    LAGGED = "lagged"


class ParamGather(enum.Enum):
    """The distributed optimizer's parameter all-gather: ``bf16`` (Megatron's) or ``delta`` (issue 18:
    each shard's change since the last gather in about one byte per element)."""

    BF16 = "bf16"
    DELTA = "delta"


class FP8Params(enum.Enum):
    """Which gradients go as FP8: ``all`` (the paper) or ``linear`` weights only, the rest BF16."""

    ALL = "all"
    LINEAR = "linear"
