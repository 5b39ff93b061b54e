"""The planner's own options as enums (torch-free, so that the command's argument table stays light).

Choices the runtime has are its enums (``megatron_gift.config``: ``Mode``, ``Schedule`` for
``--gift-schedule``, ``ParamGather`` for ``--gift-param-gather``); the two here are not the
plugin's: Megatron's schedule, and which gradients a run sends as FP8 (the paper's choice or the
recipes')."""

from __future__ import annotations

import enum


class MegatronSchedule(enum.Enum):
    """Megatron's schedule. ``overlap``: the recipes (distributed optimizer, ``--overlap-grad-reduce``
    during the last micro-batch's backward, ``--overlap-param-gather`` during the next forward);
    ``sync``: the paper's artifact (one all-reduce after the backward, nothing overlapped)."""

    OVERLAP = "overlap"
    SYNC = "sync"


class FP8Params(enum.Enum):
    """Which gradients go as FP8: ``all`` (the paper) or ``linear`` weights only, the rest BF16."""

    ALL = "all"
    LINEAR = "linear"
