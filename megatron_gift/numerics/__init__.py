"""Numerics: the wire formats' table, FP8 codec, K-FAC statistics, whitening, geometry statistics, gradient profiles,
error feedback.

Pure tensor code: nothing here imports torch.distributed or Megatron.
"""

from .error_feedback import ErrorFeedback
from .fp8 import (
    CodecConfig,
    CodecStats,
    Encoded,
    FP8Format,
    Scaling,
    decode,
    decode_flat,
    encode,
    encode_flat,
    roundtrip,
)
from .geometry import GeometryStats, geometry_stats, shares_ratio
from .kfac import KFACStatistics
from .profile import FIELDS as PROFILE_FIELDS
from .profile import ProfileSummary, profile_gradient, summarize
from .two_sided import TwoSidedWhitening
from .whitening import LowRankFactor, LowRankWhitening, approximate_factor
from .wire import WireFormat

__all__ = [
    "CodecConfig",
    "CodecStats",
    "Encoded",
    "ErrorFeedback",
    "FP8Format",
    "GeometryStats",
    "KFACStatistics",
    "LowRankFactor",
    "LowRankWhitening",
    "PROFILE_FIELDS",
    "ProfileSummary",
    "Scaling",
    "approximate_factor",
    "decode",
    "decode_flat",
    "encode",
    "encode_flat",
    "geometry_stats",
    "profile_gradient",
    "roundtrip",
    "shares_ratio",
    "summarize",
    "TwoSidedWhitening",
    "WireFormat",
]
