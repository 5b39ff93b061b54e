"""The wall-clock limits of the tests' multi-process runs, scaled for slow or loaded machines."""

from __future__ import annotations

import os

TIMEOUT_SCALE_ENV = "MEGATRON_GIFT_TEST_TIMEOUT_SCALE"


def wall_limit(seconds: float) -> float:
    """``seconds`` times ``$MEGATRON_GIFT_TEST_TIMEOUT_SCALE`` (default 1): the wall-clock limit of a
    multi-process run, raised on a slow or loaded machine without editing the tests."""
    raw = os.environ.get(TIMEOUT_SCALE_ENV, "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not scale > 0:
        raise ValueError(f"{TIMEOUT_SCALE_ENV}={raw!r}: expected a positive number (a factor on every limit)")
    return seconds * scale
